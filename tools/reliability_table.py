"""Render the reliability tables from the test suites.

- docs/evidence.md (TABLE_FILE; the README stays short): the bad-input suite (tests/test_bad_input.py CASES),
  between the reliability-table markers;
- docs/reliability.md: the adversarial suite (tests/test_adversarial.py, issue 40), its classes with
  their counts and every case, between the adversarial-table markers.

    python tools/reliability_table.py            # prints both tables
    python tools/reliability_table.py --write    # replaces them between their markers
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TABLE_FILE = ROOT / "docs" / "evidence.md"
BEGIN, END = "<!-- reliability-table:begin -->", "<!-- reliability-table:end -->"
ADV_BEGIN, ADV_END = "<!-- adversarial-table:begin -->", "<!-- adversarial-table:end -->"


def render(cases) -> str:
    rows = ["| input tried | what happens | nothing lost |", "|---|---|---|"]
    rows += [f"| {c.input} | {c.outcome} | yes (test `{c.id}`) |" for c in cases]
    return "\n".join(rows)


def render_classes(cases: list[tuple[str, str, str, str]]) -> str:
    """`cases`: (id, class, input, outcome). A table of classes with counts, then one row per case."""
    counts = Counter(cls for _, cls, _, _ in cases)
    order = list(dict.fromkeys(cls for _, cls, _, _ in cases))
    rows = ["| class | cases |", "|---|---|"] + [f"| {cls} | {counts[cls]} |" for cls in order]
    rows += [f"| **total** | **{len(cases)}** |", "", "| case | class | input tried | what happens |",
             "|---|---|---|---|"]
    rows += [f"| `{cid}` | {cls} | {text.replace('|', '/')} | {outcome.replace('|', '/')} |"
             for cid, cls, text, outcome in cases]
    return "\n".join(rows)


def _replace(path: Path, begin: str, end: str, table: str) -> None:
    text = path.read_text()
    start, stop = text.index(begin) + len(begin), text.index(end)
    path.write_text(text[:start] + "\n" + table + "\n" + text[stop:])


def main() -> int:
    sys.path.insert(0, str(ROOT))
    from tests.test_adversarial import all_cases
    from tests.test_bad_input import CASES

    table, adversarial = render(CASES), render_classes(all_cases())
    if "--write" in sys.argv:
        _replace(TABLE_FILE, BEGIN, END, table)
        _replace(ROOT / "docs" / "reliability.md", ADV_BEGIN, ADV_END, adversarial)
    print(table)
    print()
    print(adversarial)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
