"""The house's import rules, checked over the source (every import, lazy ones included):

* the server package never imports the tools (``pcr_tools``), the benchmarks or the tests;
* ``pcr_sglang/core`` imports neither SGLang nor torch (the core is pure Python);
* the client library (``pcr_client``: retrieval, the prompt builder, the DSL helpers, the
  hint envelope) imports nothing of the server package, and the server package imports
  nothing of it: an application installs the client without the server's floors, and
  the server never grows a dependency on what runs in its clients;
* what both must spell alike (the ``custom_params`` that mark documents, the document
  format, the ``kv_hints`` action's name and version) is defined once, in ``pcr_wire``, a
  package that imports nothing at all, so either side may import it: a name both sides
  copied could drift apart, and a name one side took from the other would break the
  rule above;
* the evaluation (``pcr_eval``: the accuracy measurements and the benchmarks' library) is
  imported by the benchmarks' commands under ``bench/``, by the tools and by the tests, and
  imports nothing of ``bench``; the server, the client and the wire words import nothing of
  it; no test imports a benchmark (``bench`` holds commands, the tests test the library);
* no two modules of the evaluation, the tools or the benchmarks import each other, however
  lazily or through others (a circle made the questions workload and the accuracy
  benchmark importable only in one order);
* no module of the server package is over 400 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def imported_modules(path: Path, package_root: Path) -> set[str]:
    """Every module ``path`` imports, relative imports resolved against ``package_root``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    parts = list(path.relative_to(package_root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    else:
        parts = parts[:-1]  # the module's package
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            found.add(stem)
            found.update(f"{stem}.{alias.name}" for alias in node.names)
    return found


def violations(package_root: Path, forbidden: tuple[str, ...]) -> list[str]:
    """``file: module`` for every import under ``package_root`` of a forbidden top-level name."""
    out = []
    for path in sorted(package_root.rglob("*.py")):
        for module in sorted(imported_modules(path, package_root)):
            if module.split(".")[0] in forbidden:
                out.append(f"{path.relative_to(package_root.parent)}: {module}")
    return out


def test_the_server_package_imports_no_tool_benchmark_or_test():
    assert violations(REPO / "pcr_sglang", ("pcr_tools", "pcr_eval", "bench", "tests")) == []


def test_the_client_library_imports_nothing_of_the_server():
    assert violations(REPO / "pcr_client", ("pcr_sglang", "pcr_tools", "pcr_eval", "bench", "tests")) == []


def test_the_evaluation_imports_no_benchmark_or_test():
    assert violations(REPO / "pcr_eval", ("bench", "tests")) == []


def test_no_test_imports_a_benchmark():
    assert violations(REPO / "tests", ("bench",)) == []


def module_name(path: Path, repo: Path) -> str:
    parts = list(path.relative_to(repo).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_circles(roots: tuple[str, ...], repo: Path = REPO) -> list[list[str]]:
    """Every circle of imports among the modules under ``roots`` (each import counted,
    lazy ones included): a strongly connected group of more than one module."""
    paths = {module_name(p, repo): p for root in roots for p in sorted((repo / root).rglob("*.py"))}
    edges = {
        name: sorted(m for m in imported_modules(path, repo / name.split(".")[0]) if m in paths and m != name)
        for name, path in paths.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in edges[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for name in sorted(paths):
        if name not in index:
            visit(name)
    return circles


def test_the_evaluation_tools_and_benchmarks_import_in_no_circle():
    assert import_circles(("pcr_eval", "pcr_tools", "bench")) == []


def test_the_circle_walk_sees_a_lazy_circle(tmp_path):
    package = tmp_path / "pcr_eval"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "accuracy.py").write_text("def run():\n    from pcr_eval.questions import ask\n")
    (package / "questions.py").write_text("from pcr_eval import accuracy\n")
    (package / "scores.py").write_text("")
    assert import_circles(("pcr_eval",), tmp_path) == [["pcr_eval.accuracy", "pcr_eval.questions"]]


def test_the_server_package_imports_no_client_module():
    assert violations(REPO / "pcr_sglang", ("pcr_client",)) == []


def test_the_wire_words_import_nothing():
    """``pcr_wire`` sits below both the client and the server, so it may import neither,
    nor anything else that could pull one in."""
    for path in sorted((REPO / "pcr_wire").rglob("*.py")):
        assert imported_modules(path, REPO / "pcr_wire") <= {"__future__", "__future__.annotations"}, path


def test_the_core_imports_neither_sglang_nor_torch():
    assert violations(REPO / "pcr_sglang" / "core", ("sglang", "torch", "triton")) == []


@pytest.mark.parametrize(
    ("source", "caught"),
    [
        ("import pcr_tools.launcher\n", "pcr_tools.launcher"),
        ("def later():\n    from pcr_tools.models import build_cached\n", "pcr_tools.models"),
        ("from bench.ragbench import common\n", "bench.ragbench"),
    ],
)
def test_the_walk_sees_a_forbidden_import_wherever_it_is(tmp_path, source, caught):
    package = tmp_path / "pcr_sglang"
    (package / "core").mkdir(parents=True)
    (package / "core" / "keys.py").write_text(source)
    assert f"pcr_sglang/core/keys.py: {caught}" in violations(package, ("pcr_tools", "bench"))


def test_relative_imports_resolve_to_their_package(tmp_path):
    package = tmp_path / "pcr_sglang"
    (package / "core").mkdir(parents=True)
    (package / "core" / "keys.py").write_text("from .lru import X\nfrom ..tiers import layout\n")
    assert imported_modules(package / "core" / "keys.py", package) >= {
        "pcr_sglang.core.lru",
        "pcr_sglang.tiers",
        "pcr_sglang.tiers.layout",
    }


def test_the_config_imports_no_feature():
    """config.py parses the flags; each feature builds its settings from it (reuse.settings)."""
    config = REPO / "pcr_sglang" / "config.py"
    features = {m for m in imported_modules(config, REPO / "pcr_sglang") if m.startswith("pcr_sglang.")}
    assert not {m for m in features if m.split(".")[1] in ("reuse", "rag", "sglang_adapter", "io")}, features


def test_the_selector_list_imports_nothing():
    """Blend's selectors are one list (reuse/selectors.py), which the flag declarations read
    while SGLang is still assembling ``ServerArgs``: it may import nothing of the package."""
    selectors = REPO / "pcr_sglang" / "reuse" / "selectors.py"
    assert imported_modules(selectors, REPO / "pcr_sglang") <= {"__future__", "__future__.annotations"}


def test_every_end_to_end_module_is_marked_as_such():
    """``-m "not e2e"`` must leave out every module that starts a server."""
    unmarked = [
        p.name
        for p in sorted((REPO / "tests" / "e2e").glob("test_*.py"))
        if "pytest.mark.e2e" not in pytestmark_line(p)
    ]
    assert unmarked == []


def pytestmark_line(module: Path) -> str:
    """A test module's ``pytestmark = ...`` line (empty if it has none)."""
    lines = module.read_text(encoding="utf-8").splitlines()
    return next((line for line in lines if line.startswith("pytestmark = ")), "")


def test_the_e2e_schedule_names_every_module_that_runs_two_at_a_time():
    """scripts/test.sh hands the non-paced e2e modules to its workers longest first, by the
    list in tests/e2e/conftest.py: every one of them is listed (a new module would start
    first, whatever its length), and nothing listed is missing or paced."""
    from tests.e2e.conftest import MODULES_LONGEST_FIRST

    modules = (REPO / "tests" / "e2e").glob("test_*.py")
    side_by_side = {p.name for p in modules if "pytest.mark.paced" not in pytestmark_line(p)}
    assert len(MODULES_LONGEST_FIRST) == len(set(MODULES_LONGEST_FIRST))
    assert set(MODULES_LONGEST_FIRST) == side_by_side


def test_the_reuse_wing_does_not_import_the_sglang_adapter():
    """The adapter calls into document reuse, never the other way (no circle between them)."""
    assert violations_of_prefix(REPO / "pcr_sglang" / "reuse", "pcr_sglang.sglang_adapter") == []


def violations_of_prefix(package_root: Path, prefix: str) -> list[str]:
    return [
        f"{path.name}: {module}"
        for path in sorted(package_root.rglob("*.py"))
        for module in sorted(imported_modules(path, package_root.parent))
        if module == prefix or module.startswith(prefix + ".")
    ]


def test_the_core_is_the_ground_floor():
    """``core/`` imports nothing of the package outside ``core/``: its orders, outcomes and
    counters are its own words (the I/O process encodes them; it does not define them)."""
    core = REPO / "pcr_sglang" / "core"
    outside = [
        f"{path.name}: {module}"
        for path in sorted(core.rglob("*.py"))
        for module in sorted(imported_modules(path, REPO / "pcr_sglang"))
        if module.startswith("pcr_sglang.") and not module.startswith("pcr_sglang.core")
    ]
    assert outside == []


SCHEDULER_COLLABORATORS = (
    "admission",
    "executor",
    "hints",
    "offloads",
    "remote_probes",
    "request_keys",
    "requests",
    "step_agreement",
)


@pytest.mark.parametrize("name", SCHEDULER_COLLABORATORS)
def test_the_scheduler_loops_collaborators_never_reach_back_into_it(name):
    """Each collaborator of the scheduler loop is handed keys and an executor; none imports
    the loop (a split by method would close a circle through it)."""
    path = REPO / "pcr_sglang" / "sglang_adapter" / f"{name}.py"
    assert "pcr_sglang.sglang_adapter.scheduler_side" not in imported_modules(path, REPO / "pcr_sglang")


def test_the_scheduler_loop_stays_a_loop():
    """A feature that lands in the loop instead of a collaborator shows up here first."""
    lines = (REPO / "pcr_sglang" / "sglang_adapter" / "scheduler_side.py").read_text(encoding="utf-8").count("\n")
    assert lines <= 300, f"scheduler_side.py has {lines} lines: give the new job a collaborator"


MAX_LINES = 400  # a module longer than this (and so any class in it) does more than one job


def oversized(package: Path) -> list[str]:
    """Modules of ``package`` over :data:`MAX_LINES` lines."""
    found = []
    for path in sorted(package.rglob("*.py")):
        lines = path.read_text(encoding="utf-8").count("\n")
        if lines > MAX_LINES:
            found.append(f"{path.relative_to(package.parent)}: {lines} lines")
    return found


def test_no_module_of_the_server_package_is_over_400_lines():
    assert oversized(REPO / "pcr_sglang") == []


def test_the_size_rule_sees_a_long_module(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "short.py").write_text("x = 1\n" * MAX_LINES)
    (package / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert oversized(package) == [f"pkg/long.py: {MAX_LINES + 1} lines"]
