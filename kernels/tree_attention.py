"""Triton forward kernel for attention under an arbitrary boolean mask (the speculative tree part).

``fused_mask_attn(q, k, v, mask, scale=None) -> (out, lse)`` has exactly the semantics of
``kernels.reference.masked_attention_reference``: q ``[B, H, M, D]``, k/v ``[B, Hkv, N, D]`` (GQA by head
mapping, K/V are never repeated in memory), mask ``[B, M, N]`` (nonzero = visible, shared across heads),
out in q's dtype and lse fp32 (natural log).  Rows with no visible key give ``out = 0``, ``lse = -inf``; the
caller merges this with attention over the committed prefix (``kernels.reference.merge_attention``).

Algorithm: one program per (block of BLOCK_M query rows, query head, batch); it streams the keys in blocks
of BLOCK_N with the online softmax (running max, running sum, rescaled accumulator) in the exp2 domain (scores
are pre-multiplied by ``scale * log2(e)``; lse is converted back to natural log at the end).  The mask is
loaded per tile and AND-ed with the row and column bounds, so M and N need not be multiples of the tile sizes.
The head dim is padded to the next power of two (>= 16, the minimum ``tl.dot`` size) with masked loads.
The running max is replaced by 0 while a row has seen no visible key, which keeps ``exp2(-inf - -inf)``
(NaN) out of the computation; empty rows end with sum 0 and are written as out 0 / lse -inf.

Block sizes (``select_config``).  The tree part is small: M (tree tokens) and N (tree keys, possibly plus a
short window) are at most a few hundred, and B*H is a few dozen, so the grid is a fraction of a wave on
any data-centre GPU and the kernel is latency-bound, not bandwidth-bound.  Hence:

* BLOCK_M is small (32 on Ampere): more programs in flight for the same M and fewer padded rows; 16 is the
  floor because tensor-core MMA tiles are 16 rows.  The wrapper further shrinks BLOCK_M/BLOCK_N to the next
  power of two of M/N (>= 16), so a 5-token chain does not compute a 64-row tile.
* Hopper (sm90) gets BLOCK_M = 64 because its warpgroup MMA (wgmma) works on 64-row tiles per 4-warp
  warpgroup; smaller tiles silently fall back to the Ampere-style mma path, which is still fine.
* Shared memory per stage is roughly ``2 * BLOCK_N * D * elem`` (K and V tiles) + ``BLOCK_M * BLOCK_N`` (mask
  bytes), plus the Q tile once.  Per-block limits: sm80 (A100) ~163 KB, sm86/sm89 (RTX 30/40, A10, L4)
  ~99 KB, sm90 (H100) ~227 KB.  So sm80 and sm90 afford 3 pipeline stages with BLOCK_N = 64 even at
  D = 128; sm86 uses 2 stages and, at D = 128, BLOCK_N = 32 to keep two programs resident per SM.
  ``select_config`` drops stages (then halves BLOCK_N) if the estimate would not fit, e.g. for fp32 inputs.
* num_warps = 4: with BLOCK_M <= 64 there is no work for 8 warps; 4 warps form exactly one Hopper warpgroup.
* Anything older or unknown gets 32x32, 4 warps, 1 stage (correct everywhere, untuned).
* Under the Triton interpreter (``TRITON_INTERPRET=1``, CPU) every tl.* op of every program goes through
  Python front-end code (~0.1 ms per op regardless of tile size), so the cost is per program and per loop
  iteration, not per element: 64x64 tiles are ~6x faster than 16x16 (measured: M=68, N=300, H=6, B=2 takes
  1.3 s vs 8.5 s) while tree sizes of 68-300 still give several row and column blocks with ragged edges.

fp32 inputs use ``input_precision="ieee"`` in ``tl.dot`` (no TF32), so the fp32 path matches the fp32
reference to ~1e-6; fp16/bf16 inputs multiply on tensor cores with fp32 accumulation, and the softmax
probabilities are rounded to the value dtype before the P @ V product (as FlashAttention does).

Interpreter caveat: Triton's CPU interpreter stores bf16 as raw uint16 and its ``tl.dot`` calls ``np.matmul``
on those bit patterns, i.e. bf16 dots return garbage (fp8 is special-cased, bf16 is not; seen in triton
3.9).  Under the interpreter the kernel therefore upcasts the dot operands to fp32 (``DOT_FP32``), after
rounding P to the value dtype, which reproduces the GPU's bf16-product / fp32-accumulate numerics exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["KernelConfig", "fused_mask_attn", "is_available", "select_config"]

_LOG2E = 1.4426950408889634


def is_available() -> bool:
    """Whether ``fused_mask_attn`` can run here: a CUDA GPU (Ampere or newer), or the Triton interpreter.

    Importing this module already required triton, so only the execution target is checked.  Pre-Ampere GPUs
    return False (no bf16, configs untested) and the dispatcher should use the torch path there.
    """
    if _INTERPRETED:
        return True
    if not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability() >= (8, 0)


@dataclass(frozen=True)
class KernelConfig:
    """Launch configuration: tile sizes and the compiler's warp / software-pipelining knobs."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Max dynamic shared memory per block (bytes), by compute capability.
