"""Render the bad-input suite (tests/test_bad_input.py CASES) as the reliability table in TABLE_FILE
(docs/evidence.md: the README stays short).

    python tools/reliability_table.py            # prints the table
    python tools/reliability_table.py --write    # replaces the table between the markers in TABLE_FILE
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TABLE_FILE = ROOT / "docs" / "evidence.md"
BEGIN, END = "<!-- reliability-table:begin -->", "<!-- reliability-table:end -->"


def render(cases) -> str:
    rows = ["| input tried | what happens | nothing lost |", "|---|---|---|"]
    rows += [f"| {c.input} | {c.outcome} | yes (test `{c.id}`) |" for c in cases]
    return "\n".join(rows)


def main() -> int:
    sys.path.insert(0, str(ROOT))
    from tests.test_bad_input import CASES

    table = render(CASES)
    if "--write" in sys.argv:
        text = TABLE_FILE.read_text()
        start, stop = text.index(BEGIN) + len(BEGIN), text.index(END)
        TABLE_FILE.write_text(text[:start] + "\n" + table + "\n" + text[stop:])
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
