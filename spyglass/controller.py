"""Speculation that pays: the engine-level controller that sizes every drafter's tree.

Each extra verified token costs target time, by an amount that depends on the machine (fp32 vs bf16, AMX or
not), the context length and the batch. So the controller measures that cost once at start-up (`CostCurve`)
and, per sequence and step, keeps the tree nodes that maximise expected tokens per second:

    (1 + sum of the kept nodes' acceptance probabilities) / (time(verify the kept nodes) + drafting time)

(drafting time per kept depth for drafters that draft step by step and only as deep as asked: LongSpec, GLIDE)

which may be no node at all (plain decoding for that sequence). Node probabilities come from the drafter's
scores (`DraftTree.scores`, or a neutral prior when it has none), calibrated per depth against the acceptance
the sequence actually sees (depths left untried forget old evidence as fast as tried ones). A step whose tree
does not pay is decoded plainly, and the sequence stops drafting and probes again after a back-off (with
`persist`, only once drafting has stopped paying on average); a nearly free drafter, or a composite's model-free
part, keeps proposing meanwhile.
Pruning only drops nodes, so every guarantee of the verifier holds whatever the controller decides.
"""

from __future__ import annotations

import bisect
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from spyglass.drafters.base import DraftRequest
from spyglass.sequence import Sequence
from spyglass.tree import DRAFT_SOURCE, SPAN_SOURCE, DraftTree
from spyglass.verify import Accepted

PRIOR_CONDITIONAL = 0.6  # a node's chance given its parent, for drafters that give no scores
PSEUDO_COUNT = 0.2  # evidence the calibration starts with (observed = predicted)
CHEAP_DRAFT = 0.02  # drafting below this share of a decode step: propose every step, even between probes


