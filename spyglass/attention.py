"""Hybrid tree attention: prefix attention (no mask, with log-sum-exp) + masked attention over the
few tree tokens, merged exactly by their log-sum-exp.

Every tree token sees the whole committed prefix, so the prefix part needs no mask and can use the
fastest dense kernel; only the small tree part carries a mask. Grouped-query attention never repeats
K/V: the query heads of a group are folded into the query-length axis, which is exact because the
prefix part has no mask and the tree mask is shared by all heads.

Shapes (one sequence): q `[H, n, D]`, prefix K/V `[Hkv, S, D]` (S may be 0), tree K/V `[Hkv, n, D]`,
tree_mask `[n, n]` bool (True = visible) or None for causal. Backends:

* "cpu": ATen's flash attention for CPU for the prefix (on folded GQA rows; two matmuls below
  `MATMUL_PREFIX_MAX_ROWS`) and for the tree part (float tree mask, or its causal mode for a chain),
  then the exact merge. Measured against the alternatives in bench/attention.py.
* "triton": CUDA (or the Triton interpreter): flash-attn prefix (without flash-attn: ATen's fused
  kernels below, which return the LSE too) + Triton `fused_mask_attn` tree part, in `kernels/dispatch.py`.

The prefix part's kernel (`prefix_kernel`, ATen's fused kernels that return the log-sum-exp, or two matmuls)
lives in `kernels/aten_prefix.py`.
* "auto": "triton" for CUDA tensors when the Triton kernel can run there, else "cpu".
* "reference": naive fp32 softmax over the concatenation (the oracle).
* "eager", "sdpa_masked", "sdpa_hf": the usual tree-attention baselines (materialised scores over
  prefix+tree with an additive float mask as HF eager does; torch SDPA over prefix+tree with a full
  float mask, GQA inside the kernel; the same SDPA call as transformers makes it on CPU, with K/V
  concatenated and repeated per query head). Only benchmarks and tests use them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kernels.aten_prefix import (
    _flash_cpu,
    _softmax_with_lse,
    prefix_attention,
)
from kernels.dispatch import gpu_tree_attention, gpu_tree_attention_batched, resolve_backend
from kernels.dispatch import prefix_attention as gpu_prefix_attention


def _fold_groups(q: torch.Tensor, n_kv: int) -> torch.Tensor:
    """[H, n, D] -> [Hkv, g*n, D]: heads h = kv*g + j share K/V head kv."""
    h, n, d = q.shape
    return q.reshape(n_kv, (h // n_kv) * n, d)


def _unfold_groups(x: torch.Tensor, h: int, n: int) -> torch.Tensor:
    return x.reshape(h, n, x.shape[-1])


def masked_tree_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch tree part: folded queries `[Hkv, g*n, D]` over tree keys `[Hkv, n, D]` with a `[n, n]` mask ->
    (out fp32, lse fp32). Runs in fp32 whatever the model dtype (n is small) and gives out 0 / lse -inf
    for a row with no visible key (padded rows of a batch) instead of NaN."""
    hkv, rows, d = q.shape
    n = mask.shape[0]
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale)
    scores.view(hkv, rows // n, n, k.shape[1]).masked_fill_(~mask, float("-inf"))
    probs, denom, lse = _softmax_with_lse(scores)
    return torch.matmul(probs, v.float()).div_(denom), lse


def tree_part(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q `[H, n, D]` over the tree's own keys `[Hkv, n, D]` -> (out `[H, n, D]`, lse fp32 `[H, n]`).

    On CPU this is one call of ATen's flash kernel (GQA by head mapping, a float mask or, for a chain,
    its causal mode, which is exact here because queries and keys are the same n tokens): on a shared
    2-core machine every extra small op is another chance to lose a time slice. Rows that see no key
    (only padded rows of a batch) take the torch path, whose -inf LSE the merge then ignores.
    """
    h, n, d = q.shape
    hkv = k.shape[0]
    if q.device.type == "cpu" and q.dtype == k.dtype == v.dtype:
        if mask is None and k.shape[1] == n:
            out, lse = _flash_cpu(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), is_causal=True, scale=scale)[:2]
            return out.squeeze(0), lse.squeeze(0)
        if mask is not None and bool(mask.any(dim=-1).all()):
            am = torch.full(mask.shape, torch.finfo(q.dtype).min, dtype=q.dtype).masked_fill_(mask, 0.0)
            out, lse = _flash_cpu(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=am, scale=scale)[:2]
            return out.squeeze(0), lse.squeeze(0)
    mask = mask if mask is not None else causal_mask(n, q.device)
    out, lse = masked_tree_attention(_fold_groups(q, hkv), k, v, mask, scale)
    return _unfold_groups(out, h, n), lse.reshape(h, n)


def merge_partial(
    out_p: torch.Tensor, lse_p: torch.Tensor, out_t: torch.Tensor, lse_t: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Exact merge of prefix and tree attention, in three fp32 ops: the prefix's share of the total softmax
    mass is sigmoid(lse_p - lse_t), so out = lerp(out_t, out_p, that share). A side with lse -inf gets
    weight 0 (at least one side must see a key, which holds: every tree row sees itself or the prefix)."""
    w = torch.sigmoid(lse_p - lse_t).unsqueeze(-1)
    return torch.lerp(out_t.float(), out_p.float(), w).to(dtype)


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
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    backend = resolve_backend(backend, q.device)
    if tree_mask is not None and tree_mask.device != q.device:  # (a draft tree's mask is built on the CPU)
        tree_mask = tree_mask.to(q.device)
    if backend == "cpu":
        return hybrid_attention(q, k_prefix, v_prefix, k_tree, v_tree, tree_mask, scale)
    mask = tree_mask if tree_mask is not None else causal_mask(n, q.device)
    if backend == "triton":
        return gpu_tree_attention(q, k_prefix, v_prefix, k_tree, v_tree, mask, scale)
    if backend == "reference":
        return reference_attention(q, k_prefix, v_prefix, k_tree, v_tree, mask, scale)
    if backend == "eager":
        return eager_masked_attention(q, k_prefix, v_prefix, k_tree, v_tree, mask, scale)
    if backend == "sdpa_hf":
        return sdpa_hf_attention(q, k_prefix, v_prefix, k_tree, v_tree, mask, scale)
    return sdpa_masked_attention(q, k_prefix, v_prefix, k_tree, v_tree, mask, scale)


def hybrid_attention(q, k_prefix, v_prefix, k_tree, v_tree, mask, scale) -> torch.Tensor:
    """The "cpu" backend: unmasked prefix part on folded GQA rows + masked tree part, merged exactly."""
    h, n, _ = q.shape
    out_t, lse_t = tree_part(q, k_tree, v_tree, mask, scale)
    if k_prefix.shape[1] == 0:
        return out_t.to(q.dtype)
    out_p, lse_p = prefix_attention(_fold_groups(q, k_tree.shape[0]), k_prefix, v_prefix, scale)
    return merge_partial(_unfold_groups(out_p, h, n), lse_p.reshape(h, n), out_t, lse_t, q.dtype)


def single_token_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None):
    """One new token `[H, 1, D]` over keys `[Hkv, S, D]` that end with its own: it sees every key, so on CPU one
    unmasked call replaces the hybrid's two and their merge (a decode step's attention). Returns `[H, 1, D]`."""
    h, n, d = q.shape
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    out, _ = prefix_attention(_fold_groups(q, k.shape[0]), k, v, scale)
    return _unfold_groups(out, h, n).to(q.dtype)


