"""Inference matmuls: row-invariant where losslessness needs it, else on the CPU kernel measured fastest here.

A decode step or a verify pass (one row to a few hundred: a batch of draft trees) must give each row the bits it would
get alone, or speculative output stops equalling plain decoding: the GEMM libraries pick their algorithm, and so their
summation order, by the row count, which in fp32 rarely and in bf16 often enough changes a greedy token. Those
forwards run every linear on `rows` (kernels/cpu_ops.cpp rows_linear; fp32, or bf16 with fp32 sums), or on `lanes`
where it is measured faster (below), whatever the row count: each output summed in one fixed order however many rows
share the call, the weights read once per 64 rows (a decode step is the time to read them). `Transformer.forward`
marks them with `row_invariant()`.

Prefill chunks (no logits past a segment's last row, no draft tree) and direct calls (drafts) only need speed, and
CPU GEMM libraries differ most exactly at few rows. On AMD Zen 4, MKL's fp32 GEMM handles 2-3 rows as that many
passes over the weights and reads the 49K-row LM head at half the memory speed even for one row, while oneDNN's
inner product reads the weights once for a few rows. On AMD Zen 3 (AVX2 only) both of them take two passes for two
rows, while the same product written weights-first (`W @ x^T`, MKL streaming the weights once past a few columns)
costs about one pass from 2 rows on and is slow for one. On a Xeon with AMX, MKL's fp32 GEMV path runs 1-3 rows at
nearly the cost of one. At hundreds of rows (Zen 4, one thread) oneDNN's and MKL's bf16 GEMMs run ~185 GFLOP/s,
twice their fp32 and 1.3-1.8x `rows` in bf16. Without bf16 GEMM instructions (AVX2, AVX-512F) the libraries' bf16
GEMMs are slow; `widen` widens a bf16 call's operands for oneDNN's fp32 GEMM (Zen 3, 2 threads, 256 rows of SmolLM2's
shapes: 64-86 GFLOP/s against `lanes`' 53-65). So the kernels are timed on the model's own weights, per bucket of
row counts, and the fastest per bucket makes a plan, kept for the next process on the machine (spyglass/kept.py).
Autograd always takes `F.linear` (the oneDNN op has no backward).

A library's prefill chunk gives a row bits that depend on the chunk's row count, so the engine would have to prefill
a prompt in the same chunks under any load. `lanes` (kernels/cpu_ops.cpp lanes_linear: x rows in vector lanes, each
output one multiply-add chain over k) is row-invariant at the libraries' speed from a few dozen rows (2 Zen 4
cores, SmolLM2's shapes at 256 rows: ~370 GFLOP/s bf16, ~185 fp32, as oneDNN). Where it is measured within
LANES_SLACK of the fastest library kernel at a chunk's rows, it runs every prefill chunk (`prefill_row_invariant`),
and the engine sizes chunks by load (a GEMM library with AMX, far faster, keeps fixed chunks). Below a vector's worth
of rows it puts the outputs in the lanes instead (a transposed square of weights, each x word broadcast): the same
chains, so the same bits, at about a weight read for a few rows. Where it is also measured no slower than `rows` at a
decode step's and a verify pass's rows (`lanes_for_decode`; Zen 3 fp32: 1.0x `rows`' time at 1 row, 0.34x at 16),
every forward runs it.

Backends (`set_linear_backend`): "auto", the default, is "lanes" (every forward on it) or `"prefill:<measured
plan>"`: the plan for prefill chunks, `rows` for every other forward. Both are lossless. A kernel name or a plan
without the "prefill:" prefix runs every forward on it: for experiments, lossless only when it is `rows` or `lanes`
throughout.
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import functools
import time

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu as cpu_kernels
from spyglass.kept import kept

KERNELS = ("aten", "onednn", "wfirst", "widen", "rows", "lanes")
LOSSLESS_KERNELS = ("rows", "lanes")  # every forward on one is lossless: a decode step's rows equal a verify pass's
ROW_INVARIANT_KERNELS = ("rows", "lanes")  # a row's bits do not depend on the other rows of its call
LANES_ROWS = 256  # rows (a prefill chunk) at which `lanes` is timed against the measured prefill plan
LANES_DECODE_ROWS = (1, 16)  # rows (a decode step, a verify pass) at which `lanes` is timed against `rows`
LANES_SLACK = 1.15  # `lanes` runs prefill when at most this much slower (timings here vary ~10% run to run): chunks
# of any size then give a prompt the same bits, worth a little speed
PREFILL_PREFIX = "prefill:"  # "prefill:<plan>": the plan for prefill chunks, `rows` for every other forward
# plan[i] is the kernel for row counts up to ROW_BUCKETS[i] (the last entry also serves every larger count: prefill
# chunks); single counts to 8 (libraries switch algorithms there: MKL at 4), then verify passes up to 64 rows
ROW_BUCKETS = (1, 2, 3, 4, 6, 8, 16, 32, 64, 128)
LANES = ("lanes",) * len(ROW_BUCKETS)  # the plan of every row count on `lanes`


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


def _widened(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """bf16 operands widened to fp32 for the call, through oneDNN's fp32 inner product (ATen's where oneDNN is
    missing), the result rounded to bf16 once: on a CPU without bf16 GEMM instructions a prefill chunk then runs at
    the fp32 GEMM's speed, the widening about 1/rows of the product's work."""
    xf, wf, bf = x.float(), w.float(), None if b is None else b.float()
    y = _onednn(xf, wf, bf) if _onednn_runs(torch.float32) else F.linear(xf, wf, bf)
    return y.to(x.dtype)


def _rows(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """kernels/cpu_ops.cpp's few-row product (fp32, or bf16 with fp32 sums): the weights read once per 64 rows, each
    output summed in one fixed order whatever the row count (a verify pass and a decode step agree bit for bit)."""
    return cpu_kernels.native().rows_linear(x, w, b)


def _lanes(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """kernels/cpu_ops.cpp's GEMM with x rows in vector lanes (from a vector's worth of rows; fewer: the outputs in
    the lanes, the same bits): row-invariant at the GEMM libraries' speed from a few dozen rows, and at about a
    weight read from one row. The shapes it does not take (few outputs, bf16 with odd features) run on `rows`, also
    row-invariant: the kernel follows the shape, never the row count."""
    return cpu_kernels.native().lanes_linear(x, w, b)


def rows_supported(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and cpu_kernels.native() is not None
    )


_KERNEL_FNS = {
    "aten": _aten,
    "onednn": _onednn,
    "wfirst": _weights_first,
    "widen": _widened,
    "rows": _rows,
    "lanes": _lanes,
}


def _bucket(rows: int) -> int:
    return min(bisect.bisect_left(ROW_BUCKETS, rows), len(ROW_BUCKETS) - 1)


_ROW_INVARIANT = contextvars.ContextVar("spyglass_linear_row_invariant", default=False)


@contextlib.contextmanager
def row_invariant(on: bool = True):
    """Within it (on), the linears whose backend says so (`Linear.invariant`: "auto", "prefill:<plan>") run the
    row-invariant `rows` kernel whatever their row count; off (and outside it), their plan."""
    token = _ROW_INVARIANT.set(on)
    try:
        yield
    finally:
        _ROW_INVARIANT.reset(token)


def planned_linear(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, plan: tuple[str, ...] | None, invariant: bool = False
):
    """`F.linear` on the plan's kernel for x's row count (autograd, or no plan: `F.linear` itself), or on the
    `rows` kernel when `invariant` and inside `row_invariant()`."""
    if plan is None or torch.is_grad_enabled():
        return F.linear(x, w, b)
    if invariant and _ROW_INVARIANT.get():
        return _KERNEL_FNS["rows"](x, w, b)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return _KERNEL_FNS[plan[_bucket(rows)]](x, w, b)


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and state dict) whose inference path follows a measured kernel plan."""

    plan: tuple[str, ...] | None = None  # kernel per ROW_BUCKETS entry, set by `set_linear_backend`; None = aten
    invariant = False  # inside `row_invariant()`: the `rows` kernel instead of the plan (set by `set_linear_backend`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return planned_linear(x, self.weight, self.bias, self.plan, self.invariant)


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


