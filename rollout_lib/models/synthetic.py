"""Synthetic Qwen3 snapshots, payload digests, the synthetic tokenizer and model loading.

No machine of the team can download hub weights, so the actor and teacher are *synthetic*
checkpoints with the exact Qwen3 architectures, written as normal HF snapshots (config.json +
model.safetensors + a synthetic tokenizer) and loaded through `from_pretrained(local_dir)`, the
same path a real `Qwen/Qwen3-0.6B` snapshot takes.

Bit-identical on any machine: each tensor is drawn from its own numpy PCG64 stream (seeded by
SHA-256 of the study seed and the tensor name) as uniform doubles, which are exact functions of
the generator's integer output, then rounded float64 -> float32 -> bfloat16 (IEEE round to nearest
even). No platform math library (log/cos of a Box-Muller) is involved.

CLI: `rollout models build|digest|calibrate` (rollout_lib/cli.py).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rollout_lib.core import build_directory_once, find_project_root
from rollout_lib.study.arch import INIT_STD, QWEN3_SPECIAL_TOKENS, Qwen3Arch, get_architecture
from rollout_lib.study.seeds import tensor_stream

if TYPE_CHECKING:
    import torch



def default_cache_dir() -> Path:
    """Where synthetic snapshots are built (rebuilt bit-identically from seeds, never committed):
    $ROLLOUT_CACHE_DIR, else `.cache/snapshots` under the project root found from the working directory,
    else ~/.cache/rollout-runtime/snapshots. Never inside the installed package: a regular install would
    otherwise write 2.4 GB into site-packages."""
    import os

    if os.environ.get("ROLLOUT_CACHE_DIR"):
        return Path(os.environ["ROLLOUT_CACHE_DIR"])
    root = find_project_root()
    if root is not None:
        return root / ".cache" / "snapshots"
    return Path.home() / ".cache" / "rollout-runtime" / "snapshots"


DEFAULT_CACHE_DIR = default_cache_dir()  # at import, for modules that take it as a constant


# --------------------------------------------------------------------------------------------
# Deterministic weights
# --------------------------------------------------------------------------------------------

def uniform_tensor(seed: int, label: str, shape: tuple[int, ...], std: float,
                   chunk: int = 1 << 24) -> np.ndarray:
    """float32 array, uniform on [-std*sqrt(3), std*sqrt(3)] (variance std**2), drawn in chunks."""
    rng = tensor_stream(seed, label)
    bound = std * math.sqrt(3.0)
    count = math.prod(shape)
    out = np.empty(count, dtype=np.float32)
    for start in range(0, count, chunk):
        stop = min(count, start + chunk)
        values = rng.random(stop - start)  # exact: (uint64 >> 11) * 2**-53
        out[start:stop] = (values * 2.0 - 1.0) * bound
    return out.reshape(shape)


def bf16_round(value: float) -> float:
    """The bfloat16 value nearest to `value` (what a stored final-norm scale really is)."""
    import torch

    return float(torch.tensor(value, dtype=torch.float32).to(torch.bfloat16).float().item())


def synthetic_state_dict(arch: Qwen3Arch, seed: int, logit_scale: float = 1.0) -> dict[str, torch.Tensor]:
    """HF-named bf16 tensors. The final norm weight is `logit_scale` (see calibrate): with RMSNorm
    feeding the tied LM head, scaling it scales every logit by the same factor."""
    import torch

    tensors: dict[str, torch.Tensor] = {}

    def put(name: str, array: np.ndarray) -> None:
        tensors[name] = torch.from_numpy(array).to(torch.bfloat16)

    put("model.embed_tokens.weight", uniform_tensor(seed, "embed_tokens", (arch.vocab_size, arch.hidden_size),
                                                    INIT_STD))
    for layer in range(arch.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        for module, shape in arch.linear_shapes().items():
            put(f"{prefix}.{module}.weight", uniform_tensor(seed, f"{prefix}.{module}", shape, INIT_STD))
        for norm, size in (("input_layernorm", arch.hidden_size), ("post_attention_layernorm", arch.hidden_size),
                           ("self_attn.q_norm", arch.head_dim), ("self_attn.k_norm", arch.head_dim)):
            put(f"{prefix}.{norm}.weight", np.ones(size, dtype=np.float32))
    put("model.norm.weight", np.full(arch.hidden_size, logit_scale, dtype=np.float32))
    if not arch.tie_word_embeddings:
        put("lm_head.weight", uniform_tensor(seed, "lm_head", (arch.vocab_size, arch.hidden_size), INIT_STD))
    return tensors


# --------------------------------------------------------------------------------------------
# Payload digest
# --------------------------------------------------------------------------------------------

def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def update_with_tensor(digest: Any, name: str, tensor: torch.Tensor) -> None:
    """Hash one tensor as name, dtype, shape and its little-endian bytes (all length-delimited)."""
    import torch

    data = tensor.detach().to("cpu").contiguous()
    header = json.dumps({"name": name, "dtype": _dtype_name(data.dtype), "shape": list(data.shape)},
                        sort_keys=True, separators=(",", ":")).encode()
    raw = data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
    digest.update(len(header).to_bytes(8, "little"))
    digest.update(header)
    digest.update(len(raw).to_bytes(8, "little"))
    digest.update(raw)


def payload_digest_of_tensors(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over tensors in canonical (sorted) name order, including dtype and shape."""
    digest = hashlib.sha256(b"rollout-runtime-v2/payload/v1\n")
    for name in sorted(tensors):
        update_with_tensor(digest, name, tensors[name])
    return digest.hexdigest()


