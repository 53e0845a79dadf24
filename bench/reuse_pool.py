"""``python -m bench.reuse_pool``: several runs of the accuracy benchmark's questions workload
pooled into one report. The pooling is :mod:`pcr_eval.pool`, whose docstring (and
``--help``) says how runs are matched."""

from __future__ import annotations

import sys

from pcr_eval.pool import main

if __name__ == "__main__":
    sys.exit(main())
