"""scripts/gpu_check.sh stays runnable on a GPU machine without SGLang: the scripts parse,
every step's file exists, and every Python file a step runs imports with SGLang and the
other packages that machine lacks (and scripts/gpu_wheels.sh does not carry) blocked."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
CHECK = ROOT / "scripts" / "gpu_check.sh"
WHEELS = ROOT / "scripts" / "gpu_wheels.sh"
STEPS = ["kernels-copy", "kernels-rope", "kernels-mask", "ordering", "step", "transfer", "retrieval"]
# Absent on the GPU machine and not carried as wheels (faiss-cpu and msgspec are: gpu_wheels.sh).
BLOCKED = ["sglang", "sgl_kernel", "blake3", "cryptography", "zmq"]

IMPORT_ALL = r"""
import importlib.abc, importlib.util, sys
BLOCKED = set(sys.argv[1].split(","))

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"blocked on purpose: {name}", name=name)
        return None

sys.meta_path.insert(0, Block())
from _pytest.outcomes import Skipped
for path in sys.argv[2:]:
    module = path[:-3].replace("/", ".")
    try:
        importlib.import_module(module)
        print("ok", path)
    except Skipped as e:
        print("skipped", path, str(e).replace("\n", " "))
"""


def _script_text() -> str:
    return CHECK.read_text()


def test_both_scripts_parse():
    for script in (CHECK, WHEELS):
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr


def test_every_step_is_run_on_the_gpu_and_in_the_dry_run_and_its_files_exist():
    text = _script_text()
    names = re.findall(r"^\s*step ([\w-]+) \d+ ", text, flags=re.M)
    assert names == STEPS + STEPS  # the dry-run branch, then the GPU branch
    for path in set(re.findall(r"((?:tests/gpu|tests/kernels)/[\w/.]*)", text)):
        assert (ROOT / path.rstrip("/")).exists(), path


def _python_files_run() -> list[str]:
    text = _script_text()
    files = set(re.findall(r"tests/gpu/\w+\.py", text))
    files |= {str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "kernels").glob("*.py") if p.name != "__init__.py"}
    return sorted(files)


def test_every_python_file_a_step_runs_imports_without_sglang():
    files = _python_files_run()
    assert "tests/gpu/gpu_ordering_check.py" in files and "tests/kernels/test_copy_kv_host_pool.py" in files
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, ",".join(BLOCKED), *files],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == len(files), result.stdout
    skipped = [line for line in lines if line.startswith("skipped")]
    # The position-mask tests check SGLang's own kernel: they skip themselves, and say why.
    assert len(skipped) == 2 and all("SGLang" in line for line in skipped), lines
    assert "test_position_mask_triton" in skipped[0] and "test_position_mask_warmup_triton" in skipped[1], lines


def test_the_blocker_does_block():
    """The import check can fail: importing SGLang itself is refused."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            IMPORT_ALL.replace("import_module(module)", "import_module('sglang')"),
            ",".join(BLOCKED),
            "tests/gpu/gpu_ordering_check.py",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and "blocked on purpose: sglang" in result.stderr


def test_without_cuda_the_check_refuses_clearly(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        ["bash", str(CHECK), str(tmp_path / "out")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert "no CUDA device" in result.stdout and "--cpu-dry-run" in result.stdout
    assert "no CUDA device" in (tmp_path / "out" / "summary.txt").read_text()


def test_every_carried_wheel_is_pinned_in_the_lock_and_not_blocked_above():
    packages = re.search(r"^PACKAGES=\((.*)\)$", WHEELS.read_text(), flags=re.M).group(1).split()
    lock = (ROOT / "requirements" / "cpu-lock.txt").read_text().lower()
    assert packages
    for name in packages:
        assert re.search(rf"^{re.escape(name.lower())}==", lock, flags=re.M), name
        assert name.split("-")[0] not in BLOCKED