def read_snapshot_tensors(snapshot_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a snapshot (one or many *.safetensors shards, synthetic or from the hub)."""
    from safetensors.torch import load_file

    files = sorted(Path(snapshot_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{snapshot_dir}: no *.safetensors files (not an HF snapshot directory)")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            if name in tensors:
                raise ValueError(f"{snapshot_dir}: tensor {name!r} appears in two shards")
            tensors[name] = tensor
    return tensors


def payload_digest(snapshot_dir: str | Path) -> str:
    return payload_digest_of_tensors(read_snapshot_tensors(snapshot_dir))


# --------------------------------------------------------------------------------------------
# Snapshot writing
# --------------------------------------------------------------------------------------------

def write_synthetic_tokenizer(arch: Qwen3Arch, out_dir: Path) -> None:
    """One token per id (`<t123>`), Qwen3's special tokens at their ids, padding ids named too.

    Tools such as vLLM's server refuse log-probabilities without a tokenizer; this one makes the
    id <-> text mapping total and trivial, so no id is ever merged or split.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = list(QWEN3_SPECIAL_TOKENS)
    vocab = {vocab_name(arch, token_id): token_id for token_id in range(arch.vocab_size)}
    special_names = {arch.first_special_id + i: name for i, name in enumerate(specials)
                     if arch.first_special_id + i < arch.vocab_size}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=specials[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=False)
    added = {str(i): {"content": n, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for i, n in sorted(special_names.items())}
    tokenizer_config = {
        "added_tokens_decoder": added,
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": vocab_name(arch, arch.eos_token_id),
        "model_max_length": arch.max_position_embeddings,
        "pad_token": vocab_name(arch, arch.bos_token_id),
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": specials[0],
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")


def vocab_name(arch: Qwen3Arch, token_id: int) -> str:
    offset = token_id - arch.first_special_id
    if 0 <= offset < len(QWEN3_SPECIAL_TOKENS):
        return QWEN3_SPECIAL_TOKENS[offset]
    return f"<|extra_{offset}|>" if offset >= 0 else f"<t{token_id}>"


@dataclass(frozen=True)
class SnapshotInfo:
    path: str
    arch: str
    seed: int
    logit_scale: float
    payload_digest: str


def build_snapshot(arch: Qwen3Arch, seed: int, out_dir: str | Path, logit_scale: float = 1.0) -> SnapshotInfo:
    """Write config.json, generation_config.json, model.safetensors, tokenizer files; return digest."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stored_scale = bf16_round(logit_scale)
    tensors = synthetic_state_dict(arch, seed, stored_scale)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(arch.hf_config(), indent=2, sort_keys=True) + "\n")
    generation_config = {"bos_token_id": arch.bos_token_id, "do_sample": False,
                         "eos_token_id": [arch.eos_token_id, arch.first_special_id]}
    (out / "generation_config.json").write_text(json.dumps(generation_config, indent=2, sort_keys=True) + "\n")
    write_synthetic_tokenizer(arch, out)
    info = SnapshotInfo(path=str(out), arch=arch.name, seed=seed, logit_scale=stored_scale,
                        payload_digest=payload_digest_of_tensors(tensors))
    (out / "rollout_synthetic.json").write_text(json.dumps(asdict(info) | {"path": None}, indent=2,
                                                           sort_keys=True) + "\n")
    return info


class DigestMismatchError(RuntimeError):
    pass


def ensure_snapshot(arch_name: str, seed: int, logit_scale: float, expected_digest: str | None = None,
                    cache_dir: str | Path | None = None) -> SnapshotInfo:
    """Build (once) and verify a synthetic snapshot in the cache; a digest mismatch is an error."""
    arch = get_architecture(arch_name)
    stored_scale = bf16_round(logit_scale)
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    # the architecture's config is part of the key: a changed shape must never reuse an old build
    arch_key = hashlib.sha256(json.dumps(arch.hf_config(), sort_keys=True).encode()).hexdigest()[:10]
    out = root / f"{arch.name}-{arch_key}-seed{seed}-scale{stored_scale!r}"
    marker = out / "rollout_synthetic.json"
    if not marker.exists():  # unique temp dir + atomic rename: safe with concurrent builders
        build_directory_once(out, lambda tmp: build_snapshot(arch, seed, tmp, stored_scale))
    recorded = json.loads(marker.read_text())
    info = SnapshotInfo(path=str(out), arch=arch.name, seed=seed, logit_scale=stored_scale,
                        payload_digest=recorded["payload_digest"])
    if expected_digest is not None and info.payload_digest != expected_digest:
        raise DigestMismatchError(
            f"synthetic {arch.name} (seed {seed}, logit scale {stored_scale}) has payload digest "
            f"{info.payload_digest}, the preregistration pins {expected_digest}")
    return info


# --------------------------------------------------------------------------------------------
# Loading: plain model, NF4 + LoRA actor, BF16 mirror
# --------------------------------------------------------------------------------------------

def load_causal_lm(snapshot_dir: str | Path, dtype: torch.dtype, device: str | torch.device = "cpu"):
    """`AutoModelForCausalLM.from_pretrained(local_dir)`: the path a real hub snapshot takes too."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(snapshot_dir), dtype=dtype, device_map={"": device},
                                                 trust_remote_code=False, attn_implementation="sdpa")
    model.eval()
    return model
