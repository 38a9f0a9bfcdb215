"""A profile (not preregistered) that is a study file with the hf_cached engine named (issue 43, item 4: the
median decode step measured in the campaign protocol, on the engine the picker chose).

    python tools/lab/engine_profile.py --base params/rollout-runtime-v2.yaml \
        --engine-choice outputs/perf/decode-w/engine-choice.txt \
        --out outputs/perf/engine-campaign/rollout-runtime-v2-engine.yaml

The output is the base's text with three changes: its leading comment says what it is, `study_id` gains
"-engine" and `preregistered` is false (a diagnostic, never a published verdict), and an `hf_cached_engine`
block is appended: the engine as `--engine` (JSON) or as the last JSON line of `--engine-choice` (what
`tools/lab/pick_engine.py` prints). Every other byte is the base's, so the cells, protocol, models and
calculator pin are the study's. The result is loaded and its engine checked against the engine's settings
before it is written (atomically); an existing different file is refused, the same bytes are left as they are.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rollout_lib.backends.compact_qwen3 import check_engine_settings, check_study_engine  # noqa: E402
from rollout_lib.core import sha256_bytes  # noqa: E402
from rollout_lib.safe_read import read_text  # noqa: E402
from rollout_lib.safe_write import write_bytes_atomic  # noqa: E402
from rollout_lib.study.prereg import loads  # noqa: E402


class ProfileError(ValueError):
    """A bad input, named with what is allowed."""


def engine_from_choice(text: str, where: str) -> dict[str, str]:
    """The last line of `text` that is a JSON object: the picker's engine."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                engine = json.loads(line)
            except ValueError:
                continue
            if isinstance(engine, dict):
                return engine
    raise ProfileError(f"engine-choice: {where} has no JSON object line (pick_engine.py's last line)")


def profile_text(base: str, engine: dict[str, Any], source: str) -> str:
    """The base study's text as a profile naming `engine` (see the module docstring)."""
    try:
        engine = check_engine_settings(engine)
    except ValueError as exc:
        raise ProfileError(f"engine: {exc}") from None
    if not engine:
        raise ProfileError("engine: empty; allowed: a mapping of engine settings (an empty one is the base's engine)")
    if re.search(r"^hf_cached_engine:", base, flags=re.M):
        raise ProfileError("base: already names an hf_cached_engine; allowed: a study without one")
    body = re.sub(r"\A(?:#[^\n]*\n)+", "", base)
    body, ids = re.subn(r"^study_id: ([a-z0-9][a-z0-9-]*)\s*$", r"study_id: \1-engine", body, count=1, flags=re.M)
    body, flags = re.subn(r"^preregistered: (?:true|false)\s*$", "preregistered: false", body, count=1, flags=re.M)
    if ids != 1 or flags != 1:
        raise ProfileError("base: needs one top-level `study_id:` line and one `preregistered:` line (a study file)")
    header = ("# PROFILE - NOT PREREGISTERED. Issue 43's engine in the campaign protocol: the study below is the base\n"
              f"# study's bytes (sha256 {sha256_bytes(base.encode())}) with only this comment, study_id,\n"
              "# preregistered and the hf_cached_engine block at the end changed. Written by\n"
              "# tools/lab/engine_profile.py; its numbers are diagnostics, never a published verdict.\n")
    block = f"\n# the hf_cached engine (issue 43), from {source}\nhf_cached_engine:\n" + "".join(
        f"  {name}: {json.dumps(value)}\n" for name, value in sorted(engine.items()))  # quoted: YAML reads on as true
    return header + body.rstrip("\n") + "\n" + block


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default=str(ROOT / "params" / "rollout-runtime-v2.yaml"))
    given = parser.add_mutually_exclusive_group(required=True)
    given.add_argument("--engine", help="the engine as JSON, e.g. '{\"SAMPLER\": \"chunked\"}'")
    given.add_argument("--engine-choice", help="a file whose last JSON line is the engine (pick_engine.py's)")
    parser.add_argument("--out", required=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.engine is not None:
            try:
                engine, source = json.loads(args.engine), "--engine"
            except ValueError as exc:
                raise ProfileError(f"engine: not JSON ({exc})") from None
        else:
            engine = engine_from_choice(read_text(args.engine_choice, kind="evidence"), args.engine_choice)
            source = Path(args.engine_choice).as_posix()
        text = profile_text(read_text(args.base, kind="preregistration"), engine, source)
        study = loads(text, source_path=args.out)
        check_study_engine(study)
    except (ProfileError, ValueError, FileNotFoundError) as exc:
        parser.exit(2, f"engine_profile: {exc}\n")
    out = Path(args.out)
    if out.exists():
        if out.read_bytes() == text.encode():
            print(f"{out}: already written (the same bytes)")
            return 0
        parser.exit(2, f"engine_profile: out: {out} exists with other bytes; choose another path\n")
    write_bytes_atomic(out, text.encode())
    print(f"wrote {out} (study {study.study_id}, {len(study.hf_cached_engine)} engine settings)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