def plan_name(plan: tuple[str, ...], invariant: bool = False) -> str:
    """One kernel name when the plan is uniform, else the kernels per row bucket joined by commas; prefixed with
    "prefill:" when the plan is for prefill chunks only (every other forward on `rows`)."""
    return (PREFILL_PREFIX if invariant else "") + (plan[0] if len(set(plan)) == 1 else ",".join(plan))


def parse_backend(backend: str) -> tuple[tuple[str, ...], bool]:
    """(plan, invariant) of a backend string from `plan_name`: a kernel name (every row count) or one kernel per
    row bucket, "prefill:" in front for a plan of prefill chunks only; ValueError names what is wrong."""
    invariant = backend.startswith(PREFILL_PREFIX)
    kernels = backend.removeprefix(PREFILL_PREFIX).split(",")
    if len(kernels) == 1:
        kernels = kernels * len(ROW_BUCKETS)
    bad = [k for k in kernels if k not in KERNELS]
    if bad or len(kernels) != len(ROW_BUCKETS):
        raise ValueError(
            f"unknown linear backend {backend!r}; choose 'auto' (lossless: prefill chunks on the kernels measured "
            f"fastest, every other forward on the row-invariant 'rows'), 'prefill:' and a plan (the same with that "
            f"plan), or a plan for every forward (lossless only as 'rows'): one of {', '.join(KERNELS)}, or one "
            f"kernel per row bucket {ROW_BUCKETS} joined by commas"
        )
    return tuple(kernels), invariant


