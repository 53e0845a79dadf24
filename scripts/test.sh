#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: unit tests, then end-to-end tests that
# start real SGLang servers and Engines on the tiny model. Extra arguments go to pytest.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$REPO/scripts/install.sh"
VENV="${PCR_VENV:-$REPO/.venv}"
cd "$REPO"
"$VENV/bin/python" -m pcr_sglang.models.tiny_llama >/dev/null
# Triton kernels are checked by Triton's interpreter on CPU (natively on a CUDA machine).
# The variable must be set before Triton is imported, so they run in their own session.
if [[ $# -eq 0 ]]; then
  TRITON_INTERPRET=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/kernels
fi
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=25 tests --ignore=tests/kernels "$@"
