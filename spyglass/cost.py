"""The cost model of speculation: what verifying k tokens costs on this machine, and what a step earns.

Each extra verified token costs target time, by an amount that depends on the machine (fp32 vs bf16, AMX or
not), the context length and the batch. So the engine measures that cost once at start-up (`CostCurve`), and
the controller (spyglass/controller.py) prices every step by it (`StepCost`): a step that verifies k tokens and
expects `gain` of them (the root's 1 + the drafted nodes' acceptance probabilities) makes

    gain / (this sequence's share of the verify forward of k tokens + drafting time)

expected tokens per second; plain decoding makes 1 / (its share of a 1-token forward).
"""

from __future__ import annotations

import bisect
import inspect
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from kernels.cpu import cpuinfo
from spyglass.kept import kept
from spyglass.models.llama import Segment


def cpu_model() -> str:
    """The CPU model name, with family/model and the vector extensions that change matmul speed (a VM may show
    only "AMD EPYC" for both Zen 3 and Zen 4): recorded with every measurement, as the cost curve differs."""
    info = cpuinfo()
    name = info.get("model name") or platform.processor() or platform.machine()
    if "cpu family" not in info:
        return name
    flags = set(info.get("flags", "").split())
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    return f"{name} (family {info['cpu family']} model {info.get('model', '?')}, {' '.join(isa) or 'no avx2'})"