def cross_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, backend: str = "auto"
) -> torch.Tensor:
    """Draft queries `[H, n, D]` over a context every one of them sees in full, `[Hkv, S, D]` (LongSpec's and
    GLIDE's cross-attention into the target's KV cache at inference): the hybrid's prefix part on its own,
    GQA folded, no mask. Returns `[H, n, D]` in q's dtype (zeros when S = 0). With no mask the tree-attention
    baselines have nothing to differ in: "eager" and "sdpa_*" run the "cpu" path, "reference" the naive one."""
    h, n, d = q.shape
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    backend = resolve_backend(backend, q.device)
    if backend == "triton":
        return gpu_prefix_attention(q, k, v, scale)[0].to(q.dtype)
    if backend == "reference":
        if k.shape[1] == 0:
            return torch.zeros_like(q)
        g = h // k.shape[0]
        scores = torch.matmul(q.float(), k.float().repeat_interleave(g, dim=0).transpose(-1, -2)) * scale
        return torch.matmul(torch.softmax(scores, dim=-1), v.float().repeat_interleave(g, dim=0)).to(q.dtype)
    out, _ = prefix_attention(_fold_groups(q, k.shape[0]), k, v, scale)
    return _unfold_groups(out, h, n).to(q.dtype)


def batched_tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | Sequence[int],
    k_tree: torch.Tensor,
    v_tree: torch.Tensor,
    tree_mask: torch.Tensor | None,
    scale: float | None = None,
    backend: str = "cpu",
    cache_batch_idx: torch.Tensor | Sequence[int] | None = None,
) -> torch.Tensor:
    """Several sequences with different committed lengths in one call.

    q `[B, H, M, D]`, k_cache/v_cache `[Bc, Hkv, C, D]` (sequence b reads cache row
    `cache_batch_idx[b]`, default b, up to `cache_seqlens[b]`), tree K/V `[B, Hkv, M, D]`,
    tree_mask `[B, M, M]` (None = causal chains). Trees of different sizes are padded to M with
    all-False mask rows and columns; padded rows are garbage to be ignored. Returns `[B, H, M, D]`.
    On "triton" this is one flash-attn kvcache call plus one Triton launch; elsewhere a loop.
    """
    b, h, m, d = q.shape
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    backend = resolve_backend(backend, q.device)
    if tree_mask is None:
        tree_mask = causal_mask(m, q.device).expand(b, m, m)
    tree_mask = tree_mask.to(q.device)
    if backend == "triton":
        return gpu_tree_attention_batched(
            q, k_cache, v_cache, cache_seqlens, k_tree, v_tree, tree_mask, scale, cache_batch_idx
        )
    lens = [int(x) for x in cache_seqlens]
    rows = list(range(b)) if cache_batch_idx is None else [int(x) for x in cache_batch_idx]
    outs = []
    for i in range(b):
        kp, vp = k_cache[rows[i], :, : lens[i]], v_cache[rows[i], :, : lens[i]]
        outs.append(tree_attention(q[i], kp, vp, k_tree[i], v_tree[i], tree_mask[i], scale, backend))
    return torch.stack(outs)


