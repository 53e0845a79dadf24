#!/usr/bin/env python3
"""Apply (idempotently) or verify the unified diffs under patches/ against installed packages.

Layout: ``patches/<distribution>-<version>/NN-name.patch``, paths inside each diff
relative to site-packages (``a/sglang/srt/...``). A patch applies only to exactly that
distribution version; SGLang must match, other distributions whose version differs are
skipped with a note (their fix may not be needed there).

Pure standard library, so it runs before anything else is importable. After applying the
SGLang patches it writes a stamp (``sglang/.pcr-sglang-patches.json``) with the SHA-256
of every patched file; the pcr-sglang plugin compares against it at startup and refuses
to run on an unpatched or since-modified SGLang.

Usage: ``python scripts/apply_patches.py [--check]``
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PATCH_ROOT = REPO / "patches"
STAMP_NAME = ".pcr-sglang-patches.json"
REQUIRED_DISTS = {"sglang"}
HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


@dataclass
class Hunk:
    old_start: int
    old: list[str] = field(default_factory=list)
    new: list[str] = field(default_factory=list)


@dataclass
class FilePatch:
    path: str
    hunks: list[Hunk] = field(default_factory=list)


def parse_patch(text: str) -> list[FilePatch]:
    """Parse a unified diff; lines before the first ``---`` are the human header."""
    files: list[FilePatch] = []
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            target = lines[i + 1][4:].strip().split("\t")[0]
            files.append(FilePatch(path=target[2:] if target.startswith("b/") else target))
            i += 2
            continue
        m = HUNK_RE.match(line)
        if m and files:
            hunk = Hunk(old_start=int(m.group(1)))
            files[-1].hunks.append(hunk)
            i += 1
            while i < len(lines) and not lines[i].startswith(("@@", "--- ")):
                body = lines[i]
                if body.startswith("\\"):
                    i += 1
                    continue
                tag, content = body[:1], body[1:]
                if tag in (" ", ""):
                    content = content if tag == " " else "\n"
                    hunk.old.append(content)
                    hunk.new.append(content)
                elif tag == "-":
                    hunk.old.append(content)
                elif tag == "+":
                    hunk.new.append(content)
                i += 1
            continue
        i += 1
    return files


def _find(lines: list[str], block: list[str], hint: int) -> int:
    """Index of ``block`` in ``lines``, searching outward from ``hint``; -1 if absent."""
    n = len(block)
    if n == 0:
        return hint
    candidates = range(len(lines) - n + 1)
    for start in sorted(candidates, key=lambda s: abs(s - hint)):
        if lines[start : start + n] == block:
            return start
    return -1


def apply_file_patch(text: str, fp: FilePatch) -> tuple[str, str]:
    """Return (new_text, state) with state in {"applied", "already", "conflict"}."""
    lines = text.splitlines(keepends=True)
    if all(_find(lines, h.new, h.old_start - 1) >= 0 for h in fp.hunks) and not all(
        _find(lines, h.old, h.old_start - 1) >= 0 for h in fp.hunks
    ):
        return text, "already"
    offset = 0
    for hunk in fp.hunks:
        pos = _find(lines, hunk.old, hunk.old_start - 1 + offset)
        if pos < 0:
            return text, "conflict"
        lines[pos : pos + len(hunk.old)] = hunk.new
        offset += len(hunk.new) - len(hunk.old)
    return "".join(lines), "applied"


def site_packages_of(dist: str) -> Path:
    return Path(metadata.distribution(dist).locate_file(""))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def process(check_only: bool) -> int:
    failures = 0
    for patch_dir in sorted(p for p in PATCH_ROOT.iterdir() if p.is_dir()):
        dist, _, version = patch_dir.name.rpartition("-")
        try:
            installed = metadata.version(dist)
        except metadata.PackageNotFoundError:
            if dist in REQUIRED_DISTS:
                print(f"[patches] {dist} is not installed", file=sys.stderr)
                failures += 1
            else:
                print(f"[patches] skip {patch_dir.name}: {dist} not installed")
            continue
        if installed.split("+")[0] != version:
            if dist in REQUIRED_DISTS:
                print(
                    f"[patches] {dist} {installed} is installed but the patches are for {version}",
                    file=sys.stderr,
                )
                failures += 1
            else:
                print(f"[patches] skip {patch_dir.name}: {dist} {installed} installed")
            continue
        root = site_packages_of(dist)
        patched_files: dict[str, str] = {}
        for patch_file in sorted(patch_dir.glob("*.patch")):
            for fp in parse_patch(patch_file.read_text()):
                target = root / fp.path
                if not target.is_file():
                    print(f"[patches] {patch_file.name}: {fp.path} missing", file=sys.stderr)
                    failures += 1
                    continue
                new_text, state = apply_file_patch(target.read_text(), fp)
                if state == "conflict" or (check_only and state != "already"):
                    verdict = "does not apply" if state == "conflict" else "is not applied"
                    print(f"[patches] {patch_file.name} {verdict} to {fp.path}", file=sys.stderr)
                    failures += 1
                    continue
                if state == "applied":
                    target.write_text(new_text)
                    print(f"[patches] applied {patch_file.name} to {fp.path}")
                patched_files[fp.path] = sha256(target)
        if dist == "sglang" and not failures and not check_only:
            stamp = {"sglang_version": installed, "files": patched_files}
            (root / "sglang" / STAMP_NAME).write_text(json.dumps(stamp, indent=1, sort_keys=True))
    if failures:
        print(f"[patches] {failures} problem(s)", file=sys.stderr)
        return 1
    print("[patches] all patches " + ("verified" if check_only else "applied and verified"))
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="Verify only; change nothing.")
    sys.exit(process(check_only=parser.parse_args().check))


if __name__ == "__main__":
    main()
