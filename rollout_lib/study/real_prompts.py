"""Real prompts: token ids of held-out corpus text, drawn deterministically from the workload's seeds.

A study whose workload has `prompt_source: {kind: heldout_text, corpus_manifest: ..., bpe_vocab_size: N}`
gets, for logical prompt i, a window of `max(prompt_tokens)` consecutive token ids of one held-out
file (the corpus's trained BPE, `bpe_tokenizer.encode_split`): the file and the window's start are
drawn from `tensor_stream(prompt_seeds[i], "heldout-prompt-{i}")` among the held-out files long
enough for the window. A prompt of length L is the window's first L ids, so the cell shapes (128 and
512 tokens) stay as preregistered and a shorter prompt is a prefix of the longer one, as with
seeded ids. The ids are regular BPE ids (< bpe_vocab_size < first_special_id): never special.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Literal

from rollout_lib.study.seeds import tensor_stream


@dataclass(frozen=True)
class PromptSourceSpec:
    """`workload.prompt_source`: where prompts come from when they are not seeded random ids."""

    kind: Literal["heldout_text"]
    corpus_manifest: str  # relative to the project root, e.g. params/corpora/transformers-5.17.0.json
    bpe_vocab_size: int


class PromptSourceError(ValueError):
    pass


@cache
def heldout_window(corpus_manifest: str, bpe_vocab_size: int, seed: int, prompt_index: int,
                   window_tokens: int) -> tuple[int, ...]:
    """`window_tokens` consecutive ids of one held-out file, chosen by (seed, prompt_index)."""
    from rollout_lib.study.bpe_tokenizer import encode_split
    from rollout_lib.study.corpus import load_manifest

    manifest = load_manifest(corpus_manifest)
    files = [(path, ids) for path, ids in encode_split(manifest, bpe_vocab_size, "heldout")
             if len(ids) >= window_tokens]
    if not files:
        raise PromptSourceError(f"workload.prompt_source: no held-out file of corpus {manifest.name} has "
                                f"{window_tokens} tokens; allowed prompt lengths are at most the longest held-out file")
    rng = tensor_stream(seed, f"heldout-prompt-{prompt_index}")
    _path, ids = files[int(rng.integers(0, len(files)))]
    start = int(rng.integers(0, len(ids) - window_tokens + 1))
    return tuple(ids[start:start + window_tokens])


def heldout_prompt(source: PromptSourceSpec, seed: int, prompt_index: int, length: int,
                   max_length: int) -> tuple[int, ...]:
    """Prompt `prompt_index` at `length` tokens: the first `length` ids of its `max_length` window."""
    return heldout_window(source.corpus_manifest, source.bpe_vocab_size, seed, prompt_index, max_length)[:length]