def parse_plan(backend: str) -> tuple[str, ...]:
    """The plan of a backend string (`parse_backend`), whichever forwards it is for."""
    return parse_backend(backend)[0]


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
    """The fastest library kernel (or `rows`) per row bucket, each timed on a sample of the model's layers
    (`_timing_sample`) at the bucket's largest row count, over `repeats` to twice that many rounds (`_time_kernels`).
    Measured once per machine for a given set of shapes, dtype and thread count (spyglass/kept.py)."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if not linears or linears[0].weight.device.type != "cpu":
        return ("aten",) * len(ROW_BUCKETS)
    key = _plan_key(linears)
    if key not in _PLANS:
        kernels = _library_kernels(linears[0].weight)

        def measure() -> list[str]:
            plan = []
            for rows in ROW_BUCKETS:
                est = _time_kernels(kernels, _timing_sample(linears, rows), rows, repeats, 2 * repeats)
                plan.append(min(est, key=est.get))
            return plan

        _PLANS[key] = tuple(kept("plan", (key, kernels), measure))
    return _PLANS[key]


_LANES: dict[tuple, bool] = {}


def lanes_for_prefill(model: nn.Module, repeats: int = 2) -> bool:
    """Whether `lanes` times within LANES_SLACK of the fastest other kernel at a prefill chunk's LANES_ROWS rows on
    the model's layers: then it runs every prefill chunk, so chunks of any size give a prompt the same bits
    (`prefill_row_invariant`). Measured once per machine for a given set of shapes, dtype and thread count."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if not linears or not rows_supported(linears[0].weight):
        return False
    key = _plan_key(linears)
    if key not in _LANES:
        kernels = [*_library_kernels(linears[0].weight), "lanes"]

        def measure() -> bool:
            est = _time_kernels(kernels, _timing_sample(linears, LANES_ROWS), LANES_ROWS, repeats, 2 * repeats)
            return est.get("lanes", float("inf")) <= LANES_SLACK * min(t for k, t in est.items() if k != "lanes")

        _LANES[key] = bool(kept("lanes", (key, kernels), measure))
    return _LANES[key]


_LANES_DECODE: dict[tuple, bool] = {}


