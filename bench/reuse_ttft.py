"""``python -m bench.reuse_ttft``: TTFT of the base and the document-reuse tuned model over
several server starts. The benchmark is :mod:`pcr_eval.ttft`, whose docstring (and
``--help``) says what it measures."""

from __future__ import annotations

import sys

from pcr_eval.ttft import main

if __name__ == "__main__":
    sys.exit(main())
