#!/usr/bin/env bash
# Download, here (with a package index), the wheels scripts/gpu_check.sh needs on a GPU
# machine that has PyTorch, Triton, numpy and pytest but no network and no SGLang. They land
# in .whl/ (git-ignored): carry that folder to the GPU machine beside the working tree.
#
# What the checks import beyond torch, triton, numpy and pytest (traced with the imports
# blocked, see tests/unit/tools/test_gpu_check_script.py): faiss-cpu, for tests/gpu/gpu_retrieval_check.py
# (the IVF index the GPU fast tier merges its results with), and msgspec, which pcr_sglang.core
# imports (the position-mask test reaches it where SGLang is installed). Nothing else: the
# kernel tests, the ordering check and the transfer check need neither SGLang nor blake3,
# cryptography or pyzmq. Versions are the ones requirements/cpu-lock.txt pins; the wheels
# are CPython 3.12's, the GPU machine's Python.
#
# Usage: bash scripts/gpu_wheels.sh   (PYTHON=... to use another interpreter's pip)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
PACKAGES=(faiss-cpu msgspec)
LIMIT_MIB=50
DEST=.whl

mkdir -p "$DEST"
for name in "${PACKAGES[@]}"; do
    pin=$(grep -i -m1 "^${name}==" requirements/cpu-lock.txt) || {
        echo "gpu_wheels: requirements/cpu-lock.txt pins no version of ${name}" >&2
        exit 1
    }
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$DEST" "$pin"
done

total_kib=$(du -sk "$DEST" | cut -f1)
ls -l "$DEST"
echo "gpu_wheels: ${DEST}/ holds $((total_kib / 1024)) MiB"
if (( total_kib > LIMIT_MIB * 1024 )); then
    echo "gpu_wheels: more than ${LIMIT_MIB} MiB: the GPU machine takes at most 64 MiB of carried files" >&2
    exit 1
fi
