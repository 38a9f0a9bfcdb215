"""A compact Qwen3 decoder over the mirror's tensors: static KV cache, fused projections, LoRA as one
batched low-rank product per fused projection, in-graph counter-based sampling, and one CUDA graph
per (batch rows, cache length) bucket. The fast path of `hf_cached` (DESIGN.md decision 10).

Regime: the decode step is launch-bound in eager PyTorch (about 1,000 kernel launches per step
through peft's wrappers); here a step is ~10 kernels per layer, captured once and replayed, so the
CPU issues one graph launch per token for all rows.

What it holds, and why it stays exact:
- the mirror's weights as they are (the exact dequantized NF4 projections, bf16), q/k/v and
  gate/up concatenated so each layer runs 4 projection matmuls;
- the live LoRA tensors as separate float32 low-rank terms (never merged into W, see actor.py):
  `A_cat` = [A_q; A_k; A_v] and a block-diagonal `B_bd`, so the q/k/v LoRA is
  (x @ A_cat^T) @ B_bd^T, added in float32 to the base output and rounded once (what peft does).
  A policy sync copies the exact tensors into these static buffers (no recapture), and the served
  identity is re-derived by reading the per-module blocks back;
- the LM head in float32 (the preregistered `lm_head_compute_dtype`): on CUDA in bf16 compute, a bf16
  GEMM with float32 accumulation and output (exact products of bf16 operands; see `head_operands`).

Rows are left-padded; every row advances one cache column per step, so the write position is one
scalar for the batch; a row's rotary position and its attention mask come from its own padding,
which makes its math independent of its batch mates. Prefill runs eagerly (variable length).
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollout_lib.backends import counter_noise, reduction_launch, triton_ops

if TYPE_CHECKING:
    import torch

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
         "down": ("down_proj",)}
MODULE_PATH = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
               "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
               "down_proj": "mlp.down_proj"}


@dataclass
class FusedLinear:
    """A fused projection: base weight [out, in] (compute dtype) and, when LoRA targets its parts,
    float32 A_cat [parts*r, in] and block-diagonal B_bd [out, parts*r]."""

    weight: torch.Tensor
    parts: tuple[str, ...]
    part_out: tuple[int, ...]
    lora_a: torch.Tensor | None = None
    lora_b: torch.Tensor | None = None
    lora_parts: tuple[str, ...] = ()
    # LORA_SHRINK "in_base_gemm": [W; A_hi; A_mid; A_lo] (compute dtype), `weight` a view of its first rows
    weight_cat: torch.Tensor | None = None


LORA_ADD_ALLOWED = ("float32_once", "bf16_like_nf4_oracle")


def lora_add_mode(value: str | None) -> str:
    """The `lora_add` setting, checked (None: the default, float32_once)."""
    mode = value or LORA_ADD_ALLOWED[0]
    if mode not in LORA_ADD_ALLOWED:
        raise ValueError(f"lora_add {mode!r} is not allowed; allowed: {', '.join(LORA_ADD_ALLOWED)}")
    return mode


def _fused_linear(x: torch.Tensor, weight: torch.Tensor, lora_a: torch.Tensor | None, lora_b: torch.Tensor | None,
                  scaling: float, lora_as_reductions: bool = False, lora_add: str = "float32_once",
                  expand: str = "reductions", split_k: int = 1,
                  part_out: tuple[int, ...] | None = None, gemm: str = "cublas") -> torch.Tensor:
    """x @ W^T, plus the float32 low-rank term added in float32 and rounded once (what peft's plain
    `lora.Linear` does over the bf16 mirror: the eager path). The NF4 oracle's `lora.Linear4bit` rounds
    the low-rank term to bf16 first and adds in bf16 (two roundings): a bf16-only difference that the
    float32 exactness checks cannot see and the bf16 teacher-forced check measures. `lora_add`
    "bf16_like_nf4_oracle" rounds as the oracle does (a conformance diagnostic; in float32 both are one
    and the same).

    `lora_as_reductions` (only under inductor): the two low-rank products written as broadcast
    multiply-and-sum, which inductor turns into reduction kernels fused with their neighbours (the
    B product with the add-and-round epilogue) instead of two tiny float32 GEMMs with split-K
    reductions; still float32 throughout. Eagerly it would materialize [.., out, r] products.
    `expand` (LORA_EXPAND, issue 43 candidates; only under inductor, with `lora_as_reductions`): "gemm", the B
    product stays a float32 GEMM (K is the rank, so no split-K: one kernel that reads B once, where the
    reduction reads it once per row); "unrolled", `_unrolled_expand`: the rank's products added one by one,
    pointwise, so inductor has no reduction to launch-configure; "unrolled_parts", `_unrolled_expand_parts`: the
    same per fused part (`part_out`: each part's output features), only that part's own rank terms; "triton",
    `lora_expand_add`: one hand-written Triton kernel with one fixed launch configuration (CUDA only).
    `split_k` > 1 (GEMM_SPLIT_K, issue 43 candidate): the base GEMM as `_split_k_product`, rounded once to the
    compute dtype as `linear` rounds its float32 accumulation. `gemm` "triton_skinny" (GEMM_KERNEL, issue 43
    candidate; decode steps): the GEMM as `skinny_gemm.skinny_mm_float32`, rounded likewise."""
    import torch

    def base_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if gemm == "triton_skinny":
            from rollout_lib.backends.skinny_gemm import skinny_mm_float32

            rows = skinny_mm_float32(x.reshape(-1, x.shape[-1]), weight)
            return rows.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])
        if split_k > 1:
            return _split_k_product(x, weight, split_k).to(x.dtype)
        return torch.nn.functional.linear(x, weight)

    if lora_a is None:
        return base_product(x, weight)
    if weight.shape[0] > lora_b.shape[0]:  # LORA_SHRINK "in_base_gemm": A's rows after W (static shapes)
        base, xa = _base_and_shrink_in_one_gemm(x, weight, lora_a.shape[0], lora_b.shape[0], split_k, gemm)
    else:
        base = base_product(x, weight)
        xa = (x.float()[..., None, :] * lora_a).sum(-1) if lora_as_reductions else torch.nn.functional.linear(
            x.float(), lora_a)
    if lora_as_reductions and expand == "triton":  # the add and the rounding are the kernel's
        return lora_expand_add(base, xa, lora_b, scaling, lora_add == "bf16_like_nf4_oracle")
    if lora_as_reductions and expand == "unrolled":
        low = _unrolled_expand(xa, lora_b)
    elif lora_as_reductions and expand == "unrolled_parts":
        low = _unrolled_expand_parts(xa, lora_b, part_out or (lora_b.shape[0],))
    elif lora_as_reductions and expand == "reductions":
        low = (xa[..., None, :] * lora_b).sum(-1)
    else:
        low = torch.nn.functional.linear(xa, lora_b)
    if lora_add == "bf16_like_nf4_oracle":
        return base + (low * scaling).to(base.dtype)
    return (base.float() + low * scaling).to(base.dtype)


# LORA_EXPAND "triton": one launch configuration, fixed here, for every row count and every compilation
LORA_EXPAND_BLOCK_N = 128  # output features per program (a program per BLOCK_N features of one row)
LORA_EXPAND_WARPS = 4
_LORA_EXPAND_OP = None


def _lora_expand_triton_op():
    """The custom op `rollout::lora_expand_add` (registered once per process, on first use): the Triton kernel
    behind an opaque op with a fake (shape-only) implementation, so inductor calls it from a compiled piece as it
    calls a cuBLAS GEMM (its launch recorded in the piece's CUDA graph) and chooses nothing for it."""
    global _LORA_EXPAND_OP
    if _LORA_EXPAND_OP is not None:
        return _LORA_EXPAND_OP
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(base_ptr, xa_ptr, b_ptr, out_ptr, features, rank, scaling, base_row, xa_row, b_row, out_row,
               BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, ORACLE_ROUNDING: tl.constexpr):
        row = tl.program_id(1)
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        r = tl.arange(0, BLOCK_R)
        keep_n, keep_r = n < features, r < rank
        b = tl.load(b_ptr + n[:, None] * b_row + r[None, :], mask=keep_n[:, None] & keep_r[None, :], other=0.0)
        xa = tl.load(xa_ptr + row * xa_row + r, mask=keep_r, other=0.0)
        low = tl.sum(b * xa[None, :], axis=1) * scaling  # float32 products and sums, in the kernel's fixed order
        base = tl.load(base_ptr + row * base_row + n, mask=keep_n, other=0.0)
        if ORACLE_ROUNDING:  # lora_add "bf16_like_nf4_oracle": the term rounded to the base's dtype first, then
            low = low.to(base.dtype).to(tl.float32)  # added as torch adds two bf16 tensors (in float32, rounded)
        out = (base.to(tl.float32) + low).to(base.dtype)  # "float32_once": added in float32, rounded once
        tl.store(out_ptr + row * out_row + n, out, mask=keep_n)

    def lora_expand_rows(base, xa, lora_b, scaling, oracle_rounding):
        rows, features = base.shape
        out = torch.empty((rows, features), dtype=base.dtype, device=base.device)
        kernel[(triton.cdiv(features, LORA_EXPAND_BLOCK_N), rows)](
            base, xa, lora_b, out, features, lora_b.shape[1], scaling, base.stride(0), xa.stride(0),
            lora_b.stride(0), out.stride(0), BLOCK_N=LORA_EXPAND_BLOCK_N,
            BLOCK_R=triton.next_power_of_2(lora_b.shape[1]), ORACLE_ROUNDING=oracle_rounding,
            num_warps=LORA_EXPAND_WARPS)
        return out

    from rollout_lib.backends.triton_ops import opaque_op

    _LORA_EXPAND_OP = opaque_op("rollout::lora_expand_add", lora_expand_rows,
                                lambda base, xa, lora_b, scaling, oracle_rounding: base.new_empty(base.shape),
                                {"base": torch.Tensor, "xa": torch.Tensor, "lora_b": torch.Tensor, "scaling": float,
                                 "oracle_rounding": bool})
    return _LORA_EXPAND_OP


def lora_expand_add(base: torch.Tensor, xa: torch.Tensor, lora_b: torch.Tensor, scaling: float,
                    oracle_rounding: bool = False) -> torch.Tensor:
    """LORA_EXPAND "triton" (issue 43 candidate): base + scaling * (xa @ B^T), the float32 low-rank term added in
    float32 and rounded once to the base's dtype (or rounded first and added in that dtype: `oracle_rounding`,
    lora_add "bf16_like_nf4_oracle"), as `_fused_linear`'s other expands. base [..., out] (any row stride), xa
    [..., rank] float32, B [out, rank] float32 (for a fused projection its block-diagonal B: a part's rows read
    the other parts' exact zeros, which add nothing). One program per BLOCK_N output features of one row, B's
    tile and the row's xa loaded whole, their products summed by one `tl.sum` over the rank: a launch
    configuration fixed here, not picked by inductor's first-run benchmark (leases 28-31: the expand reductions'
    picks moved a 16-row step by 0.2-1.0 ms between compilations of the same source)."""
    features = base.shape[-1]
    rows = base.reshape(-1, features)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    terms = xa.reshape(-1, xa.shape[-1])
    if terms.stride(-1) != 1:
        terms = terms.contiguous()
    if lora_b.stride(-1) != 1:
        lora_b = lora_b.contiguous()
    op = _LORA_EXPAND_OP or _lora_expand_triton_op()  # registered by the engine before any trace reaches here
    out = op(rows, terms, lora_b, float(scaling), bool(oracle_rounding))
    return out.view(*base.shape[:-1], features) if base.dim() != 2 else out


def _unrolled_expand(xa: torch.Tensor, lora_b: torch.Tensor) -> torch.Tensor:
    """xa @ B^T for B [out, rank] as sum_r xa[..., r] * B[:, r], added in the order r = 0, 1, ..., rank - 1: float32
    products and adds, the same terms as the reduction's in an order fixed here (the reduction's summation order
    is the generated kernel's). Under inductor these are pointwise operations, fused with the add-and-round
    epilogue into one kernel with no reduction. Why (lease 28's traces): inductor benchmarks each reduction's
    launch configurations when a piece first runs, and for these 2-10 us kernels its pick varies between
    compilations of the same source (one kernel 1.5 us with one pick, 10.9 us with another; a layer's four
    12.7-27.4 us at 16 rows), so every compilation drew a different step time. Eagerly it materializes rank
    intermediates: for compiled pieces only."""
    return _sum_in_order([xa[..., r:r + 1] * lora_b[:, r] for r in range(lora_b.shape[1])])


def _unrolled_expand_parts(xa: torch.Tensor, lora_b: torch.Tensor, part_out: tuple[int, ...]) -> torch.Tensor:
    """`_unrolled_expand` per part of a fused projection: B is block-diagonal ([sum(part_out), parts x rank], part p's
    rows reading only columns p x rank .. (p + 1) x rank), so each part adds its own rank terms and none of the
    others' zeros (qkv: 16 terms an element, not 48; gate_up: 16, not 32), then the parts are concatenated. Equal
    to `_unrolled_expand` bit for bit on finite values: there a part's sum starts with exact zeros and adds exact
    zeros after its own terms. Lease 30's dense unrolled kernel took 15.4 us a call at 16 rows; with B stored
    rank-major (LORA_EXPAND "unrolled_parts" allocates it so) each term's B loads are contiguous across the
    output features a warp computes, where row-major B put neighbouring threads' loads a B row apart."""
    import torch

    rank = lora_b.shape[1] // len(part_out)
    parts, start = [], 0
    for index, rows in enumerate(part_out):
        columns = slice(index * rank, (index + 1) * rank)
        parts.append(_unrolled_expand(xa[..., columns], lora_b[start:start + rows, columns]))
        start += rows
    return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]


def _sum_in_order(terms: list[torch.Tensor]) -> torch.Tensor:
    """((t0 + t1) + t2) + ...: float32 partial results added in a fixed order, as pointwise adds (no reduction
    kernel under inductor): the split shrink's three parts, the split-K slices, the unrolled expand's terms."""
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total


def _attention_kernel(backend: str):
    """ATTENTION_BACKEND as a context for one SDPA call: "auto" lets SDPA choose (a no-op context),
    otherwise only that SDPA backend may run (an error, not a silent fallback, where it cannot take the
    call). Entered while the decode graph is captured; replays run the captured kernel. The backends that are
    not SDPA's (flex, fa3, triton, triton_qkv) leave the prefill's SDPA call to choose, as "auto" does."""
    import contextlib

    if backend not in SDPA_BACKENDS:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[backend])])


def _flex_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """ATTENTION_BACKEND "flex": the same attention through FlexAttention, the boolean mask [B, 1, T, L] read
    inside the kernel (grouped query row g*T + t is position t), no additive bias tensor."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    positions = allowed.shape[2]

    def keep_allowed(score, b, h, q_idx, kv_idx):
        return torch.where(allowed[b, 0, q_idx % positions, kv_idx], score, -float("inf"))

    return flex_attention(q, k, v, score_mod=keep_allowed, scale=scale)


_FLEX_COMPILED = None


def _flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """`_flex_decode`, compiled on CUDA (FlexAttention generates one Triton kernel for the shape, a
    split-cache decoding kernel for few query rows; static shapes: one compilation per graph bucket),
    eager elsewhere (flex's reference implementation: correct, slow, for CPU tests)."""
    global _FLEX_COMPILED
    import torch

    if not q.is_cuda:
        return _flex_decode(q, k, v, allowed, scale)
    if _FLEX_COMPILED is None:
        _FLEX_COMPILED = torch.compile(_flex_decode, dynamic=False)
    return _FLEX_COMPILED(q, k, v, allowed, scale)


def _fa3_op():
    """vLLM's FlashAttention-3 forward (`torch.ops._vllm_fa3_C.fwd`; vllm 0.26's wheel ships the sm90 kernels):
    the op library is loaded by its path, without importing the vllm package. ValueError where it is absent."""
    import importlib.util

    import torch

    try:
        return torch.ops._vllm_fa3_C.fwd
    except (AttributeError, RuntimeError):
        pass
    spec = importlib.util.find_spec("vllm")
    library = (Path(spec.submodule_search_locations[0]) / "vllm_flash_attn" / "_vllm_fa3_C.abi3.so"
               if spec is not None and spec.submodule_search_locations else None)
    if library is None or not library.is_file():
        raise ValueError("ATTENTION_BACKEND fa3 needs vLLM's FlashAttention-3 kernels "
                         "(vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so, vllm 0.26); not found: install vLLM or choose "
                         f"one of {', '.join(a for a in ATTENTION_BACKEND_ALLOWED if a != 'fa3')}")
    torch.ops.load_library(str(library))
    return torch.ops._vllm_fa3_C.fwd


def _fa3_plan_op():
    """FA3's scheduler-metadata op (`torch.ops._vllm_fa3_C.get_scheduler_metadata`), from the library `_fa3_op`
    loads."""
    import torch

    _fa3_op()
    return torch.ops._vllm_fa3_C.get_scheduler_metadata


def _check_fa3(device: torch.device, dtype: torch.dtype) -> None:
    """FA3's kernels are Hopper's (compute capability 9.x), in bf16 or fp16; refused elsewhere, by name."""
    import torch

    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if capability is None or capability[0] != 9 or dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"ATTENTION_BACKEND fa3 needs a bf16 engine on a Hopper GPU (compute capability 9.x); "
                         f"this engine: {dtype} on {device} (capability {capability})")
    _fa3_op()


