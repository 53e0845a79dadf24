#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: unit tests, then end-to-end tests that
# start real SGLang servers and Engines on the tiny model. Extra arguments go to pytest.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$REPO/scripts/install.sh"
VENV="${PCR_VENV:-$REPO/.venv}"
cd "$REPO"
"$VENV/bin/python" -m pcr_sglang.models.tiny_llama >/dev/null
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests "$@"