def cpu_model() -> str:
    """The CPU model name, with family/model and the vector extensions that change matmul speed (a VM may show
    only "AMD EPYC" for both Zen 3 and Zen 4): recorded with every measurement, as the cost curve differs."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
            if key.strip() == "flags":
                break
    except OSError:
        pass
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
        contexts: tuple[int, ...] = (256, 2048, 6144),
        sizes: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 64),
        repeats: int = 3,
    ) -> CostCurve:
        """Time verify-shaped forwards on this machine: per context, `repeats` rounds over every size after a
        warm-up round, and each size's median round. Rounds interleave the sizes and the median ignores one
        lucky or unlucky pass: the controller compares the sizes' ratios, and a best-of-2 run was seen to
        price the 1-token step 10-20% below the decode steps that followed (so drafting looked dearer than it
        was: n-gram 0.98x against 1.62x on the same prompt in the next run). The prefix K/V are zeros: the
        attention's cost does not depend on their values. The
        sizes are dense where BLAS switches kernels (on one Sapphire Rapids: 3 tokens cost about 1.1 decode steps,
        4 about 1.5, 12 more than 16; on Zen 4 at 5.6K: 3 cost more than 4, and 5 as much as 6), which
        interpolating between neighbours would miss."""
        from spyglass.models.llama import Segment

        slot = cache.allocate()
        try:
            sizes = tuple(n for n in sizes if n <= cache.capacity // 2) or (1,)
            ctxs = sorted({min(c, cache.capacity - max(sizes)) for c in contexts if c > 0})
            for layer in range(cache.n_layers):
                k, v = cache.layer(slot, layer)
                k[:, : ctxs[-1]].zero_()
                v[:, : ctxs[-1]].zero_()
            vocab = target.args.vocab_size
            table = []
            for ctx in ctxs:
                cache.lengths[slot] = ctx
                segs = [Segment(slot, ctx, torch.randint(0, vocab, (n,)), torch.arange(ctx, ctx + n), None, "all")
                        for n in sizes]  # fmt: skip
                rounds = []
                for _ in range(repeats + 1):  # the first round warms up every shape
                    times = []
                    for seg in segs:
                        t0 = time.perf_counter()
                        target([seg], cache)
                        if cache.device.type == "cuda":  # the forward only queued its kernels
                            torch.cuda.synchronize(cache.device)
                        times.append(time.perf_counter() - t0)
                    rounds.append(times)
                table.append([statistics.median(col) for col in zip(*rounds[1:], strict=True)])
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


@dataclass
class _SeqControl:
    # per source, per depth: [decayed accepted count, decayed predicted count]
    evidence: dict[int, list[list[float]]] = field(default_factory=dict)
    plain_streak: int = 0  # consecutive steps without speculation
    backoff: int = 4  # plain steps before the next probe
    probing: bool = False  # this step is a probe
    draft_s: float = 0.0  # recent drafting time per step (per drafted depth with `cost_by_depth`), decayed mean
    kept_depth: int = 0  # depth of the subtree verified at the last step that kept one
    value: float = 0.0  # decayed mean gain of a step where every part drafted over a plain one, in plain steps
    free_only: bool = False  # this step asked for the free part alone (`DraftRequest.free_only`)


class SpeculationController:
    """Per sequence: how many of the drafter's nodes to verify this step (0 = plain decoding)."""

    # Keep drafting while drafted steps pay on average, instead of backing off after any step that did not. Off:
    # on one Zen 4 machine it never engaged for LongSpec or DFlash (drafting did not pay on average there) and moved
    # the composite's tau by +0.2 / +0.06 / -0.6 on three prompts (bench/probes/controller_rules.py --rule persist).
    persist = False
    # Calibrate each source of a merged tree (`DraftTree.sources`: a composite's suffix lookups, its learned draft,
    # both) on its own acceptance: their scores err differently, and one factor per depth would shrink the
    # trustworthy source's nodes and keep the other's. Measured neutral within noise for the composite on one AMX
    # Xeon (+1.4% over two runs, bench/probes/controller_rules.py --rule per_source).
    per_source = True
    # Most plain steps between probes (the wait doubles after each probe that accepts nothing). 16 was tried, so that a
    # learned draft whose first probes fall on output it cannot predict gets tried again sooner (LongSpec v12 on one
    # prompt: tau 2.01 with every node verified, 1.00 with the controller on): same speed on 11 prompts
    # (bench/probes/controller_rules.py --rule short_backoff).
    max_backoff = 64
    # Chains drafted one depth at a time (a drafter with `drafts_chain`) are sized by ChainDepthController (below)
    # instead: on one Zen 4 machine this per-step sizing reached 1.08x with LongSpec where a fixed depth-1 chain
    # would have made 1.23x (bench/probes/replay.py policies; bench/probes/controller_rules.py --rule chain_profile).
    chain_profile = True
    # Size a drafted tree by what verifying it adds from now on: the drafting time is spent either way. Off (the
    # earlier rule), that sunk time counted against every node too, so a step whose tree would have paid
    # its verification, though not its drafting as well, verified nothing (DFlash on Zen 4: ~1 drafted step in
    # 5). Whether drafting paid, its time included, still decides whether the next step drafts.
    marginal = True

    def __init__(
        self,
        curve: CostCurve,
        max_nodes: int | None = None,
        decay: float = 0.85,
        cost_by_depth: bool = False,
        free_part: bool = False,
    ) -> None:
        """`cost_by_depth`: the drafter runs one step per depth and drafts only as deep as `DraftRequest.depth`
        asks (LongSpec, GLIDE), so a shallow tree costs a fraction of a probe's deep one: charge drafting per kept
        depth. Otherwise drafting costs what it cost recently, whatever is kept. `free_part`: the drafter can
        propose from its model-free parts alone (`DraftRequest.free_only`), which it does between probes."""
        self.curve = curve
        self.cost_by_depth = cost_by_depth
        self.free_part = free_part
        self.max_nodes = max_nodes if max_nodes is not None else max(curve.sizes) - 1
        self.decay = decay

    def _state(self, seq: Sequence) -> _SeqControl:
        if seq.control is None:
            seq.control = _SeqControl()
        return seq.control

    def wants_draft(self, seq: Sequence) -> DraftRequest | None:
        """What the drafter should propose for `seq` this step; None while a sequence decodes plainly between probes:
        its drafter need not run at all (a drafter with a model-free part still proposes from that part alone,
        `DraftRequest.free_only`)."""
        st = self._state(seq)
        st.free_only = False
        if st.plain_streak == 0:
            # one level deeper than what paid last time (room to grow); drafting deeper would only be pruned
            return DraftRequest(st.kept_depth + 1 if st.kept_depth else None)
        st.probing = st.plain_streak >= st.backoff
        # A drafter that costs almost nothing (model-free lookups) proposes every step: the sizing then decides
        # from its scores whether this step's tree pays (a long fresh match often does, right after a miss).
        if st.probing or st.draft_s <= CHEAP_DRAFT * self.curve.time(1, seq.committed):
            return DraftRequest()
        if self.persist and st.value > 0:  # drafting has paid on average: one step that did not is no reason to stop
            return DraftRequest(st.kept_depth + 1 if st.kept_depth else None)
        # A composite's suffix lookup is as free as suffix drafting alone: only its learned part waits for a probe.
        st.free_only = self.free_part
        return DraftRequest(free_only=True) if self.free_part else None

    def skip(self, seq: Sequence) -> None:
        """The sequence decodes plainly this step without drafting."""
        self._state(seq).plain_streak += 1
        seq.stats.control.plain_steps += 1

    def calibration(self, seq: Sequence, depth: int, source: int = 0) -> float:
        """Observed / predicted acceptance of a source's nodes at a depth (1 with no evidence; deeper depths borrow
        the last seen)."""
        st = self._state(seq)
        by_depth = st.evidence.get(source)
        if not by_depth:
            return 1.0
        hits, expected = by_depth[min(depth, len(by_depth)) - 1]
        return (hits + PSEUDO_COUNT) / (expected + PSEUDO_COUNT)

    def _sources(self, tree: DraftTree) -> list[int]:
        return tree.sources if self.per_source and tree.sources is not None else [0] * len(tree)

    def conditionals(self, tree: DraftTree) -> list[float]:
        """Each node's chance of acceptance given its parent's, as the drafter estimates it.

        A chain verified by rejection sampling (it carries its proposal distributions) is sized from its shape
        and the sequence's history only: scores of its own sampled tokens would make the kept length depend on
        those tokens, and the kept tokens would no longer be distributed as the proposals the verifier assumes."""
        out = [1.0] * len(tree)
        if tree.scores is not None and tree.probs is None:
            s = tree.scores
            for i, p in enumerate(tree.parents[1:], start=1):
                out[i] = min(1.0, s[i] / s[p]) if s[p] > 0 else 0.0
            return out
        for children in tree.children():
            norm = sum(1 / (r + 1) for r in range(len(children)))
            for rank, c in enumerate(children):
                out[c] = PRIOR_CONDITIONAL / (rank + 1) / norm
        return out

    def scores(self, seq: Sequence, tree: DraftTree) -> list[float]:
        """Calibrated P(node accepted), by cumulating calibrated conditionals down the tree."""
        cond = self.conditionals(tree)
        depths, sources = tree.depths, self._sources(tree)
        s = [1.0] * len(tree)
        for i, p in enumerate(tree.parents[1:], start=1):
            s[i] = s[p] * min(1.0, cond[i] * self.calibration(seq, depths[i], sources[i]))
        return s

    def size(self, seq: Sequence, tree: DraftTree, batch: int) -> DraftTree:
        """The subtree of `tree` to verify this step."""
        st = self._state(seq)
        stats = seq.stats.control
        stats.proposed_nodes += len(tree) - 1
        if len(tree) == 1:
            return tree
        scores = self.scores(seq, tree)
        depths = tree.depths
        order = sorted(range(1, len(tree)), key=lambda i: -scores[i])[: self.max_nodes]
        ctx = seq.committed
        plain_rate = 1.0 / self._cost(1, ctx, batch)
        free = st.free_only
        draft_s = 0.0 if free else st.draft_s  # a model-free part alone costs next to nothing
        best_k, best_rate, best_total, gain, depth = 0, plain_rate, 0.0, 1.0, 0
        for k, i in enumerate(order, start=1):
            gain += scores[i]
            depth = max(depth, depths[i])
            draft = draft_s * depth if self.cost_by_depth else draft_s
            verify = self._cost(k + 1, ctx, batch)
            best_total = max(best_total, gain / (verify + draft))  # drafting is part of this price
            rate = gain / (verify if self.marginal else verify + draft)
            if rate > best_rate:
                best_k, best_rate = k, rate
        paid = best_total > plain_rate  # drafting this step beat plain decoding, its own time included
        if not free:  # what drafting with every part bought lately: the tree's gain, or the time lost
            spent = st.draft_s * (tree.max_depth if self.cost_by_depth else 1)
            step_gain = best_total / plain_rate - 1.0 if paid else -spent * plain_rate
            st.value = self.decay * st.value + (1.0 - self.decay) * step_gain
        if st.probing:
            best_k = max(best_k, min(len(order), 4))  # a small probe: enough to re-measure the first depths
            stats.probe_steps += 1
        elif best_k == 0:
            st.plain_streak += 1
            stats.plain_steps += 1
            return DraftTree.root_only(int(tree.tokens[0]))
        # A tree that paid its drafting too: speculate again next step (else wait for a probe). A model-free part's
        # tree brings every part back only while their drafting has paid lately: a learned part that costs about
        # a decode step and rarely pays (TokenSwift's partial-cache pass at T=1) waits for its probes.
        if not st.probing:
            again = paid and (not free or st.value >= 0.0)
            st.plain_streak = 0 if again else st.plain_streak + 1
        stats.drafted_steps += 1
        stats.verified_nodes += best_k
        kept = tree.subtree(tree.best_nodes(scores, best_k))
        st.kept_depth = kept.max_depth
        return kept

    def note_draft_time(self, seq: Sequence, seconds: float, depth: int = 1) -> None:
        """The drafter's time for this sequence in this step (a tree `depth` deep): a slow drafter must earn its
        own cost too. Not from a step where only a model-free part drafted: it says nothing of the whole cost."""
        st = self._state(seq)
        if st.free_only:
            return
        cost = seconds / max(depth, 1) if self.cost_by_depth else seconds
        st.draft_s = cost if st.draft_s == 0.0 else 0.7 * st.draft_s + 0.3 * cost

    def _cost(self, tokens: int, context: int, batch: int) -> float:
        """This sequence's share of a step in which every sequence of the batch verifies about as many tokens."""
        return self.curve.time(tokens * batch, context) / batch

    def observe(self, seq: Sequence, tree: DraftTree, accepted: Accepted) -> None:
        """Update the sequence's per-depth calibration from a verified tree and its accepted path."""
        st = self._state(seq)
        if len(tree) == 1:
            return
        cond = self.conditionals(tree)
        kids = tree.children()
        sources = self._sources(tree)
        path = accepted.path
        tried: set[tuple[int, int]] = set()
        for d in range(1, tree.max_depth + 1):
            if d - 1 >= len(path):  # the path stopped before this depth: no trial here
                break
            parent = path[d - 1]
            took = path[d] if d < len(path) else -1
            predicted: dict[int, float] = {}
            for c in kids[parent]:
                predicted[sources[c]] = predicted.get(sources[c], 0.0) + cond[c]
            for src, p in predicted.items():  # one trial per source with candidates here
                by_depth = st.evidence.setdefault(src, [])
                while len(by_depth) < d:  # a depth's first trial starts from the evidence one level up
                    by_depth.append(list(by_depth[-1]) if by_depth else [0.0, 0.0])
                ev = by_depth[d - 1]
                ev[0] = self.decay * ev[0] + (1.0 if took >= 0 and sources[took] == src else 0.0)
                ev[1] = self.decay * ev[1] + min(1.0, p)
                tried.add((src, d))
        # What was not tried this step forgets too: evidence from long ago must not keep a depth (or a source)
        # pruned, and so untried, for the rest of the request after a few early misses.
        for src, by_depth in st.evidence.items():
            for d, ev in enumerate(by_depth, start=1):
                if (src, d) not in tried:
                    ev[0] *= self.decay
                    ev[1] *= self.decay
        if st.probing:  # a probe that found acceptance ends the plain phase; one that did not backs off further
            st.probing = False
            if accepted.num_drafted_accepted > 0:
                st.plain_streak, st.backoff = 0, 4
            else:
                st.plain_streak, st.backoff = 1, min(self.max_backoff, st.backoff * 2)


