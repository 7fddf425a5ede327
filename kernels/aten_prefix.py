"""The prefix part of hybrid attention on ATen's fused kernels: unmasked attention of folded GQA query rows over a
sequence's committed keys, with the log-sum-exp the exact merge needs (`spyglass/attention.py` merges it with the
tree part; `kernels/dispatch.py` uses it on CUDA where flash-attn is absent).

The kernel (`prefix_kernel`): ATen's flash attention for CPU on CPU; on CUDA, ATen's own FlashAttention-2 op
(`_scaled_dot_product_flash_attention`: fp16/bf16, head dim a multiple of 8 up to 256, Ampere or newer) or its
memory-efficient op (fp32), both of which return the log-sum-exp; two matmuls with an fp32 softmax only where none
of these applies (other devices, odd head dims, mixed dtypes). Plain torch: imports anywhere.
"""

from __future__ import annotations

import torch

_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_cuda = torch.ops.aten._scaled_dot_product_flash_attention
_efficient_cuda = torch.ops.aten._scaled_dot_product_efficient_attention
PREFIX_KERNELS = ("cpu_flash", "cuda_flash", "cuda_efficient", "matmul")

# Up to this many folded query rows (GQA group x tree tokens) per KV head, two matmuls would be used for
# the unmasked prefix instead of ATen's flash kernel for CPU. Measured (bench/attention.py, `prefix_choice`
# in bench/results/attention.json; 3 KV heads, D 64, 1K-16K contexts, 2 threads): the flash kernel is as
# fast or faster from 3 rows up in both dtypes, and more precise in bf16 (fp32 scores instead of scores
# rounded to bf16), so the matmul path is off on CPU; it remains the path for other devices.
MATMUL_PREFIX_MAX_ROWS: dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 0}


# ATen's flash kernel for CPU spreads (batch, head, query block) over the threads, and a verify step has few
# of those (SmolLM2, 32-node tree: 3 KV heads x 3 blocks of 32 rows; a decode step: 3 x 1). Cutting the prefix
# into chunks that run as one batch, merged by their LSE (flash-decoding's split-K), keeps every thread busy,
# at the price of a merge. Measured in bench/attention.py (`kv_split`, 2 threads, 3-204 rows): fp32 gains
# 5-25% from 8K keys (mixed at 4K, a loss below); bf16 only gains reliably from 32K keys.
KV_SPLIT_MIN_KEYS: dict[torch.dtype, int] = {torch.float32: 8192, torch.bfloat16: 32768}


def kv_split_parts(dtype: torch.dtype, keys: int) -> int:
    """Key chunks for one CPU flash call: two per thread from KV_SPLIT_MIN_KEYS[dtype] keys (fp16 as bf16)."""
    threads = torch.get_num_threads()
    if threads < 2 or keys < KV_SPLIT_MIN_KEYS.get(dtype, KV_SPLIT_MIN_KEYS[torch.bfloat16]):
        return 1
    return 2 * threads


def split_flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, parts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """ATen's flash for CPU over `parts` key chunks in one batched call (views, no copy) -> (out fp32, lse fp32).

    The last S % parts keys, if any, take two matmuls; all partial results merge exactly by their LSE."""
    s = k.shape[1]
    c = s // parts
    kc = k[:, : parts * c].unflatten(1, (parts, c)).transpose(0, 1)
    vc = v[:, : parts * c].unflatten(1, (parts, c)).transpose(0, 1)
    out, lse = _flash_cpu(q.expand(parts, -1, -1, -1), kc, vc, scale=scale)[:2]
    out, lse = out.float(), lse.float()
    if parts * c < s:
        out_r, lse_r = matmul_prefix_attention(q, k[:, parts * c :], v[:, parts * c :], scale)
        out, lse = torch.cat([out, out_r.unsqueeze(0)]), torch.cat([lse, lse_r.unsqueeze(0)])
    total = torch.logsumexp(lse, dim=0)
    return (out * torch.exp(lse - total).unsqueeze(-1)).sum(dim=0), total


def matmul_prefix_max_rows(dtype: torch.dtype) -> int:
    """Crossover for `dtype` (fp16 and others follow bf16: same kernels, same 2-byte traffic)."""
    return MATMUL_PREFIX_MAX_ROWS.get(dtype, MATMUL_PREFIX_MAX_ROWS[torch.bfloat16])


def _softmax_with_lse(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """In place on fp32 `scores`: unnormalised probs, their row sums and the LSE (-inf for empty rows).

    Normalising after P @ V (not before) saves one pass over the large score matrix.
    """
    m = scores.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)  # rows that see nothing: exp(-inf) = 0
    probs = scores.sub_(m).exp_()
    denom = probs.sum(dim=-1, keepdim=True)
    lse = torch.where(denom > 0, m + torch.log(denom), torch.full_like(denom, float("-inf"))).squeeze(-1)
    return probs, torch.where(denom > 0, denom, torch.ones_like(denom)), lse


