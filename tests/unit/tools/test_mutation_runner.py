"""The negative-control runner (``python -m tests.mutations``) on a tiny repository of its
own: stale entries are errors, a mutant is applied only in a copy (the tree is left as it
was) and the copy's module is the one its tests import, and the table matches the tree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.mutations.runner import (
    ANCHOR_REACH,
    BASELINE_FAILED,
    ERROR,
    KILLED,
    STALE,
    SURVIVED,
    Runner,
    apply_mutant,
    check_isolation,
    copy_environment,
    copy_tree,
    stale_reason,
)
from tests.mutations.table import KINDS, MUTANTS, Mutant

REPO = Path(__file__).resolve().parents[3]
MODULE = "tinymod/__init__.py"
ORIGINAL = (
    '"""A module small enough to mutate."""\n\n\ndef add(a, b):\n    # mutant: add-subtracts\n'
    "    # mutant: add-commutes\n    return a + b\n"
)


@pytest.fixture
def tiny_repo(tmp_path) -> Path:
    """A git work tree with one module and its test (untracked files: what the runner copies
    besides tracked ones), plus an ignored file that must not be copied."""
    root = tmp_path / "repo"
    (root / "tinymod").mkdir(parents=True)
    (root / MODULE).write_text(ORIGINAL)
    (root / "checks").mkdir()
    (root / "checks" / "test_add.py").write_text(
        "# mutant: add-subtracts\nfrom tinymod import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
        "def test_add_zero():\n    assert add(0, 0) == 0\n"
    )
    (root / ".gitignore").write_text("ignored.txt\n")
    (root / "ignored.txt").write_text("not copied\n")
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    return root


def mutant(**fields) -> Mutant:
    defaults = dict(
        name="add-subtracts",
        kind="unit",
        file=MODULE,
        original="return a + b",
        replacement="return a - b",
        tests=("checks/test_add.py",),
    )
    return Mutant(**{**defaults, **fields})


def runner(root: Path, **fields) -> Runner:
    return Runner(root, sys.executable, package="tinymod", **fields)


def test_a_stale_entry_is_an_error_not_a_skip(tiny_repo):
    gone = mutant(original="return a * b")
    doubled = mutant(file="checks/test_add.py", original="assert add(")
    missing = mutant(file="tinymod/nothing.py")
    unmarked = mutant(name="add-negates")
    for entry, reason in (
        (gone, "occurs 0 times"),
        (doubled, "occurs 2 times"),
        (missing, "does not exist"),
        (unmarked, "no marker line '# mutant: add-negates'"),
    ):
        result = runner(tiny_repo).run(entry)
        assert result.status == STALE and not result.ok and reason in result.detail, result
        assert reason in stale_reason(entry, tiny_repo)


def test_the_marker_says_which_occurrence_a_mutant_breaks(tiny_repo, tmp_path):
    """The same text elsewhere in the file, past the marker's reach, is neither counted nor
    mutated: the marker, not the text, anchors the entry."""
    later = "\n" * (ANCHOR_REACH + 1) + "def add_again(a, b):\n    return a + b\n"
    (tiny_repo / MODULE).write_text(ORIGINAL + later)
    assert stale_reason(mutant(), tiny_repo) is None
    copy = tmp_path / "copy"
    copy_tree(tiny_repo, copy)
    assert apply_mutant(mutant(), copy) is None
    mutated = (copy / MODULE).read_text()
    assert mutated.count("return a - b") == 1 and mutated.endswith("return a + b\n")
    (tiny_repo / MODULE).write_text(ORIGINAL + ORIGINAL[ORIGINAL.index("    # mutant: add-subtracts") :])
    assert "2 marker lines" in stale_reason(mutant(), tiny_repo)


def test_a_mutant_is_killed_in_a_copy_and_the_tree_is_left_alone(tiny_repo, monkeypatch):
    # The original tree importable first, as an editable install would make it: the copy
    # must still win, or the mutant would survive.
    monkeypatch.setenv("PYTHONPATH", str(tiny_repo))
    module = tiny_repo / MODULE
    before = module.stat().st_mtime_ns
    result = runner(tiny_repo).run(mutant())
    assert result.status == KILLED and result.ok, result
    assert "test_add" in result.detail
    assert module.read_text() == ORIGINAL and module.stat().st_mtime_ns == before
    assert not list(tiny_repo.glob(".mutation-junit.xml"))  # nothing written into the tree


def test_a_mutant_its_tests_cannot_see_survives(tiny_repo):
    result = runner(tiny_repo).run(mutant(name="add-commutes", replacement="return b + a"))
    assert result.status == SURVIVED and not result.ok, result


def test_tests_that_fail_unmutated_prove_nothing(tiny_repo):
    (tiny_repo / "checks" / "test_add.py").write_text("def test_broken():\n    assert False\n")
    result = runner(tiny_repo).run(mutant())
    assert result.status == BASELINE_FAILED and not result.ok, result


def test_a_mutant_that_does_not_compile_is_an_error_not_a_kill(tiny_repo):
    """Its tests would fail at import, whatever they check."""
    result = runner(tiny_repo, baseline=False).run(mutant(replacement="return a +"))
    assert result.status == ERROR and "does not compile" in result.detail, result


def test_the_copy_holds_tracked_and_untracked_files_but_not_ignored_ones(tiny_repo, tmp_path):
    copy = tmp_path / "copy"
    assert copy_tree(tiny_repo, copy) == 3  # .gitignore, the module, its test
    assert (copy / "checks" / "test_add.py").is_file() and not (copy / "ignored.txt").exists()
    assert apply_mutant(mutant(), copy) is None
    assert "return a - b" in (copy / MODULE).read_text() and (tiny_repo / MODULE).read_text() == ORIGINAL


def test_isolation_is_refused_when_the_package_comes_from_elsewhere(tiny_repo):
    env = copy_environment(tiny_repo, "unit")
    assert check_isolation(sys.executable, tiny_repo, "tinymod", env) is None
    assert "not from the copy" in check_isolation(sys.executable, tiny_repo, "json", env)


def test_kernel_mutants_run_under_the_triton_interpreter(tiny_repo, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert copy_environment(tiny_repo, "kernel")["TRITON_INTERPRET"] == "1"
    assert "TRITON_INTERPRET" not in copy_environment(tiny_repo, "unit")
    assert copy_environment(tiny_repo, "unit")["PYTHONPATH"].split(":")[0] == str(tiny_repo)


def test_every_table_entry_applies_to_this_tree_once_and_names_real_tests():
    """A failure here names an entry whose guarded code changed: update the entry with it."""
    assert len({m.name for m in MUTANTS}) == len(MUTANTS)
    for m in MUTANTS:
        assert m.kind in KINDS and m.tests and m.original != m.replacement and m.claim and m.breaks, m.name
        assert stale_reason(m, REPO) is None, f"{m.name}: {stale_reason(m, REPO)}"
        for test in m.tests:
            assert (REPO / test.split("::")[0]).is_file(), f"{m.name}: {test}"


def test_only_fixture_errors_are_not_a_kill():
    """A server that did not start under load errors every test's setup: that proves
    nothing about the mutant."""
    from tests.mutations.runner import MutantResult, PytestOutcome, _classify

    result = MutantResult("m", "e2e", "t", "")
    _classify(PytestOutcome(1, errored=["tests.e2e.test_x::test_y"]), result)
    assert result.status == ERROR and "no test failed" in result.detail
    _classify(PytestOutcome(1, failed=["tests.e2e.test_x::test_y"], first_message="assert 1 == 2"), result)
    assert result.status == KILLED and "assert 1 == 2" in result.detail