_SMEM_LIMIT = {
    (8, 0): 163 * 1024,
    (8, 6): 99 * 1024,
    (8, 7): 163 * 1024,
    (8, 9): 99 * 1024,
    (9, 0): 227 * 1024,
}


def _smem_bytes(block_m: int, block_n: int, block_d: int, elem: int, stages: int) -> int:
    """Rough shared-memory need: pipelined K, V and mask tiles plus the resident Q tile."""
    per_stage = 2 * block_n * block_d * elem + block_m * block_n
    return stages * per_stage + block_m * block_d * elem


def select_config(capability: tuple[int, int] | None, head_dim: int, elem_size: int = 2) -> KernelConfig:
    """Pick tiles for a device (``None`` = Triton interpreter) and head dim; the module docstring says why."""
    if capability is None:
        return KernelConfig(block_m=64, block_n=64, num_warps=1, num_stages=1)
    block_d = max(16, triton.next_power_of_2(head_dim))
    major, minor = capability
    if major == 9:
        cfg = KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=3)
    elif (major, minor) in ((8, 0), (8, 7)):
        cfg = KernelConfig(block_m=32, block_n=64, num_warps=4, num_stages=3)
    elif major == 8:  # sm86 / sm89: ~100 KB shared memory per SM
        cfg = KernelConfig(block_m=32, block_n=64 if block_d <= 64 else 32, num_warps=4, num_stages=2)
    else:
        return KernelConfig(block_m=32, block_n=32, num_warps=4, num_stages=1)
    limit = _SMEM_LIMIT.get((major, minor), 99 * 1024)
    block_n, stages = cfg.block_n, cfg.num_stages
    while _smem_bytes(cfg.block_m, block_n, block_d, elem_size, stages) > limit:
        if stages > 1:
            stages -= 1
        elif block_n > 16:
            block_n //= 2
        else:
            break
    return KernelConfig(cfg.block_m, block_n, cfg.num_warps, stages)


