"""The trained stand-in's tokenizer: byte-level BPE trained deterministically on the corpus's train split.

Part of the study definition (like the architecture): the workload's real prompts are token ids of
this tokenizer, and `rollout models train` ships the same bytes as the snapshot's tokenizer.json.

- Trained with the `tokenizers` library: a byte-level pre-tokenizer (GPT-2 regex, every byte in the
  initial alphabet, so any text encodes and no id is unknown), BPE merges up to `bpe_vocab_size`
  regular tokens, no special tokens, files fed in manifest (path) order.
- The *trained* tokenizer is the encoder (training data and prompts). The *shipped* tokenizer.json is
  the same model with its vocabulary padded to the architecture's size: ids bpe_vocab_size ..
  first_special_id - 1 are `<|pad_N|>` entries, then Qwen3's special tokens at their ids, then
  `<|extra_N|>` up to vocab_size. No merge produces a padding name (the pre-tokenizer splits '<|'
  from letters), so the padding ids are never produced by encoding text; they exist so that every
  id the model can emit decodes (vLLM's server needs a tokenizer for log-probabilities).
- Deterministic: same corpus bytes and library version -> byte-identical tokenizer.json (tested).
  The `tokenizers` version is recorded with the result; a different version may merge differently.
"""

from __future__ import annotations

import json
from functools import cache
from typing import TYPE_CHECKING

from rollout_lib.study.arch import QWEN3_SPECIAL_TOKENS, Qwen3Arch
from rollout_lib.study.corpus import Manifest, read_split

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# regular BPE tokens per architecture: 32k for the Qwen3 shapes (what issue 42's first trial used),
# 512 for the tiny test shape (its regular ids stop at first_special_id = 1000)
DEFAULT_BPE_VOCAB = {"qwen3-0.6b": 32768, "qwen3-1.7b": 32768, "tiny": 512}
MIN_BPE_VOCAB = 257  # the 256-byte alphabet plus at least one merge


class TokenizerError(ValueError):
    pass


def default_bpe_vocab(arch: Qwen3Arch) -> int:
    return DEFAULT_BPE_VOCAB.get(arch.name, min(32768, arch.first_special_id))


def check_bpe_vocab(arch: Qwen3Arch, bpe_vocab_size: int) -> None:
    if not MIN_BPE_VOCAB <= bpe_vocab_size <= arch.first_special_id:
        raise TokenizerError(f"bpe_vocab_size: {bpe_vocab_size} for {arch.name}; allowed {MIN_BPE_VOCAB}.."
                             f"{arch.first_special_id} (regular ids stop at the first special id)")


@cache
def train_tokenizer_json(manifest: Manifest, bpe_vocab_size: int) -> str:
    """The trained (unpadded) tokenizer as JSON text; cached per process."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [text for _, text in read_split(manifest, "train")]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=bpe_vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    if tokenizer.get_vocab_size() > bpe_vocab_size:
        raise TokenizerError(f"bpe_vocab_size: trained {tokenizer.get_vocab_size()} tokens, asked {bpe_vocab_size}")
    return tokenizer.to_str()


def trained_tokenizer(manifest: Manifest, bpe_vocab_size: int) -> Tokenizer:
    """The encoder of training data and prompts: the trained BPE, no added or special tokens."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(train_tokenizer_json(manifest, bpe_vocab_size))


def padding_name(arch: Qwen3Arch, token_id: int) -> str:
    offset = token_id - arch.first_special_id
    if 0 <= offset < len(QWEN3_SPECIAL_TOKENS):
        return QWEN3_SPECIAL_TOKENS[offset]
    return f"<|extra_{offset}|>" if offset >= 0 else f"<|pad_{token_id}|>"


def padded_tokenizer_json(manifest: Manifest, bpe_vocab_size: int, arch: Qwen3Arch) -> bytes:
    """tokenizer.json bytes for the snapshot: the trained model, vocabulary padded to arch.vocab_size."""
    from tokenizers import Tokenizer

    check_bpe_vocab(arch, bpe_vocab_size)
    data = json.loads(train_tokenizer_json(manifest, bpe_vocab_size))
    vocab: dict[str, int] = data["model"]["vocab"]
    trained = len(vocab)
    if sorted(vocab.values()) != list(range(trained)):
        raise TokenizerError("trained vocabulary ids are not 0..n-1")
    for token_id in range(trained, arch.vocab_size):
        name = padding_name(arch, token_id)
        if name in vocab:
            raise TokenizerError(f"padding name {name!r} collides with a trained token")
        vocab[name] = token_id
    data["added_tokens"] = [
        {"id": arch.first_special_id + i, "content": name, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i, name in enumerate(QWEN3_SPECIAL_TOKENS) if arch.first_special_id + i < arch.vocab_size]
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    loaded = Tokenizer.from_str(text)  # refuse to ship what the library cannot read back
    if loaded.get_vocab_size(with_added_tokens=True) != arch.vocab_size:
        raise TokenizerError(f"padded tokenizer has {loaded.get_vocab_size()} ids, the architecture {arch.vocab_size}")
    return text.encode("utf-8")


def tokenizer_config(arch: Qwen3Arch, bpe_vocab_size: int) -> dict:
    """tokenizer_config.json for the snapshot (transformers' PreTrainedTokenizerFast reads it)."""
    added = {str(arch.first_special_id + i): {"content": name, "lstrip": False, "normalized": False,
                                              "rstrip": False, "single_word": False, "special": True}
             for i, name in enumerate(QWEN3_SPECIAL_TOKENS) if arch.first_special_id + i < arch.vocab_size}
    return {"added_tokens_decoder": added, "bos_token": None, "clean_up_tokenization_spaces": False,
            "eos_token": padding_name(arch, arch.eos_token_id), "model_max_length": arch.max_position_embeddings,
            "pad_token": padding_name(arch, arch.bos_token_id), "tokenizer_class": "PreTrainedTokenizerFast",
            "unk_token": None, "rollout_bpe_vocab_size": bpe_vocab_size}


@cache
def encode_split(manifest: Manifest, bpe_vocab_size: int, split: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(path, token ids) of every file of a split, in path order; cached per process."""
    tokenizer = trained_tokenizer(manifest, bpe_vocab_size)
    files = read_split(manifest, split)  # type: ignore[arg-type]
    encoded = tokenizer.encode_batch([text for _, text in files], add_special_tokens=False)
    return tuple((path, tuple(enc.ids)) for (path, _), enc in zip(files, encoded, strict=True))