# A chain's node as the chain controller sees it: a span's (or copied token's) conditional from its score (None: a
# drafted token, sized by the profile), and whether its verdict is evidence of the drafted profile
_Node = tuple[float | None, bool]


@dataclass
class _ChainControl:
    # per depth: [decayed acceptances, decayed trials] of a drafted token whose parent was accepted
    accepted: list[list[float]] = field(default_factory=list)
    # [decayed acceptances, decayed predicted] of span nodes (copied from the context, scored per step)
    span: list[float] = field(default_factory=lambda: [0.0, 0.0])
    # drafted tokens not verified, scored once committed: (index in seq.tokens of the token before them, their
    # tokens, the depth of the first, their `_Node`s)
    pending: list[tuple[int, list[int], int, list[_Node]]] = field(default_factory=list)
    deepest: int = 0  # the deepest chain the drafter has proposed
    verified: int = 0  # the depth verified at this step
    rest: tuple | None = None  # this step's unverified drafted tokens (as `pending`), pending after observe
    nodes: list[_Node] = field(default_factory=list)  # this step's chain nodes by depth
    drafted: int = 0  # drafted steps so far (every `explore`-th drafts one depth deeper)
    plain_streak: int = 0
    draft_s: float = 0.0  # drafting time (per depth with `cost_by_depth`), decayed mean
    free_only: bool = False  # this step asked for the free part alone (`DraftRequest.free_only`)


