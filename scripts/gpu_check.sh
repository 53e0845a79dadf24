#!/usr/bin/env bash
# Every CUDA check of pcr-sglang in one command, for a GPU machine with PyTorch, Triton,
# numpy and pytest but no SGLang and no network (docs/testing.md, "Checking on a GPU").
#
#   here:            bash scripts/gpu_wheels.sh          (fills .whl/, git-ignored)
#   on the GPU:      bash scripts/gpu_check.sh OUTDIR     (with .whl/ carried beside the tree)
#   on a CPU:        bash scripts/gpu_check.sh --cpu-dry-run OUTDIR
#
# Steps, each under its own time limit and all under one budget (GPU_CHECK_BUDGET_S, 420 s
# by default on a GPU), each printing PASS, FAIL or SKIP; logs and a summary go to OUTDIR
# (default: $OUT, else gpu-check-results). Exits non-zero if a step failed or did not run.
#   kernels-copy      tests/kernels compiled for the GPU (no TRITON_INTERPRET) but for the two
#                     below: the copy kernel on pin_memory() and on the server's host pool
#                     (POSIX shared memory + cudaHostRegister in pieces), given the pool's
#                     device address resolved explicitly (never the CPU tensor); the startup
#                     warm-ups, after which serving-shaped launches compile nothing (SGLang's
#                     masked extend too, its first permuted launch timed, where SGLang is installed)
#   kernels-rope      the RoPE re-placement kernel against the torch path
#   kernels-mask      SGLang's Triton extend attention with the position-causal mask; SKIP
#                     where SGLang is not installed (the kernel is SGLang's)
#   ordering          tests/gpu/gpu_ordering_check.py: the transfer engine's CUDA branch
#                     (CudaStreams, deliberately slow copies) against the CPU ordering model
#   step              tests/gpu/gpu_step_check.py: a step with 4 host hits, 16 re-placed documents,
#                     2 offloads and permuted rows (SGLang's *_cpu lengths unset) makes no
#                     synchronizing call (sync debug mode "error"), no upload from pageable memory,
#                     no allocation in the layer hooks past layer 0, compiles no kernel after the
#                     warm-up; blend's probe peak memory within its estimate (--pcr-blend-probe-mb),
#                     the position mask's within its bytes (--pcr-position-mask-mb)
#   transfer          tests/gpu/gpu_transfer_check.py: copy bandwidth, exposed transfer time,
#                     the document re-placement
#   retrieval         tests/gpu/gpu_retrieval_check.py: the GPU fast tier of look-ahead retrieval
# --cpu-dry-run runs the reduced CPU form of every step under TRITON_INTERPRET=1, so the
# script does not rot where no GPU is at hand; its figures are not GPU figures.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

DRY_RUN=0
OUTDIR=""
for arg in "$@"; do
    case "$arg" in
        --cpu-dry-run) DRY_RUN=1 ;;
        -h|--help) sed -n '2,33p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "gpu_check: unknown option $arg" >&2; exit 2 ;;
        *) OUTDIR=$arg ;;
    esac
done
OUTDIR=${OUTDIR:-${OUT:-gpu-check-results}}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
SUMMARY="$OUTDIR/summary.txt"
: > "$SUMMARY"
PYTHON=${PYTHON:-python3}

say() { echo "$*" | tee -a "$SUMMARY"; }

# ---------------------------------------------------------------- the machine
if ! HAS_CUDA=$("$PYTHON" -c "import torch; print(int(torch.cuda.is_available()))" 2> /dev/null); then
    say "gpu_check: $PYTHON cannot import torch (set PYTHON to the interpreter that has it)"
    exit 2
fi
if [[ $DRY_RUN == 1 ]]; then
    export TRITON_INTERPRET=1
    export CUDA_VISIBLE_DEVICES=""  # the reduced forms even where a GPU is present
    BUDGET_S=${GPU_CHECK_BUDGET_S:-1800}
    say "gpu_check --cpu-dry-run: the reduced CPU forms under TRITON_INTERPRET=1; NOT a GPU check"
elif [[ $HAS_CUDA != 1 ]]; then
    say "gpu_check: no CUDA device visible to torch; refusing (run on a GPU machine, or pass --cpu-dry-run)"
    exit 2
else
    unset TRITON_INTERPRET
    BUDGET_S=${GPU_CHECK_BUDGET_S:-420}
fi

# ---------------------------------------------------------------- carried wheels
SITE=""
PY312=$("$PYTHON" -c "import sys; print(int(sys.version_info[:2] == (3, 12)))")
if compgen -G ".whl/*.whl" > /dev/null && [[ $PY312 != 1 ]]; then
    say "gpu_check: .whl/ holds CPython 3.12 wheels and $PYTHON is not 3.12: not installed, its own packages used"
