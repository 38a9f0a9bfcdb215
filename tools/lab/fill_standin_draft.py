"""Fill the trained stand-ins' payload digests into the v3 draft (lab use, issue 42).

    python3 tools/lab/fill_standin_draft.py RECORDS_DIR OUT_YAML

RECORDS_DIR holds the two `rollout models train --record` files (qwen3-0.6b-actor.json,
qwen3-1.7b-teacher.json). OUT_YAML must sit in params/drafts/ (the draft's snapshot paths are relative
to its folder); a copy of it goes beside the records too (RECORDS_DIR/<its name>), where the report's
exactness ladder finds the preregistration the trained rows were measured under. Refuses, writing
nothing, when a record is missing or a placeholder is not found.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

DRAFT = Path("params/drafts/rollout-runtime-v3-trained.yaml")
PLACEHOLDERS = {"qwen3-0.6b-actor": "TO-BE-FILLED-actor-digest-from-tools/lab/train_standins.sh",
                "qwen3-1.7b-teacher": "TO-BE-FILLED-teacher-digest-from-tools/lab/train_standins.sh"}


def main(records_dir: str, out_yaml: str) -> int:
    out = Path(out_yaml)
    if out.resolve().parent != DRAFT.resolve().parent:
        print(f"OUT_YAML must be in {DRAFT.parent}/ (snapshot paths are relative to it): {out}", file=sys.stderr)
        return 2
    text = DRAFT.read_text()
    for name, placeholder in PLACEHOLDERS.items():
        record_file = Path(records_dir) / f"{name}.json"
        if not record_file.is_file():
            print(f"record missing: {record_file}", file=sys.stderr)
            return 2
        if placeholder not in text:
            print(f"placeholder for {name} not in {DRAFT}", file=sys.stderr)
            return 2
        text = text.replace(placeholder, json.loads(record_file.read_text())["payload_digest"])
    for target in (out, Path(records_dir) / out.name):
        tmp = target.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(target)
        print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2]))
