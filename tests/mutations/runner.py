"""Apply one mutant to a private copy of the tree and run its tests there.

The working tree itself is never written: each mutant gets a fresh copy of the files git
would show (tracked and untracked-but-not-ignored; the virtual environment and build
outputs stay behind), made in a temporary directory. Its tests run with the given Python
(the project's virtual environment) as ``python -m pytest`` with cwd the copy, which puts
the copy first on ``sys.path``, so the copy's ``pcr_sglang`` is the one imported even though
the editable install points at the original tree (setuptools appends its finder after the
path entries). The copy also goes first on ``PYTHONPATH``, for processes the tests start
elsewhere: the servers of e2e tests inherit it and load the copy's plugin. Where the copy's
tests would import ``pcr_sglang`` from is checked for each copy before any test runs.

A mutant is *killed* when its tests, which pass on the unmutated copy (checked first unless
``baseline=False``), fail with it (an assertion or exception in a test itself);
*survived* when they still pass. Anything else (its text gone stale, a mutant that does
not compile, a test module that no longer imports, a test failing unmutated, only fixture
errors such as a server that did not start, nothing run, a timeout) is an error: it proves
nothing, so it is reported, never counted as a kill.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from tests.mutations.table import Mutant

logger = logging.getLogger(__name__)

KILLED, SURVIVED = "killed", "survived"
STALE, BASELINE_FAILED, NOT_RUN, TIMEOUT, ERROR = "stale", "baseline-failed", "not-run", "timeout", "error"
DEFAULT_TIMEOUT_S = {"unit": 600.0, "kernel": 900.0, "e2e": 2400.0}
INTERRUPT_GRACE_S = 60.0  # after SIGINT, for fixtures to stop the servers they started
REPORT_NAME = ".mutation-junit.xml"


@dataclass
class PytestOutcome:
    """One pytest run in a copy."""

    returncode: Optional[int]  # None: stopped at the timeout
    passed: int = 0
    failed: list[str] = field(default_factory=list)  # node ids that failed or errored
    collection_errors: list[str] = field(default_factory=list)  # modules that failed to import
    errored: list[str] = field(default_factory=list)  # node ids whose setup or teardown raised
    first_message: str = ""  # the first failure's message, as pytest put it in its report
    skipped: int = 0
    seconds: float = 0.0
    tail: str = ""  # the end of pytest's output

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


@dataclass
class MutantResult:
    name: str
    kind: str
    tests: str
    status: str  # KILLED, SURVIVED or one of the errors
    seconds: float = 0.0
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == KILLED


# A mutant's code is anchored by a comment line ``# mutant: <name>`` right above it: its
# original text is looked for in the lines that follow (ANCHOR_REACH, marker lines not
# counted), so an entry names which occurrence it breaks, survives ``ruff format`` moving
# code around, and a reader of the source sees the line is guarded by a negative control.
MARKER = "# mutant: "
ANCHOR_REACH = 12


def anchored_region(text: str, name: str) -> Optional[tuple[int, int]]:
    """The character span the mutant ``name``'s marker anchors in ``text`` (the
    ANCHOR_REACH lines after its marker line, other markers skipped), or None without one."""
    lines = text.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    markers = [i for i, line in enumerate(lines) if line.strip() == MARKER + name]
    if len(markers) != 1:
        return None
    start = end = markers[0] + 1
    taken = 0
    while end < len(lines) and taken < ANCHOR_REACH:
        if not lines[end].strip().startswith(MARKER):
            taken += 1
        end += 1
    return offsets[start], offsets[end]


def locate(mutant: Mutant, text: str) -> tuple[int, Optional[str]]:
    """Where the mutant's original text starts in ``text``, or why it cannot be placed: no
    marker (or more than one), or its original not exactly once in the anchored lines."""
    region = anchored_region(text, mutant.name)
    if region is None:
        count = sum(line.strip() == MARKER + mutant.name for line in text.splitlines())
        return -1, (
            f"no marker line '{MARKER}{mutant.name}' in {mutant.file}"
            if count == 0
            else f"{count} marker lines '{MARKER}{mutant.name}' in {mutant.file} (must be exactly one)"
        )
    start, end = region
    count = text.count(mutant.original, start, end)
    if count != 1:
        return -1, (
            f"its original text occurs {count} times in the {ANCHOR_REACH} lines after its marker in "
            f"{mutant.file} (must be exactly once)"
        )
    return text.index(mutant.original, start, end), None


def stale_reason(mutant: Mutant, root: Path) -> Optional[str]:
    """Why the entry no longer applies to the tree at ``root``, or None when it does."""
    path = root / mutant.file
    if not path.is_file():
        return f"{mutant.file} does not exist"
    return locate(mutant, path.read_text(encoding="utf-8"))[1]


def tree_files(root: Path) -> list[str]:
    """The files ``git status`` would show: tracked ones still present, and untracked ones
    that are not ignored."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return sorted({p for p in listed.split("\0") if p and os.path.lexists(root / p)})