elif compgen -G ".whl/*.whl" > /dev/null; then
    SITE=$(mktemp -d -t pcr-site.XXXXXX)
    trap 'rm -rf "$SITE"' EXIT
    if ! "$PYTHON" -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl > "$OUTDIR/wheels.log" 2>&1; then
        say "FAIL  wheels: installing .whl/*.whl failed (see wheels.log)"
        exit 1
    fi
fi
export PYTHONPATH="$ROOT${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"

{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    if command -v nvidia-smi > /dev/null; then nvidia-smi -L; else echo "nvidia-smi: not found"; fi
    "$PYTHON" - <<'PY'
import platform
import torch
import triton
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}")
if torch.cuda.is_available():
    print(f"device: {torch.cuda.get_device_name()}, capability {torch.cuda.get_device_capability()}")
for name in ("faiss", "sglang"):
    try:
        __import__(name)
        print(f"{name}: importable")
    except ImportError:
        print(f"{name}: not installed")
PY
} 2>&1 | tee -a "$SUMMARY"

# ---------------------------------------------------------------- steps
START=$(date +%s)
FAILED=0
RESULTS=()

# step NAME LIMIT_S COMMAND...: run COMMAND under min(LIMIT_S, what is left of the budget).
step() {
    local name=$1 limit=$2
    shift 2
    local left=$(( BUDGET_S - ($(date +%s) - START) ))
    local log="$OUTDIR/$name.log"
    if (( left < 10 )); then
        RESULTS+=("FAIL  $name: not run, the ${BUDGET_S} s budget is spent")
        say "${RESULTS[-1]}"
        FAILED=1
        return
    fi
    (( limit > left )) && limit=$left
    echo "---- $name (limit ${limit} s): $*" | tee "$log"
    local t0=$(date +%s)
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    local took=$(( $(date +%s) - t0 ))
    local status=PASS detail=""
    if (( rc == 124 || rc == 137 )); then
        status=FAIL detail="timed out after ${limit} s"
    elif (( rc == 0 || rc == 5 )) && grep -qE '[0-9]+ skipped' "$log" && ! grep -qE '[0-9]+ passed' "$log"; then
        # pytest: nothing passed, something skipped (rc 5: a module that skipped itself)
        status=SKIP detail=$(grep -m1 -E '^SKIPPED' "$log" | sed 's/^SKIPPED \[[0-9]*\] //')
    elif (( rc != 0 )); then
        status=FAIL detail="exit code $rc"
    fi
    [[ $status == FAIL ]] && FAILED=1
    RESULTS+=("$status  $name (${took} s)${detail:+: $detail}")
    say "${RESULTS[-1]}"
}

PYTEST=("$PYTHON" -m pytest -q -p no:cacheprovider -rs)
if [[ $DRY_RUN == 1 ]]; then
    step kernels-copy 900 "${PYTEST[@]}" tests/kernels \
        --ignore=tests/kernels/test_rope_shift_triton.py --ignore=tests/kernels/test_position_mask_triton.py
    step kernels-rope 600 "${PYTEST[@]}" tests/kernels/test_rope_shift_triton.py
    step kernels-mask 300 "${PYTEST[@]}" tests/kernels/test_position_mask_triton.py
    step ordering 300 "$PYTHON" tests/gpu/gpu_ordering_check.py
    step step 300 "$PYTHON" tests/gpu/gpu_step_check.py
    step transfer 300 "$PYTHON" tests/gpu/gpu_transfer_check.py --prefix 256 --new 64 --doc 64 --bw-chunks 8 --repeats 1
    step retrieval 300 "$PYTHON" tests/gpu/gpu_retrieval_check.py --vectors 5000 --queries 10 --steps 5 --copy-gb 0.01 \
        --json "$OUTDIR/retrieval.json"
else
    step kernels-copy 150 "${PYTEST[@]}" tests/kernels \
        --ignore=tests/kernels/test_rope_shift_triton.py --ignore=tests/kernels/test_position_mask_triton.py
    step kernels-rope 90 "${PYTEST[@]}" tests/kernels/test_rope_shift_triton.py
    step kernels-mask 60 "${PYTEST[@]}" tests/kernels/test_position_mask_triton.py
    step ordering 90 "$PYTHON" tests/gpu/gpu_ordering_check.py
    step step 90 "$PYTHON" tests/gpu/gpu_step_check.py
    step transfer 150 "$PYTHON" tests/gpu/gpu_transfer_check.py --layers 32 --prefix 4096 --new 1024 --doc 1024 --repeats 10
    step retrieval 180 "$PYTHON" tests/gpu/gpu_retrieval_check.py --vectors 500000 --nlist 1024 --copy-gb 1 \
        --json "$OUTDIR/retrieval.json"
fi

say ""
say "summary ($(( $(date +%s) - START )) s of a ${BUDGET_S} s budget):"
for line in "${RESULTS[@]}"; do say "  $line"; done
if (( FAILED )); then
    say "gpu_check: FAILED"
    exit 1
fi
say "gpu_check: all steps passed or skipped (a SKIP is not a check)"