def _fa3_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqused_k: torch.Tensor,
                leftpad_k: torch.Tensor, scale: float, plan: torch.Tensor | None = None) -> torch.Tensor:
    """ATTENTION_BACKEND "fa3": one decode position per row. q [B, 1, H, D]; k, v [B, L, Hk, D] (views of the
    static cache, head-major in memory: FA3 takes any strides with a contiguous last dimension); row b attends
    to columns leftpad_k[b] <= j < seqused_k[b] (int32) -- FA3 counts seqused_k from column 0, padding
    included. Query head h reads kv head h // (H / Hk), as the grouped rows here. FA3 chooses split-KV and
    packed GQA by its heuristics, from the static shapes, so a captured graph replays one kernel plan. `plan`:
    see `_fa3_attention`."""
    return _fa3_attention(q, k, v, seqused_k, leftpad_k, scale, plan)[0]


def _fa3_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqused_k: torch.Tensor,
                   leftpad_k: torch.Tensor, scale: float,
                   plan: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """FA3's forward as `_fa3_decode` calls it, for T >= 1 query positions per batch entry (q [B, T, H, D], not
    causal: every position sees the whole column range), with its log-sum-exp: (out [B, T, H, D],
    lse [B, H, T] float32). `plan` (ATTENTION_PLAN "per_step"): `_fa3_plan`'s scheduler metadata for these very
    arguments, so the call launches the attention kernel alone (without it FA3 launches its
    `prepare_varlen_num_blocks` kernel first, every call)."""
    out = _fa3_op()(q, k, v, None, None, None, None, None, None, None, None, seqused_k, None, None, None, None,
                    leftpad_k, None, None, None, None, None, None, scale, False, -1, -1, 0.0, True, plan, 0, None,
                    0, None, 1, 0, None)
    return out[0], out[1]


def _fa3_plan(positions: int, heads: int, kv_heads: int, head_dim: int, columns: int, dtype: torch.dtype,
              seqused_k: torch.Tensor, leftpad_k: torch.Tensor) -> torch.Tensor:
    """ATTENTION_PLAN "per_step": FA3's scheduler metadata (`torch.ops._vllm_fa3_C.get_scheduler_metadata`, what
    vLLM's `get_scheduler_metadata` calls) for `_fa3_attention(q, k, v, seqused_k, leftpad_k, ...)` with q [B,
    positions, heads, head_dim] and k, v [B, columns, kv_heads, head_dim] of `dtype` (B: seqused_k's length):
    computed once per decode step by one launch of the same `prepare_varlen_num_blocks` kernel
    FA3's forward launches itself when given none, from the same arguments (batch, lengths, heads, head size,
    dtype, the rows' column ranges, no causal mask, no window, no softcap, FA3's own split and GQA-packing
    heuristics), so every layer's call gets the plan it would have computed: the same kernel plan, the same
    outputs, 27 fewer launches per 28-layer step. vLLM shares one such plan among all layers of a forward."""
    # (batch, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim, headdim_v, qkv_dtype, seqused_k,
    #  cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q, leftpad_k, page_size, max_seqlen_k_new, causal,
    #  window_size_left, window_size_right, has_softcap, num_splits, pack_gqa, sm_margin): as `_fa3_attention`
    return _fa3_plan_op()(
        seqused_k.shape[0], positions, columns, heads, kv_heads, head_dim, head_dim, dtype, seqused_k,
        None, None, None, None, leftpad_k, None, 0, False, -1, -1, False, 0, None, 0)


def merge_attention_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                           lse_b: torch.Tensor) -> torch.Tensor:
    """Attention over two disjoint column ranges merged into attention over both (outputs [B, T, H, D], their
    log-sum-exps [B, H, T]): each output weighted by its share of the total softmax mass, in float32."""
    import torch

    top = torch.maximum(lse_a, lse_b)
    weight_a, weight_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    total = weight_a + weight_b
    share_a = (weight_a / total).transpose(1, 2).unsqueeze(-1)  # [B, T, H, 1]
    share_b = (weight_b / total).transpose(1, 2).unsqueeze(-1)
    return (out_a.float() * share_a + out_b.float() * share_b).to(out_a.dtype)


def _gemm_float32(rows: torch.Tensor, weight: torch.Tensor, split_k: int = 1, gemm: str = "cublas") -> torch.Tensor:
    """rows [N, K] @ W^T as float32 [N, out]: float32 sums of the exact products of bf16 operands, by cuBLAS
    (`mm_float32`), over `split_k` slices of K (`_split_k_product`) or by the skinny Triton GEMM (GEMM_KERNEL
    "triton_skinny")."""
    from rollout_lib.models.actor import mm_float32

    if gemm == "triton_skinny":
        from rollout_lib.backends.skinny_gemm import skinny_mm_float32

        return skinny_mm_float32(rows, weight)
    return _split_k_product(rows, weight, split_k) if split_k > 1 else mm_float32(rows, weight.t())


def _base_and_shrink_in_one_gemm(x: torch.Tensor, weight_cat: torch.Tensor, low_rows: int,
                                 out_rows: int, split_k: int = 1,
                                 gemm: str = "cublas") -> tuple[torch.Tensor, torch.Tensor]:
    """LORA_SHRINK "in_base_gemm" (issue 43 candidate): `weight_cat` is [W; A_hi; A_mid; A_lo], the float32
    A split exactly into three bf16 matrices (`CompactQwen3._write_shrink_rows` checks the split), so one
    bf16 GEMM with float32 output gives the base projection (rounded to bf16 as `linear` rounds it) and
    the three partial products x A_k, each a float32 sum of exact products; x A is their float32 sum: the
    float32 contract in another summation order, on tensor cores, with no kernel of its own. Returns
    (base, x A); the B product and the add are `_fused_linear`'s. `split_k` > 1: the GEMM as
    `_split_k_product` (the same float32 sums of exact products, in another order); `gemm` "triton_skinny":
    `skinny_gemm.skinny_mm_float32` (the same, in its order)."""
    rows = x.reshape(-1, x.shape[-1])
    both = _gemm_float32(rows, weight_cat, split_k, gemm)
    base = both[:, :out_rows].to(x.dtype).reshape(*x.shape[:-1], out_rows)
    parts = both[:, out_rows:].reshape(-1, 3, low_rows)
    return base, _sum_in_order([parts[:, 0], parts[:, 1], parts[:, 2]]).reshape(*x.shape[:-1], low_rows)