def copy_tree(root: Path, dest: Path) -> int:
    """Copy the tree's files (links as links) into ``dest``; returns how many."""
    files = tree_files(root)
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target, follow_symlinks=False)
    return len(files)


def apply_mutant(mutant: Mutant, copy: Path) -> Optional[str]:
    """Write the mutant into the copy; returns why it is not a usable mutant (a Python file
    that no longer compiles: its tests would fail at collection, which proves nothing)."""
    path = copy / mutant.file
    text = path.read_text(encoding="utf-8")
    at, problem = locate(mutant, text)  # the copy is the tree's: checked before, checked again
    if problem is not None:
        raise ValueError(f"{mutant.name}: {problem} (the copy's)")
    mutated = text[:at] + mutant.replacement + text[at + len(mutant.original) :]
    path.write_text(mutated, encoding="utf-8")
    if path.suffix == ".py":
        try:
            compile(mutated, str(path), "exec")
        except SyntaxError as exc:
            return f"the mutated {mutant.file} does not compile: {exc.msg} (line {exc.lineno})"
    return None


def copy_environment(copy: Path, kind: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(copy), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if kind == "kernel":
        env.setdefault("TRITON_INTERPRET", "1")  # set it to 0 on a CUDA machine to run them natively
    return env


def imported_from(python: str, copy: Path, package: str, env: dict[str, str]) -> str:
    """Where ``package`` is found when run as the tests are (without importing it)."""
    found = subprocess.run(
        [python, "-c", f"import importlib.util as u; s = u.find_spec({package!r}); print(s.origin if s else '')"],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return found.stdout.strip()


def check_isolation(python: str, copy: Path, package: str, env: dict[str, str]) -> Optional[str]:
    """None when the copy's ``package`` is the one its tests would import."""
    origin = imported_from(python, copy, package, env)
    if not origin:
        return f"{package} is not importable from the copy"
    if not Path(origin).resolve().is_relative_to(copy.resolve()):
        return f"the copy's tests would import {package} from {origin}, not from the copy"
    return None


def pytest_argv(python: str, mutant: Mutant, stop_at_first_failure: bool) -> list[str]:
    argv = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={REPORT_NAME}", "-rfE"]
    if stop_at_first_failure:
        argv.append("-x")
    argv += list(mutant.tests)
    if mutant.k:
        argv += ["-k", mutant.k]
    return argv


def run_pytest(argv: Sequence[str], copy: Path, env: dict[str, str], timeout_s: float) -> PytestOutcome:
    """Run pytest in ``copy`` in a session of its own; at the timeout SIGINT it (pytest then
    runs its fixtures' teardown, which stops the servers they started), and SIGKILL what is
    left of that session after a grace period."""
    report = copy / REPORT_NAME
    report.unlink(missing_ok=True)
    start = time.monotonic()
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            list(argv), cwd=copy, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            returncode: Optional[int] = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            returncode = None
            _stop(proc)
        log.seek(0)
        tail = "\n".join(log.read().decode(errors="replace").splitlines()[-40:])
    outcome = PytestOutcome(returncode, seconds=time.monotonic() - start, tail=tail)
    if report.is_file():
        _read_junit(report, outcome)
    return outcome


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=INTERRUPT_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _read_junit(report: Path, outcome: PytestOutcome) -> None:
    try:
        root = ElementTree.parse(report).getroot()
    except ElementTree.ParseError:
        return
    for case in root.iter("testcase"):
        tags = {child.tag for child in case}
        node = f"{case.get('classname', '')}::{case.get('name', '')}"
        # pytest's entry for a module it could not collect
        if tags & {"failure", "error"} and not case.get("classname"):
            outcome.collection_errors.append(case.get("name", ""))
        elif "error" in tags:  # a fixture raised (a server that did not start, say), not the test
            outcome.errored.append(node)
        elif "failure" in tags:
            outcome.failed.append(node)
            if not outcome.first_message:
                problem = next(c for c in case if c.tag == "failure")
                outcome.first_message = " ".join((problem.get("message") or "").split())[:240]
        elif "skipped" in tags:
            outcome.skipped += 1
        else:
            outcome.passed += 1


def describe_tests(mutant: Mutant) -> str:
    names = [t.split("::")[-1] if "::" in t else t for t in mutant.tests]
    return ", ".join(names) + (f" -k {mutant.k!r}" if mutant.k else "")


@dataclass
class Runner:
    """Runs mutants of the tree at ``root`` with ``python``; baselines are remembered per
    test selection, so mutants naming the same tests run them unmutated once."""

    root: Path
    python: str
    package: str = "pcr_sglang"  # must import from the copy
    baseline: bool = True
    timeout_s: Optional[float] = None  # None: DEFAULT_TIMEOUT_S by kind
    keep_copies: bool = False
    _baselines: dict[tuple, PytestOutcome] = field(default_factory=dict)

    def run(self, mutant: Mutant) -> MutantResult:
        started = time.monotonic()
        result = MutantResult(mutant.name, mutant.kind, describe_tests(mutant), ERROR)
        try:
            self._run(mutant, result)
        except Exception as exc:  # a broken entry or environment: reported, the others still run
            logger.exception("mutant %s", mutant.name)
            result.status, result.detail = ERROR, f"{type(exc).__name__}: {exc}"
        result.seconds = time.monotonic() - started
        return result

    def _run(self, mutant: Mutant, result: MutantResult) -> None:
        stale = stale_reason(mutant, self.root)
        if stale:
            result.status, result.detail = STALE, stale
            return
        copy = Path(tempfile.mkdtemp(prefix=f"pcr-mutant-{mutant.name}-"))
        try:
            copy_tree(self.root, copy)
            env = copy_environment(copy, mutant.kind)
            isolation = check_isolation(self.python, copy, self.package, env)
            if isolation:
                result.status, result.detail = ERROR, isolation
                return
            timeout = self.timeout_s or DEFAULT_TIMEOUT_S[mutant.kind]
            if self.baseline:
                key = (mutant.kind, mutant.tests, mutant.k)
                if key not in self._baselines:
                    self._baselines[key] = run_pytest(pytest_argv(self.python, mutant, False), copy, env, timeout)
                base = self._baselines[key]
                if base.timed_out or base.returncode != 0 or base.failed or base.errored or base.collection_errors:
                    result.status = TIMEOUT if base.timed_out else BASELINE_FAILED
                    result.detail = _failure_detail("unmutated", base)
                    return
                if base.passed == 0:
                    result.status, result.detail = (
                        NOT_RUN,
                        f"unmutated: no test ran ({base.skipped} skipped)\n{base.tail}",
                    )
                    return
            unusable = apply_mutant(mutant, copy)
            if unusable:
                result.status, result.detail = ERROR, unusable
                return
            outcome = run_pytest(pytest_argv(self.python, mutant, True), copy, env, timeout)
            _classify(outcome, result)
        finally:
            if self.keep_copies:
                result.detail += f"\ncopy kept at {copy}"
            else:
                shutil.rmtree(copy, ignore_errors=True)


def _classify(outcome: PytestOutcome, result: MutantResult) -> None:
    if outcome.timed_out:
        result.status, result.detail = TIMEOUT, _failure_detail("mutated", outcome)
    elif outcome.collection_errors:  # an import error proves nothing about the behaviour under test
        result.status = ERROR
        result.detail = (
            f"test modules failed to import with the mutant: {', '.join(outcome.collection_errors)}\n{outcome.tail}"
        )
    elif outcome.errored and not outcome.failed:  # nothing failed: the tests never ran as written
        result.status = ERROR
        result.detail = f"setup or teardown errors, no test failed: {', '.join(outcome.errored[:3])}\n{outcome.tail}"
    elif outcome.failed:
        result.status = KILLED
        more = f" (+{len(outcome.failed) - 1})" if len(outcome.failed) > 1 else ""
        result.detail = f"failed: {outcome.failed[0]}{more}: {outcome.first_message}"
    elif outcome.returncode == 0 and outcome.passed:
        result.status, result.detail = SURVIVED, f"{outcome.passed} passed with the mutant"
    elif outcome.returncode in (0, 5):
        result.status, result.detail = NOT_RUN, f"no test ran ({outcome.skipped} skipped)\n{outcome.tail}"
    else:  # pytest itself failed (usage, internal error) without a failing test
        result.status, result.detail = ERROR, _failure_detail("mutated", outcome)


def _failure_detail(label: str, outcome: PytestOutcome) -> str:
    what = "timed out" if outcome.timed_out else f"pytest exit {outcome.returncode}"
    failed = f", failed: {', '.join(outcome.failed[:3])}" if outcome.failed else ""
    failed += f", errored: {', '.join(outcome.errored[:3])}" if outcome.errored else ""
    return f"{label}: {what}{failed}\n{outcome.tail}"
