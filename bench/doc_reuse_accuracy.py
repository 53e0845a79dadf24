"""``python -m bench.doc_reuse_accuracy``: answer accuracy of document KV reuse (the questions
and trace workloads, ``--reorder-applicability``). The benchmark is :mod:`pcr_eval.accuracy`,
whose docstring (and ``--help``) says what it measures."""

from __future__ import annotations

import sys

from pcr_eval.accuracy import main

if __name__ == "__main__":
    sys.exit(main())
