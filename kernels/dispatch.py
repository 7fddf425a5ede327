"""GPU hybrid tree attention: flash-attn over the committed prefix (with its log-sum-exp), the Triton
``fused_mask_attn`` kernel over the few tree tokens, and the exact LSE merge.

Why split: every tree token sees the whole committed prefix, so the long part needs no mask and can use
flash-attn's kvcache kernel unchanged; only the tree part (tens to a few hundred keys) needs the tree mask,
which is what ``fused_mask_attn`` does.  ``out = out_p * exp(lse_p - lse) + out_t * exp(lse_t - lse)`` with
``lse = logaddexp(lse_p, lse_t)`` is exact (``kernels.reference.merge_attention``).

Imports are lazy: flash-attn (optional GPU extra) and triton are only imported when a call needs them, so
this module imports anywhere.  Without flash-attn the prefix part runs ATen's fused kernels that return the LSE
(``kernels.aten_prefix.prefix_kernel``: torch's FlashAttention-2 op for fp16/bf16, its memory-efficient op for fp32
on CUDA; ATen's flash attention for CPU under ``TRITON_INTERPRET=1``), GQA folded into the row axis; several
sequences of one length in consecutive cache rows take one launch, others one launch each.

Prefix part on GPU: ``flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=...,
cache_batch_idx=..., causal=False, return_softmax_lse=True)`` (flash-attn >= 2.4; fp16/bf16 only, so fp32
inputs take ATen's memory-efficient kernel).  The kvcache entry point reads the cache in place (``[B, S, Hkv, D]``
with a contiguous last dim: our ``[Hkv, S, D]`` slots are passed as transposed views, no copy), takes per-sequence
lengths (``cache_seqlens``: several sequences with different committed lengths in one launch), handles GQA by
head mapping, and splits the key axis across thread blocks (``num_splits`` heuristic) when there are few
queries and a long cache, which is exactly the verify shape.  flash-attn reports an empty row's LSE as +inf;
rows of sequences with no committed prefix are therefore overwritten with out 0 / lse -inf before merging.

Tree part on GPU, block sizes and warps (``kernels.tree_attention.select_config``; not timed here: no GPU):

* The tree part is latency-bound: M, N <= a few hundred and B*H a few dozen programs, a fraction of one
  wave, so small tiles (more programs in flight, less padding) beat large ones.  The wrapper also shrinks
  tiles to the next power of two of M/N (>= 16), so a short chain does not compute a 64-row tile.
* Ampere sm80/sm87 (A100, Orin): BLOCK_M 32, BLOCK_N 64, 4 warps, 3 stages; ~163 KB shared memory per
  block fits three K/V stages even at D=128.
* sm86/sm89 (RTX 30/40, A10, L4): ~99 KB, so 2 stages and BLOCK_N 32 at D=128 to keep two programs per SM.
* Hopper sm90 (H100): BLOCK_M 64 because wgmma works on 64-row tiles per 4-warp warpgroup; 4 warps = one
  warpgroup; 3 stages (227 KB).
* With BLOCK_M <= 64 there is no work for 8 warps.  fp32 inputs can exceed the shared-memory estimate;
  ``select_config`` then drops stages, then halves BLOCK_N.  Pre-Ampere GPUs report the kernel unavailable
  and "auto" uses the torch path.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch

from kernels.aten_prefix import choose_prefix_kernel, fused_attention_with_lse, prefix_kernel
from kernels.aten_prefix import prefix_attention as aten_prefix_attention
from kernels.reference import merge_attention

__all__ = [
    "flash_attn_available",
    "gpu_tree_attention",
    "gpu_tree_attention_batched",
    "kernel_plan",
    "prefix_attention",
    "served_kernels",
    "triton_available",
]

_FLASH_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def _flash_attn_with_kvcache() -> Callable | None:
    """flash-attn's kvcache entry point, or None when flash-attn is not installed (CPU machines)."""
    try:
        from flash_attn import flash_attn_with_kvcache
    except Exception:  # noqa: BLE001 - ImportError, or a broken CUDA build raising at import
        return None
    return flash_attn_with_kvcache


def flash_attn_available() -> bool:
    return _flash_attn_with_kvcache() is not None


@functools.cache
def triton_available() -> bool:
    """Whether ``fused_mask_attn`` can run: CUDA (Ampere+) or the Triton interpreter."""
    try:
        from kernels import tree_attention
    except Exception:  # noqa: BLE001 - triton missing or failing to initialise
        return False
    return tree_attention.is_available()


