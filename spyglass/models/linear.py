"""Inference matmuls on whichever CPU kernel is fastest here for the number of rows, chosen by measurement.

A decode step multiplies one row by each weight matrix, a verify step 2-64 rows, and CPU GEMM libraries differ
most exactly there. On AMD Zen 4, MKL's fp32 GEMM handles 2-3 rows as that many passes over the weights and
reads the 49K-row LM head at half the memory speed even for one row, while oneDNN's inner product reads the
weights once for a few rows (the SmolLM2 decode step: 41 instead of 59 ms). On AMD Zen 3 (AVX2 only) both of them
take two passes for two rows, so verifying 2 tokens cost 2 decode steps of matmuls, while the same product
written weights-first (`W @ x^T`, MKL streaming the weights once past a few columns) costs about one pass from 2
rows on and is slow for one. On a Xeon with AMX, MKL's fp32 GEMV path runs 1-3 rows at nearly the cost of one and
4 rows at 1.6x. So each process times the kernels on the model's own weights, per bucket of row counts, and keeps
a plan: the fastest kernel per bucket. Every kernel computes the same product (fp32 sums in a
different order at most), so the choice never changes which tokens are accepted beyond that rounding. Autograd
always takes `F.linear` (the oneDNN op has no backward).
"""

from __future__ import annotations

import bisect
import functools
import time

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu as cpu_kernels

KERNELS = ("aten", "onednn", "wfirst", "rows")
ROWS_MAX = 64  # the "rows" kernel (kernels/cpu_ops.cpp rows_linear, fp32) takes 1 to 64 rows
# plan[i] is the kernel for row counts up to ROW_BUCKETS[i] (the last entry also serves every larger count: prefill
# chunks); single counts to 8 (libraries switch algorithms there: MKL at 4), then verify passes up to 64 rows
ROW_BUCKETS = (1, 2, 3, 4, 6, 8, 16, 32, 64, 128)


def _aten(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, w, b)