def _split_k_product(x: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    """x @ W^T as float32 [.., out] (GEMM_SPLIT_K, issue 43 candidate): `splits` GEMMs over equal slices of the
    inner dimension K, as one strided batched GEMM over views of x and W (no copy), so cuBLAS launches `splits`
    times the thread blocks of the one skinny GEMM; their float32 partial sums are then added in a fixed order,
    as pointwise adds that inductor fuses into the kernels reading the product (no reduction kernel, unlike
    cuBLAS's own split-K). bf16 operands: float32 sums of exact products, as `mm_float32`, in another order."""
    partials = _split_k_partials(x.reshape(-1, x.shape[-1]), weight, splits)
    return _sum_in_order([partials[index] for index in range(splits)]).reshape(*x.shape[:-1], weight.shape[0])


def _split_k_partials(rows: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    """The `splits` float32 partial sums [splits, N, out] of rows [N, K] @ W^T over equal slices of K: one strided
    batched GEMM over views of the rows and W (no copy)."""
    from rollout_lib.models.actor import bmm_float32

    out_features, in_features = weight.shape
    part = in_features // splits
    return bmm_float32(rows.view(rows.shape[0], splits, part).transpose(0, 1),
                       weight.view(out_features, splits, part).permute(1, 2, 0))


def _gemm_for_epilogue(rows: torch.Tensor, weight: torch.Tensor, split_k: int = 1,
                       gemm: str = "cublas") -> torch.Tensor:
    """What an epilogue kernel that adds split-K partials itself reads (O_, DOWN_EPILOGUE): with `split_k` > 1 and
    cuBLAS, the partial sums [S, N, out] (`_split_k_partials`: no sum kernel before the epilogue); otherwise the
    product [N, out] as `_gemm_float32` gives it."""
    if split_k > 1 and gemm == "cublas":
        return _split_k_partials(rows, weight, split_k)
    return _gemm_float32(rows, weight, split_k, gemm)


# GEMM_SPLIT_K "auto" (see the setting's note below): the output features per thread block of cuBLAS's kernels
# for the projections at 4-16 rows (lease 23's traces: nvjet `..._64x8_...`, `..._64x16_...`)
GEMM_TILE_OUTPUTS = 64
GEMM_MIN_SLICE = 256  # "auto" keeps each slice of K at least this long (a GEMM's fixed cost per block)
GEMM_MAX_SPLITS = 8


def gemm_splits(out_features: int, in_features: int, setting: str, multiprocessors: int | None) -> int:
    """How many slices of K a decode step's projection GEMM is split into under GEMM_SPLIT_K `setting`: "off" 1;
    "2", "4", "8" that many (halved until it divides K); "auto" the fewest (powers of two up to 8) that give
    the GPU's `multiprocessors` at least ~0.9 of a wave of output tiles, each slice >= GEMM_MIN_SLICE long (1
    without a GPU: nothing to fill)."""
    if setting == "off":
        return 1
    if setting != "auto":
        splits = int(setting)
        while in_features % splits:
            splits //= 2
        return splits
    if not multiprocessors:
        return 1
    tiles = -(-out_features // GEMM_TILE_OUTPUTS)
    splits = 1
    while (splits < GEMM_MAX_SPLITS and tiles * splits < 0.9 * multiprocessors
           and in_features % (2 * splits) == 0 and in_features // (2 * splits) >= GEMM_MIN_SLICE):
        splits *= 2
    return splits


@dataclass
class Layer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    proj: dict[str, FusedLinear] = field(default_factory=dict)

    def tensors(self, fused: str) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        linear = self.proj[fused]
        weight = linear.weight_cat if linear.weight_cat is not None else linear.weight
        return weight, linear.lora_a, linear.lora_b


# How the decode step's pieces are compiled (read when an engine is built; tools/fast_path_probe.py
# patches them to measure the alternatives side by side in one process):
# - STEP_SHAPES "dynamic": one compilation for every row count (lengths and rows dynamic); "per_rows":
#   one compilation per row count (1, 4, 16), each configured by inductor for its own shape. Measured
#   side by side in lease 6 (outputs/perf/fast-path-issue12-final/): per_rows is 0.5 ms/step *slower*
#   at 16 rows (its two fused LoRA reductions took 401 + 474 us per step there, against 299 + 159 us
#   compiled once with dynamic rows) and equal at 4 rows; lease 5's guess that it would be faster was
#   wrong (docs/perf-notes.md).
# - CACHE_WRITE "inside": k/v written into the cache by the compiled piece that computes them (-56
#   launches per step; lease 6: -0.16 to -0.20 ms/step at 16 rows, +0.07 at 4 rows; lease 5: 0.16-0.26
#   faster at both); "outside": written by index_copy_ launches between the pieces.
# - INDUCTOR_OPTIONS: inductor settings for these compilations (torch.compile's `options`), empty by
#   default; the probe's `+cdt` turns on coordinate-descent tuning of each kernel's launch configuration
#   at its own shape (a longer cold start), to test whether the LoRA reductions' configuration is the gap.
# - LORA_SHRINK "reductions" (the default): the LoRA A product is its own kernel (an inductor reduction
#   when compiled, a float32 GEMM eagerly); "in_base_gemm" (issue 43 candidate, bf16 engines only): A is
#   appended to the projection's weight as three bf16 matrices whose sum is exactly A, so the base GEMM
#   computes it too (`_base_and_shrink_in_one_gemm`; 112 kernels fewer per step). Measured against the
#   default with the probe's `+shrinkgemm` before it may become a default (lease 23: -0.23 ms/step at 4
#   rows, -0.36 ms at 16; docs/perf-notes.md).
# - LORA_EXPAND "reductions" (the default): the LoRA B product an inductor reduction, which reads B once
#   per row (112 kernels, 0.43 ms of a 16-row step with the shrink in the GEMM, lease 23); "gemm" (issue
#   43 candidate): a float32 GEMM (`linear`), K = rank. The probe's `+expandgemm`.
#   "unrolled" (issue 43 candidate): the rank's products added one by one in a fixed order, pointwise
#   (`_unrolled_expand`), so the B product has no reduction whose launch configuration inductor picks by
#   benchmarking at first run (lease 28: that pick moved a 16-row step by up to ~0.4 ms between compilations
#   of the same source). The probe's `+unrollexpand`.
#   "unrolled_parts" (issue 43 candidate, after lease 30's "unrolled" lost +0.6-0.9 ms): the same per fused part
#   (`_unrolled_expand_parts`: each part only its own rank terms, not the block-diagonal B's zeros) over B stored
#   rank-major, so each term's loads are contiguous across output features. The probe's `+partsexpand`.
#   "triton" (issue 43 candidate, CUDA only, after lease 31 measured the draw at up to ~0.3 ms per pair of
#   compilations with nothing changed): the B product, the add and the rounding as one hand-written Triton kernel
#   (`lora_expand_add`) with one launch configuration fixed here, so no compilation draws it. The probe's
#   `+tritonexpand`.
# - ATTENTION_BACKEND "auto" (the default): SDPA picks its kernel (cuDNN's on the H200, ~11 us a layer
#   at 16 rows); "efficient" or "cudnn": that SDPA backend only (`torch.nn.attention.sdpa_kernel`), to
#   compare decode attention kernels side by side (the probe's `+sdpaeff`, `+sdpacudnn`); "flex":
#   FlexAttention for the decode steps with the boolean mask read in the kernel (`_flex_attention`; the
#   probe's `+flex`; prefill keeps SDPA: one compilation per graph bucket, none per prompt shape); "fa3":
#   vLLM's FlashAttention-3 decode kernel over the static cache with per-row left padding (`_fa3_decode`;
#   Hopper, bf16, vLLM installed; the probe's `+fa3`; prefill keeps SDPA); "triton" (after lease 39: FA3 6.6 us
#   a layer + its 1.8 us plan, for 0.3-1.5 MB of k/v): `decode_attention`'s one Triton kernel a layer over the
#   static cache and the rows' column ranges, split over columns, no plan, no combine kernel (bf16, CUDA; the
#   probe's `+tritonattn`; prefill keeps SDPA); "triton_qkv" (with QKV_EPILOGUE "triton"): that kernel doing the
#   qkv epilogue's work too (`attend_from_projection`: q, and the new k/v written into the caches, from the qkv
#   GEMM's output), one kernel a layer fewer (the probe's `+tritonqkv`).
# - PREFILL "per_row" (the default): every row's prompt is prefilled, also the n rows of a prompt's n
#   samples; "shared_prompts" (issue 43 item 5, candidate): rows with identical prompts are prefilled once
#   and the prompt's k/v columns and last logits are copied to its other rows (`prefill_rows`), so
#   each row still samples its first token with its own seed from the same counter noise. The probe's
#   `+sharedprefill`.
# - PREFILL_STEP "eager" (the default): the prompt's forward runs op by op (~2,000 launches: 35-45 ms at 4
#   rows, ~98 ms at 16 rows x 512 in h200-v2, 15-33 % of a p*-r64 cell's wall); "compiled_graph" (issue 43
#   candidate): through the decode step's inductor pieces (one more compilation, dynamic in the prompt
#   width) and captured with the first token's sampling as one CUDA graph per (rows, width, cache length)
#   (`PrefillGraph`), its buffers from one memory pool shared by every prefill graph. The probe's
#   `+prefillgraph`. With PREFILL "shared_prompts" too, the graph prefills the distinct prompts only and copies
#   their k/v and logits to the rows inside the graph (one graph per distinct-prompt count).
# - STEP_PIECES "per_half_layer" (the default): two compiled pieces per layer, before and after attention;
#   "across_layers" (issue 43 candidate: RMSNorm + residual in one kernel): layer i's part after attention
#   and layer i+1's part before it are one piece (`_between_layers`), so inductor fuses the MLP's residual
#   add with the next input norm (27 boundaries fewer per step). The probe's `+acrosslayers`.
# - SAMPLER "row" (the default): the decode step's sampler reduces each row's 151,936 logits in one program (a
#   compiled step: 4-16 programs, ~85 us per step on the H200, lease 23's traces); "chunked" (issue 43
#   candidate): the same noise and formulas with every vocabulary reduction split into up to 128 chunks
#   (`counter_noise.sample_chunked`). The probe's `+chunkedsampler`. "triton" (issue 43 candidate): one
#   hand-written kernel reading the logits once, the row's last program combining its chunks
#   (`triton_sampler`: the same noise and race, the tokens apart only at float32 near-ties). The probe's
#   `+tritonsampler`.
# - DECODE_PREFIX "per_row" (the default): each row's decode attention reads its own copy of its prompt's k/v;
#   "shared" (issue 43 item 5, candidate; with ATTENTION_BACKEND "fa3" or "triton"): when a batch's rows come in
#   blocks of n consecutive rows with one prompt each (a GRPO group, the workload's n > 1 cells), each
#   decode step reads the prompt's columns, held by the block's first row, once per block, and each row's own
#   generated columns once. The prompt's k/v is read once per block instead of n times (at p512-r512-n4, 16
#   rows: about half the step's cache reads). With fa3: two FA3 calls per layer, the block's n rows as n query
#   positions over the prompt and each row over its own columns, merged by their log-sum-exp
#   (`merge_attention_states`, cascade attention as vLLM does it for shared prefixes); lease 31: the second call
#   and the merge cost more than the reads saved. With triton: one kernel a layer (`decode_attention.
#   attend_shared`: the block's rows as one MMA tile over the prompt's columns and each row's own, one softmax,
#   no merge kernel; the probe's `+tritonattn+sharedprefix`). One graph per (rows, length, n). Other batches
#   decode per row. "shared_long" (candidate after lease 43): "shared" only where the batch's prompts take
#   SHARED_PROMPT_MIN_COLUMNS or more (padded); shorter ones decode per row. Lease 43 (H200, on the Triton
#   kernel): -0.11 ms a step at p512-r256-n4, -0.006 at p128-r64-n4 (128 prompt columns are a small part of a
#   step's reads), so "shared" could not show a gain in every cell it runs in. The probe's `+sharedlong`.
# - READBACK "per_step" (the default): after each step's graph replay the host reads its tokens (a blocking
#   copy), checks the stops, then replays the next step, so the GPU waits for the host between steps (72-105 us a
#   step in lease 23's traces: the copy, the Python bookkeeping, the launch); "pipelined" (issue 43 candidate):
#   step t+1 is enqueued before step t's tokens are read (`DecodeBucket.run_pipelined`: a copy into pinned memory
#   and an event per step, two buffers in turn), so the host's work overlaps the GPU's next step. Never more
#   steps than the cache has columns for; when every row stops early (EOS), the one step already enqueued past
#   the stop is computed and discarded (its tokens never reach the output; the next call's `start` resets what
#   it advanced). The probe's `+pipelined`.
# - STEP_EDGES "eager" (the default): what a decode step does outside its layers runs op by op inside the graph:
#   the mask, positions, embedding, rotary and attention bias (~15 kernels), the final norm (~6), and the step's
#   bookkeeping after the sampler (~7: tokens and log-probabilities to `out`, the next tokens, the counters):
#   ~35 of lease 23's ~575 kernels per step, ~0.07 ms with their gaps; "compiled" (issue 43 candidate): the
#   same operations as three inductor pieces (`_decode_inputs`, `_rms`, `_advance`), ~5 kernels. The head GEMM
#   and the sampler are unchanged. The probe's `+edges`.
# - GEMM_SPLIT_K "off" (the default): each projection of a decode step is one skinny GEMM (4-16 rows), for which
#   cuBLAS launches one thread block per 64 output features: 17 blocks for o_proj and down_proj on 132 SMs (lease
#   23's traces: 5.0-5.5 us each for 4-6 MB of weights, ~0.8 TB/s; down_proj with cuBLAS's split-K and its own
#   reduction kernel); "2", "4", "8", "auto" (issue 43 candidate): the GEMM over that many slices of K as one
#   batched GEMM whose float32 partial sums are added inside the next compiled kernel (`_split_k_product`,
#   `gemm_splits`: "auto" per projection from the GPU's SM count). Decode steps only (one position per row);
#   the prefill and the LM head keep their GEMMs. The probe's `+splitk` ("auto"), `+splitk2`, `+splitk4`,
#   `+splitk8`.
# - AUTOTUNE_ROWS "first_bucket" (the default): inductor benchmarks each compiled kernel's launch configurations
#   when the kernel first runs and keeps one pick for every row count (STEP_SHAPES "dynamic": one compilation), so
#   the picks are made at the first bucket the cold start captures: the study's first samples_per_prompt (4 rows in
#   h200-v2), where the configurations nearly tie; "largest" (issue 43 candidate): the cold start captures the
#   largest row count's buckets first, so the picks are made where they differ most (lease 28's traces: one LoRA
#   expand reduction 1.5 us against 10.9 us by pick at 16 rows, 1.4 against 3.4 us at 4). The probe's
#   `+tunelargest`.
# - COMBO_KERNELS "off" (the default): inductor launches each fused kernel of a compiled piece on its own; "on"
#   (issue 43 candidate): inductor's `combo_kernels`, data-independent kernels of one piece (the q and k norms,
#   a group's LoRA terms, the k/v cache writes) launched as one kernel, for this engine's compilations only.
#   Lease 30 (H100): -0.19 to -0.23 ms per decode step in every probed cell, the norms' kernels 0.34 -> 0.08 ms.
#   The probe's `+combo` (an inductor option there; this setting lets the picker and `engine=` choose it).
# - ATTENTION_PLAN "per_call" (the default; with ATTENTION_BACKEND "fa3"): each layer's FA3 call computes its own
#   scheduler metadata, a `prepare_varlen_num_blocks` kernel before each attention kernel (lease 32's traces: 1.8-1.9
#   us a call, 28 a step, ~0.05 ms of a 4-row step with their gaps); "per_step" (issue 43 candidate): a decode step
#   computes it once (`_fa3_plan`) and every layer's call reads it, as vLLM's FlashAttention backend does. Not with
#   DECODE_PREFIX "shared" (its two calls per layer differ in shape: each computes its own). The probe's
#   `+fa3plan`.
# - GEMM_KERNEL "cublas" (the default): each projection's GEMM is cuBLAS's (lease 32's traces at 4 rows: one kernel
#   shape, 64 output features per thread block, ~6 us per GEMM whatever its size; the o projection at 0.78 TB/s on
#   17 thread blocks); "triton_skinny" (issue 43 candidate; bf16 engines, decode steps, CUDA): `skinny_gemm`'s
#   Triton kernel, its slices of K chosen to fill the SMs and added inside the kernel in a fixed order (no reduction
#   kernel after it); a prefill keeps cuBLAS. Not with GEMM_SPLIT_K. The probe's `+skinnygemm`.
#   "triton_skinny_o_down" (issue 43 candidate): the skinny kernel for the o and down projections only, cuBLAS for
#   qkv and gate_up: lease 33's bench (`decode-pick/gemm-bench.json`, H200, in CUDA graphs) had the kernel 0.2-0.3
#   us under cuBLAS on o and ~1.0 us under it on down (cuBLAS's split-K reduction kernel after down included), and
#   0.7-1.2 us over it on qkv and gate_up. The probe's `+skinnyodown`.
# - GATE_UP_EPILOGUE "inductor" (the default): between the gate_up GEMM and the down GEMM, inductor's kernels (the
#   LoRA expand reduction, the SiLU product: 2 kernels, ~3.1 us + 2 gaps a layer at 4 rows, lease 33); "triton"
#   (issue 43 candidate; with LORA_SHRINK "in_base_gemm", bf16, CUDA): one hand-written kernel from the GEMM's
#   float32 output to the SiLU product (`mlp_epilogue`). The probe's `+mlpepilogue`.
# - O_EPILOGUE "inductor" (the default): between the o GEMM and the gate_up GEMM, inductor's kernels (the LoRA
#   expand reduction, the residual add with the post-attention norm: 2 kernels, ~2.5 us + 2 gaps a layer at 4 rows,
#   lease 33); "triton" (issue 43 candidate; with LORA_SHRINK "in_base_gemm", bf16, CUDA): one hand-written kernel
#   from the GEMM's float32 output to the residual stream and its norm (`norm_epilogue`; with GEMM_SPLIT_K, from
#   the GEMM's partial sums, which the kernel adds: no sum kernel before it). The probe's `+oepilogue`.
# - DOWN_EPILOGUE "inductor" (the default): between the down GEMM and the next layer's qkv GEMM, inductor's kernels
#   (the LoRA expand with the residual add, then in the next piece the next layer's input norm: 2 kernels, ~2.8 us
#   + 2 gaps a layer at 4 rows, lease 33); "triton" (issue 43 candidate; likewise): `norm_epilogue`'s kernel with
#   the next layer's norm, whose output the next piece takes as its normed input (the last layer keeps inductor's:
#   the final norm is the step's). The probe's `+downepilogue`.
# - QKV_EPILOGUE "inductor" (the default): between the qkv GEMM and attention, inductor's kernels (the LoRA expand
#   reduction, the q/k norms with the rotary embedding, the k/v cache writes: 4 kernels, ~7.5 us + 4 gaps a layer at
#   4 rows, lease 33); "triton" (issue 43 candidate; likewise, in the compiled pieces that write the caches): one
#   hand-written kernel from the GEMM's float32 output to q, k and v written into their caches (`qkv_epilogue`).
#   The probe's `+qkvepilogue`.
# - NORM_EPILOGUE_ROW "one_program" (the default): O_/DOWN_EPILOGUE "triton"'s kernel runs one program per row, which
#   reads all of the projection's B (64 KB at 1,024 features, rank 16) on one SM; "slices" (issue 43 candidate, with
#   O_EPILOGUE "triton"): one program per slice of SLICE_FEATURES features of a row, the row's last program to
#   arrive writing its norm (`norm_epilogue`; lease 38's bench: 4.65 us a call with the L2 flushed, 2.52 with B in
#   it). The probe's `+rowslices`.
# - ATTENTION_LAUNCH "fixed" (the default): ATTENTION_BACKEND "triton"'s kernel at one launch configuration (64
#   columns an iteration, 2 warps, 2 stages); "by_columns" (issue 43 candidate, after lease 41's bench: 1.0-1.7 us a
#   call off at 192 and 768 columns): one chosen by the static cache's length (`decode_attention.launch_for`: a
#   cache under 256 columns at 128 columns an iteration in one slice; a longer one at "fixed"'s since session 43,
#   so the setting runs only in short caches' cells). The probe's `+attnlaunch`. "by_columns_shared" (issue 43
#   candidate after lease 43's bench): "by_columns", and DECODE_PREFIX shared's kernel over a cache of 256 columns
#   or more at its own launch (`decode_attention.shared_launch_for`: 128 columns an iteration, 4 warps, one stage;
#   -1.5 us a call at 16 rows over 768 columns in the bench); without a shared prefix it is "by_columns". The
#   probe's `+sharedlaunch`.
# - REDUCTION_LAUNCH "benchmarked" (the default): inductor benchmarks a persistent reduction's launch
#   configurations (XBLOCK 1-128) on its first run and keeps one pick for every row count: a draw that moved the
#   LoRA expand reductions 0.23-3.17 ms per step over three compilations of one source (lease 32); "fewest_programs"
#   (issue 43 candidate): the largest XBLOCK, without benchmarking, the same in every compilation
#   (`reduction_launch`). The probe's `+fewest`. "fill_multiprocessors" (issue 43 candidate, after lease 34 found
#   the fewest programs under-filling the SMs at 4 rows): the largest XBLOCK whose grid still has a program per SM
#   at the first call. The probe's `+fillsms`.
# - WEIGHT_PREFETCH "off" (the default): each GEMM and epilogue kernel of a decode step reads its weights from the
#   memory when it runs; "rest_of_layer" (issue 43 candidate, sm_90 or later): while a compiled decode step's
#   attention runs, a side stream asks the L2 for the layer's o, gate_up and down weights (with their shrink rows)
#   and LoRA B, which those kernels read next (`weight_prefetch`: one bulk-prefetch kernel a layer, forked after
#   the qkv epilogue, joined at the step's end); "through_next_qkv": the next layer's qkv weight and B too. The
#   values do not change (a prefetch writes nothing). The probe's `+prefetch` and `+prefetchnext`.
# - DEPENDENT_LAUNCH "off" (the default): each epilogue kernel starts when the GEMM before it has ended;
#   "epilogues" (issue 43 candidate, sm_90 or later, with O_EPILOGUE "triton"): the o/down and gate_up epilogue
#   kernels launched with programmatic dependent launch, loading their LoRA B (and the norm's weight) before they
#   wait for the GEMM (`griddepcontrol.wait`), so those loads and the kernel's start may overlap the GEMM's tail
#   (tools/lab/pdl_bench.py measures the pair alone; lease 28's inductor PDL, waiting first, lost). The same
#   operations on the same values: the same bits. The probe's `+pdlepilogues`. Lease 45 (H100): -0.07/-0.09 ms a
#   step at 16 rows, +0.023 at 4; so "norm_epilogues" (the o/down kernels only: their trace time fell at both row
#   counts, the gate_up kernel's rose) and "epilogues_from_16_rows" (both, in calls of 16 rows or more: the op sees
#   each call's rows) are measured beside it: the probe's `+pdlnorm` and `+pdl16`. Session 49's short probe
#   (H100): `+pdl16` -0.001 / -0.054 / -0.073, `+pdlnorm` +0.014 / -0.054..-0.089 / -0.075: from 16 rows kept.
#   "epilogues_and_qkv_from_16_rows": the qkv epilogue too (B loaded before its wait; needs QKV_EPILOGUE triton):
#   the probe's `+pdlqkv16`.
# - ATTENTION_DEPENDENT_LAUNCH "off" (the default): the Triton attention kernel starts when the kernel before it (the
#   qkv epilogue) has ended; "prefetch_kv" (issue 43 candidate, sm_90, with ATTENTION_BACKEND "triton"): `attend`'s
#   kernel launched with PDL, each program asking the L2 for its slice's k and v before it waits for q
#   (`decode_attention`'s note: the memory is idle during the ~2.2 us epilogue, and a 4-row step over a 768-column
#   cache reads 12.6 MB of k/v a layer); `attend_shared`'s kernel keeps its launch. The same bits. The probe's
#   `+pdlattn`.
# - WEIGHT_PREFETCH_BY "side_stream" (the default): WEIGHT_PREFETCH's plans issued by their own kernel on a side
#   stream; "attention" (issue 43 candidate, with ATTENTION_BACKEND "triton" and a WEIGHT_PREFETCH plan): issued by
#   `attend`'s kernel, each of its programs asking the L2 for its share of the layer's regions before its attention,
#   so no side stream and 28 kernels a step fewer; where another attention kernel runs (`attend_shared`, FA3, SDPA)
#   the side stream still issues them. Why: lease 46's pdl4 diagnosis (H100, p128 x 4): without the side stream,
#   DEPENDENT_LAUNCH epilogues gained 0.071 ms a step, where with it they lost 0.02. The same bits (a prefetch
#   writes nothing). The probe's `+attnprefetch`. "side_stream_wide": the side stream's kernel with 8x the
#   programs (each thread's chunk of a region at most 4 KB, not 32): lease 46's traces (H100, 4 rows) show its 4
#   programs taking 40 us a layer for ~31 MB (0.8 TB/s) of a ~49 us layer, so the gate_up and down GEMMs start
#   before their weights are in the L2; wider, the plan is asked for sooner. The probe's `+prefetchwide`.
STEP_SHAPES = "dynamic"
CACHE_WRITE = "inside"
INDUCTOR_OPTIONS: dict[str, bool | int | str] = {}
LORA_SHRINK = "reductions"
STEP_SHAPES_ALLOWED = ("per_rows", "dynamic")
CACHE_WRITE_ALLOWED = ("outside", "inside")
LORA_SHRINK_ALLOWED = ("reductions", "in_base_gemm")
LORA_EXPAND = "reductions"
LORA_EXPAND_ALLOWED = ("reductions", "gemm", "unrolled", "unrolled_parts", "triton")
ATTENTION_BACKEND = "auto"
ATTENTION_BACKEND_ALLOWED = ("auto", "efficient", "cudnn", "flex", "fa3", "triton", "triton_qkv")
# the values that pin one SDPA backend (torch.nn.attention.SDPBackend's member names)
SDPA_BACKENDS = {"efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION"}
# the decode attention paths that take no additive bias: flex reads the boolean mask, the others the rows' ranges
NO_BIAS_BACKENDS = ("flex", "fa3", "triton", "triton_qkv")
PREFILL = "per_row"
PREFILL_ALLOWED = ("per_row", "shared_prompts")
PREFILL_STEP = "eager"
PREFILL_STEP_ALLOWED = ("eager", "compiled_graph")
STEP_PIECES = "per_half_layer"
STEP_PIECES_ALLOWED = ("per_half_layer", "across_layers")
SAMPLER = "row"
SAMPLER_ALLOWED = ("row", "chunked", "triton")
DECODE_PREFIX = "per_row"
DECODE_PREFIX_ALLOWED = ("per_row", "shared", "shared_long")
SHARED_PROMPT_MIN_COLUMNS = 256  # DECODE_PREFIX "shared_long": the shortest (padded) prompt read once per block
READBACK = "per_step"
READBACK_ALLOWED = ("per_step", "pipelined")
STEP_EDGES = "eager"
STEP_EDGES_ALLOWED = ("eager", "compiled")
GEMM_SPLIT_K = "off"
GEMM_SPLIT_K_ALLOWED = ("off", "auto", "2", "4", "8")
AUTOTUNE_ROWS = "first_bucket"
AUTOTUNE_ROWS_ALLOWED = ("first_bucket", "largest")
COMBO_KERNELS = "off"
COMBO_KERNELS_ALLOWED = ("off", "on")
ATTENTION_PLAN = "per_call"
ATTENTION_PLAN_ALLOWED = ("per_call", "per_step")
GEMM_KERNEL = "cublas"
GEMM_KERNEL_ALLOWED = ("cublas", "triton_skinny", "triton_skinny_o_down")
REDUCTION_LAUNCH = "benchmarked"
REDUCTION_LAUNCH_ALLOWED = reduction_launch.REDUCTION_LAUNCH_ALLOWED
GATE_UP_EPILOGUE = "inductor"
O_EPILOGUE = "inductor"
DOWN_EPILOGUE = "inductor"
QKV_EPILOGUE = "inductor"
EPILOGUE_ALLOWED = ("inductor", "triton")
NORM_EPILOGUE_ROW = "one_program"
NORM_EPILOGUE_ROW_ALLOWED = ("one_program", "slices")
ATTENTION_LAUNCH = "fixed"
ATTENTION_LAUNCH_ALLOWED = ("fixed", "by_columns", "by_columns_shared")
WEIGHT_PREFETCH = "off"
WEIGHT_PREFETCH_ALLOWED = ("off", "rest_of_layer", "through_next_qkv")
WEIGHT_PREFETCH_BY = "side_stream"
WEIGHT_PREFETCH_BY_ALLOWED = ("side_stream", "side_stream_wide", "attention")
DEPENDENT_LAUNCH = "off"
DEPENDENT_LAUNCH_ALLOWED = ("off", "epilogues", "norm_epilogues", "epilogues_from_16_rows",
                            "epilogues_and_qkv_from_16_rows")
ATTENTION_DEPENDENT_LAUNCH = "off"
ATTENTION_DEPENDENT_LAUNCH_ALLOWED = ("off", "prefetch_kv")
# each DEPENDENT_LAUNCH value: (the o/down epilogue's, the gate_up epilogue's, the qkv epilogue's) fewest rows a call
# launched with PDL has, 0 never
PDL_FROM_ROWS = {"off": (0, 0, 0), "epilogues": (1, 1, 0), "norm_epilogues": (1, 0, 0),
                 "epilogues_from_16_rows": (16, 16, 0), "epilogues_and_qkv_from_16_rows": (16, 16, 16)}
# each "<PROJECTION>_EPILOGUE" setting: (the projection whose GEMM output its kernel reads, the kernel's module)
EPILOGUES = {"GATE_UP_EPILOGUE": ("gate_up", "mlp_epilogue"), "O_EPILOGUE": ("o", "norm_epilogue"),
             "DOWN_EPILOGUE": ("down", "norm_epilogue"), "QKV_EPILOGUE": ("qkv", "qkv_epilogue")}


def _engine_setting(name: str, value: str, allowed: tuple[str, ...]) -> str:
    """One of the module's engine settings above, refused by name with its allowed values."""
    if value not in allowed:
        raise ValueError(f"{name} {value!r} is not allowed; allowed: {', '.join(allowed)}")
    return value


# a setting's value that runs only with another setting's value, or one of several (the engine refuses it otherwise)
SETTING_REQUIRES = {**{("DECODE_PREFIX", value): ("ATTENTION_BACKEND", ("fa3", "triton"),
                                                   "FA3's kernel returns the log-sum-exp the two halves merge by; "
                                                   "the Triton kernel reads the shared columns itself")
                       for value in ("shared", "shared_long")},
                    ("ATTENTION_PLAN", "per_step"): ("ATTENTION_BACKEND", "fa3", "the plan is FA3's scheduler "
                                                     "metadata"),
                    ("ATTENTION_BACKEND", "triton_qkv"): ("QKV_EPILOGUE", "triton", "its kernel does that epilogue's "
                                                          "work on the same GEMM output"),
                    ("NORM_EPILOGUE_ROW", "slices"): ("O_EPILOGUE", "triton", "it is how that kernel (and "
                                                      "DOWN_EPILOGUE triton's) is launched"),
                    **{("ATTENTION_LAUNCH", value): ("ATTENTION_BACKEND", "triton", "it chooses that kernel's "
                                                     "launch configuration")
                       for value in ("by_columns", "by_columns_shared")},
                    **{(name, "triton"): ("LORA_SHRINK", "in_base_gemm", f"its kernel reads the shrink's rows from "
                                                                         f"the {projection} GEMM's output")
                       for name, (projection, _) in EPILOGUES.items()},
                    ("ATTENTION_DEPENDENT_LAUNCH", "prefetch_kv"): ("ATTENTION_BACKEND", "triton", "it launches "
                                                                    "that backend's kernel"),
                    # after the epilogues' entries: a float32 engine leaves this out once it has left them out
                    **{("DEPENDENT_LAUNCH", value): ("O_EPILOGUE", "triton", "it launches the epilogue kernels "
                                                     "(O_EPILOGUE's, and DOWN_/GATE_UP_EPILOGUE's where on)")
                       for value in DEPENDENT_LAUNCH_ALLOWED if value != "off"}}


def requirement_met(value: str | None, needed: str | tuple[str, ...]) -> bool:
    """Whether a setting's `value` is what a SETTING_REQUIRES entry needs (`needed`: one value or several)."""
    return value in needed if isinstance(needed, tuple) else value == needed


def requirement_text(needed: str | tuple[str, ...]) -> str:
    """A SETTING_REQUIRES entry's needed value(s) in a message: "fa3", or "fa3 or triton"."""
    return " or ".join(needed) if isinstance(needed, tuple) else needed


# a setting's value that runs in a bfloat16 engine only (the engine refuses it in float32, by name)
BF16_ONLY_SETTINGS = {("LORA_SHRINK", "in_base_gemm"): "A is appended to the bf16 base weight as three bf16 parts",
                      **{(name, "triton"): "its kernel rounds to bf16" for name in EPILOGUES},
                      ("ATTENTION_BACKEND", "fa3"): "FA3's kernels take bf16 or fp16 only",
                      ("ATTENTION_BACKEND", "triton"): "its kernel multiplies bf16 operands",
                      ("ATTENTION_BACKEND", "triton_qkv"): "its kernel multiplies bf16 operands",
                      ("GEMM_KERNEL", "triton_skinny"): "its kernel multiplies bf16 operands",
                      ("GEMM_KERNEL", "triton_skinny_o_down"): "its kernel multiplies bf16 operands"}


def settings_for_dtype(settings: dict[str, str], dtype: str) -> tuple[dict[str, str], dict[str, str]]:
    """(the part of an `engine` mapping an engine of `dtype` ("float32", "bfloat16") runs, {setting: why it is
    left out}): a candidate's bf16-only values, and what requires them (SETTING_REQUIRES), are left out of a
    float32 engine, so a check that runs the candidate in both dtypes (conformance) keeps the rest of it in float32
    and says what it left out."""
    settings = check_engine_settings(settings)
    left_out: dict[str, str] = {}
    if dtype != "bfloat16":
        for (name, value), why in BF16_ONLY_SETTINGS.items():
            if settings.get(name) == value:
                left_out[name] = f"{value}: bfloat16 engines only ({why})"
        for (name, value), (needs, needed, _) in SETTING_REQUIRES.items():
            if settings.get(name) == value and needs in left_out and requirement_met(settings.get(needs), needed):
                left_out[name] = f"{value}: needs {needs} {requirement_text(needed)}, left out in {dtype}"
    return {k: v for k, v in settings.items() if k not in left_out}, left_out


# the settings an engine takes per instance (hf_cached's `engine` option: a candidate measured or checked for
# conformance without editing this module); each falls back to the module's value above
ENGINE_SETTINGS = {"LORA_SHRINK": LORA_SHRINK_ALLOWED, "LORA_EXPAND": LORA_EXPAND_ALLOWED,
                   "ATTENTION_BACKEND": ATTENTION_BACKEND_ALLOWED, "PREFILL": PREFILL_ALLOWED,
                   "PREFILL_STEP": PREFILL_STEP_ALLOWED, "STEP_PIECES": STEP_PIECES_ALLOWED,
                   "SAMPLER": SAMPLER_ALLOWED, "DECODE_PREFIX": DECODE_PREFIX_ALLOWED, "READBACK": READBACK_ALLOWED,
                   "STEP_EDGES": STEP_EDGES_ALLOWED, "GEMM_SPLIT_K": GEMM_SPLIT_K_ALLOWED,
                   "AUTOTUNE_ROWS": AUTOTUNE_ROWS_ALLOWED, "COMBO_KERNELS": COMBO_KERNELS_ALLOWED,
                   "ATTENTION_PLAN": ATTENTION_PLAN_ALLOWED, "GEMM_KERNEL": GEMM_KERNEL_ALLOWED,
                   "REDUCTION_LAUNCH": REDUCTION_LAUNCH_ALLOWED, **dict.fromkeys(EPILOGUES, EPILOGUE_ALLOWED),
                   "NORM_EPILOGUE_ROW": NORM_EPILOGUE_ROW_ALLOWED, "ATTENTION_LAUNCH": ATTENTION_LAUNCH_ALLOWED,
                   "WEIGHT_PREFETCH": WEIGHT_PREFETCH_ALLOWED, "DEPENDENT_LAUNCH": DEPENDENT_LAUNCH_ALLOWED,
                   "ATTENTION_DEPENDENT_LAUNCH": ATTENTION_DEPENDENT_LAUNCH_ALLOWED,
                   "WEIGHT_PREFETCH_BY": WEIGHT_PREFETCH_BY_ALLOWED}


def check_engine_settings(settings: Any) -> dict[str, str]:
    """An `engine` option: a mapping of ENGINE_SETTINGS names to allowed values; anything else is refused in
    one line naming the key and what is allowed."""
    if settings is None:
        return {}
    if not isinstance(settings, dict):
        raise ValueError(f"engine {settings!r} is not allowed; allowed: a mapping of "
                         f"{', '.join(ENGINE_SETTINGS)} to their values")
    for name, value in settings.items():
        if name not in ENGINE_SETTINGS:
            raise ValueError(f"engine setting {name!r} is not allowed; allowed: {', '.join(ENGINE_SETTINGS)}")
        _engine_setting(name, value, ENGINE_SETTINGS[name])
    return dict(settings)


def unmet_requirement(settings: dict[str, str]) -> tuple[str, str] | None:
    """The first SETTING_REQUIRES entry an engine's settings break (each unnamed setting at the module's value), as
    (the setting that needs another, a one-line message naming both); None when every requirement is met."""
    def setting(name: str) -> str:
        return settings.get(name, globals()[name])

    for (name, value), (needs, needed, why) in SETTING_REQUIRES.items():
        if setting(name) == value and not requirement_met(setting(needs), needed):
            return name, (f"{name} {value} needs {needs} {requirement_text(needed)} ({why}); this engine: "
                          f"{needs} {setting(needs)}")
    return None


def check_study_engine(study: Any) -> dict[str, str]:
    """A study's `hf_cached_engine` (issue 43: the engine a campaign measures), checked against ENGINE_SETTINGS and
    SETTING_REQUIRES before anything runs; a bad name, value or combination is refused in one line naming
    `hf_cached_engine.<NAME>` and what is allowed. Imports no torch: `rollout prereg`, the measure notebook's
    parameter check and `rollout campaign` call it."""
    engine = dict(getattr(study, "hf_cached_engine", {}))
    for name, value in engine.items():
        try:
            check_engine_settings({name: value})
        except ValueError as exc:
            raise ValueError(f"hf_cached_engine.{name}: {exc}") from None
    unmet = unmet_requirement(engine)
    if unmet is not None:
        raise ValueError(f"hf_cached_engine.{unmet[0]}: {unmet[1]}")
    return engine


# recompilations allowed per compiled function: the row counts of one engine, times the engines a
# process builds (tests, the probe's variants); past dynamo's default (8) it would run them eagerly
RECOMPILE_LIMIT = 64

HEAD_BF16_OPERANDS = "float32 products and sums of bf16 operands (cuBLAS bf16 GEMM, out_dtype float32)"
HEAD_FLOAT32 = "float32 GEMM over a float32 copy of the weights"


def _cuda_bf16_gemm_with_float32_output(device: torch.device) -> bool:
    """Whether `torch.mm(bf16, bf16, out_dtype=torch.float32)` runs here (torch >= 2.8 on CUDA)."""
    import torch

    if device.type != "cuda":
        return False
    try:
        probe = torch.ones(2, 8, dtype=torch.bfloat16, device=device)
        out = torch.mm(probe, probe.t(), out_dtype=torch.float32)
    except (TypeError, RuntimeError):
        return False
    return out.dtype == torch.float32


def _exact_in_bf16(values: torch.Tensor, bf16: torch.Tensor, chunk_rows: int = 16384) -> bool:
    """Whether `bf16`, upcast, equals the float32 `values` bit for bit (compared in row chunks: no
    full-size float32 temporary)."""
    import torch

    if values.shape != bf16.shape:
        return False
    return all(torch.equal(bf16[i:i + chunk_rows].to(torch.float32), values[i:i + chunk_rows])
               for i in range(0, values.shape[0], chunk_rows))


def head_operands(head: torch.Tensor, embed: torch.Tensor | None, compute_dtype: torch.dtype,
                  bf16_gemm_float32_out: bool) -> tuple[str, torch.Tensor]:
    """(mode, weights) of the float32 LM head. In bf16 compute, where cuBLAS can sum bf16 products into
    float32 (`bf16_gemm_float32_out`), a head whose float32 values are exactly bf16 values is computed on
    those bf16 operands: every product is exact in float32, so it is the float32 GEMM in another order.
    The mirror's head is a float32 copy of the tied bf16 embedding (`use_float32_lm_head`), so the
    embedding itself serves as the operands (no copy); an untied exactly-bf16 head gets one bf16 copy;
    anything else (float32 compute, a CPU, a head with float32-only values) keeps the float32 GEMM."""
    import torch

    if compute_dtype == torch.bfloat16 and bf16_gemm_float32_out:
        if head.dtype == torch.bfloat16:
            return HEAD_BF16_OPERANDS, head
        if head.dtype == torch.float32:
            if embed is not None and embed.dtype == torch.bfloat16 and _exact_in_bf16(head, embed):
                return HEAD_BF16_OPERANDS, embed
            rounded = head.to(torch.bfloat16)
            if _exact_in_bf16(head, rounded):
                return HEAD_BF16_OPERANDS, rounded
    return HEAD_FLOAT32, head if head.dtype == torch.float32 else head.to(torch.float32)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3RMSNorm: statistics in float32, then weight * normalized (in the input dtype)."""
    import torch

    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    import torch

    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class CompactQwen3:
    """Built from a peft-wrapped mirror (`actor.add_lora(build_mirror_base(...))`)."""

    def __init__(self, peft_mirror: Any, lora_rank: int, lora_targets: tuple[str, ...], scaling: float,
                 compile_step: bool = False, lora_add: str = "float32_once", settings: dict[str, str] | None = None):
        import functools

        import torch

        self.lora_add = lora_add_mode(lora_add)
        model = peft_mirror.get_base_model() if hasattr(peft_mirror, "get_base_model") else peft_mirror
        config = model.config
        self.device = next(model.parameters()).device
        self.dtype = model.model.embed_tokens.weight.dtype
        self.hidden = config.hidden_size
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.vocab = config.vocab_size
        self.rank = lora_rank
        self.targets = tuple(lora_targets)
        self._lora_views: dict[str, torch.Tensor] | None = None  # built on first use (lora_views)
        self._identity_staging: torch.Tensor | None = None
        self._lora_stacks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # see _stack_lora_buffers
        self._lora_groups: list[tuple[torch.Tensor, list[str]]] | None = None
        self._served: tuple[list[torch.Tensor], dict[str, torch.Tensor]] | None = None  # see served_lora
        self.scaling = float(scaling)
        chosen = check_engine_settings(settings)

        def setting(name: str) -> str:  # this engine's value (the `engine` option), else the module's
            return _engine_setting(name, chosen.get(name, globals()[name]), ENGINE_SETTINGS[name])

        self.lora_shrink = setting("LORA_SHRINK")
        if self.lora_shrink == "in_base_gemm" and self.dtype != torch.bfloat16:
            raise ValueError(f"LORA_SHRINK in_base_gemm needs a bfloat16 engine, not {self.dtype}")
        self.lora_expand = setting("LORA_EXPAND")
        if self.lora_expand == "triton":
            triton_ops.check_triton_runs_here(self.device, "LORA_EXPAND triton")
            _lora_expand_triton_op()  # the op registered now, outside any compiled trace
        self.attention_backend = setting("ATTENTION_BACKEND")
        if self.attention_backend == "fa3":
            _check_fa3(self.device, self.dtype)
        if self.attention_backend in ("triton", "triton_qkv"):
            from rollout_lib.backends import decode_attention

            if self.dtype != torch.bfloat16:
                raise ValueError(f"ATTENTION_BACKEND {self.attention_backend} needs a bfloat16 engine, not "
                                 f"{self.dtype}")
            triton_ops.check_triton_runs_here(self.device, f"ATTENTION_BACKEND {self.attention_backend}")
            decode_attention.prepare(self.device)  # its counters zeroed now, before any graph capture
        self.prefill = setting("PREFILL")
        self.prefill_step = setting("PREFILL_STEP")
        self.step_pieces = setting("STEP_PIECES")
        self.sampler_reduction = setting("SAMPLER")
        if self.sampler_reduction == "triton":
            from rollout_lib.backends import triton_sampler

            triton_ops.check_triton_runs_here(self.device, "SAMPLER triton")
            triton_sampler.prepare(self.device)  # its counters zeroed now, before any graph capture
        self.decode_prefix = setting("DECODE_PREFIX")
        self.readback = setting("READBACK")
        self.step_edges = setting("STEP_EDGES")
        self.gemm_split_k = setting("GEMM_SPLIT_K")
        self.autotune_rows = setting("AUTOTUNE_ROWS")  # read by the backend's cold start (the capture order)
        self.combo_kernels = setting("COMBO_KERNELS")
        self.attention_plan = setting("ATTENTION_PLAN")
        self.gemm_kernel = setting("GEMM_KERNEL")
        self.gate_up_epilogue = setting("GATE_UP_EPILOGUE")
        self.o_epilogue = setting("O_EPILOGUE")
        self.down_epilogue = setting("DOWN_EPILOGUE")
        self.qkv_epilogue = setting("QKV_EPILOGUE")
        self.norm_epilogue_row = setting("NORM_EPILOGUE_ROW")
        self.norm_slices = self.norm_epilogue_row == "slices"
        self.attention_launch = setting("ATTENTION_LAUNCH")
        self.weight_prefetch = setting("WEIGHT_PREFETCH")
        self.weight_prefetch_by = setting("WEIGHT_PREFETCH_BY")
        if self.weight_prefetch_by == "side_stream_wide" and self.weight_prefetch == "off":
            raise ValueError("WEIGHT_PREFETCH_BY side_stream_wide widens WEIGHT_PREFETCH's kernel; this engine: "
                             "WEIGHT_PREFETCH off (allowed with it: rest_of_layer, through_next_qkv)")
        if self.weight_prefetch_by == "attention" and (self.weight_prefetch == "off"
                                                       or self.attention_backend != "triton"):
            raise ValueError(f"WEIGHT_PREFETCH_BY attention issues WEIGHT_PREFETCH's plans from ATTENTION_BACKEND "
                             f"triton's kernel; this engine: WEIGHT_PREFETCH {self.weight_prefetch}, "
                             f"ATTENTION_BACKEND {self.attention_backend} (allowed with it: WEIGHT_PREFETCH "
                             "rest_of_layer or through_next_qkv, ATTENTION_BACKEND triton)")
        if self.weight_prefetch != "off":
            triton_ops.check_sm90(self.device, f"WEIGHT_PREFETCH {self.weight_prefetch}", "sm_90's bulk L2 prefetch")
        self.dependent_launch = setting("DEPENDENT_LAUNCH")
        self.pdl_norm_from_rows, self.pdl_gate_up_from_rows, self.pdl_qkv_from_rows = \
            PDL_FROM_ROWS[self.dependent_launch]
        if self.pdl_qkv_from_rows and self.qkv_epilogue != "triton":
            raise ValueError(f"DEPENDENT_LAUNCH {self.dependent_launch} launches QKV_EPILOGUE triton's kernel; this "
                             f"engine: QKV_EPILOGUE {self.qkv_epilogue} (allowed with it: triton)")
        self.attention_dependent_launch = setting("ATTENTION_DEPENDENT_LAUNCH")
        self.pdl_attention = self.attention_dependent_launch != "off"
        if self.pdl_attention:
            triton_ops.check_sm90(self.device, f"ATTENTION_DEPENDENT_LAUNCH {self.attention_dependent_launch}",
                                  "programmatic dependent launch")
        if self.dependent_launch != "off":
            triton_ops.check_sm90(self.device, f"DEPENDENT_LAUNCH {self.dependent_launch}",
                                  "programmatic dependent launch")
            if self.norm_slices:
                raise ValueError(f"DEPENDENT_LAUNCH {self.dependent_launch} launches the one-program o/down kernel; "
                                 "this engine: NORM_EPILOGUE_ROW slices (allowed with it: one_program)")
        # B stored rank-major for a projection whose epilogue kernel reads it: each rank term's B loads are then
        # contiguous across the features a warp computes (lease 34: row-major B made the o/down kernel 10.5 us)
        self.rank_major_b = frozenset(projection for name, (projection, _) in EPILOGUES.items()
                                      if setting(name) == "triton")
        self.reduction_launch = setting("REDUCTION_LAUNCH")
        if self.reduction_launch != "benchmarked":
            reduction_launch.install(self.reduction_launch)  # refuses a torch without the hook, before compiling
        if self.gemm_kernel != "cublas":
            from rollout_lib.backends import skinny_gemm

            if self.dtype != torch.bfloat16:
                raise ValueError(f"GEMM_KERNEL {self.gemm_kernel} needs a bfloat16 engine, not {self.dtype}")
            if self.gemm_split_k != "off":
                raise ValueError(f"GEMM_KERNEL {self.gemm_kernel} splits K itself; this engine: GEMM_SPLIT_K "
                                 f"{self.gemm_split_k} (allowed with it: off)")
            triton_ops.check_triton_runs_here(self.device, f"GEMM_KERNEL {self.gemm_kernel}")
            skinny_gemm.prepare(self.device)  # its counters zeroed now, before any graph capture
        self.multiprocessors = (torch.cuda.get_device_properties(self.device).multi_processor_count
                                if self.device.type == "cuda" else None)
        unmet = unmet_requirement(chosen)
        if unmet is not None:
            raise ValueError(unmet[1])
        for name, (_, module) in EPILOGUES.items():
            if setting(name) == "triton":
                triton_ops.check_triton_runs_here(self.device, f"{name} triton")
                # the op registered now, outside any compiled trace
                importlib.import_module(f"rollout_lib.backends.{module}").prepare()
        if self.norm_slices:
            from rollout_lib.backends import norm_epilogue

            norm_epilogue.prepare(self.device)  # its counters zeroed now, before any graph capture
        rotary = model.model.rotary_emb  # the model's own frequencies and scaling, as its forward uses them
        self.inv_freq = rotary.inv_freq.detach().to(self.device, torch.float32)
        self.rope_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        with torch.no_grad():
            self.embed = model.model.embed_tokens.weight.detach()
            self.final_norm = model.model.norm.weight.detach()
            head = model.get_output_embeddings().weight.detach()
            # The head is float32 arithmetic (the preregistered lm_head_compute_dtype). With bf16 hidden
            # states and bf16 weights every product is exact in float32, so cuBLAS's bf16 GEMM with float32
            # accumulation and output (`out_dtype`) is the same float32 sum in another order, on tensor
            # cores and reading half the bytes of a float32 copy (the float32 SIMT GEMM took 214-378 us
            # per step at 4-16 rows on the H200, lease 4). Otherwise (float32 compute, a CPU): float32 GEMM.
            # (lease 5: the mirror's head is a float32 copy, so a test of the head's own dtype never
            # chose the bf16 operands; the exact-values test below does)
            self.head_mode, self.lm_head = head_operands(head, self.embed, self.dtype,
                                                         _cuda_bf16_gemm_with_float32_output(self.device))
            self.layers = [self._layer(block) for block in model.model.layers]
            self._stack_lora_buffers()
        self._prefetch_plans = self._weight_prefetch_plans() if self.weight_prefetch != "off" else []
        self._prefetch_stream = torch.cuda.Stream(self.device) if self._prefetch_plans else None
        # `compile_step`: the per-layer pieces of the decode step and its sampler go through inductor
        # before capture, which fuses the elementwise chains (norms, rotary, LoRA casts and adds, the
        # noise hash) into a few kernels. They are compiled per piece, not per layer (the layer's
        # tensors are arguments), dynamic in the cache length (one compilation serves every bucket of a
        # row count; per row count with STEP_SHAPES "per_rows"): a whole-model compilation of the 28
        # unrolled layers took longer than 6 minutes on the H200.
        self.compiled = bool(compile_step)
        if STEP_SHAPES not in STEP_SHAPES_ALLOWED or CACHE_WRITE not in CACHE_WRITE_ALLOWED:
            raise ValueError(f"STEP_SHAPES {STEP_SHAPES!r} (allowed: {', '.join(STEP_SHAPES_ALLOWED)}), "
                             f"CACHE_WRITE {CACHE_WRITE!r} (allowed: {', '.join(CACHE_WRITE_ALLOWED)})")
        self.step_shapes, self.cache_write = STEP_SHAPES, CACHE_WRITE
        if self.compiled:
            dynamo = torch._dynamo.config
            name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
            setattr(dynamo, name, max(getattr(dynamo, name), RECOMPILE_LIMIT))
        # dynamic shapes (the cache length varies by bucket); "per_rows" marks the row dimension of every
        # per-row input static at each call (`mark_rows`), so a new row count is a new compilation
        combo = {"combo_kernels": True} if self.combo_kernels == "on" else {}
        self.inductor_options = (dict(INDUCTOR_OPTIONS) | combo
                                 | reduction_launch.compile_options(self.reduction_launch))

        def compile(fn: Any) -> Any:  # each piece compiled with this engine's options, run under its launch rule
            compiled = torch.compile(fn, dynamic=True, fullgraph=True, options=self.inductor_options or None)
            return reduction_launch.with_rule(compiled, self.reduction_launch)

        if self.compiled:  # only rows and lengths vary: the weights' shapes are constants of the kernels
            for layer in self.layers:
                for tensor in (layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm,
                               *(t for fused in FUSED for t in layer.tensors(fused) if t is not None)):
                    torch._dynamo.mark_static(tensor)
        self.before_attention = compile(self._before_attention) if self.compiled else None
        self.after_attention = compile(self._after_attention) if self.compiled else None
        self.between_layers = (compile(self._between_layers) if self.compiled and self.step_pieces == "across_layers"
                               else None)
        if self.sampler_reduction == "row":
            self.sample = compile(counter_noise.sample) if self.compiled else counter_noise.sample
        elif self.sampler_reduction == "triton":  # one opaque op: nothing for inductor to compile
            from rollout_lib.backends import triton_sampler

            self.sample = triton_sampler.sample
        else:  # the vocabulary viewed in chunks outside the compiled part (see sample_chunked)
            self.sample = functools.partial(
                counter_noise.sample_chunked, chunks=counter_noise.vocabulary_chunks(self.vocab),
                in_chunks=compile(counter_noise.sample_in_chunks) if self.compiled else None)
        # DECODE_PREFIX "shared": the merge of the two attention halves as one kernel per layer, not ~10
        self.merge = (compile(merge_attention_states) if self.compiled and self.decode_prefix != "per_row"
                      and self.attention_backend == "fa3" else merge_attention_states)
        # STEP_EDGES "compiled": the decode step's work outside its layers as three pieces (decode_step)
        edges = self.compiled and self.step_edges == "compiled"
        self.decode_inputs = compile(_decode_inputs) if edges else _decode_inputs
        self.final_rms = compile(_rms) if edges else _rms
        self.advance = compile(_advance) if edges else _advance

    def _weight_prefetch_plans(self) -> list:
        """WEIGHT_PREFETCH: one prefetch plan per layer, its regions in the order the layer's kernels read them after
        its attention: the o, gate_up and down GEMMs' weights (with the shrink's rows under LORA_SHRINK
        "in_base_gemm", else followed by A) and each one's B; with "through_next_qkv" the next layer's qkv weight
        (and A) and B after them. Built once the buffers are final: their addresses are the tables'."""
        from rollout_lib.backends import weight_prefetch

        def read(layer: Layer, fused: str) -> list[torch.Tensor]:
            weight, lora_a, lora_b = layer.tensors(fused)
            in_gemm = layer.proj[fused].weight_cat is not None  # A's rows are in the weight
            return [weight, *([] if in_gemm else [lora_a]), lora_b]

        # the side stream's kernel's largest chunk a thread ("attention" keeps it where `attend` does not run)
        chunk = (weight_prefetch.WIDE_CHUNK_BYTES if self.weight_prefetch_by == "side_stream_wide"
                 else weight_prefetch.CHUNK_BYTES)
        plans = []
        for index, layer in enumerate(self.layers):
            tensors = [t for fused in ("o", "gate_up", "down") for t in read(layer, fused)]
            if self.weight_prefetch == "through_next_qkv" and index + 1 < len(self.layers):
                tensors += read(self.layers[index + 1], "qkv")
            plans.append(weight_prefetch.plan(tensors, self.device, chunk))
        return plans

    def mark_rows(self, *tensors: torch.Tensor | None) -> None:
        """Before a compiled piece is called with these per-row tensors (dimension 0 = rows): with
        STEP_SHAPES "per_rows", the row count becomes a constant of that compilation (dynamo guards on
        it and compiles again for another row count); the other dimensions stay dynamic."""
        import torch

        if self.compiled and self.step_shapes == "per_rows":
            for tensor in tensors:
                if tensor is not None and tensor.dim() > 0:
                    torch._dynamo.mark_static(tensor, 0)

    def _layer(self, block: Any) -> Layer:
        import torch

        def base_weight(module: Any) -> torch.Tensor:
            return (module.base_layer if hasattr(module, "base_layer") else module).weight.detach()

        layer = Layer(block.input_layernorm.weight.detach(), block.post_attention_layernorm.weight.detach(),
                      block.self_attn.q_norm.weight.detach(), block.self_attn.k_norm.weight.detach())
        modules = {name: block.get_submodule(MODULE_PATH[name]) for name in PROJECTIONS}
        for fused, parts in FUSED.items():
            weights = [base_weight(modules[p]) for p in parts]
            linear = FusedLinear(torch.cat(weights, dim=0).contiguous() if len(weights) > 1 else weights[0],
                                 parts, tuple(w.shape[0] for w in weights))
            lora_parts = tuple(p for p in parts if p in self.targets)
            if lora_parts:
                in_features = weights[0].shape[1]
                linear.lora_a = torch.zeros(len(parts) * self.rank, in_features, dtype=torch.float32,
                                            device=self.device)
                linear.lora_b = torch.zeros(sum(linear.part_out), len(parts) * self.rank, dtype=torch.float32,
                                            device=self.device)
                linear.lora_parts = lora_parts
                if self.lora_shrink == "in_base_gemm":  # rows for A_hi, A_mid, A_lo after W (zero: no policy yet)
                    rows = linear.weight.shape[0]
                    linear.weight_cat = torch.zeros(rows + 3 * linear.lora_a.shape[0], in_features,
                                                    dtype=linear.weight.dtype, device=self.device)
                    linear.weight_cat[:rows].copy_(linear.weight)
                    linear.weight = linear.weight_cat[:rows]
            layer.proj[fused] = linear
        return layer

    # -- policy: exact live tensors into static buffers -----------------------------------------
    def _stack_lora_buffers(self) -> None:
        """Every layer's A (and B) buffer of one fused projection becomes a slice of one [layers, ...]
        tensor, so one projection's A (or B) of all layers is a single strided view: a sync copies one
        group per (projection, A|B), 14 copies for Qwen3's 7 targets instead of 392 (the qkv and
        gate_up B blocks are column slices of block-diagonal buffers, which keep a multi-tensor copy
        off its fused route). Each layer's buffers keep their shapes and strides."""
        import torch

        for fused in FUSED:
            linears = [layer.proj[fused] for layer in self.layers]
            if not linears or linears[0].lora_a is None:
                continue
            stack_a = torch.stack([linear.lora_a for linear in linears])
            stack_b = torch.stack([linear.lora_b for linear in linears])
            if self.lora_expand == "unrolled_parts" or fused in self.rank_major_b:
                # rank-major: B[:, r] contiguous (same shapes, other strides)
                stack_b = stack_b.transpose(1, 2).contiguous().transpose(1, 2)
            for index, linear in enumerate(linears):
                linear.lora_a, linear.lora_b = stack_a[index], stack_b[index]
            self._lora_stacks[fused] = (stack_a, stack_b)

    def lora_groups(self) -> list[tuple[torch.Tensor, list[str]]]:
        """(strided view [layers, ...] of the stacked buffers, the canonical name of each layer's
        tensor in it), one entry per targeted projection and A|B."""
        if self._lora_groups is None:
            groups, r = [], self.rank
            for fused, (stack_a, stack_b) in self._lora_stacks.items():
                linear = self.layers[0].proj[fused]
                for index, name in enumerate(linear.parts):
                    if name not in self.targets:
                        continue
                    start, rows = sum(linear.part_out[:index]), linear.part_out[index]
                    names = [f"model.layers.{layer}.{MODULE_PATH[name]}" for layer in range(len(self.layers))]
                    groups.append((stack_a[:, index * r:(index + 1) * r], [f"{n}.lora_A" for n in names]))
                    groups.append((stack_b[:, start:start + rows, index * r:(index + 1) * r],
                                   [f"{n}.lora_B" for n in names]))
            self._lora_groups = groups
        return self._lora_groups

    def _blocks(self, layer: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the A and B blocks of projection `name` in layer `layer` (inside the fused buffers)."""
        fused = next(f for f, parts in FUSED.items() if name in parts)
        linear = self.layers[layer].proj[fused]
        index = linear.parts.index(name)
        r = self.rank
        start = sum(linear.part_out[:index])
        a = linear.lora_a[index * r:(index + 1) * r]
        b = linear.lora_b[start:start + linear.part_out[index], index * r:(index + 1) * r]
        return a, b

    def load_lora(self, tensors: dict[str, torch.Tensor], scaling: float) -> None:
        """Copy the live LoRA tensors (canonical names, float32, any device) into the static buffers."""
        if float(scaling) != self.scaling:
            raise ValueError(f"LoRA scaling {scaling} != the engine's {self.scaling}")
        import torch

        views = self.lora_views()
        for key, tensor in tensors.items():
            target = views.get(key)
            if target is None:
                raise ValueError(f"{key}: not a LoRA tensor of this engine (targets: {', '.join(self.targets)})")
            if tensor.dtype != target.dtype or tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(f"{key}: {tuple(tensor.shape)} {tensor.dtype} does not fit "
                                 f"{tuple(target.shape)} {target.dtype}")
        # a whole group (one projection's A or B in every layer) in one stack and one strided copy
        done = set()
        for view, names in self.lora_groups():
            if all(name in tensors for name in names):
                view.copy_(torch.stack([tensors[name] for name in names]), non_blocking=True)
                done.update(names)
        rest = [key for key in tensors if key not in done]  # a partial set: tensor by tensor
        if rest:
            torch._foreach_copy_([views[k] for k in rest], [tensors[k] for k in rest], non_blocking=True)
        if self.lora_shrink == "in_base_gemm":
            self._write_shrink_rows()

    def _write_shrink_rows(self) -> None:
        """LORA_SHRINK "in_base_gemm": each projection's float32 A, just written, as A_hi + A_mid + A_lo
        (bf16 each) in the rows after W. Exact: A_hi is A rounded to bf16, A - A_hi is exact in float32 and
        holds at most 16 significant bits, A_mid takes 8 of them and A_lo the rest; checked once per sync
        (a value bf16's range cannot split, e.g. a float32 subnormal, is refused, never served inexactly)."""
        import torch

        exact = torch.ones((), dtype=torch.bool, device=self.device)
        for layer in self.layers:
            for linear in layer.proj.values():
                if linear.weight_cat is None:
                    continue
                a, rows, low = linear.lora_a, linear.lora_b.shape[0], linear.lora_a.shape[0]
                high = a.to(torch.bfloat16)
                rest = a - high.float()
                middle = rest.to(torch.bfloat16)
                last = (rest - middle.float()).to(torch.bfloat16)
                exact &= ((high.float() + middle.float()) + last.float() == a).all()
                for k, part in enumerate((high, middle, last)):
                    linear.weight_cat[rows + k * low:rows + (k + 1) * low].copy_(part)
        if not bool(exact):
            raise ValueError("LORA_SHRINK in_base_gemm: a LoRA A tensor is not exactly the sum of three bf16 "
                             "matrices; this engine cannot serve it exactly")

    def lora_views(self) -> dict[str, torch.Tensor]:
        """The served LoRA tensors as views of the static buffers, canonical names, on the device
        (built once: the buffers are allocated once, so the views stay valid)."""
        if self._lora_views is None:
            views = {}
            for layer in range(len(self.layers)):
                for name in self.targets:
                    a, b = self._blocks(layer, name)
                    base = f"model.layers.{layer}.{MODULE_PATH[name]}"
                    views[f"{base}.lora_A"], views[f"{base}.lora_B"] = a.detach(), b.detach()
            self._lora_views = views
        return self._lora_views

    def served_lora(self) -> dict[str, torch.Tensor]:
        """The served LoRA tensors re-read from the static buffers into one dense device copy (one copy
        per group, into memory allocated once), as dense views with canonical names in `lora_views`
        order: what a sync hashes for the identity (the gather then needs no copy per strided block)."""
        import torch

        groups = self.lora_groups()
        if self._served is None:
            dense = [torch.empty(view.shape, dtype=view.dtype, device=view.device) for view, _ in groups]
            by_name = {name: block[layer] for block, (_, names) in zip(dense, groups, strict=True)
                       for layer, name in enumerate(names)}
            self._served = dense, {name: by_name[name] for name in self.lora_views()}
        dense, views = self._served
        for block, (view, _) in zip(dense, groups, strict=True):
            block.copy_(view)
        return views

    def identity_staging(self) -> torch.Tensor:
        """Host memory the served tensors are read back into for the identity (page-locked on CUDA so
        the transfer overlaps the hashing), allocated once: a sync allocates nothing."""
        import torch

        if self._identity_staging is None:
            numel = sum(t.numel() for t in self.lora_views().values())
            self._identity_staging = torch.empty(numel, dtype=torch.float32, pin_memory=self.device.type == "cuda")
        return self._identity_staging

    def read_lora(self) -> dict[str, torch.Tensor]:
        """The served LoRA tensors, read back from the static buffers (canonical names, CPU): gathered
        into one buffer on the device and moved in one transfer (not one per tensor: ~400 syncs)."""
        import torch

        views = self.served_lora()
        flat = torch.cat([t.reshape(-1) for t in views.values()]).to("cpu")
        out, offset = {}, 0
        for key, view in views.items():
            out[key] = flat[offset:offset + view.numel()].view(view.shape)
            offset += view.numel()
        return out

    # -- the forward pieces ----------------------------------------------------------------------
    def gemm_split_plan(self) -> dict[str, int]:
        """GEMM_SPLIT_K's slices per fused projection of a decode step (every layer has the same shapes)."""
        return {fused: self._splits(self.layers[0].tensors(fused)[0], 1) for fused in FUSED}

    def _splits(self, weight: torch.Tensor, length: int) -> int:
        """GEMM_SPLIT_K's slices for one projection's GEMM: decode steps only (one position per row; the
        weights' shapes are static, so this is a constant of the compiled piece); a prefill keeps its GEMM."""
        if length != 1:
            return 1
        return gemm_splits(weight.shape[0], weight.shape[1], self.gemm_split_k, self.multiprocessors)

    def _gemm(self, length: int, projection: str) -> str:
        """The kernel ("cublas", "triton_skinny") of `projection`'s GEMM ("qkv", "o", "gate_up", "down") under
        GEMM_KERNEL: the skinny kernel for decode steps only (one position per row; a prefill keeps cuBLAS), and
        under "triton_skinny_o_down" for the o and down projections only."""
        if length != 1 or self.gemm_kernel == "cublas":
            return "cublas"
        if self.gemm_kernel == "triton_skinny_o_down" and projection not in ("o", "down"):
            return "cublas"
        return "triton_skinny"

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, D] in the compute dtype for integer positions [B, T] (as transformers)."""
        return _rotary(positions, self.inv_freq, self.rope_scaling, self.dtype)

    def _before_attention(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, input_norm: torch.Tensor,
                          q_norm: torch.Tensor, k_norm: torch.Tensor, weight: torch.Tensor,
                          lora_a: torch.Tensor | None, lora_b: torch.Tensor | None, fused: bool = False,
                          cache_k: torch.Tensor | None = None, cache_v: torch.Tensor | None = None,
                          write: torch.Tensor | None = None, normed: torch.Tensor | None = None,
                          projection_only: bool = False):
        """h [B, T, hidden] -> q [B, kv_heads, groups * T, D] (grouped query rows), k, v [B, kv_heads, T, D].
        `fused`: traced by inductor (LoRA products as reductions, see _fused_linear). With `cache_k`,
        `cache_v`, `write`: k and v are written into the caches at columns `write` here (inside the
        compiled piece: inductor stores them from the kernel that computes them) and returned as None. `normed`
        (DOWN_EPILOGUE "triton"): h's input norm, computed by the previous layer's down epilogue.
        `projection_only` (ATTENTION_BACKEND "triton_qkv", with QKV_EPILOGUE's path): the qkv GEMM's float32 output
        with the shrink's rows in q's place, the caches left to the attention kernel."""
        batch, length, _ = h.shape
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        x = _rms(h, input_norm, self.eps) if normed is None else normed
        if self.qkv_epilogue == "triton" and lora_b is not None and cache_k is not None:  # QKV_EPILOGUE: one kernel
            from rollout_lib.backends.qkv_epilogue import queries_and_cache_write

            both = _gemm_float32(x.reshape(batch * length, -1), weight, self._splits(weight, length),
                                 self._gemm(length, "qkv"))
            if projection_only:
                return both, None, None
            return queries_and_cache_write(both, lora_b, q_norm, k_norm, cos, sin, cache_k, cache_v, write,
                                           self.heads, self.scaling, self.eps,
                                           self.lora_add == "bf16_like_nf4_oracle", self.pdl_qkv_from_rows), None, None
        qkv = _fused_linear(x, weight, lora_a, lora_b, self.scaling, fused,
                            self.lora_add, expand=self.lora_expand,
                            split_k=self._splits(weight, length), part_out=(q_size, kv_size, kv_size),
                            gemm=self._gemm(length, "qkv"))
        q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
        q = _rms(q.view(batch, length, self.heads, self.head_dim), q_norm, self.eps).transpose(1, 2)
        k = _rms(k.view(batch, length, self.kv_heads, self.head_dim), k_norm, self.eps).transpose(1, 2)
        v = v.view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        # GQA as plain attention over the kv heads: the query heads that share a kv head become extra
        # query rows (head h = kv head h // groups, as transformers' repeat_kv), so the cache is read
        # once and never expanded, and SDPA can take its fused kernel with the additive mask
        groups = self.heads // self.kv_heads
        q = q.reshape(batch, self.kv_heads, groups * length, self.head_dim)
        if cache_k is not None:
            cache_k.index_copy_(2, write, k)
            cache_v.index_copy_(2, write, v)
            return q, None, None
        return q, k, v

    def _after_attention(self, h: torch.Tensor, attn: torch.Tensor, post_norm: torch.Tensor,
                         o: tuple, gate_up: tuple, down: tuple, fused: bool = False,
                         next_norm: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The o projection, the residual, the MLP and its residual; `o`, `gate_up`, `down` are
        (weight, lora_a, lora_b). With `next_norm` (DOWN_EPILOGUE "triton", the next layer's input norm): (h, h's
        norm), both from the down epilogue's kernel."""
        import torch

        batch, length, _ = h.shape
        # reshape, not view: SDPA's float32 kernels return [B, kv, G*L, D] laid out as [B, G*L, kv, D],
        # which cannot be viewed as the query heads (a copy, fused by inductor; a view when contiguous)
        attn = attn.reshape(batch, self.heads, length, self.head_dim).transpose(1, 2)
        add, expand = self.lora_add, self.lora_expand
        attn = attn.reshape(batch, length, self.heads * self.head_dim)
        if self.o_epilogue == "triton" and o[2] is not None:  # O_EPILOGUE: one kernel after the GEMM
            from rollout_lib.backends.norm_epilogue import residual_and_norm

            both = _gemm_for_epilogue(attn.reshape(batch * length, -1), o[0], self._splits(o[0], length),
                                      self._gemm(length, "o"))
            h, x = residual_and_norm(both, o[2], h, post_norm, self.scaling, self.eps, add == "bf16_like_nf4_oracle",
                                     both.dim() == 3, self.norm_slices, self.pdl_norm_from_rows)
        else:
            h = h + _fused_linear(attn, *o, self.scaling, fused, add, expand=expand,
                                  split_k=self._splits(o[0], length), gemm=self._gemm(length, "o"))
            x = _rms(h, post_norm, self.eps)
        if self.gate_up_epilogue == "triton" and gate_up[2] is not None:  # GATE_UP_EPILOGUE: one kernel after the GEMM
            from rollout_lib.backends.mlp_epilogue import gate_up_activation

            both = _gemm_float32(x.reshape(-1, x.shape[-1]), gate_up[0], self._splits(gate_up[0], length),
                                 self._gemm(length, "gate_up"))
            act = gate_up_activation(both, gate_up[2], self.scaling, gate_up[2].shape[0] // 2,
                                     add == "bf16_like_nf4_oracle", self.pdl_gate_up_from_rows)
            act = act.reshape(batch, length, -1)
        else:
            gate, up = _fused_linear(x, *gate_up, self.scaling, fused, add, expand=expand,
                                     split_k=self._splits(gate_up[0], length),
                                     part_out=None if gate_up[2] is None else (gate_up[2].shape[0] // 2,) * 2,
                                     gemm=self._gemm(length, "gate_up")).chunk(2, dim=-1)
            act = torch.nn.functional.silu(gate) * up
        if next_norm is not None and down[2] is not None:  # DOWN_EPILOGUE: one kernel after the GEMM
            from rollout_lib.backends.norm_epilogue import residual_and_norm

            both = _gemm_for_epilogue(act.reshape(batch * length, -1), down[0], self._splits(down[0], length),
                                      self._gemm(length, "down"))
            return residual_and_norm(both, down[2], h, next_norm, self.scaling, self.eps,
                                     add == "bf16_like_nf4_oracle", both.dim() == 3, self.norm_slices,
                                     self.pdl_norm_from_rows)
        h = h + _fused_linear(act, *down, self.scaling, fused, add,
                              expand=expand, split_k=self._splits(down[0], length),
                              gemm=self._gemm(length, "down"))
        return h if next_norm is None else (h, _rms(h, next_norm, self.eps))

    def _between_layers(self, h: torch.Tensor, attn: torch.Tensor, post_norm: torch.Tensor, o: tuple,
                        gate_up: tuple, down: tuple, cos: torch.Tensor, sin: torch.Tensor, input_norm: torch.Tensor,
                        q_norm: torch.Tensor, k_norm: torch.Tensor, weight: torch.Tensor, lora_a: torch.Tensor | None,
                        lora_b: torch.Tensor | None, fused: bool = False, cache_k: torch.Tensor | None = None,
                        cache_v: torch.Tensor | None = None, write: torch.Tensor | None = None):
        """STEP_PIECES "across_layers": one layer's part after attention and the next layer's part before it,
        as one piece: (h, q, k, v) of the next layer (k, v None when written into the caches here)."""
        h = self._after_attention(h, attn, post_norm, o, gate_up, down, fused,
                                  input_norm if self.down_epilogue == "triton" else None)
        h, normed = h if isinstance(h, tuple) else (h, None)
        return (h, *self._before_attention(h, cos, sin, input_norm, q_norm, k_norm, weight, lora_a, lora_b, fused,
                                           cache_k, cache_v, write, normed))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: StaticCache, write: torch.Tensor,
                mask: torch.Tensor, keep: int = 1, compiled: bool = False,
                pad: torch.Tensor | None = None, group: int = 1,
                prefix_end: torch.Tensor | None = None,
                inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
                ) -> torch.Tensor:
        """Float32 logits of the last position of each row [B, V] (tokens/positions [B, T]); with
        `keep` > 1, of the last `keep` positions [B, keep, V] (teacher-forced scoring). Writes this
        chunk's k/v at cache columns `write` [T]; mask: boolean [B, 1, T, L]. `compiled`: the
        per-layer pieces through inductor (the decode step; the prefill too with PREFILL_STEP "compiled_graph";
        see __init__). `pad` [B]: each row's
        left padding, which a decode step passes for ATTENTION_BACKEND "fa3" (the mask, in columns). `group` > 1
        (DECODE_PREFIX "shared", fa3 or triton): rows come in blocks of `group` sharing one prompt, whose k/v columns
        [pad, prefix_end) the block's first row holds; attention then reads them once per block (see
        DECODE_PREFIX). `inputs`
        (STEP_EDGES "compiled", decode steps): the embedded tokens, cos, sin and the additive bias (None where the
        attention kernel takes no bias), computed by `decode_inputs` from the same tensors."""
        import torch

        before, after = ((self.before_attention, self.after_attention) if compiled
                         else (self._before_attention, self._after_attention))
        between = (self.between_layers if compiled else self._between_layers) \
            if self.step_pieces == "across_layers" else None
        if inputs is None:
            h = torch.nn.functional.embedding(tokens, self.embed)
            cos, sin = self._rope(positions)
        else:
            h, cos, sin, prepared_bias = inputs
        # the boolean mask once per forward as an additive bias, repeated for the grouped query rows
        # (row g*T + t is query position t); flex's decode steps read the boolean mask in the kernel instead
        flex = self.attention_backend == "flex" and tokens.shape[1] == 1  # prefill stays SDPA
        fa3 = self.attention_backend == "fa3" and tokens.shape[1] == 1 and pad is not None
        # the Triton decode kernel reads each row's column range (pad, write), as FA3 does; no bias
        triton_attention = (self.attention_backend in ("triton", "triton_qkv") and tokens.shape[1] == 1
                            and pad is not None)
        allowed = mask
        if fa3:  # the rows' column ranges, as FA3 reads them: [pad, write] (int32)
            batch = tokens.shape[0]
            seqused_k = (write + 1).to(torch.int32).expand(batch).contiguous()
            leftpad_k = pad.to(torch.int32)
            cascade = group > 1 and prefix_end is not None
            plan = None
            if self.attention_plan == "per_step" and not cascade:  # one plan for the step's 28 calls
                plan = _fa3_plan(1, self.heads, self.kv_heads, self.head_dim, cache.k[0].shape[2], self.dtype,
                                 seqused_k, leftpad_k)
            if cascade:  # the block's prompt [pad, prefix_end) once per block; each row's own [prefix_end, write]
                blocks = batch // group
                prefix_used = prefix_end.to(torch.int32).expand(blocks).contiguous()
                prefix_pad = leftpad_k[::group].contiguous()
                own_start = prefix_end.to(torch.int32).expand(batch).contiguous()
        elif triton_attention:
            mask = None
            from rollout_lib.backends.decode_attention import (
                DEFAULT,
                attend,
                attend_from_projection,
                attend_shared,
                launch_for,
                shared_launch_for,
            )

            cache_columns = cache.k[0].shape[2]
            attention_launch = launch_for(cache_columns) if self.attention_launch.startswith("by_columns") else DEFAULT
            shared_launch = (shared_launch_for(cache_columns) if self.attention_launch == "by_columns_shared"
                             else attention_launch)
        elif not flex and inputs is not None:
            mask = prepared_bias
        elif not flex:
            mask = _attention_bias(mask, self.dtype, self.heads // self.kv_heads)
        scale = 1.0 / math.sqrt(self.head_dim)
        inside = compiled and self.cache_write == "inside"
        # ATTENTION_BACKEND "triton_qkv": the qkv epilogue's work inside the attention kernel, where the compiled
        # piece would run that epilogue (k/v written inside, the LoRA B of a synced policy); else "triton"'s kernel
        projected = (triton_attention and self.attention_backend == "triton_qkv" and inside
                     and self.qkv_epilogue == "triton" and between is None)

        def cache_args(index: int) -> dict[str, torch.Tensor]:
            # CACHE_WRITE "inside": the compiled piece writes k/v; otherwise index_copy_ between the pieces
            return {"cache_k": cache.k[index], "cache_v": cache.v[index], "write": write} if inside else {}

        last = len(self.layers) - 1
        normed = None  # DOWN_EPILOGUE "triton": the next layer's input norm, from this layer's down epilogue
        # WEIGHT_PREFETCH: a compiled decode step's layers prefetch what follows their attention (see __init__)
        prefetching = self._prefetch_stream is not None and compiled and tokens.shape[1] == 1
        forked = False  # whether a layer's plan went to the side stream (WEIGHT_PREFETCH_BY attention: maybe none)
        if prefetching:
            from rollout_lib.backends import weight_prefetch
        for index, layer in enumerate(self.layers):
            if index == 0 or between is None:
                write_inside = cache_args(index)
                if normed is not None:
                    write_inside["normed"] = normed
                if compiled:
                    self.mark_rows(h, cos, sin, write_inside.get("cache_k"), write_inside.get("cache_v"), normed)
                if projected:
                    write_inside["projection_only"] = True
                q, k, v = before(h, cos, sin, layer.input_norm, layer.q_norm, layer.k_norm, *layer.tensors("qkv"),
                                 fused=compiled, **write_inside)
            # else: q, k, v come from the previous layer's `between` piece
            # WEIGHT_PREFETCH_BY attention: `attend`'s kernel issues the layer's plan, where it is the kernel that runs
            by_attention = (prefetching and self.weight_prefetch_by == "attention" and triton_attention and not flex
                            and not fa3 and not (projected and q.dtype == torch.float32)
                            and not (group > 1 and prefix_end is not None))
            if prefetching and not by_attention:  # forked here: the attention's inputs are enqueued, the GEMMs not
                weight_prefetch.launch(self._prefetch_plans[index], self._prefetch_stream)
                forked = True
            if not inside:
                cache.k[index].index_copy_(2, write, k)
                cache.v[index].index_copy_(2, write, v)
            if flex:
                attn = _flex_attention(q, cache.k[index], cache.v[index], allowed, scale)
            elif fa3 and cascade:  # a block's rows are its n query positions over the block's first row's prompt
                rows_q = q.reshape(batch, 1, self.heads, self.head_dim)
                shared, shared_lse = _fa3_attention(
                    rows_q.reshape(blocks, group, self.heads, self.head_dim),
                    cache.k[index][::group].transpose(1, 2), cache.v[index][::group].transpose(1, 2), prefix_used,
                    prefix_pad, scale)
                own, own_lse = _fa3_attention(rows_q, cache.k[index].transpose(1, 2), cache.v[index].transpose(1, 2),
                                              seqused_k, own_start, scale)
                attn = self.merge(
                    shared.reshape(batch, 1, self.heads, self.head_dim),
                    shared_lse.transpose(1, 2).reshape(batch, 1, self.heads).transpose(1, 2), own,
                    own_lse).reshape(q.shape)
            elif fa3:  # grouped rows [B, kv, G, D] are the query heads h = kv * G + g: [B, 1, H, D] and back
                attn = _fa3_decode(q.reshape(batch, 1, self.heads, self.head_dim),
                                   cache.k[index].transpose(1, 2), cache.v[index].transpose(1, 2), seqused_k,
                                   leftpad_k, scale, plan).reshape(q.shape)
            elif projected and q.dtype == torch.float32:  # q: the qkv GEMM's output (no LoRA B: SDPA's path)
                rows = tokens.shape[0]
                attn = attend_from_projection(
                    q, layer.tensors("qkv")[2], layer.q_norm, layer.k_norm, cos.reshape(rows, -1),
                    sin.reshape(rows, -1), cache.k[index], cache.v[index], pad, write, self.heads, self.scaling,
                    self.eps, scale, self.lora_add == "bf16_like_nf4_oracle")
            elif triton_attention and group > 1 and prefix_end is not None:  # a block's prompt read once for it
                attn = attend_shared(q, cache.k[index], cache.v[index], pad, write, prefix_end, group, scale,
                                     shared_launch)
            elif triton_attention:  # the grouped rows [B, kv, G, D] as they are
                attn = attend(q, cache.k[index], cache.v[index], pad, write, scale, attention_launch,
                              pdl=self.pdl_attention,
                              weights=self._prefetch_plans[index].table if by_attention else None)
            else:
                with _attention_kernel(self.attention_backend):
                    attn = torch.nn.functional.scaled_dot_product_attention(q, cache.k[index], cache.v[index],
                                                                            attn_mask=mask, scale=scale)
            if compiled:
                self.mark_rows(h, attn)
            if between is not None and index < last:
                following = self.layers[index + 1]
                write_inside = cache_args(index + 1)
                if compiled:
                    self.mark_rows(write_inside.get("cache_k"), write_inside.get("cache_v"))
                h, q, k, v = between(h, attn, layer.post_norm, layer.tensors("o"), layer.tensors("gate_up"),
                                     layer.tensors("down"), cos, sin, following.input_norm, following.q_norm,
                                     following.k_norm, *following.tensors("qkv"), fused=compiled, **write_inside)
                continue
            if self.down_epilogue == "triton" and index < last:  # the next layer's norm by this layer's epilogue
                h, normed = after(h, attn, layer.post_norm, layer.tensors("o"), layer.tensors("gate_up"),
                                  layer.tensors("down"), fused=compiled, next_norm=self.layers[index + 1].input_norm)
                continue
            h = after(h, attn, layer.post_norm, layer.tensors("o"), layer.tensors("gate_up"), layer.tensors("down"),
                      fused=compiled)
        if forked:  # joined: a captured graph ends with every stream it forked
            weight_prefetch.join(self._prefetch_stream)
        h = (self.final_rms if inputs is not None else _rms)(h[:, -keep:, :], self.final_norm, self.eps)
        if self.head_mode == HEAD_BF16_OPERANDS:
            logits = torch.mm(h.reshape(-1, self.hidden), self.lm_head.t(), out_dtype=torch.float32)
            logits = logits.view(*h.shape[:-1], -1)
        else:
            logits = torch.nn.functional.linear(h.to(torch.float32), self.lm_head)
        return logits[:, -1] if keep == 1 else logits

    def score(self, prompt: tuple[int, ...], response: list[int]):
        """Teacher-forced scoring of `response` after `prompt` (one row, one eager pass): the shared
        `decode.teacher_forced`, with this engine called the way a transformers model is."""
        from rollout_lib.backends.decode import teacher_forced

        return teacher_forced(_ScoringView(self), prompt, response, self.device)


class _ScoringView:
    """A CompactQwen3 behind transformers' call signature (`input_ids`, `logits_to_keep` -> `.logits`
    [B, keep, V]), over a throw-away causal cache sized for the sequence."""

    def __init__(self, engine: CompactQwen3):
        self.engine = engine

    def __call__(self, input_ids: torch.Tensor, use_cache: bool = False, logits_to_keep: int = 1):
        import types

        import torch

        length = input_ids.shape[1]
        cache = StaticCache.allocate(self.engine, input_ids.shape[0], length)
        columns = torch.arange(length, device=self.engine.device)
        mask = (columns[None, :] <= columns[:, None])[None, None]
        logits = self.engine.forward(input_ids, columns[None].expand(input_ids.shape[0], -1), cache, columns, mask,
                                     keep=logits_to_keep)
        return types.SimpleNamespace(logits=logits[:, None] if logits_to_keep == 1 else logits)


@dataclass
class StaticCache:
    """k, v: one [B, kv_heads, length, head_dim] tensor per layer, allocated once per bucket."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @classmethod
    def allocate(cls, engine: CompactQwen3, rows: int, length: int) -> StaticCache:
        import torch

        shape = (rows, engine.kv_heads, length, engine.head_dim)
        return cls([torch.zeros(shape, dtype=engine.dtype, device=engine.device) for _ in engine.layers],
                   [torch.zeros(shape, dtype=engine.dtype, device=engine.device) for _ in engine.layers])

    @property
    def length(self) -> int:
        return self.k[0].shape[2]

    def view(self, length: int) -> StaticCache:
        """The first `length` columns (shared storage: one cache per row count serves every length)."""
        return StaticCache([t[:, :, :length] for t in self.k], [t[:, :, :length] for t in self.v])

    def rows(self, count: int) -> StaticCache:
        """The first `count` rows (shared storage): where PREFILL "shared_prompts" prefills each distinct prompt."""
        return StaticCache([t[:count] for t in self.k], [t[:count] for t in self.v])

    def spread_rows(self, count: int, width: int, spread: torch.Tensor) -> None:
        """Row r's first `width` columns become those of row spread[r] (< count) in every layer; index_select
        copies first, so a source row may itself be overwritten."""
        for layer in self.k + self.v:
            layer[:, :, :width].copy_(layer[:count, :, :width].index_select(0, spread))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


def decode_step(engine: CompactQwen3, tokens: torch.Tensor, write: torch.Tensor, pad: torch.Tensor,
                seeds: torch.Tensor, step: torch.Tensor, inv_temperature: torch.Tensor, greedy: torch.Tensor,
                columns: torch.Tensor, k: list[torch.Tensor], v: list[torch.Tensor], group: int = 1,
                prefix_end: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step for every row of a bucket: mask and positions from the per-row padding, the
    forward pass, and the in-graph sampler. A pure function of its tensors (what is captured)."""
    if engine.step_edges == "compiled":
        engine.mark_rows(tokens, pad)
        # the bias the default attention path adds (none for NO_BIAS_BACKENDS)
        bias_groups = engine.heads // engine.kv_heads if engine.attention_backend not in NO_BIAS_BACKENDS else 0
        h, cos, sin, mask, bias = engine.decode_inputs(tokens, write, pad, columns, engine.embed, engine.inv_freq,
                                                       engine.rope_scaling, engine.dtype, bias_groups)
        logits = engine.forward(tokens[:, None], None, StaticCache(k, v), write, mask, compiled=engine.compiled,
                                pad=pad, group=group, prefix_end=prefix_end, inputs=(h, cos, sin, bias))
    else:
        valid, positions = _valid_columns(write, pad, columns)
        logits = engine.forward(tokens[:, None], positions, StaticCache(k, v), write, valid[:, None, None, :],
                                compiled=engine.compiled, pad=pad, group=group, prefix_end=prefix_end)
    engine.mark_rows(logits, seeds, inv_temperature, greedy)
    return engine.sample(logits, seeds, step, inv_temperature, greedy)


def _decode_inputs(tokens: torch.Tensor, write: torch.Tensor, pad: torch.Tensor, columns: torch.Tensor,
                   embed: torch.Tensor, inv_freq: torch.Tensor, rope_scaling: float, dtype: torch.dtype,
                   bias_groups: int):
    """A decode step's inputs from its buffers, the same operations as the eager path (decode_step and forward
    call the same helpers): the embedded tokens [B, 1, hidden], cos and sin [B, 1, D] in `dtype`, the boolean
    mask [B, 1, 1, L], and with `bias_groups` > 0 the additive bias in `dtype` repeated for the grouped query rows
    (else None)."""
    import torch

    valid, positions = _valid_columns(write, pad, columns)
    h = torch.nn.functional.embedding(tokens[:, None], embed)
    cos, sin = _rotary(positions, inv_freq, rope_scaling, dtype)
    mask = valid[:, None, None, :]
    return h, cos, sin, mask, _attention_bias(mask, dtype, bias_groups) if bias_groups else None


def _valid_columns(write: torch.Tensor, pad: torch.Tensor, columns: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's boolean mask [B, L] (each row's columns from its padding to the column it writes) and its
    positions [B, 1]."""
    valid = (columns[None, :] <= write) & (columns[None, :] >= pad[:, None])
    valid = valid | (columns[None, :] == write)  # a row never attends to nothing
    return valid, (write - pad)[:, None]


def _rotary(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, T, D] in `dtype` for integer positions [B, T] (as transformers)."""
    import torch

    freqs = positions.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def _attention_bias(mask: torch.Tensor, dtype: torch.dtype, groups: int) -> torch.Tensor:
    """The boolean mask [B, 1, T, L] as an additive bias in `dtype`, repeated for the grouped query rows (row
    g*T + t is query position t)."""
    import torch

    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return bias.repeat(1, 1, groups, 1)


def _advance(tokens: torch.Tensor, logprobs: torch.Tensor, out: torch.Tensor, next_tokens: torch.Tensor,
             write: torch.Tensor, step: torch.Tensor) -> None:
    """A decode step's bookkeeping, in place: its tokens and log-probabilities into `out` [2, B] (float64), the
    tokens as the next step's input, the cache column and the noise step one further."""
    import torch

    out.copy_(torch.stack((tokens.to(torch.float64), logprobs.to(torch.float64))))
    next_tokens.copy_(tokens)
    write.add_(1)
    step.add_(1)


class DecodeBucket:
    """Static buffers and (on CUDA) one captured graph for a (rows, cache length) shape.

    Inputs the graph reads: `tokens` [B], `write` [1] (the cache column this step writes),
    `pad` [B] (left padding per row), `seeds` [B], `step` [] (the row-independent step counter of the
    noise), `inv_temperature` [B], `greedy` [B]. A step also advances its own inputs (the sampled
    tokens become the next `tokens`; `write` and `step` count up), so the host only replays, and it
    leaves the sampled tokens and their log-probabilities in `out` [2, B] (float64, exact for both),
    read back in one transfer. With `group` > 1 (DECODE_PREFIX "shared"), rows come in blocks of `group` with
    one prompt each, and `prefix_end` [1] (the first decode column) ends the prompt the blocks share.
    """

    def __init__(self, engine: CompactQwen3, cache: StaticCache, length: int, use_graph: bool, group: int = 1):
        import torch

        rows = cache.k[0].shape[0]
        if group < 1 or rows % group:
            raise ValueError(f"group {group}: rows ({rows}) must come in blocks of it")
        self.engine, self.rows, self.length, self.group = engine, rows, length, group
        self.prefix_end = torch.ones(1, dtype=torch.long, device=engine.device)  # warm-up: a one-column prompt
        device = engine.device
        self.cache = cache.view(length)
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.write = torch.zeros(1, dtype=torch.long, device=device)
        self.pad = torch.zeros(rows, dtype=torch.long, device=device)
        self.seeds = torch.zeros(rows, dtype=torch.long, device=device)
        self.step = torch.zeros((), dtype=torch.long, device=device)
        self.inv_temperature = torch.ones(rows, dtype=torch.float32, device=device)
        self.greedy = torch.ones(rows, dtype=torch.bool, device=device)
        self.columns = torch.arange(length, dtype=torch.long, device=device)
        self.out = torch.zeros(2, rows, dtype=torch.float64, device=device)
        self.graph = None
        self.capture_s: float | None = None
        # READBACK "pipelined": two pinned host buffers and their events, made on first use (run_pipelined)
        self._host_out: list[torch.Tensor] | None = None
        self._host_ready: list[Any] = []
        if use_graph:
            self._capture()

    def start(self, tokens: torch.Tensor, column: int, step: int) -> None:
        """Set the first decode step: its input tokens [B], the cache column it writes, its noise step."""
        self.tokens.copy_(tokens)
        self.write.fill_(column)
        if self.group > 1:
            self.prefix_end.fill_(column)
        self.step.fill_(step)

    def _step(self) -> None:
        tokens, logprobs = decode_step(self.engine, self.tokens, self.write, self.pad, self.seeds, self.step,
                                       self.inv_temperature, self.greedy, self.columns, self.cache.k, self.cache.v,
                                       self.group, self.prefix_end if self.group > 1 else None)
        self.engine.advance(tokens, logprobs, self.out, self.tokens, self.write, self.step)

    def _capture(self) -> None:
        import time

        import torch

        started = time.perf_counter()
        stream = torch.cuda.Stream(self.engine.device)
        stream.wait_stream(torch.cuda.current_stream(self.engine.device))
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):  # warm the kernels (cuBLAS workspaces, SDPA choice, inductor) outside the capture
                # any in-range column: the warm steps write garbage that the next prefill overwrites
                self.write.fill_(self.length - 1)
                self._step()
        torch.cuda.current_stream(self.engine.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph):
            self._step()
        torch.cuda.synchronize(self.engine.device)
        self.graph = graph
        self.capture_s = time.perf_counter() - started

    def _launch(self) -> None:
        """Enqueue one decode step: the graph's replay, or the step itself without a graph."""
        import torch

        if self.graph is not None:
            self.graph.replay()
        else:
            with torch.inference_mode():
                self._step()

    def run_step(self) -> tuple[list[int], list[float]]:
        """One decode step; the sampled tokens and their log-probabilities, on the host."""
        self._launch()
        tokens, logprobs = self.out.tolist()
        return [int(t) for t in tokens], logprobs

    def run_pipelined(self, tracker: Any, max_steps: int) -> int:
        """Decode steps into `tracker` (its `add` and `done`) until it is done, step t+1 enqueued before step t's
        tokens are read (READBACK "pipelined"); at most `max_steps` steps. Returns the steps run, the one
        discarded past an early stop included."""
        import torch

        if max_steps < 1:
            return 0
        on_cuda = self.engine.device.type == "cuda"
        if self._host_out is None:  # two buffers in turn: step t's is read while t+1's fills
            self._host_out = [torch.empty((2, self.rows), dtype=torch.float64, pin_memory=on_cuda) for _ in range(2)]
            self._host_ready = [torch.cuda.Event() if on_cuda else None for _ in range(2)]

        def launch(step: int) -> None:
            self._launch()
            # queued behind the step on its stream and ahead of the next replay, which overwrites `out`
            self._host_out[step % 2].copy_(self.out, non_blocking=on_cuda)
            if on_cuda:
                self._host_ready[step % 2].record()

        launch(0)
        launched, read = 1, 0
        while True:
            if launched < max_steps:
                launch(launched)
                launched += 1
            if on_cuda:
                self._host_ready[read % 2].synchronize()
            tokens, logprobs = self._host_out[read % 2].tolist()
            tracker.add([int(t) for t in tokens], logprobs)
            read += 1
            if tracker.done or read == launched:
                return launched


def prefill_logits(engine: CompactQwen3, ids: torch.Tensor, pad: torch.Tensor, columns: torch.Tensor,
                   key_columns: torch.Tensor, cache: StaticCache, compiled: bool) -> torch.Tensor:
    """The prompt's forward over left-padded `ids` [B, W] (the last position's logits [B, V]), writing its k/v
    into `cache`; positions and mask from the per-row padding `pad` [B]."""
    positions = (columns[None, :] - pad[:, None]).clamp(min=0)
    valid = ((key_columns[None, None, :] <= columns[None, :, None])
             & (key_columns[None, None, :] >= pad[:, None, None]))
    valid = valid | (key_columns[None, None, :] == columns[None, :, None])
    return engine.forward(ids, positions, cache, columns, valid[:, None], compiled=compiled)


def prefill_rows(engine: CompactQwen3, ids: torch.Tensor, pad: torch.Tensor, columns: torch.Tensor,
                 key_columns: torch.Tensor, cache: StaticCache, compiled: bool,
                 spread: torch.Tensor | None = None) -> torch.Tensor:
    """Every row's prefill logits [B, V]. With `spread` (PREFILL "shared_prompts"), `ids` [D, W] and `pad` [D]
    are the distinct prompts: each is prefilled once into the cache's first D rows (the same cache length,
    mask and padding as its rows would have had: only the batch is smaller), then its k/v columns are copied
    to every row of that prompt (`spread` [B]: row -> distinct prompt) and its logits gathered per row."""
    if spread is None:
        return prefill_logits(engine, ids, pad, columns, key_columns, cache, compiled)
    distinct = ids.shape[0]
    logits = prefill_logits(engine, ids, pad, columns, key_columns, cache.rows(distinct), compiled)
    cache.spread_rows(distinct, ids.shape[1], spread)
    return logits.index_select(0, spread)


class PrefillGraph:
    """PREFILL_STEP "compiled_graph": the prefill of one (rows, prompt width) into one decode bucket's cache,
    with the first token's sampling, as one captured CUDA graph (eager on a CPU: the same function).

    Reads the bucket's per-row buffers (`pad`, `seeds`, `inv_temperature`, `greedy`) and its own `ids`
    [B, W]; leaves the first tokens and their log-probabilities in `out` [2, B] (float64). With `distinct`
    (< rows; PREFILL "shared_prompts" too): `ids` and `pad` hold the distinct prompts [D, W], [D], prefilled
    into the cache's first D rows, and `spread` [B] says which one each row is: its k/v columns and logits
    are copied to the rows inside the graph."""

    def __init__(self, bucket: DecodeBucket, width: int, pool: Any, distinct: int | None = None):
        import torch

        self.bucket, self.width = bucket, width
        device = bucket.engine.device
        shared = distinct is not None and distinct < bucket.rows
        self.distinct = distinct if shared else None
        self.ids = torch.zeros(distinct if shared else bucket.rows, width, dtype=torch.long, device=device)
        self.pad = torch.zeros(distinct, dtype=torch.long, device=device) if shared else None
        self.spread = torch.zeros(bucket.rows, dtype=torch.long, device=device) if shared else None
        self.columns = torch.arange(width, dtype=torch.long, device=device)
        self.step = torch.zeros((), dtype=torch.long, device=device)  # the first token is noise step 0
        self.out = torch.zeros(2, bucket.rows, dtype=torch.float64, device=device)
        self.graph = None
        self.capture_s: float | None = None
        if bucket.graph is not None:
            self._capture(pool)

    def _step(self) -> None:
        import torch

        b = self.bucket
        logits = prefill_rows(b.engine, self.ids, b.pad if self.distinct is None else self.pad, self.columns,
                              b.columns, b.cache, b.engine.compiled, self.spread)
        tokens, logprobs = counter_noise.sample(logits, b.seeds, self.step, b.inv_temperature, b.greedy)
        self.out.copy_(torch.stack((tokens.to(torch.float64), logprobs.to(torch.float64))))

    def _capture(self, pool: Any) -> None:
        import time

        import torch

        started = time.perf_counter()
        device = self.bucket.engine.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):  # compile and warm outside the capture; the garbage it writes is prefilled over
                self._step()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
            self._step()
        torch.cuda.synchronize(device)
        self.graph = graph
        self.capture_s = time.perf_counter() - started

    def run(self, ids: torch.Tensor, pad: torch.Tensor | None = None,
            spread: torch.Tensor | None = None) -> torch.Tensor:
        """Prefill `ids` [B, W] (the bucket's per-row buffers already set), or with `distinct` the distinct
        prompts' `ids` [D, W], their `pad` [D] and each row's `spread` [B]; the first tokens and their
        log-probabilities [2, B] on the device."""
        import torch

        self.ids.copy_(ids)
        if self.distinct is not None:
            self.pad.copy_(pad)
            self.spread.copy_(spread)
        if self.graph is not None:
            self.graph.replay()
        else:
            with torch.inference_mode():
                self._step()
        return self.out


class BucketSet:
    """One static cache per row count (sized for the longest cell) and one bucket per (rows, length)."""

    def __init__(self, engine: CompactQwen3, max_length: int, use_graphs: bool):
        self.engine, self.max_length, self.use_graphs = engine, max_length, use_graphs
        self.prefills: dict[tuple, PrefillGraph] = {}  # PREFILL_STEP "compiled_graph": (rows, width, length, distinct)
        self._prefill_pool = None
        self.caches: dict[int, StaticCache] = {}
        self.buckets: dict[tuple[int, int], DecodeBucket] = {}
        self.shared_prefix_buckets: dict[tuple[int, int, int], DecodeBucket] = {}  # DECODE_PREFIX "shared"

    def get(self, rows: int, length: int, group: int = 1) -> DecodeBucket:
        """The bucket of (rows, length), or of (rows, length, group) for blocks of `group` rows sharing a prompt
        (its own graph, the same cache)."""
        key = (rows, length) if group == 1 else (rows, length, group)
        found = self.buckets if group == 1 else self.shared_prefix_buckets
        if key not in found:
            if length > self.max_length:
                raise ValueError(f"cache length {length} exceeds the allocated {self.max_length}")
            if rows not in self.caches:
                self.caches[rows] = StaticCache.allocate(self.engine, rows, self.max_length)
            found[key] = DecodeBucket(self.engine, self.caches[rows], length, self.use_graphs, group)
        return found[key]

    def prefill(self, bucket: DecodeBucket, width: int, distinct: int | None = None) -> PrefillGraph:
        """The prefill graph of `bucket` for prompts `width` wide (of `distinct` distinct prompts, if fewer than
        the rows), captured on first use (one memory pool for all of them: they replay one at a time on one
        stream, and each one's outputs stay allocated)."""
        distinct = distinct if distinct is not None and distinct < bucket.rows else None
        # a prefill graph reads its bucket's inputs: a shared-prefix bucket of the same rows has its own
        key = (bucket.rows, width, bucket.length, distinct) + ((bucket.group,) if bucket.group > 1 else ())
        if key not in self.prefills:
            if bucket.graph is not None and self._prefill_pool is None:
                import torch

                self._prefill_pool = torch.cuda.graph_pool_handle()
            self.prefills[key] = PrefillGraph(bucket, width, self._prefill_pool, distinct)
        return self.prefills[key]

    @property
    def cache_bytes(self) -> int:
        return sum(c.nbytes for c in self.caches.values())

    @property
    def capture_s(self) -> float:
        return (sum(b.capture_s or 0.0 for b in (*self.buckets.values(), *self.shared_prefix_buckets.values()))
                + sum(p.capture_s or 0.0 for p in self.prefills.values()))


def bucket_length(prompt_tokens: int, max_new_tokens: int, multiple: int = 64) -> int:
    """Cache columns for a batch: its padded prompt width plus its longest response, rounded up so
    a cell's requests always land in the same bucket (no capture inside a measured repetition)."""
    return int(math.ceil((prompt_tokens + max_new_tokens) / multiple) * multiple)


def distinct_prompts(prompts: list) -> tuple[list[int], list[int]]:
    """PREFILL "shared_prompts": the first row of each distinct prompt (in order of first appearance) and, per
    row, the index of its distinct prompt."""
    first: dict[tuple, int] = {}
    spread = [first.setdefault(tuple(p), len(first)) for p in prompts]
    return [spread.index(u) for u in range(len(first))], spread


def prompt_blocks(prompts: list) -> int:
    """DECODE_PREFIX "shared": n when the rows are blocks of n > 1 consecutive rows, each block one prompt (rows
    g*n .. g*n + n - 1, the workload's prompt-major order); else 1 (decode per row)."""
    rows = len(prompts)
    n = 1
    while n < rows and tuple(prompts[n]) == tuple(prompts[0]):
        n += 1
    if n == 1 or rows % n:
        return 1
    for start in range(0, rows, n):
        if any(tuple(prompts[row]) != tuple(prompts[start]) for row in range(start, start + n)):
            return 1
    return n


def shared_prompt_group(decode_prefix: str, attention_backend: str, prompts: list, width: int) -> int:
    """The rows of a block that read one prompt's k/v once in each decode step (1: each row its own), for a batch
    of `prompts` padded to `width` columns: `prompt_blocks` under DECODE_PREFIX "shared", and under "shared_long"
    when `width` is SHARED_PROMPT_MIN_COLUMNS or more; 1 with an attention backend that cannot read them once."""
    if attention_backend not in ("fa3", "triton"):
        return 1
    if decode_prefix == "shared" or (decode_prefix == "shared_long" and width >= SHARED_PROMPT_MIN_COLUMNS):
        return prompt_blocks(prompts)
    return 1


def _prefill_eager(engine: CompactQwen3, bucket: DecodeBucket, ids: torch.Tensor,
                   pick: torch.Tensor | None, spread: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt's forward op by op (PREFILL_STEP "eager"), of the distinct prompts' rows `pick` only when
    they are shared (`prefill_rows`), and the first token's sampling."""
    import torch

    device = ids.device
    columns = torch.arange(ids.shape[1], device=device)
    key_columns = torch.arange(bucket.length, device=device)
    pad = bucket.pad
    if pick is not None:
        ids, pad = ids.index_select(0, pick), pad.index_select(0, pick)
    logits = prefill_rows(engine, ids, pad, columns, key_columns, bucket.cache, False, spread)
    bucket.step.fill_(0)
    return counter_noise.sample(logits, bucket.seeds, bucket.step, bucket.inv_temperature, bucket.greedy)


def generate_static(engine: CompactQwen3, buckets: BucketSet, requests: list, pad_id: int):
    """Batched decoding on the static cache: a prefill (eager, or one graph replay with PREFILL_STEP
    "compiled_graph"), then one graph replay per token."""
    import time

    import torch

    from rollout_lib.backends.decode import DecodeOutput, _StopTracker, synchronize

    for request in requests:
        if not request.greedy and (request.top_k is not None or request.top_p < 1.0):
            raise ValueError(f"{request.request_id}: decode 'graphs' samples from the full distribution "
                             f"(top_p 1.0, top_k null); got top_p {request.top_p}, top_k {request.top_k}: "
                             "use decode 'eager'")
    rows = len(requests)
    width = max(len(r.prompt_token_ids) for r in requests)
    longest = max(r.max_new_tokens for r in requests)
    group = shared_prompt_group(engine.decode_prefix, engine.attention_backend,
                                [r.prompt_token_ids for r in requests], width)
    bucket = buckets.get(rows, bucket_length(width, longest), group)
    # PREFILL "shared_prompts": each distinct prompt's first row and each row's distinct prompt (None: per row)
    pick, spread = (distinct_prompts([r.prompt_token_ids for r in requests]) if engine.prefill == "shared_prompts"
                    else (None, None))
    if pick is not None and len(pick) == rows:
        pick, spread = None, None  # every prompt distinct: nothing to share
    prefill_graph = (buckets.prefill(bucket, width, len(pick) if pick is not None else None)
                     if engine.prefill_step == "compiled_graph" else None)
    device = engine.device
    ids = torch.full((rows, width), pad_id, dtype=torch.long)
    pad = torch.empty(rows, dtype=torch.long)
    for row, request in enumerate(requests):
        ids[row, width - len(request.prompt_token_ids):] = torch.tensor(request.prompt_token_ids)
        pad[row] = width - len(request.prompt_token_ids)
    bucket.pad.copy_(pad)
    bucket.seeds.copy_(torch.tensor([0 if r.seed is None else r.seed for r in requests]))
    bucket.greedy.copy_(torch.tensor([r.greedy for r in requests]))
    bucket.inv_temperature.copy_(torch.tensor([1.0 if r.greedy else 1.0 / r.temperature for r in requests]))
    tracker = _StopTracker(requests)
    steps = 0
    with torch.inference_mode():
        synchronize(device)
        start = time.perf_counter()
        ids = ids.to(device)
        if pick is not None:
            pick, spread = torch.tensor(pick, device=device), torch.tensor(spread, device=device)
        if prefill_graph is None:
            tokens, logprobs = _prefill_eager(engine, bucket, ids, pick, spread)
        else:
            if pick is None:
                out = prefill_graph.run(ids)
            else:
                out = prefill_graph.run(ids.index_select(0, pick), bucket.pad.index_select(0, pick), spread)
            tokens, logprobs = out[0].long(), out[1]
        tracker.add(tokens.tolist(), logprobs.tolist())
        prefill_end = time.perf_counter()
        bucket.start(tokens, column=width, step=1)
        if engine.readback == "pipelined":
            # the prefill gave each row its first token: at most `longest - 1` steps, each with a cache column
            steps = 0 if tracker.done else bucket.run_pipelined(tracker, longest - 1)
        else:
            while not tracker.done:
                tracker.add(*bucket.run_step())
                steps += 1
        synchronize(device)
        end = time.perf_counter()
    return DecodeOutput(tracker.tokens, tracker.logprobs, list(tracker.reasons), prefill_end - start,
                        end - prefill_end, steps)
