"""The docs against the tree: a link that points nowhere, or a layout that no longer matches
the folders, misleads a reader more than a missing page would.

* every relative link in the repository's markdown names a file (or folder) that exists,
  and every ``#anchor`` a heading of its target;
* every file the docs name in code spans (``core/keys.py``, ``test_faults.py``) is in the tree,
  so a moved or deleted module cannot linger in a page (result pages under ``bench/results``
  keep the names of their date and are not checked);
* the layout in ``docs/architecture.md`` names every package folder and top-level folder
  of the tree, names none that does not exist, and keeps no line counts (they went stale).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*```")


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [line for line in out.stdout.splitlines() if (REPO / line).exists()]


def prose_lines(path: Path) -> list[str]:
    """The file's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = heading.strip().lstrip("#").strip().replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(line) for line in prose_lines(path) if line.startswith("#")}


def test_every_relative_link_in_the_markdown_resolves():
    broken = []
    for name in tracked_files():
        if not name.endswith(".md"):
            continue
        source = REPO / name
        for line in prose_lines(source):
            for target in LINK.findall(line):
                if re.match(r"^[a-z]+:", target):
                    continue  # http(s), mailto: not checked here
                file_part, _, anchor = target.partition("#")
                dest = (source.parent / file_part).resolve() if file_part else source
                if not dest.exists():
                    broken.append(f"{name}: {target} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    broken.append(f"{name}: {target} (no such heading)")
    assert broken == []


CODE_PATH = re.compile(r"`([\w./-]+\.(?:py|sh|md|json|txt|patch))(?:::\w+)?`")
RUNTIME_FILES = {"namespace.json"}  # written by the server into a store, not the repository's


def runtime(path: str) -> bool:
    """A file a server or tool writes at run time: under a placeholder (``DIR/``), or a store file."""
    return path.split("/")[0].isupper() or path in RUNTIME_FILES


def test_every_file_the_docs_name_is_in_the_tree():
    files = tracked_files()
    names = {Path(f).name for f in files}
    missing = []
    for name in files:
        if not name.endswith(".md") or name.startswith("bench/results/"):
            continue
        for path in CODE_PATH.findall((REPO / name).read_text(encoding="utf-8")):
            if runtime(path):
                continue
            if "/" in path:
                found = path in files or any(f.endswith("/" + path) for f in files)
            else:
                found = path in names
            if not found:
                missing.append(f"{name}: {path}")
    assert missing == []


def layout_block() -> list[str]:
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## Repository layout", 1)[1]
    return section.split("```", 2)[1].strip("\n").splitlines()


def layout_paths() -> set[str]:
    """The folders the layout names, as repository paths (indentation is nesting)."""
    paths, parents = set(), []
    for line in layout_block():
        name = line.split()[0]
        depth = (len(line) - len(line.lstrip())) // 2
        parents = parents[:depth] + [name.rstrip("/")]
        paths.add("/".join(parents))
    return paths


def test_the_layout_in_architecture_md_matches_the_tree():
    files = tracked_files()
    listed = layout_paths()
    top = {f.split("/")[0] for f in files if "/" in f and not f.startswith(".")}
    roots = {"pcr_sglang", "pcr_client", "pcr_wire", "pcr_tools", "pcr_eval", "bench"}
    packages = {str(Path(f).parent) for f in files if f.endswith("/__init__.py") and f.split("/")[0] in roots}
    assert sorted(p for p in listed if not (REPO / p).is_dir()) == [], "the layout names folders that do not exist"
    assert sorted((top | packages) - listed) == [], "folders missing from the layout in docs/architecture.md"


def test_the_layout_keeps_no_line_counts():
    assert [line for line in layout_block() if re.search(r"\s\d+\s*$", line)] == []


def test_every_pcr_flag_has_a_row_in_docs_flags_md():
    """The README promises every flag with its default and meaning in docs/flags.md."""
    import msgspec

    from pcr_sglang.flags import PcrFlags

    text = (REPO / "docs" / "flags.md").read_text(encoding="utf-8")
    flags = ["--" + field.name.replace("_", "-") for field in msgspec.structs.fields(PcrFlags)]
    assert flags and [f for f in flags if f"`{f}" not in text] == []