class ChainDepthController(SpeculationController):
    """Sizes a drafted chain (LongSpec, GLIDE, a small LM: one token per depth) by the acceptance profile the
    sequence has shown, not by the draft's scores at this step.

    Why: the per-step sizing of SpeculationController verifies nothing when a step's scores are low, then stops
    drafting until a probe, and learns only from what it verified; a learned draft's scores are rough (LongSpec
    v10's tokens scored 0.2-0.3 were accepted 40% of the time), so a few early misses kept it plain. Here each
    step verifies the depth D that maximises

        (1 + sum over d <= D of P(the first d drafted tokens accepted)) / (verify D + 1 tokens + drafting)

    (D = 0: plain decoding, where one depth is still drafted every `probe` steps), and every drafted token counts
    as evidence: a verified one by its verdict, an unverified one (a probe's, or one drafted a depth beyond D every
    `explore`-th step) once the target has committed the token at its place (under greedy decoding exactly what
    verification would have said; under sampling an under-count, so a sampled sequence's probes verify their first
    token). D depends on the sequence's history only, so a sampled chain keeps the distribution the verifier
    assumes.

    A chain may end in a span copied from the context (`DraftTree.sources` SPAN_SOURCE, `longspec-span`,
    `dflash-span`): those nodes cost no drafting and are right or wrong by how far the copy's source matches, which
    their scores tell step by step (suffix lookup's estimate), so they enter the sum with their own conditional,
    calibrated by how the sequence's spans have fared (token-matched chains only: a sampled chain's sizing stays
    history-only). A copied drafted token (COPY_SOURCE) is priced so too, and counts for the profile as well. A
    drafter with a model-free part (a copy that goes on) proposes from it alone between probes, priced without
    the draft step's time; and an unverified token counts as soon as the target has committed its place, so a
    probe's chain is evidence from the next step on, not once all of it is committed.
    """

    explore = 8
    probe = 8
    prior = 0.4  # a depth's acceptance before any evidence, worth one trial
    profile_decay = 0.95  # evidence fades over ~20 chains (0.85, the per-step sizing's, followed noise: -3%)
    # the spans' calibration starts as if one predicted token had come true: at PSEUDO_COUNT's 0.2 a single early
    # miss of a token predicted 0.5 cut every later span's conditional to 0.29, and deep spans went unverified
    span_prior = 1.0

    def _state(self, seq: Sequence) -> _ChainControl:
        if seq.control is None:
            seq.control = _ChainControl()
        return seq.control

    def _count(self, st: _ChainControl, depth: int, hit: bool, node: _Node) -> None:
        """A verdict on a chain's node at `depth`: a span's conditional counts for the spans' calibration, a drafted
        token for the profile (a copied token for both)."""
        span, drafted = node
        if span is not None:
            st.span[0] = self.profile_decay * st.span[0] + float(hit)
            st.span[1] = self.profile_decay * st.span[1] + span
        if not drafted:
            return
        while len(st.accepted) < depth:
            st.accepted.append([self.prior, 1.0])
        ev = st.accepted[depth - 1]
        ev[0] = self.profile_decay * ev[0] + float(hit)
        ev[1] = self.profile_decay * ev[1] + 1.0

    def _resolve(self, seq: Sequence, st: _ChainControl) -> None:
        """Score the unverified drafted tokens whose places the target has committed since."""
        last = seq.num_tokens - 1  # the root is the target's choice too
        still = []
        for before, chain, first, nodes in st.pending:
            # counted as soon as committed: a probe's long chain is evidence from the next step on
            committed = seq.tokens[before + 1 : min(before + 1 + len(chain), last + 1)].tolist()
            for k, (drafted, actual) in enumerate(zip(chain, committed, strict=False)):
                self._count(st, first + k, drafted == actual, nodes[k])
                if drafted != actual:
                    break
            else:
                n = len(committed)
                if n < len(chain):
                    still.append((before + n, chain[n:], first + n, nodes[n:]))
        st.pending = still

    @staticmethod
    def _nodes(tree: DraftTree) -> list[_Node]:
        """Per depth of a chain, its node: a span's (or copied token's) conditional from its score, None for a
        drafted token or without spans; and whether it is evidence of the drafted profile."""
        if tree.sources is None or tree.scores is None or tree.probs is not None:
            return [(None, True)] * tree.max_depth
        s, src = tree.scores, tree.sources
        return [
            (min(1.0, s[i] / s[i - 1]) if src[i] & SPAN_SOURCE and s[i - 1] > 0 else None, bool(src[i] & DRAFT_SOURCE))
            for i in range(1, len(tree))
        ]

    def _best_depth(
        self,
        st: _ChainControl,
        context: int,
        batch: int,
        limit: int,
        nodes: list[_Node] | None = None,
        free: bool = False,
    ) -> int:
        """`nodes`: the chain's, whose span conditionals are calibrated here by the sequence's spans so far; `free`:
        no draft step was run (a model-free proposal)."""
        draft_s = 0.0 if free else st.draft_s
        best, best_rate = 0, 1.0 / self._cost(1, context, batch)
        gain = p = 1.0
        calibration = (st.span[0] + self.span_prior) / (st.span[1] + self.span_prior)
        for d in range(1, limit + 1):
            if nodes and nodes[d - 1][0] is not None:
                p *= min(1.0, nodes[d - 1][0] * calibration)
            else:
                hits, trials = st.accepted[d - 1] if d <= len(st.accepted) else (self.prior, 1.0)
                p *= hits / trials
            gain += p
            rate = gain / (self._cost(d + 1, context, batch) + (d if self.cost_by_depth else 1) * draft_s)
            if rate > best_rate:
                best, best_rate = d, rate
        return best

    def wants_draft(self, seq: Sequence) -> DraftRequest | None:
        st = self._state(seq)
        self._resolve(seq, st)
        st.free_only = False
        if st.deepest == 0:  # the first step drafts as deep as the drafter goes: evidence for every depth
            return DraftRequest()
        depth = self._best_depth(st, seq.committed, 1, st.deepest)
        if depth == 0:
            if st.plain_streak >= self.probe:
                return DraftRequest(1)
            st.free_only = self.free_part  # a model-free part (a copy that goes on) still proposes
            return DraftRequest(1, free_only=True) if self.free_part else None
        st.drafted += 1
        return DraftRequest(min(st.deepest, depth + (st.drafted % self.explore == 0)))

    def skip(self, seq: Sequence) -> None:
        self._state(seq).plain_streak += 1
        seq.stats.control.plain_steps += 1

    def size(self, seq: Sequence, tree: DraftTree, batch: int) -> DraftTree:
        st = self._state(seq)
        stats = seq.stats.control
        stats.proposed_nodes += len(tree) - 1
        st.deepest = max(st.deepest, tree.max_depth)
        st.nodes = self._nodes(tree)
        st.verified = self._best_depth(st, seq.committed, batch, tree.max_depth, st.nodes, st.free_only)
        probe = st.verified == 0 and st.plain_streak >= self.probe
        if probe and not seq.params.greedy:
            # A sampled token matches the one the target then samples less often than rejection sampling would
            # accept it (sum p*q against sum min(p, q)), so unverified probes would keep a sampled chain plain:
            # verify the probe's first token (a decision from the history only, so still exact).
            st.verified = min(1, tree.max_depth)
        if tree.max_depth > st.verified:  # the unverified rest, scored once committed
            rest = [int(t) for t, d in zip(tree.tokens.tolist(), tree.depths, strict=True) if d > st.verified]
            st.rest = (seq.num_tokens - 1 + st.verified, rest, st.verified + 1, st.nodes[st.verified :])
        if probe:
            stats.probe_steps += 1
        if st.verified == 0:
            if probe:  # drafted to be scored, not verified
                stats.plain_steps += 1
                st.plain_streak = 0
            else:
                self.skip(seq)
            return DraftTree.root_only(int(tree.tokens[0]))
        st.plain_streak = 0
        stats.drafted_steps += 1
        stats.verified_nodes += st.verified
        return tree.subtree([i for i, d in enumerate(tree.depths) if d <= st.verified])

    def observe(self, seq: Sequence, tree: DraftTree, accepted: Accepted) -> None:
        """Count the verified depths' verdicts; the unverified rest of the chain stays pending only if every
        verified token was accepted (otherwise its parent was not)."""
        st = self._state(seq)
        a = accepted.num_drafted_accepted
        for d in range(1, min(a + 1, st.verified) + 1):
            self._count(st, d, d <= a, st.nodes[d - 1])
        if st.rest is not None and a == st.verified:
            st.pending.append(st.rest)
        st.verified, st.rest = 0, None