@dataclass
class CostCurve:
    """Seconds of one target forward with `sizes[j]` new tokens over a `contexts[i]`-token prefix."""

    contexts: list[int]
    sizes: list[int]
    seconds: list[list[float]]  # [context][size]
    cpu: str = field(default_factory=cpu_model)

    @classmethod
    def linear(cls, base: float = 1.0, per_token: float = 0.1, max_size: int = 64) -> CostCurve:
        """A synthetic curve (tests, or a machine where measuring is not wanted)."""
        sizes = [1, 2, 4, 8, 16, 32, max_size]
        return cls([1], sizes, [[base + per_token * (s - 1) for s in sizes]], cpu="synthetic")

    @classmethod
    @torch.inference_mode()
    def measure(
        cls,
        target,
        cache,
        contexts: tuple[int, ...] | None = None,
        sizes: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 64),
        repeats: int = 3,
    ) -> CostCurve:
        """Time verify-shaped forwards on this machine: per context, `repeats` rounds over every size (after one
        warm-up round at the first context), and each size's median round. Rounds interleave the sizes and the
        median ignores one lucky or unlucky pass: the controller compares the sizes' ratios, and a best-of-2 run
        was seen to price the 1-token step 10-20% below the decode steps that followed (so drafting looked dearer
        than it was: n-gram 0.98x against 1.62x on the same prompt in the next run). The prefix K/V are zeros: the
        attention's cost does not depend on their values. The sizes are dense where BLAS switches kernels (on one
        Sapphire Rapids: 3 tokens cost about 1.1 decode steps, 4 about 1.5, 12 more than 16; on Zen 4 at 5.6K: 3
        cost more than 4, and 5 as much as 6), which interpolating between neighbours would miss. `contexts` by
        default: 256, 2K and 6K tokens, then half the cache's capacity and the capacity itself where it is longer
        (a 32K window is priced at 16K and 32K, not extrapolated from 6K)."""
        if contexts is None:
            contexts = (256, 2048, 6144, *(c for c in (cache.capacity // 2, cache.capacity) if c > 6144))

        slot = cache.allocate()
        try:
            sizes = tuple(n for n in sizes if n <= cache.capacity // 2) or (1,)
            ctxs = sorted({min(c, cache.capacity - max(sizes)) for c in contexts if c > 0})
            zero_prefix(cache, slot, ctxs[-1])
            vocab = target.args.vocab_size
            table = []

            def one_round(segs: list[Segment]) -> list[float]:
                times = []
                for seg in segs:
                    t0 = time.perf_counter()
                    target([seg], cache)
                    if cache.device.type == "cuda":  # the forward only queued its kernels
                        torch.cuda.synchronize(cache.device)
                    times.append(time.perf_counter() - t0)
                return times

            for ctx in ctxs:
                cache.lengths[slot] = ctx
                segs = [Segment(slot, ctx, torch.randint(0, vocab, (n,)), torch.arange(ctx, ctx + n), None, "all")
                        for n in sizes]  # fmt: skip
                if ctx == ctxs[0]:
                    one_round(segs)  # warms up every shape, once: the next contexts run the same shapes
                rounds = [one_round(segs) for _ in range(repeats)]
                table.append([statistics.median(col) for col in zip(*rounds, strict=True)])
        finally:
            cache.lengths[slot] = 0
            cache.release(slot)
        return cls(ctxs, list(sizes), table)

    def time(self, tokens: int, context: int) -> float:
        """Interpolated forward time (linear in tokens and context; extrapolated past the largest size)."""
        rows = [self._in_size(r, tokens) for r in self.seconds]
        if len(rows) == 1 or context <= self.contexts[0]:
            return rows[0]
        if context >= self.contexts[-1]:
            c0, c1 = self.contexts[-2], self.contexts[-1]
            i = len(self.contexts) - 2
        else:
            i = bisect.bisect_right(self.contexts, context) - 1
            c0, c1 = self.contexts[i], self.contexts[i + 1]
        w = (context - c0) / (c1 - c0)
        return max(1e-9, rows[i] + w * (rows[i + 1] - rows[i]))

    def _in_size(self, row: list[float], tokens: int) -> float:
        s = self.sizes
        if tokens <= s[0]:
            return row[0]
        j = min(bisect.bisect_right(s, tokens) - 1, len(s) - 2)
        w = (tokens - s[j]) / (s[j + 1] - s[j])
        return row[j] + w * (row[j + 1] - row[j])

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class BatchShape:
    """The rest of a step's batch as one sequence's sizing sees it: the tokens the other rows verify, the sum over
    those tokens of their prefix lengths, and the tokens they are expected to make. The engine sizes the rows one
    after another, each against the rows sized before it and the plain rows still to size, so each row keeps
    only what raises the whole step's expected tokens per second."""

    tokens: int = 0
    context_tokens: int = 0
    gain: float = 0.0

    @classmethod
    def plain(cls, contexts: list[int]) -> BatchShape:
        """A batch of plain rows over these prefixes."""
        return cls(len(contexts), sum(contexts), float(len(contexts)))

    def plus(self, tokens: int, context: int, gain: float) -> BatchShape:
        return BatchShape(self.tokens + tokens, self.context_tokens + tokens * context, self.gain + gain)

    def time(self, curve: CostCurve, tokens: int = 0, context: int = 0) -> float:
        """One forward of these rows and `tokens` more over a `context`-token prefix, on `curve`: the curve's
        time for all the tokens at their token-weighted mean prefix (the attention reads each token's own prefix,
        the matmuls see every token)."""
        n = self.tokens + tokens
        return curve.time(n, (self.context_tokens + tokens * context) / max(n, 1))


@dataclass(frozen=True)
class StepCost:
    """Prices one sequence's speculative step on `curve`. `cost_by_depth`: the drafter runs one step per depth and
    drafts only as deep as asked (LongSpec, GLIDE), so drafting is charged per drafted depth, not per step."""

    curve: CostCurve
    cost_by_depth: bool = False

    def verify(self, tokens: int, context: int, batch: int) -> float:
        """This sequence's share of a step in which every sequence of the batch verifies about as many tokens."""
        return self.curve.time(tokens * batch, context) / batch

    def drafting(self, draft_s: float, depth: int) -> float:
        """Drafting time of a tree `depth` deep, from the recent drafting time `draft_s` (per depth or per step)."""
        return draft_s * depth if self.cost_by_depth else draft_s

    def per_draft(self, seconds: float, depth: int) -> float:
        """One step's drafting time as `draft_s` counts it (per drafted depth or per step)."""
        return seconds / max(depth, 1) if self.cost_by_depth else seconds

    @staticmethod
    def rate(gain: float, verify: float, drafting: float = 0.0) -> float:
        """Expected tokens per second of a step that expects `gain` tokens."""
        return gain / (verify + drafting)

    def step_rate(
        self, gain: float, tokens: int, context: int, batch: int | BatchShape, drafting: float = 0.0
    ) -> float:
        """Expected tokens per second of a step in which this sequence verifies `tokens` expecting `gain`: with a
        `BatchShape`, of the whole step (the other rows' tokens and gains with this one's, this drafting added to
        the step); with a batch size, of this sequence's share of a batch of rows like it."""
        if isinstance(batch, BatchShape):
            return (batch.gain + gain) / (batch.time(self.curve, tokens, context) + drafting)
        return self.rate(gain, self.verify(tokens, context, batch), drafting)

    def share(self, context: int, batch: int | BatchShape) -> float:
        """This sequence's share of a plain step's time at this batch (what a decode step costs it)."""
        if isinstance(batch, BatchShape):
            return batch.time(self.curve, 1, context) / (batch.tokens + 1)
        return self.verify(1, context, batch)


_CURVES: dict[tuple, CostCurve] = {}


def _device_key(device: torch.device) -> str:
    """The device in a measurement's key: a GPU by its name too (the CPU is in every kept key already)."""
    return f"{device} {torch.cuda.get_device_name(device)}" if device.type == "cuda" else str(device)


def measured_curves(target) -> list[CostCurve]:
    """Every cost curve measured in this process for `target` (results files record them)."""
    return [curve for key, curve in _CURVES.items() if key[0] == target.model_id]


def measured_curve(target, cache) -> CostCurve:
    """The cost curve for this model, dtype, thread count and capacity: measured once per machine (spyglass/kept.py),
    taken once per process."""
    key = (
        target.model_id,
        str(target.dtype),
        target.linear_backend,
        bool(getattr(target.layers[0], "native", False)),  # the CPU kernels on or off (kernels/cpu.py)
        torch.get_num_threads(),
        cache.capacity,
        _device_key(cache.device),
        str(inspect.signature(CostCurve.measure)),  # what it times: a change of its sizes measures again
    )
    if key not in _CURVES:
        _CURVES[key] = CostCurve(**kept("cost curve", key, lambda: CostCurve.measure(target, cache).to_dict()))
    return _CURVES[key]


@torch.inference_mode()
def zero_prefix(cache, slot: int, tokens: int) -> None:
    """The first `tokens` positions of `slot`'s K/V in every layer set to zeros: the prefix a cost is measured over."""
    for layer in range(cache.n_layers):
        k, v = cache.layer(slot, layer)
        k[:, :tokens].zero_()
        v[:, :tokens].zero_()


@torch.inference_mode()
def measure_prefill_rate(target, cache, chunk: int = 256, context: int = 2048, repeats: int = 2) -> float:
    """Prompt tokens per second of a `chunk`-token prefill forward over a `context`-token prefix on this machine
    (the median of `repeats` after a warm-up): what sizes the engine's per-step prefill budget (`PrefillCost`).
    The prefix K/V are zeros, as for the cost curve."""
    from spyglass.models.llama import Segment

    slot = cache.allocate()
    try:
        chunk = max(1, min(chunk, cache.capacity // 2))
        context = max(0, min(context, cache.capacity - chunk))
        zero_prefix(cache, slot, context)
        vocab = target.args.vocab_size
        times = []
        for _ in range(repeats + 1):  # the first warms up the shape
            cache.lengths[slot] = context
            ids, pos = torch.randint(0, vocab, (chunk,)), torch.arange(context, context + chunk)
            seg = Segment(slot, context, ids, pos, None, "last")
            t0 = time.perf_counter()
            target([seg], cache)
            if cache.device.type == "cuda":
                torch.cuda.synchronize(cache.device)
            times.append(time.perf_counter() - t0)
    finally:
        cache.lengths[slot] = 0
        cache.release(slot)
    return chunk / max(statistics.median(times[1:]), 1e-9)


@dataclass(frozen=True)
class PrefillCost:
    """A prefill forward's cost: `fixed` seconds whatever its size (the weights read once, the layers' dispatch), and
    per prompt token of a chunk `context` tokens into a prompt, `base` (the linears, the same at any point) plus
    `per_context` per token before it (the attention reads them all)."""

    base: float
    per_context: float
    fixed: float = 0.0

    def seconds_per_token(self, context: int) -> float:
        return self.base + self.per_context * max(0, context)

    def seconds(self, chunks: list[tuple[int, int]]) -> float:
        """One forward over chunks (start, tokens): each chunk's tokens at its point of its prompt."""
        return self.fixed + sum(take * self.seconds_per_token(start) for start, take in chunks)


_PREFILL_COSTS: dict[tuple, PrefillCost] = {}
PREFILL_FAR = 4096  # the context of the second measured chunk (less where the capacity is smaller)
PREFILL_SMALL = 32  # the size of the small chunk that separates a forward's fixed cost from its cost per token


def measured_prefill_cost(target, cache, chunk: int = 256) -> PrefillCost:
    """A prefill forward's cost (`measure_prefill_cost`) for this model, dtype, thread count and capacity: measured
    once per machine (spyglass/kept.py), taken once per process."""
    key = (target.model_id, repr(target.args), str(target.dtype), target.linear_backend, torch.get_num_threads(),
           cache.capacity, _device_key(cache.device), chunk, PREFILL_SMALL, PREFILL_FAR)  # fmt: skip
    if key not in _PREFILL_COSTS:
        measured = kept("prefill cost", key, lambda: asdict(measure_prefill_cost(target, cache, chunk)))
        _PREFILL_COSTS[key] = PrefillCost(**measured)
    return _PREFILL_COSTS[key]


def measure_prefill_cost(target, cache, chunk: int = 256) -> PrefillCost:
    """From `measure_prefill_rate`: a `chunk`-token and a PREFILL_SMALL-token forward at the start of a prompt give the
    fixed cost and the cost per token (a line through the two), a `chunk`-token one PREFILL_FAR tokens in how that
    grows with the context. (bf16 SmolLM2 on 2 Zen 4 cores: a 96-token forward costs ~18% more per token than a
    256-token one.)"""
    chunk = max(1, min(chunk, cache.capacity // 2))
    far = max(1, min(PREFILL_FAR, cache.capacity - chunk))
    near = chunk / measure_prefill_rate(target, cache, chunk, context=0)  # seconds of the forward
    fixed = 0.0
    if chunk > PREFILL_SMALL:  # where the line through the two forwards' times meets 0 tokens
        small = PREFILL_SMALL / measure_prefill_rate(target, cache, PREFILL_SMALL, context=0)
        fixed = min(near, max(0.0, (small * chunk - near * PREFILL_SMALL) / (chunk - PREFILL_SMALL)))
    base = max(near - fixed, 1e-9) / chunk
    far_s = (chunk / measure_prefill_rate(target, cache, chunk, context=far) - fixed) / chunk
    return PrefillCost(base, max(0.0, far_s - base) / far, fixed)