def _onednn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def _weights_first(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """(W @ x^T)^T: the weights as the GEMM's long operand, streamed once for a few rows of x."""
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.mm(w, x2.t()).t().contiguous()  # contiguous: callers slice columns and view them as heads
    if b is not None:
        y += b
    return y.view(*x.shape[:-1], w.shape[0])


def _rows(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """kernels/cpu_ops.cpp's few-row product: the weights read once, each output summed in one fixed order
    whatever the row count (a verify pass of up to 64 rows and a decode step agree bit for bit)."""
    return cpu_kernels.native().rows_linear(x, w, b)


def rows_supported(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and cpu_kernels.native() is not None


_KERNEL_FNS = {"aten": _aten, "onednn": _onednn, "wfirst": _weights_first, "rows": _rows}


def _bucket(rows: int) -> int:
    return min(bisect.bisect_left(ROW_BUCKETS, rows), len(ROW_BUCKETS) - 1)


def planned_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, plan: tuple[str, ...] | None):
    """`F.linear` on the plan's kernel for x's row count (autograd, or no plan: `F.linear` itself)."""
    if plan is None or torch.is_grad_enabled():
        return F.linear(x, w, b)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return _KERNEL_FNS[plan[_bucket(rows)]](x, w, b)


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and state dict) whose inference path follows a measured kernel plan."""

    plan: tuple[str, ...] | None = None  # kernel per ROW_BUCKETS entry, set by `set_linear_backend`; None = aten

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return planned_linear(x, self.weight, self.bias, self.plan)


def onednn_supported(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and _onednn_runs(weight.dtype)


@functools.cache
def _onednn_runs(dtype: torch.dtype) -> bool:
    """Whether oneDNN has an inner product for `dtype` on this CPU (bf16 needs AVX-512 BF16 or AMX)."""
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    try:
        _onednn(torch.ones(1, 8, dtype=dtype), torch.ones(4, 8, dtype=dtype), None)
    except RuntimeError:
        return False
    return True


def plan_name(plan: tuple[str, ...]) -> str:
    """One kernel name when the plan is uniform, else the kernels per row bucket joined by commas."""
    return plan[0] if len(set(plan)) == 1 else ",".join(plan)


def parse_plan(backend: str) -> tuple[str, ...]:
    """A kernel name (every row count) or a plan string from `plan_name`; ValueError names what is wrong."""
    kernels = backend.split(",")
    if len(kernels) == 1:
        kernels = kernels * len(ROW_BUCKETS)
    bad = [k for k in kernels if k not in KERNELS]
    if bad or len(kernels) != len(ROW_BUCKETS):
        raise ValueError(
            f"unknown linear backend {backend!r}; choose 'auto', one of {', '.join(KERNELS)}, or one kernel per "
            f"row bucket {ROW_BUCKETS} joined by commas"
        )
    return tuple(kernels)


_PLANS: dict[tuple, tuple[str, ...]] = {}


TIMED_CALL_BYTES = 16 << 20  # weights of one timed call at most: a long call is more often hit by a busy machine


def _timing_sample(linears: list[Linear], rows: int) -> list[tuple[Linear, torch.Tensor, torch.Tensor | None, float]]:
    """The calls a plan times `rows` rows on, in model order, as (layer, weight rows, bias, share of the forward
    they stand for). Up to 8 rows the matmuls stream their weights: every third layer of each shape and the largest
    whole, far more bytes than the caches hold (SmolLM2: 250 MB). Past 8 rows they are compute-bound: the sample
    shrinks as the rows grow (fewer layers of each shape, a part of the largest's rows) so each pass costs about the
    same. A weight over TIMED_CALL_BYTES (an LM head) is timed in parts of consecutive rows, each call on its own."""
    grow = max(1, rows // 8)
    largest = max(linears, key=lambda m: m.weight.numel())
    by_shape: dict[tuple, list[Linear]] = {}
    for m in linears:
        if m is not largest:
            by_shape.setdefault((tuple(m.weight.shape), m.bias is not None), []).append(m)
    used = {largest: -(-largest.weight.shape[0] // grow)}  # weight rows timed, and the share they stand for
    share = {largest: largest.weight.shape[0] / used[largest]}
    for group in by_shape.values():
        k = max(1, round(len(group) / (3 * grow)))
        for j in range(k):
            share[group[(2 * j + 1) * len(group) // (2 * k)]] = len(group) / k  # spread along the model
    sample = []
    for m in linears:
        if m in share:
            n = used.get(m, m.weight.shape[0])
            step = -(-n // -(-n * m.weight[0].nbytes // TIMED_CALL_BYTES))  # n rows in equal parts
            for lo in range(0, n, step):
                hi = min(n, lo + step)
                sample.append((m, m.weight[lo:hi], None if m.bias is None else m.bias[lo:hi], share[m]))
    return sample


def _time_kernels(kernels: list[str], sample, rows: int, min_rounds: int, max_rounds: int) -> dict[str, float]:
    """Each kernel's estimated time for the sample's share of a forward at `rows` rows: every call timed alone,
    its fastest of the rounds kept (a busy machine only ever adds time), weighted by its share and summed.

    One round runs each kernel over the whole sample in turn (no kernels interleaved within a pass: each reads
    the weights as a forward does), the kernel order rotating from round to round; rounds go on past
    `min_rounds` while the fastest kernel still changed in the last one, up to `max_rounds`, for the kernels
    within 3x of it."""
    xs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype) for _, w, _, _ in sample}
    seen = set()
    for _, w, b, _ in sample:  # warm-up: a call per shape (oneDNN builds its primitives, MKL its buffers)
        if (w.shape, b is None) not in seen:
            seen.add((w.shape, b is None))
            for k in kernels:
                _KERNEL_FNS[k](xs[w.shape[1]], w, b)
    best = {k: [float("inf")] * len(sample) for k in kernels}
    estimate, winner = {}, None
    for r in range(max_rounds):
        for k in kernels[r % len(kernels) :] + kernels[: r % len(kernels)]:
            fn, times = _KERNEL_FNS[k], best[k]
            for i, (_, w, b, _) in enumerate(sample):
                t0 = time.perf_counter()
                fn(xs[w.shape[1]], w, b)
                times[i] = min(times[i], time.perf_counter() - t0)
        estimate = {k: sum(t * s[-1] for t, s in zip(best[k], sample, strict=True)) for k in kernels}
        winner, before = min(estimate, key=estimate.get), winner
        if r + 1 >= min_rounds:
            if winner == before:
                break
            kernels = [k for k in kernels if estimate[k] < 3 * estimate[winner]]  # the rest cannot catch up
    return estimate


@torch.inference_mode()
def measure_linear_plan(model: nn.Module, repeats: int = 2) -> tuple[str, ...]:
    """The fastest kernel per row bucket, each timed on a sample of the model's layers (`_timing_sample`) at the
    bucket's largest row count, over `repeats` to twice that many rounds (`_time_kernels`). Measured once per
    process for a given set of shapes, dtype and thread count."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if not linears or linears[0].weight.device.type != "cpu":
        return ("aten",) * len(ROW_BUCKETS)
    w0 = linears[0].weight
    kernels = [k for k in KERNELS if (k != "onednn" or onednn_supported(w0)) and (k != "rows" or rows_supported(w0))]
    shapes = tuple((tuple(m.weight.shape), m.bias is not None) for m in linears)
    key = (shapes, str(w0.dtype), torch.get_num_threads())
    if key not in _PLANS:
        plan = []
        for rows in ROW_BUCKETS:
            allowed = [k for k in kernels if k != "rows" or rows <= ROWS_MAX]
            est = _time_kernels(allowed, _timing_sample(linears, rows), rows, repeats, 2 * repeats)
            plan.append(min(est, key=est.get))
        _PLANS[key] = tuple(plan)
    return _PLANS[key]


def set_linear_backend(model: nn.Module, backend: str = "auto") -> str:
    """Point every `Linear` of `model` at a kernel plan: "auto" measures, a kernel name uses it for every row
    count, a plan string (`model.linear_backend` of another model) copies that plan. Returns the plan's name."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    plan = measure_linear_plan(model) if backend == "auto" else parse_plan(backend)
    if "onednn" in plan and linears and not onednn_supported(w := linears[0].weight):
        raise ValueError(
            f"the oneDNN linear backend has no kernel for {w.dtype} weights on {w.device} here "
            "(fp32 on the CPU; bf16 where the CPU has AVX-512 BF16 or AMX)"
        )
    if "rows" in plan and linears and not rows_supported(w := linears[0].weight):
        raise ValueError(
            f"the 'rows' linear kernel needs fp32 weights on the CPU and the built CPU kernels (kernels/cpu.py); "
            f"got {w.dtype} on {w.device}" + ("" if cpu_kernels.native() else ", and the kernels are not built here")
        )
    if "rows" in plan[_bucket(ROWS_MAX + 1) :]:
        raise ValueError(f"the 'rows' linear kernel takes at most {ROWS_MAX} rows: use it only in buckets up to it")
    for m in linears:
        m.plan = None if set(plan) == {"aten"} else plan
    model.linear_backend = plan_name(plan)
    return model.linear_backend
