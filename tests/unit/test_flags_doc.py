"""docs/flags.md's table of flags is written from the declarations (scripts/flags_doc.py):
each flag once, in ``--help`` order, at its declared default; the page keeps each row's
placeholder and Meaning."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import msgspec

from pcr_sglang.flags import PcrFlags

REPO = Path(__file__).resolve().parents[2]


def load_flags_doc():
    spec = importlib.util.spec_from_file_location("flags_doc", REPO / "scripts" / "flags_doc.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # where its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def table_rows(doc, text: str) -> list[str]:
    return [line for line in doc.block(text).splitlines() if line.startswith("| `--")]


def test_the_docs_table_of_flags_is_written_from_the_declarations():
    doc = load_flags_doc()
    text = doc.DOC.read_text(encoding="utf-8")
    assert doc.rewritten(text) == text, "run python scripts/flags_doc.py"
    rows = table_rows(doc, text)
    fields = msgspec.structs.fields(PcrFlags)
    assert len(rows) == len(fields)
    for line, field in zip(rows, fields):
        cli = "--" + field.name.replace("_", "-")
        assert line.startswith(f"| `{cli}`") or line.startswith(f"| `{cli} "), (line, cli)
        assert f"` | {doc.default_cell(field.default)} | " in line, line


def test_a_stale_default_is_rewritten_and_the_meaning_kept():
    doc = load_flags_doc()
    text = doc.DOC.read_text(encoding="utf-8")
    row = next(line for line in table_rows(doc, text) if line.startswith("| `--pcr-chunk-size N` |"))
    stale = text.replace(row, row.replace("| 64 |", "| 32 |", 1))
    assert stale != text
    assert doc.rewritten(stale) == text


def test_rows_follow_the_declarations_a_new_flag_gets_its_help_and_a_gone_one_loses_its_row():
    doc = load_flags_doc()
    text = doc.DOC.read_text(encoding="utf-8")
    rows = table_rows(doc, text)
    gone = "| `--pcr-retired-flag N` | 3 | A flag no longer declared. |"
    missing = next(line for line in rows if line.startswith("| `--pcr-hint-rate "))
    edited = doc.block(text)
    edited = edited.replace(rows[0] + "\n", "").replace(rows[1], rows[1] + "\n" + rows[0])  # out of order
    edited = edited.replace(missing + "\n", gone + "\n")
    regenerated = doc.rewritten(text.replace(doc.block(text), edited))
    new_rows = table_rows(doc, regenerated)
    assert [line.split("`")[1].split()[0] for line in new_rows] == [line.split("`")[1].split()[0] for line in rows]
    assert gone not in regenerated
    seeded = next(line for line in new_rows if line.startswith("| `--pcr-hint-rate "))
    assert seeded.startswith("| `--pcr-hint-rate X` | 20 | KV hints: most hints registered per second per tenant")
    assert "Default:" not in seeded and seeded.endswith("hints over either are answered and dropped. |")


def test_defaults_are_written_as_the_page_writes_them():
    doc = load_flags_doc()
    cells = [
        doc.default_cell(v)
        for v in (False, True, None, 0.0, 1.0, 0.15, 64, "through", "on-evict", "Document: {doc}\n\n")
    ]
    assert cells == ["off", "on", "none", "0", "1", "0.15", "64", "through", "on-evict", "`Document: {doc}\\n\\n`"]
