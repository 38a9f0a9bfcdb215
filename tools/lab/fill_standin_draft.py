"""Fill the trained stand-ins' payload digests into the v3 draft (lab use, issue 42).

    python3 tools/lab/fill_standin_draft.py RECORDS_DIR OUT_YAML

RECORDS_DIR holds the two `rollout models train --record` files (qwen3-0.6b-actor.json,
qwen3-1.7b-teacher.json). OUT_YAML must sit in params/drafts/ (the draft's snapshot paths are relative
to its folder); a copy of it goes beside the records too (RECORDS_DIR/<its name>), where the report's
exactness ladder finds the preregistration the trained rows were measured under. Each role's
`payload_digest:` line is replaced, a placeholder or an earlier build's pinned digest alike (a rebuild with
other kernels pins its own). Refuses, writing nothing, when a record is missing or a role's block has not
exactly one digest line.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

DRAFT = Path("params/drafts/rollout-runtime-v3-trained.yaml")
ROLES = {"qwen3-0.6b-actor": "actor", "qwen3-1.7b-teacher": "teacher"}


def _pin(text: str, role: str, digest: str) -> str | None:
    """`text` with the `payload_digest:` line of the top-level `role:` block set to `digest`; None when the block
    is missing or has not exactly one such line."""
    block = re.search(rf"^{role}:\n(?:(?:[ #].*)?\n)*", text, flags=re.MULTILINE)
    if block is None:
        return None
    body, count = re.subn(r"^(  payload_digest: )\S+", lambda m: m.group(1) + digest, block.group(0),
                          flags=re.MULTILINE)
    return text[:block.start()] + body + text[block.end():] if count == 1 else None


def main(records_dir: str, out_yaml: str) -> int:
    out = Path(out_yaml)
    if out.resolve().parent != DRAFT.resolve().parent:
        print(f"OUT_YAML must be in {DRAFT.parent}/ (snapshot paths are relative to it): {out}", file=sys.stderr)
        return 2
    text = DRAFT.read_text()
    for name in ROLES:
        record_file = Path(records_dir) / f"{name}.json"
        if not record_file.is_file():
            print(f"record missing: {record_file}", file=sys.stderr)
            return 2
        pinned = _pin(text, ROLES[name], json.loads(record_file.read_text())["payload_digest"])
        if pinned is None:
            print(f"no single payload_digest line in {DRAFT}'s {ROLES[name]}: block", file=sys.stderr)
            return 2
        text = pinned
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