def lanes_for_decode(model: nn.Module, repeats: int = 2) -> bool:
    """Whether `lanes` times no slower than `rows` at a decode step's and at a verify pass's rows
    (LANES_DECODE_ROWS) on the model's layers: then every forward runs on it (a decode step and a verify pass still
    give a row the same bits). Measured once per machine for a given set of shapes, dtype and thread count."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if not linears or not rows_supported(linears[0].weight):
        return False
    key = _plan_key(linears)
    if key not in _LANES_DECODE:

        def measure() -> bool:
            for rows in LANES_DECODE_ROWS:
                est = _time_kernels(["rows", "lanes"], _timing_sample(linears, rows), rows, repeats, 2 * repeats)
                if est["lanes"] > est["rows"]:
                    return False
            return True

        _LANES_DECODE[key] = bool(kept("lanes_decode", key, measure))
    return _LANES_DECODE[key]


def _plan_key(linears: list[Linear]) -> tuple:
    w0 = linears[0].weight
    return tuple((tuple(m.weight.shape), m.bias is not None) for m in linears), str(w0.dtype), torch.get_num_threads()


def _library_kernels(w0: torch.Tensor) -> list[str]:
    """The kernels a plan picks from: every one that runs here but `lanes` (timed on its own, for prefill); `widen`
    for bf16 weights only (on fp32 ones it is oneDNN's)."""
    runs = {"onednn": onednn_supported(w0), "rows": rows_supported(w0), "widen": w0.dtype == torch.bfloat16}
    return [k for k in KERNELS if k != "lanes" and runs.get(k, True)]


def prefill_row_invariant(model: nn.Module) -> bool:
    """Whether every `Linear` of `model` runs its prefill chunks on one row-invariant kernel (its plan is `rows` or
    `lanes` throughout): then a row's bits do not depend on the chunk it is prefilled in."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    return bool(linears) and all(
        m.plan is not None and len(set(m.plan)) == 1 and m.plan[0] in ROW_INVARIANT_KERNELS for m in linears
    )


def set_linear_backend(model: nn.Module, backend: str = "auto") -> str:
    """Point every `Linear` of `model` at a kernel plan: "auto" measures one for prefill chunks and runs every other
    forward on the row-invariant `rows` kernel (lossless; a plan for every forward where `rows` cannot run: not on
    the CPU, not fp32/bf16, the kernels not built); "prefill:<plan>" does the same with that plan; a kernel name or
    a plan alone runs every forward on it (not lossless unless it is `rows`: a verify pass may round differently
    from a decode step). A backend string (`model.linear_backend` of another model) copies it. Returns its name.
    `model.draft_linear_backend` is what a draft beside it takes: the measured plan without `lanes` (few rows are
    `lanes`' worst case, and a draft's rows need no invariance), or the plan given."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if backend == "auto":
        plan = measure_linear_plan(model)
        invariant = bool(linears) and rows_supported(linears[0].weight)
    else:
        plan, invariant = parse_backend(backend)
    model.draft_linear_backend = plan_name(plan, invariant)  # a draft's few-row calls: the measured plan
    if backend == "auto" and invariant and lanes_for_prefill(model):
        plan = LANES
        invariant = not lanes_for_decode(model)  # every forward on `lanes`, or the others on `rows`
    if "onednn" in plan and linears and not onednn_supported(w := linears[0].weight):
        raise ValueError(
            f"the oneDNN linear backend has no kernel for {w.dtype} weights on {w.device} here "
            "(fp32 on the CPU; bf16 where the CPU has AVX-512 BF16 or AMX)"
        )
    if ("rows" in plan or "lanes" in plan or invariant) and linears and not rows_supported(w := linears[0].weight):
        raise ValueError(
            f"the 'rows' linear kernel needs fp32 or bf16 weights on the CPU and the built CPU kernels "
            f"(kernels/cpu.py); got {w.dtype} on {w.device}"
            + ("" if cpu_kernels.native() else ", and the kernels are not built here")
        )
    for m in linears:
        m.plan = None if set(plan) == {"aten"} and not invariant else plan
        m.invariant = invariant
    model.linear_backend = plan_name(plan, invariant)
    return model.linear_backend
