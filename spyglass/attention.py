"""Hybrid tree attention: prefix attention (no mask, with log-sum-exp) + masked attention over the
few tree tokens, merged exactly by their log-sum-exp.

Every tree token sees the whole committed prefix, so the prefix part needs no mask and can use the
fastest dense kernel; only the small tree part carries a mask. Grouped-query attention never repeats
K/V: the query heads of a group are folded into the query-length axis, which is exact because the
prefix part has no mask and the tree mask is shared by all heads.

Shapes (one sequence): q `[H, n, D]`, prefix K/V `[Hkv, S, D]` (S may be 0), tree K/V `[Hkv, n, D]`,
tree_mask `[n, n]` bool (True = visible) or None for causal. Backends: "cpu" (ATen's flash attention
for CPU for the prefix, torch for the tree part), "triton" (CUDA: flash-attn prefix + Triton
`fused_mask_attn`), "reference" (naive softmax over the concatenation).
"""

from __future__ import annotations

import math

import torch

_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

# Below this many query rows per KV head, two matmuls beat the flash kernel on CPU (measured in
# bench/attention.py): the kernel's blocking only pays off when there are many query rows.
MATMUL_PREFIX_MAX_ROWS = 64


def _fold_groups(q: torch.Tensor, n_kv: int) -> torch.Tensor:
    """[H, n, D] -> [Hkv, g*n, D]: heads h = kv*g + j share K/V head kv."""
    h, n, d = q.shape
    return q.reshape(n_kv, (h // n_kv) * n, d)


def _unfold_groups(x: torch.Tensor, h: int, n: int) -> torch.Tensor:
    return x.reshape(h, n, x.shape[-1])


def prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Unmasked attention of folded queries `[Hkv, R, D]` over `[Hkv, S, D]` -> (out, lse fp32 [Hkv, R])."""
    rows = q.shape[1]
    if rows <= MATMUL_PREFIX_MAX_ROWS or q.dtype != k.dtype:
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse.unsqueeze(-1)).to(v.dtype)
        return torch.matmul(probs, v), lse
    out, lse = _flash_cpu(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), scale=scale)[:2]
    return out.squeeze(0), lse.squeeze(0).float()


def masked_tree_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Folded queries `[Hkv, g*n, D]` over tree keys `[Hkv, n, D]` with a `[n, n]` mask."""
    groups = q.shape[1] // mask.shape[0]
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    full_mask = mask.repeat(groups, 1)
    scores = scores.masked_fill(~full_mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num_(0.0).to(v.dtype)
    return torch.matmul(probs, v), lse


def merge_attention(out_a, lse_a, out_b, lse_b):
    """Exact merge of two attentions over disjoint key sets by their log-sum-exp."""
    lse = torch.logaddexp(lse_a, lse_b)
    wa = torch.exp(lse_a - lse).nan_to_num_(0.0).unsqueeze(-1)
    wb = torch.exp(lse_b - lse).nan_to_num_(0.0).unsqueeze(-1)
    out = out_a.float() * wa + out_b.float() * wb
    return out.to(out_a.dtype), lse


def causal_mask(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril_()


def tree_attention(
    q: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    k_tree: torch.Tensor,
    v_tree: torch.Tensor,
    tree_mask: torch.Tensor | None,
    scale: float | None = None,
    backend: str = "cpu",
) -> torch.Tensor:
    """Attention of the n tree queries over prefix + tree; returns `[H, n, D]` in q's dtype."""
    h, n, d = q.shape
    n_kv = k_tree.shape[0]
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    mask = tree_mask if tree_mask is not None else causal_mask(n, q.device)
    if backend == "reference":
        return reference_attention(q, k_prefix, v_prefix, k_tree, v_tree, mask, scale)
    if backend == "triton":
        from kernels.dispatch import gpu_tree_attention

        return gpu_tree_attention(q, k_prefix, v_prefix, k_tree, v_tree, mask, scale)
    qf = _fold_groups(q, n_kv)
    out_t, lse_t = masked_tree_attention(qf, k_tree, v_tree, mask, scale)
    if k_prefix.shape[1] == 0:
        return _unfold_groups(out_t, h, n)
    out_p, lse_p = prefix_attention(qf, k_prefix, v_prefix, scale)
    out, _ = merge_attention(out_p, lse_p, out_t, lse_t)
    return _unfold_groups(out, h, n)


def reference_attention(q, k_prefix, v_prefix, k_tree, v_tree, mask, scale):
    """Naive softmax over the concatenated keys with the full mask, in fp32: the test oracle."""
    h, n, d = q.shape
    n_kv = k_tree.shape[0]
    k = torch.cat([k_prefix, k_tree], dim=1).float().repeat_interleave(h // n_kv, dim=0)
    v = torch.cat([v_prefix, v_tree], dim=1).float().repeat_interleave(h // n_kv, dim=0)
    s = k_prefix.shape[1]
    full = torch.cat([torch.ones(n, s, dtype=torch.bool, device=q.device), mask], dim=1)
    scores = torch.matmul(q.float(), k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~full, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v).to(q.dtype)
