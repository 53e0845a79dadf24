#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite in stages: lint, unit tests (types checked
# beside them), the Triton kernels, then end-to-end tests that start real SGLang servers and
# Engines on the tiny model. Extra arguments go to one pytest run instead
# (`bash scripts/test.sh tests/unit -k hint`).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Stages, fastest first, each printing its time: a lint error fails in seconds, a unit or
# type failure in about two minutes, before any server starts.
stage() {
  local name="$1"; shift
  local start=$SECONDS
  echo "[test] stage $name"
  if "$@"; then
    echo "[test] stage $name passed in $((SECONDS - start)) s"
  else
    local rc=$?
    echo "[test] stage $name FAILED after $((SECONDS - start)) s" >&2
    exit "$rc"
  fi
}
stage install bash "$REPO/scripts/install.sh"
VENV="${PCR_VENV:-$REPO/.venv}"
cd "$REPO"
"$VENV/bin/python" -m pcr_tools.models.tiny_llama >/dev/null
# One OpenMP thread per process: the suite runs several servers (and two pytest workers) on
# the machine's cores at once, and torch's default (a thread per core in every process)
# makes their OpenMP threads spin against each other: two baseline servers answering 50
# prompts each side by side took 58-61 s with the default and 4-5 s with one thread each
# (2 cores, 2026-12-06).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export PCR_SERVER_START_SLOTS="${PCR_SERVER_START_SLOTS:-2}"
export PCR_TEST_SERVER_SLOTS="${PCR_TEST_SERVER_SLOTS:-10}"
PYTEST=("$VENV/bin/python" -m pytest -q -p no:cacheprovider)
if [[ $# -gt 0 ]]; then  # extra arguments: one pytest run over them (kernels need TRITON_INTERPRET=1)
  exec "${PYTEST[@]}" "$@"
fi

echo "[test] stages: lint, format, spelling, unit (types beside it), types, kernels, e2e, e2e-paced"
stage lint "$VENV/bin/ruff" check .
stage format "$VENV/bin/ruff" format --check .
stage spelling "$VENV/bin/codespell"
# mypy, strict on the whole server package (pyproject.toml [tool.mypy]). Without its cache (a
# clean clone, as in CI) it takes about 40 s, mostly reading torch's types: it runs beside the unit tests at a lower priority (the same session,
# so `nice` applies), and its stage reports after them; if a stage fails first, mypy's result
# is still printed on the way out.
types_out="$(mktemp)"
nice -n 10 "$VENV/bin/mypy" >"$types_out" 2>&1 &
types_pid=$!
types_result() {  # mypy's output and exit status, collected once
  local rc=0
  wait "$types_pid" || rc=$?
  types_pid=""
  cat "$types_out"
  return "$rc"
}
on_exit() {
  if [[ -n "$types_pid" ]]; then
    echo "[test] types (ran beside the stage that stopped the suite):"
    types_result || true
  fi
  rm -f "$types_out"
}
trap on_exit EXIT
# A background job of a script ignores Ctrl-C: stop it with the script.
trap '[[ -n "$types_pid" ]] && kill "$types_pid" 2>/dev/null; exit 130' INT TERM
# Unit tests: two files at a time on xdist workers (module fixtures stay in one process):
# 112 s instead of 163 s one after another on the idle 2-core machine (2026-12-06).
stage unit "${PYTEST[@]}" --durations=10 -n "${PCR_TEST_WORKERS:-2}" --dist loadfile tests/unit
stage types types_result
# Triton kernels are checked by Triton's interpreter on CPU (natively on a CUDA machine).
# The variable must be set before Triton is imported, so they run in their own session.
stage kernels env TRITON_INTERPRET=1 "${PYTEST[@]}" tests/kernels
# Two e2e stages. Most modules only need their servers to answer: they run two files at a
# time on pytest-xdist workers (PCR_TEST_WORKERS, default 2; module fixtures stay in one
# process), since most of a module's time is its servers starting or one request at a
# time on the tiny model, which keeps one core busy. The modules marked `paced` check paths
# taken only when background work keeps pace with the scheduler (an SSD or remote read
# landing before its request stops waiting, an abort arriving while reads are queued):
# beside another module on two cores they took the other path (correct tokens, a failed
# assertion), so they run one file after another with nothing beside them.
# PCR_SERVER_START_SLOTS bounds the servers starting at once (a start is CPU-bound imports:
# too many at once run past their startup timeout on two cores), PCR_TEST_SERVER_SLOTS the
# servers the modules hold at once (about 1.3 GB each: see tests/e2e/helpers.py).
# The workers take the modules longest first (tests/e2e/conftest.py), not by test count.
stage e2e "${PYTEST[@]}" --durations=25 -m "not paced" -n "${PCR_TEST_WORKERS:-2}" --dist loadfile \
  --no-loadscope-reorder tests/e2e
stage e2e-paced "${PYTEST[@]}" --durations=25 -m paced tests/e2e
