"""Plain-torch reference implementations of masked (tree) attention and the exact LSE merge.

These are the ground truth for the Triton kernel in ``kernels/tree_attention.py`` and the CPU fallback of the
hybrid tree attention: they favour obvious correctness over speed (fp32 math, K/V heads expanded explicitly).

Conventions shared with the kernel:

* ``q`` is ``[B, H, M, D]``, ``k``/``v`` are ``[B, Hkv, N, D]`` with ``H % Hkv == 0``; query head ``h`` reads
  KV head ``h // (H // Hkv)`` (GQA).
* ``mask`` is ``[B, M, N]``, nonzero / True = the key is visible to the query; it is shared by all heads.
* ``lse`` is the natural log of the sum over visible keys of ``exp(scale * q.k)``, fp32, ``[B, H, M]``.
* A query row that sees no key returns ``out = 0`` and ``lse = -inf`` (never NaN), so that merging it with
  attention over another key set gives exactly the other side.
"""

from __future__ import annotations

import math

import torch

__all__ = ["masked_attention_reference", "merge_attention"]


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> None:
    """Fail loudly on shape mismatches instead of letting broadcasting hide them."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, h, m, d = q.shape
    bk, hkv, n, dk = k.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if bk != b or dk != d:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head_dim")
    if hkv == 0 or h % hkv != 0:
        raise ValueError(f"num query heads {h} must be a multiple of num kv heads {hkv}")
    if tuple(mask.shape) != (b, m, n):
        raise ValueError(f"mask must be [B, M, N] = {(b, m, n)}, got {tuple(mask.shape)}")


def masked_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention restricted to ``mask``; returns ``(out [B,H,M,D] in q.dtype, lse [B,H,M] fp32)``.

    Computed in fp32 so it can serve as the reference for fp16/bf16 kernels.
    """
    _check_shapes(q, k, v, mask)
    b, h, m, d = q.shape
    group = h // k.shape[1]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    qf = q.float()
    kf = k.float().repeat_interleave(group, dim=1)  # [B, H, N, D]
    vf = v.float().repeat_interleave(group, dim=1)
    visible = (mask != 0)[:, None, :, :]  # [B, 1, M, N], broadcast over heads
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf for rows without a visible key
    # Subtracting a finite stand-in for empty rows keeps exp(-inf - (-inf)) = NaN out of the picture.
    shift = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(scores - shift[..., None])  # exactly 0 at masked keys
    out = torch.matmul(probs, vf)
    return out.to(q.dtype), lse


def merge_attention(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exactly combine attention over two disjoint key sets from their outputs and log-sum-exps.

    ``out_*`` are ``[..., D]`` and ``lse_*`` are ``[...]``.  A side with ``lse = -inf`` (no visible key)
    contributes weight 0; if both sides are empty the result is ``out = 0``, ``lse = -inf``.
    The math is fp32; ``out`` is returned in ``out_a.dtype``.
    """
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or out_a.shape[:-1] != lse_a.shape:
        raise ValueError(
            f"shape mismatch: out_a {tuple(out_a.shape)}, out_b {tuple(out_b.shape)}, "
            f"lse_a {tuple(lse_a.shape)}, lse_b {tuple(lse_b.shape)}"
        )
    la = lse_a.float()
    lb = lse_b.float()
    lse = torch.logaddexp(la, lb)
    empty = torch.isneginf(lse)
    safe = torch.where(empty, torch.zeros_like(lse), lse)
    # A side at -inf gets exp(-inf - finite) = 0; when both are -inf `safe` is 0 so both weights are 0.
    w_a = torch.exp(la - safe)
    w_b = torch.exp(lb - safe)
    out = out_a.float() * w_a[..., None] + out_b.float() * w_b[..., None]
    lse = torch.where(empty, torch.full_like(lse, float("-inf")), lse)
    return out.to(out_a.dtype), lse