def _use_flash(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in _FLASH_DTYPES and flash_attn_available()


def prefix_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefix part for one sequence: q `[H, n, D]`, K/V `[Hkv, S, D]` -> (out `[H, n, D]`, lse fp32 `[H, n]`).

    flash-attn's kvcache kernel where installed, else ATen's fused kernels (`kernels.aten_prefix.prefix_attention`,
    GQA folded into the rows); S = 0 gives out 0 and lse -inf."""
    s = k.shape[1]
    if s == 0 or not _use_flash(q):
        h, n, d = q.shape
        out, lse = aten_prefix_attention(q.reshape(k.shape[0], (h // k.shape[0]) * n, d), k, v, scale)
        return out.reshape(h, n, d), lse.reshape(h, n)
    out, lse = _flash_attn_with_kvcache()(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        cache_seqlens=s,
        softmax_scale=scale,
        causal=False,
        return_softmax_lse=True,
    )
    return out.squeeze(0).transpose(0, 1), lse.squeeze(0).float()


def _aten_prefix_batched(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lens: list[int], rows: list[int], scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batched prefix part without flash-attn: q `[B, H, M, D]` over cache rows `rows` up to `lens` -> (out
    `[B, H, M, D]`, lse fp32 `[B, H, M]`). Sequences of one length in consecutive cache rows (a batch admitted
    together, as in the verify-cost measurements) are one fused launch over views of the cache; otherwise one
    launch per sequence (a cache row gathered into a batch would be a copy of its whole prefix)."""
    b, h, m, d = q.shape
    hkv = k_cache.shape[1]
    qf = q.reshape(b, hkv, (h // hkv) * m, d)
    s, r0 = lens[0], rows[0]
    if s > 0 and lens == [s] * b and rows == list(range(r0, r0 + b)):
        kernel = prefix_kernel(qf, k_cache, v_cache)
        if kernel != "matmul":
            ks, vs = k_cache[r0 : r0 + b, :, :s], v_cache[r0 : r0 + b, :, :s]
            out, lse = fused_attention_with_lse(qf, ks, vs, scale, kernel)
            return out.reshape(b, h, m, d), lse.reshape(b, h, m)
    parts = [aten_prefix_attention(qf[i], k_cache[rows[i], :, : lens[i]], v_cache[rows[i], :, : lens[i]], scale)
             for i in range(b)]  # fmt: skip
    out = torch.stack([p[0].float() for p in parts]).reshape(b, h, m, d)
    return out, torch.stack([p[1] for p in parts]).reshape(b, h, m)


def _fused_mask_attn(q, k, v, mask, scale) -> tuple[torch.Tensor, torch.Tensor]:
    from kernels.tree_attention import fused_mask_attn

    return fused_mask_attn(q, k, v, mask, scale)


def gpu_tree_attention(
    q: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    k_tree: torch.Tensor,
    v_tree: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """One sequence: q `[H, n, D]`, prefix K/V `[Hkv, S, D]`, tree K/V `[Hkv, n, D]`, mask `[n, n]` bool.

    Returns `[H, n, D]` in q's dtype.
    """
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out_t, lse_t = _fused_mask_attn(q.unsqueeze(0), k_tree.unsqueeze(0), v_tree.unsqueeze(0), mask.unsqueeze(0), scale)
    if k_prefix.shape[1] == 0:
        return out_t.squeeze(0)
    out_p, lse_p = prefix_attention(q, k_prefix, v_prefix, scale)
    out, _ = merge_attention(out_p.float(), lse_p, out_t.squeeze(0).float(), lse_t.squeeze(0))
    return out.to(q.dtype)


def _as_index(x: torch.Tensor | Sequence[int] | None, device: torch.device) -> torch.Tensor | None:
    if x is None:
        return None
    return torch.as_tensor(x, dtype=torch.int32, device=device)


def gpu_tree_attention_batched(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | Sequence[int],
    k_tree: torch.Tensor,
    v_tree: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None = None,
    cache_batch_idx: torch.Tensor | Sequence[int] | None = None,
) -> torch.Tensor:
    """Several sequences with different committed lengths: q `[B, H, M, D]`, caches `[Bc, Hkv, C, D]` read up
    to `cache_seqlens[b]` in row `cache_batch_idx[b]` (default b), tree K/V `[B, Hkv, M, D]`, mask `[B, M, M]`.

    With flash-attn: one kvcache launch for all prefixes; without it ATen's fused kernels (`_aten_prefix_batched`).
    The tree part is one Triton launch over the batch either way. Returns `[B, H, M, D]`.
    """
    b, h, m, d = q.shape
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    out_t, lse_t = _fused_mask_attn(q, k_tree, v_tree, mask, scale)
    if _use_flash(q):
        seqlens = _as_index(cache_seqlens, q.device)
        batch_idx = _as_index(cache_batch_idx, q.device)
        out_p, lse_p = _flash_attn_with_kvcache()(
            q.transpose(1, 2),
            k_cache.transpose(1, 2),
            v_cache.transpose(1, 2),
            cache_seqlens=seqlens,
            cache_batch_idx=batch_idx,
            softmax_scale=scale,
            causal=False,
            return_softmax_lse=True,
        )
        out_p, lse_p = out_p.transpose(1, 2).float(), lse_p.float()
        empty = (seqlens == 0).view(b, 1, 1)  # flash-attn gives +inf LSE for rows without keys
        lse_p = torch.where(empty, torch.full_like(lse_p, float("-inf")), lse_p)
        out_p = torch.where(empty.unsqueeze(-1), torch.zeros_like(out_p), out_p)
    else:
        lens = [int(x) for x in cache_seqlens]
        rows = list(range(b)) if cache_batch_idx is None else [int(x) for x in cache_batch_idx]
        out_p, lse_p = _aten_prefix_batched(q, k_cache, v_cache, lens, rows, scale)
    out, _ = merge_attention(out_p, lse_p, out_t.float(), lse_t)
    return out.to(q.dtype)


BACKENDS = ("auto", "cpu", "triton", "reference", "eager", "sdpa_masked", "sdpa_hf")


def resolve_backend(backend: str, device: torch.device) -> str:
    """Map "auto" to a concrete backend for tensors on `device`; reject unknown names early."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
    if backend != "auto":
        return backend
    if device.type == "cuda":
        return "triton" if triton_available() else "cpu"
    return "cpu"


def served_kernels(device: torch.device, dtype: torch.dtype, head_dim: int, backend: str = "auto") -> dict[str, str]:
    """The attention kernels a model on `device` in `dtype` runs its verify passes with (a replica's `info()`):
    `backend` ("auto": the model's `attention_backend`) resolved, the tree part and the prefix part with its LSE."""
    from kernels import cpu as cpu_kernels

    resolved = resolve_backend(backend, device)
    capability = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        capability = (props.major, props.minor)
    native = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and cpu_kernels.native() is not None
    return kernel_plan(device.type, dtype, head_dim, resolved, capability, flash_attn_available(), native)


def kernel_plan(
    device_type: str,
    dtype: torch.dtype,
    head_dim: int,
    backend: str,
    capability: tuple[int, int] | None,
    flash_attn: bool,
    cpu_ops: bool,
) -> dict[str, str]:
    """`served_kernels` given the facts: a GPU runs the Triton tree kernel (`backend` "triton") with flash-attn's
    kvcache kernel for the prefix where flash-attn is installed (fp16/bf16), else ATen's fused kernel
    (`choose_prefix_kernel`); without Triton the torch hybrid. The CPU runs the kernels of kernels/cpu_ops.cpp (fp32,
    bf16) where they are built (`cpu_ops`), else the torch hybrid on ATen's flash attention."""
    out = {"attention_backend": backend}
    tree = "triton fused_mask_attn" if backend == "triton" else "torch masked attention"
    if device_type == "cuda":
        flash = backend == "triton" and flash_attn and dtype in _FLASH_DTYPES
        aten = _named(choose_prefix_kernel("cuda", dtype, head_dim, 1, capability))
        out.update(prefix="flash_attn kvcache" if flash else aten, tree=tree)
    elif device_type == "cpu" and backend == "cpu" and cpu_ops:
        out.update(prefix="cpu_ops (kernels/cpu_ops.cpp)", tree="cpu_ops (kernels/cpu_ops.cpp)")
    else:
        out.update(prefix=_named(choose_prefix_kernel(device_type, dtype, head_dim, 1 << 20)), tree=tree)
    return out


def _named(prefix_kernel: str) -> str:
    return "torch matmuls" if prefix_kernel == "matmul" else f"aten {prefix_kernel}"
