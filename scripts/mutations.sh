#!/usr/bin/env bash
# Optional stage (not part of scripts/test.sh): rerun the negative controls the README
# claims. Each mutant in tests/mutations/table.py breaks the code a test guards, in a
# temporary copy of the tree (this tree is never modified), and the test must then fail.
# Extra arguments go to the runner: --list, --only NAME[,NAME], --kind unit,kernel,e2e,
# --timeout S (python -m tests.mutations --help). Without --kind every mutant runs: e2e
# ones start real servers and take minutes each. Exit 1 if any mutant survived or could
# not be judged.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$REPO/scripts/install.sh"
VENV="${PCR_VENV:-$REPO/.venv}"
cd "$REPO"
"$VENV/bin/python" -m pcr_tools.models.tiny_llama >/dev/null
exec "$VENV/bin/python" -m tests.mutations "$@"