def matmul_prefix_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked attention by two matmuls: `[Hkv, R, D]` over `[Hkv, S, D]` -> (out fp32, lse fp32 `[Hkv, R]`)."""
    scores = torch.matmul(q, k.transpose(-1, -2))
    scores = scores.float().mul_(scale) if scores.dtype != torch.float32 else scores.mul_(scale)
    probs, denom, lse = _softmax_with_lse(scores)
    out = torch.matmul(probs.to(v.dtype), v).float().div_(denom)
    return out, lse


def choose_prefix_kernel(
    device_type: str, dtype: torch.dtype, head_dim: int, rows: int, capability: tuple[int, int] | None = None
) -> str:
    """The prefix part's kernel (one of PREFIX_KERNELS) for folded queries of `rows` rows on `device_type` (CUDA:
    the device's compute `capability`): ATen's fused kernels where they take these inputs, two matmuls elsewhere."""
    if device_type == "cpu":
        return "cpu_flash" if rows > matmul_prefix_max_rows(dtype) else "matmul"
    if device_type == "cuda" and head_dim % 8 == 0 and head_dim <= 256:
        if dtype in (torch.float16, torch.bfloat16) and capability is not None and capability >= (8, 0):
            return "cuda_flash"  # FlashAttention-2 (torch's build): fp16/bf16 on Ampere or newer
        if dtype in (torch.float32, torch.float16):
            return "cuda_efficient"  # the memory-efficient kernel: fp32, and fp16 before Ampere
    return "matmul"


def prefix_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """`choose_prefix_kernel` for folded queries `q` `[.., R, D]` over `k`/`v` (mixed dtypes or devices: "matmul")."""
    if not (q.dtype == k.dtype == v.dtype and q.device == k.device == v.device):
        return "matmul"
    cap = None
    if q.device.type == "cuda":  # (the properties, not get_device_capability: torch.compile folds them)
        props = torch.cuda.get_device_properties(q.device)
        cap = (props.major, props.minor)
    return choose_prefix_kernel(q.device.type, q.dtype, q.shape[-1], q.shape[-2], cap)


def fused_attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, kernel: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked attention `[B, Hkv, R, D]` over `[B, Hkv, S, D]` (S >= 1) in one ATen kernel that also returns the
    log-sum-exp -> (out in q's dtype, lse fp32 `[B, Hkv, R]`). `kernel` from `prefix_kernel`, not "matmul"."""
    if k.stride(-1) != 1 or v.stride(-1) != 1:  # the fused kernels read rows of D contiguous values
        k, v = k.contiguous(), v.contiguous()
    if kernel == "cpu_flash":
        out, lse = _flash_cpu(q, k, v, scale=scale)[:2]
    elif kernel == "cuda_flash":
        out, lse = _flash_cuda(q.contiguous(), k, v, 0.0, False, False, scale=scale)[:2]
    elif kernel == "cuda_efficient":  # its LSE is padded along the rows (to a multiple of 32)
        out, lse = _efficient_cuda(q.contiguous(), k, v, None, True, 0.0, False, scale=scale)[:2]
        lse = lse[..., : q.shape[-2]]
    else:
        raise ValueError(f"no fused prefix kernel {kernel!r}; expected one of {PREFIX_KERNELS[:-1]}")
    return out, lse.float()


def prefix_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked attention of folded queries `[Hkv, R, D]` over `[Hkv, S, D]` -> (out, lse fp32 `[Hkv, R]`).

    The kernel is `prefix_kernel`'s: on CPU two matmuls for few rows (the flash kernel's blocking does not pay
    off there) and ATen's flash attention for CPU otherwise, split along the keys where that pays
    (`kv_split_parts`); on CUDA ATen's flash or memory-efficient kernel. S = 0 gives out 0 and lse -inf, which
    the merge ignores.
    """
    hkv, rows, d = q.shape
    if k.shape[1] == 0:
        return q.new_zeros(hkv, rows, d, dtype=torch.float32), q.new_full(
            (hkv, rows), float("-inf"), dtype=torch.float32
        )
    kernel = prefix_kernel(q, k, v)
    if kernel == "matmul":
        return matmul_prefix_attention(q, k, v, scale)
    if kernel == "cpu_flash":
        parts = min(kv_split_parts(q.dtype, k.shape[1]), k.shape[1])
        if parts > 1:
            return split_flash_attention(q, k, v, scale, parts)
    out, lse = fused_attention_with_lse(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), scale, kernel)
    return out.squeeze(0), lse.squeeze(0)
