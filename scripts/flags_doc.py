#!/usr/bin/env python3
"""Write the table of PCR's flags in docs/flags.md from their one declaration
(``PcrFlags`` in pcr_sglang/flags.py and the groups it derives from), so the page cannot
give a default the server does not have, miss a flag or name one that is gone.

The declaration gives each row's flag, its place (the order of ``--help``) and its
default. The page keeps what only it says: each flag's placeholder (``N`` in
``--pcr-chunk-size N``) and its Meaning, longer than ``--help`` where it links other pages
or names what is refused at startup. A new flag gets a row whose Meaning is its ``--help``
text (without the default), to be rewritten on the page; a flag no longer declared loses
its row.

    python scripts/flags_doc.py          # rewrite the table
    python scripts/flags_doc.py --check  # exit 1 if the committed table is not current

tests/unit/test_flags_doc.py runs the check.
"""

from __future__ import annotations

import re
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import msgspec.structs  # noqa: E402
from sglang.srt.arg_groups.arg_utils import Arg  # noqa: E402

from pcr_sglang.flags import PcrFlags  # noqa: E402

DOC = REPO / "docs" / "flags.md"
BEGIN = (
    "<!-- flags: written by scripts/flags_doc.py from pcr_sglang/flags.py "
    "(flags, order, defaults); each placeholder and Meaning is kept as written here -->"
)
END = "<!-- end of flags -->"
HEADER = ["| Flag | Default | Meaning |", "| --- | --- | --- |"]
ROW = re.compile(r"^\| `(--[a-z0-9-]+)(?: ([^`]+))?` \| (.*?) \| (.*) \|$")
# A new flag's placeholder until the page names a better one.
PLACEHOLDER = {int: "N", float: "X", str: "S"}


@dataclass(frozen=True)
class Declared:
    """What the declaration says of one flag."""

    cli: str  # --pcr-chunk-size
    kind: type  # bool, int, float or str (Optional unwrapped)
    default: Any
    help: str


@dataclass(frozen=True)
class Written:
    """What the page says of one flag: its placeholder (None for a switch) and its Meaning."""

    placeholder: str | None
    meaning: str


def declared() -> list[Declared]:
    """Every flag of ``PcrFlags``, in field order (the order of ``--help``)."""
    hints = typing.get_type_hints(PcrFlags, include_extras=True)
    out = []
    for field in msgspec.structs.fields(PcrFlags):
        kind, *extras = typing.get_args(hints[field.name])
        inner = [t for t in typing.get_args(kind) if t is not type(None)]
        arg = next(e for e in extras if isinstance(e, Arg))
        out.append(
            Declared("--" + field.name.replace("_", "-"), inner[0] if inner else kind, field.default, arg.help or "")
        )
    return out


def default_cell(value: Any) -> str:
    """A default as the table writes it: a switch off or on, no value as none, a number
    without a trailing .0, a word as it is, anything else as code with its escapes."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None:
        return "none"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, str) and not re.fullmatch(r"[\w.-]+", value):
        return "`" + value.encode("unicode_escape").decode("ascii") + "`"
    return str(value)


def written(text: str) -> dict[str, Written]:
    """The rows of the table between the markers, by flag."""
    rows = {}
    for line in block(text).splitlines():
        match = ROW.match(line)
        if match:
            cli, placeholder, _default, meaning = match.groups()
            rows[cli] = Written(placeholder, meaning)
    return rows


def block(text: str) -> str:
    return text[text.index(BEGIN) + len(BEGIN) : text.index(END)]


def first_meaning(flag: Declared) -> str:
    """A new flag's Meaning: its ``--help`` text without the default, which has its column."""
    meaning = re.split(r"\s*Default: ", flag.help)[0].strip()
    return meaning.replace("|", "\\|")


def row(flag: Declared, page: Written | None) -> str:
    placeholder = (
        None
        if flag.kind is bool
        else (page.placeholder if page and page.placeholder else PLACEHOLDER.get(flag.kind, "V"))
    )
    name = f"{flag.cli} {placeholder}" if placeholder else flag.cli
    meaning = page.meaning if page else first_meaning(flag)
    return f"| `{name}` | {default_cell(flag.default)} | {meaning} |"


def table(text: str) -> str:
    """The markdown table: one row per declared flag, in declaration order, with its
    declared default and the page's placeholder and Meaning."""
    page = written(text)
    return "\n".join(HEADER + [row(flag, page.get(flag.cli)) for flag in declared()])


def rewritten(text: str) -> str:
    """``text`` with the block between the markers replaced by the current table."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n" + table(text) + "\n" + text[end:]


def main(argv: list[str]) -> int:
    text = DOC.read_text(encoding="utf-8")
    current = rewritten(text)
    if "--check" in argv:
        if current != text:
            print(
                f"{DOC.relative_to(REPO)}: the flags table is not current; run python scripts/flags_doc.py",
                file=sys.stderr,
            )
            return 1
        return 0
    DOC.write_text(current, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
