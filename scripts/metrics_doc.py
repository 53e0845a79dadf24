#!/usr/bin/env python3
"""Write the table of PCR's Prometheus series in docs/architecture.md from their one
declaration (``METRICS`` in pcr_sglang/sglang_adapter/metrics.py), so the page cannot
name a series, a label or a label value the server does not export.

    python scripts/metrics_doc.py          # rewrite the table
    python scripts/metrics_doc.py --check  # exit 1 if the committed table is not current

tests/unit/sglang_adapter/test_metrics.py runs the check.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from pcr_sglang.sglang_adapter.metrics import METRICS, label_values  # noqa: E402

DOC = REPO / "docs" / "architecture.md"
BEGIN = "<!-- metrics: written by scripts/metrics_doc.py from pcr_sglang/sglang_adapter/metrics.py -->"
END = "<!-- end of metrics -->"


def table() -> str:
    """The markdown table: one row per series, its own label with the values it takes."""
    rows = ["| series | label: values | what it counts |", "| --- | --- | --- |"]
    for metric in METRICS:
        label = f"`{metric.label}`: {', '.join(label_values(metric))}" if metric.label else ""
        rows.append(f"| `{metric.series}` | {label} | {metric.help.replace('|', chr(92) + '|')} |")
    return "\n".join(rows)


def rewritten(text: str) -> str:
    """``text`` with the block between the markers replaced by the current table."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n" + table() + "\n" + text[end:]


def main(argv: list[str]) -> int:
    text = DOC.read_text(encoding="utf-8")
    current = rewritten(text)
    if "--check" in argv:
        if current != text:
            print(
                f"{DOC.relative_to(REPO)}: the metrics table is not current; run python scripts/metrics_doc.py",
                file=sys.stderr,
            )
            return 1
        return 0
    DOC.write_text(current, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