def controller_for(drafter, curve: CostCurve) -> SpeculationController:
    """The controller a drafter gets: ChainDepthController for a chain (`drafts_chain`, unless `chain_profile` is
    off), SpeculationController otherwise."""
    traits = drafter.traits
    chain = traits.drafts_chain and SpeculationController.chain_profile
    return (ChainDepthController if chain else SpeculationController)(
        curve, cost_by_depth=traits.cost_by_depth, free_part=traits.free == "part"
    )


_CURVES: dict[tuple, CostCurve] = {}


def measured_curves(target) -> list[CostCurve]:
    """Every cost curve measured in this process for `target` (results files record them)."""
    return [curve for key, curve in _CURVES.items() if key[0] == target.model_id]


def measured_curve(target, cache) -> CostCurve:
    """The cost curve for this model, dtype, thread count and capacity, measured once per process."""
    key = (
        target.model_id,
        str(target.dtype),
        target.linear_backend,
        getattr(target, "attention_plan", 1),
        bool(getattr(target.layers[0], "native", False)),  # the CPU kernels on or off (kernels/cpu.py)
        torch.get_num_threads(),
        cache.capacity,
        str(cache.device),
    )
    if key not in _CURVES:
        _CURVES[key] = CostCurve.measure(target, cache)
    return _CURVES[key]
