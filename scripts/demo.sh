#!/usr/bin/env bash
# Set up (if needed) and run the demo: SmolLM2-135M served by SGLang with --enable-pcr,
# answering a RAG workload over Wikipedia articles. Extra arguments go to the demo
# (see `python -m pcr_tools.demo --help`).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$REPO/scripts/install.sh"
VENV="${PCR_VENV:-$REPO/.venv}"
cd "$REPO"
exec "$VENV/bin/python" -m pcr_tools.demo "$@"
