"""Negative controls anyone can rerun: ``python -m tests.mutations``.

docs/testing.md says which tests were watched going red when the code they guard was broken on
purpose. :mod:`tests.mutations.table` writes each of those breaks down as a mutant (a file,
an exact text, its replacement, the tests that must then fail), and
:mod:`tests.mutations.runner` applies them one at a time to a private copy of the tree and
runs the tests there, so the claim is checked again on today's code instead of living only
in a commit message. ``python -m tests.mutations --help`` lists the options.
"""
