"""``python -m bench.ragbench``: the RAG serving benchmark, PCR against SGLang's radix cache,
HiCache and the oracle, with its subcommands ``generate``, ``operating-points``,
``headline`` and ``one-at-a-time``. The benchmark is :mod:`pcr_eval.ragbench` (the full comparison in
:mod:`pcr_eval.ragbench.compare`, whose docstring and ``--help`` say what it runs)."""

from __future__ import annotations

import sys

from pcr_eval.ragbench.compare import main

if __name__ == "__main__":
    sys.exit(main())