@triton.jit
def _masked_attn_fwd(
    Q,
    K,
    V,
    Mask,
    Out,
    Lse,
    qk_scale_log2,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_mb,
    stride_mm,
    stride_mn,
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    stride_lb,
    stride_lh,
    stride_lm,
    M,
    N,
    HEAD_DIM,
    GROUP,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    kv_head = head // GROUP

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < M
    d_ok = offs_d < HEAD_DIM

    q_base = Q + batch * stride_qb + head * stride_qh
    q = tl.load(
        q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)

    k_base = K + batch * stride_kb + kv_head * stride_kh
    v_base = V + batch * stride_vb + kv_head * stride_vh
    mask_base = Mask + batch * stride_mb + offs_m[:, None] * stride_mm

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    for start_n in range(0, N, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < N
        # K is loaded transposed ([D, BLOCK_N]) so the score tile is a plain q @ kT.
        kt = tl.load(
            k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd,
            mask=d_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        v = tl.load(
            v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
            mask=col_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if DOT_FP32:
            kt = kt.to(tl.float32)
            v = v.to(tl.float32)
        tile_ok = row_ok[:, None] & col_ok[None, :]
        vis = tl.load(mask_base + offs_n[None, :] * stride_mn, mask=tile_ok, other=0)
        visible = (vis != 0) & tile_ok

        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale_log2
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # While a row has seen nothing, use 0 as its reference so exp2(-inf - ref) = 0 rather than NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        # P is rounded to the value dtype first (a no-op for fp32), matching the tensor-core path.
        p_lo = p.to(V.dtype.element_ty).to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(p_lo, v, input_precision=PRECISION)
        m_i = m_new

    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(has_keys, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))

    o_ptrs = Out + batch * stride_ob + head * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(Lse + batch * stride_lb + head * stride_lh + offs_m * stride_lm, lse, mask=row_ok)


# Triton decides at decoration time (i.e. when this module is imported) whether @triton.jit compiles for the
# GPU or returns a CPU interpreter object, so the kernel object itself is the source of truth.
_INTERPRETED = not isinstance(_masked_attn_fwd, triton.runtime.JITFunction)


def fused_mask_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None = None,
    *,
    config: KernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked attention with the Triton kernel; returns ``(out [B,H,M,D] q.dtype, lse [B,H,M] fp32)``.

    Inputs may be strided (e.g. K/V views of a ``[B, N, Hkv, D]`` cache); only the mask is normalised (a bool
    mask is reinterpreted as uint8 without a copy).  ``config`` overrides ``select_config`` (tests, tuning);
    block sizes must be powers of two >= 16.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, h, m, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if hkv == 0 or h % hkv != 0:
        raise ValueError(f"num query heads {h} must be a multiple of num kv heads {hkv}")
    if tuple(mask.shape) != (b, m, n):
        raise ValueError(f"mask must be [B, M, N] = {(b, m, n)}, got {tuple(mask.shape)}")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"unsupported dtype {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device == mask.device):
        raise ValueError("q, k, v and mask must be on the same device")
    if scale is None:
        scale = 1.0 / math.sqrt(d)

    out = torch.empty((b, h, m, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, m), dtype=torch.float32, device=q.device)
    if out.numel() == 0 and lse.numel() == 0:
        return out, lse
    if n == 0 or d == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)

    interp = _INTERPRETED
    if not interp and not q.is_cuda:
        raise ValueError("fused_mask_attn needs CUDA tensors unless TRITON_INTERPRET=1 was set before import")
    capability = None if interp else torch.cuda.get_device_capability(q.device)
    cfg = config if config is not None else select_config(capability, d, q.element_size())
    for size in (cfg.block_m, cfg.block_n):
        if size < 16 or size & (size - 1):
            raise ValueError(f"block sizes must be powers of two >= 16, got {cfg}")
    block_m = min(cfg.block_m, max(16, triton.next_power_of_2(m)))
    block_n = min(cfg.block_n, max(16, triton.next_power_of_2(n)))
    block_d = max(16, triton.next_power_of_2(d))
    grid = (triton.cdiv(m, block_m), h, b)
    launch_kwargs = {} if interp else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}

    def _launch() -> None:
        _masked_attn_fwd[grid](
            q,
            k,
            v,
            mask,
            out,
            lse,
            scale * _LOG2E,
            *q.stride(),
            *k.stride(),
            *v.stride(),
            *mask.stride(),
            *out.stride(),
            *lse.stride(),
            m,
            n,
            d,
            h // hkv,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_D=block_d,
            PRECISION="ieee" if (q.dtype == torch.float32 or interp) else "tf32",
            DOT_FP32=interp,
            **launch_kwargs,
        )

    if q.is_cuda:
        with torch.cuda.device(q.device):
            _launch()
    else:
        _launch()
    return out, lse