# --- baselines and the oracle -------------------------------------------------------------------


def _join_kv(prefix: torch.Tensor, tree: torch.Tensor) -> torch.Tensor:
    """prefix ++ tree along the sequence axis, without a copy when the tree entries already follow the
    prefix in memory, so a baseline is not charged for a concatenation a static KV cache avoids.

    That is the case in the model: the prefix is a view of the sequence's cache slot and the tree's K/V
    were just written right after it. The extended view is used only if it holds exactly `tree` there.
    """
    hkv, s, d = prefix.shape
    if s == 0:
        return tree
    n = tree.shape[1]
    st = prefix.stride()
    fits = (
        prefix.dtype == tree.dtype
        and prefix.device == tree.device
        and st[2] == 1
        and st[1] == d
        and (hkv == 1 or (s + n) * st[1] <= st[0])
        and prefix.storage_offset() + (hkv - 1) * st[0] + (s + n) * st[1]
        <= prefix.untyped_storage().nbytes() // prefix.element_size()
    )
    if fits:
        ext = prefix.as_strided((hkv, s + n, d), st, prefix.storage_offset())
        same_memory = tree.data_ptr() == ext[:, s:].data_ptr() and tree.stride() == st
        if same_memory or torch.equal(ext[:, s:], tree):
            return ext
    return torch.cat([prefix, tree], dim=1)


def additive_mask(mask: torch.Tensor, s: int, dtype: torch.dtype) -> torch.Tensor:
    """`[n, s+n]` float mask (0 visible, dtype's min hidden) as HF builds it for eager and SDPA."""
    n = mask.shape[0]
    full = torch.zeros(n, s + n, dtype=dtype, device=mask.device)
    full[:, s:].masked_fill_(~mask, torch.finfo(dtype).min)
    return full


def eager_masked_attention(q, k_prefix, v_prefix, k_tree, v_tree, mask, scale) -> torch.Tensor:
    """HF "eager" tree attention: repeat K/V per query head, scores over prefix+tree, additive mask,
    fp32 softmax cast back to the model dtype."""
    h, n, d = q.shape
    g = h // k_tree.shape[0]
    k = _join_kv(k_prefix, k_tree)
    v = _join_kv(v_prefix, v_tree)
    if g > 1:
        k, v = k.repeat_interleave(g, dim=0), v.repeat_interleave(g, dim=0)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale + additive_mask(mask, k_prefix.shape[1], q.dtype)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def sdpa_masked_attention(q, k_prefix, v_prefix, k_tree, v_tree, mask, scale) -> torch.Tensor:
    """Torch SDPA over prefix+tree with a full float mask (GQA handled inside SDPA, no K/V repeat)."""
    h = q.shape[0]
    k = _join_kv(k_prefix, k_tree)
    v = _join_kv(v_prefix, v_tree)
    am = additive_mask(mask, k_prefix.shape[1], q.dtype)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=am, scale=scale, enable_gqa=h != k.shape[0]
    )
    return out.squeeze(0)


def sdpa_hf_attention(q, k_prefix, v_prefix, k_tree, v_tree, mask, scale) -> torch.Tensor:
    """Masked SDPA as transformers' `sdpa` integration runs a tree on CPU: its dynamic cache concatenates
    prefix + tree K/V, and with a mask it repeats K/V per query head instead of `enable_gqa`."""
    g = q.shape[0] // k_tree.shape[0]
    k = torch.cat([k_prefix, k_tree], dim=1).repeat_interleave(g, dim=0)
    v = torch.cat([v_prefix, v_tree], dim=1).repeat_interleave(g, dim=0)
    am = additive_mask(mask, k_prefix.shape[1], q.dtype)
    return F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=am, scale=scale)[0]


def reference_attention(q, k_prefix, v_prefix, k_tree, v_tree, mask, scale) -> torch.Tensor:
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
