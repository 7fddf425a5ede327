"""Speculation that pays: the engine-level controller that sizes every drafter's tree.

Per sequence and step it keeps the part of the drafter's tree that maximises expected tokens per second, priced on
the verify-cost curve measured at start-up (spyglass/cost.py); that may be no node at all (plain decoding for that
sequence). Two sizing policies answer the engine (`Controller`), and `controller_for` picks one per drafter
(in spyglass/chain_controller.py, which sees both): `SpeculationController` sizes scored trees node by node,
`ChainDepthController` sizes chains drafted one token per depth by the acceptance profile the sequence has shown.
Every tuned constant is in `ControllerConfig`. Pruning only drops nodes, so every guarantee of the verifier holds
whatever the controller decides.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from spyglass.cost import BatchShape, CostCurve, StepCost
from spyglass.drafters.base import DraftRequest
from spyglass.sequence import Sequence
from spyglass.tree import DraftTree
from spyglass.verify import Accepted


@dataclass(frozen=True)
class ControllerConfig:
    """Every tuned constant of the two sizing policies, each beside why it has its value (a served replica reports
    it in its info). Rules measured against an alternative are fixed in the code, each beside its measurement."""

    # -- scored trees (SpeculationController)
    prior_conditional: float = 0.6  # a node's chance given its parent, for drafters that give no scores
    pseudo_count: float = 0.2  # evidence the calibration starts with (observed = predicted)
    decay: float = 0.85  # per-step decay of the calibration's evidence, tried depths and untried alike
    # drafting below this share of a decode step: propose every step, even between probes (the sizing then decides
    # whether the tree pays: a long fresh match often does, right after a miss)
    cheap_draft: float = 0.02
    first_backoff: int = 4  # plain steps before the first probe, and again after a probe that found acceptance
    # most plain steps between probes (doubling after each probe that accepts nothing): 16, to try a learned draft
    # again sooner after early misses, made the same speed on 11 prompts (controller_rules.py --rule short_backoff)
    max_backoff: int = 64
    probe_nodes: int = 4  # a probe verifies at least this many nodes: enough to re-measure the first depths
    # -- both policies
    draft_time_weight: float = 0.3  # weight of the latest step in the decayed mean drafting time
    # -- chains by acceptance profile (ChainDepthController)
    chain_prior: float = 0.4  # a depth's acceptance before any evidence, worth one trial
    profile_decay: float = 0.95  # evidence fades over ~20 chains (0.85, the per-step sizing's, followed noise: -3%)
    # the spans' calibration starts as if one predicted token had come true: at pseudo_count's 0.2 a single early
    # miss of a token predicted 0.5 cut every later span's conditional to 0.29, and deep spans went unverified
    span_prior: float = 1.0
    chain_probe: int = 8  # plain steps before a chain that does not pay drafts a probe
    chain_explore: int = 8  # every this many drafted steps a chain drafts one depth deeper than pays


DEFAULT_CONFIG = ControllerConfig()


class Controller(Protocol):
    """What the engine asks a sizing policy per sequence and step: whether the drafter runs (`wants_draft`, which
    returns the `DraftRequest` for it) or the sequence decodes plainly without drafting
    (`skip`); the drafting time (`note_draft_time`); the subtree to verify (`size`; the root alone: plain
    decoding); and the verdict to learn from (`observe`)."""

    curve: CostCurve
    last_gain: float  # the tokens the tree `size` returned last is expected to make (1: plain)

    def wants_draft(self, seq: Sequence, batch: int = 1) -> DraftRequest | None: ...

    def skip(self, seq: Sequence) -> None: ...

    def note_draft_time(self, seq: Sequence, seconds: float, depth: int = 1) -> None: ...

    def size(self, seq: Sequence, tree: DraftTree, batch: int | BatchShape) -> DraftTree: ...

    def observe(self, seq: Sequence, tree: DraftTree, accepted: Accepted) -> None: ...


class BasePolicy:
    """What both policies share: the cost model, the drafter's traits, and per sequence the drafting time and
    the plain steps in a row (`plain_streak`, `draft_s` of the policy's state, made by `_new_state`).

    `cost_by_depth`: the drafter runs one step per depth and drafts only as deep as `DraftRequest.depth` asks
    (LongSpec, GLIDE), so a shallow tree costs a fraction of a probe's deep one: drafting is charged per kept
    depth. Otherwise drafting costs what it cost recently, whatever is kept. `free_part`: the drafter can propose
    from its model-free parts alone (`DraftRequest.free_only`), which it does between probes."""

    def __init__(
        self,
        curve: CostCurve,
        config: ControllerConfig = DEFAULT_CONFIG,
        cost_by_depth: bool = False,
        free_part: bool = False,
    ) -> None:
        self.curve = curve
        self.config = config
        self.cost = StepCost(curve, cost_by_depth)
        self.free_part = free_part
        self.last_gain = 1.0

    def _state(self, seq: Sequence):
        if seq.control is None:
            seq.control = self._new_state()
        return seq.control

    def skip(self, seq: Sequence) -> None:
        """The sequence decodes plainly this step without drafting."""
        self._state(seq).plain_streak += 1
        seq.stats.control.plain_steps += 1

    def note_draft_time(self, seq: Sequence, seconds: float, depth: int = 1) -> None:
        """The drafter's time for this sequence in this step (a tree `depth` deep): a slow drafter must earn its
        own cost too. Not from a step where only a model-free part drafted: it says nothing of the whole cost."""
        st = self._state(seq)
        if st.free_only:
            return
        cost, w = self.cost.per_draft(seconds, depth), self.config.draft_time_weight
        st.draft_s = cost if st.draft_s == 0.0 else (1 - w) * st.draft_s + w * cost


@dataclass
class _SeqControl:
    # per source, per depth: [decayed accepted count, decayed predicted count]
    evidence: dict[int, list[list[float]]] = field(default_factory=dict)
    plain_streak: int = 0  # consecutive steps without speculation
    backoff: int = 0  # plain steps before the next probe (`first_backoff` to start with)
    probing: bool = False  # this step is a probe
    draft_s: float = 0.0  # recent drafting time per step (per drafted depth with `cost_by_depth`), decayed mean
    kept_depth: int = 0  # depth of the subtree verified at the last step that kept one
    value: float = 0.0  # decayed mean gain of a step where every part drafted over a plain one, in plain steps
    free_only: bool = False  # this step asked for the free part alone (`DraftRequest.free_only`)


class SpeculationController(BasePolicy):
    """Scored trees, per sequence: how many of the drafter's nodes to verify this step (0 = plain decoding), those
    that maximise (1 + sum of the kept nodes' acceptance probabilities) / time(verify the kept nodes). Node
    probabilities come from the drafter's scores (`DraftTree.scores`, or a neutral prior when it has none),
    calibrated per source and depth against the acceptance the sequence actually sees. A step whose tree does not
    pay, its drafting time included, is decoded plainly, and the sequence stops drafting and probes again after a
    back-off; a nearly free drafter, or a composite's model-free part, keeps proposing meanwhile."""

    def _new_state(self) -> _SeqControl:
        return _SeqControl(backoff=self.config.first_backoff)

    def wants_draft(self, seq: Sequence, batch: int = 1) -> DraftRequest | None:
        """What the drafter should propose for `seq` this step (in a batch of `batch` sequences); None while a
        sequence decodes plainly between probes: its drafter need not run at all (a drafter with a model-free part
        still proposes from that part alone, `DraftRequest.free_only`)."""
        st = self._state(seq)
        st.free_only = False
        if st.plain_streak == 0:
            # one level deeper than what paid last time (room to grow); drafting deeper would only be pruned
            return DraftRequest(st.kept_depth + 1 if st.kept_depth else None)
        st.probing = st.plain_streak >= st.backoff
        # A drafter that costs almost nothing (model-free lookups) proposes every step: the sizing then decides
        # from its scores whether this step's tree pays (a long fresh match often does, right after a miss).
        # "Almost nothing" is relative to the sequence's share of a batched decode step, which shrinks as the batch
        # grows: at 4-8 streams a lookup that was 2% of a lone decode step is 6-12% of its share.
        if st.probing or st.draft_s <= self.config.cheap_draft * self.cost.share(seq.committed, batch):
            return DraftRequest()
        # Else wait for a probe, even if drafting has paid on average (drafting on through such steps never engaged
        # for LongSpec or DFlash on one Zen 4 machine, and moved the composite's tau by +0.2 / +0.06 / -0.6 on three
        # prompts). A composite's suffix lookup is as free as suffix drafting alone: only its learned part waits.
        st.free_only = self.free_part
        return DraftRequest(free_only=True) if self.free_part else None

    def calibration(self, seq: Sequence, depth: int, source: int = 0) -> float:
        """Observed / predicted acceptance of a source's nodes at a depth (1 with no evidence; deeper depths borrow
        the last seen)."""
        st = self._state(seq)
        by_depth = st.evidence.get(source)
        if not by_depth:
            return 1.0
        hits, expected = by_depth[min(depth, len(by_depth)) - 1]
        return (hits + self.config.pseudo_count) / (expected + self.config.pseudo_count)

    @staticmethod
    def _sources(tree: DraftTree) -> list[int]:
        """Each source of a merged tree (a composite's parts) is calibrated on its own: their scores err differently
        (against one factor per depth for all: +1.4% for the composite on one AMX Xeon, within noise)."""
        return tree.sources if tree.sources is not None else [0] * len(tree)

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
                out[c] = self.config.prior_conditional / (rank + 1) / norm
        return out

    def scores(self, seq: Sequence, tree: DraftTree) -> list[float]:
        """Calibrated P(node accepted), by cumulating calibrated conditionals down the tree."""
        cond = self.conditionals(tree)
        depths, sources = tree.depths, self._sources(tree)
        s = [1.0] * len(tree)
        for i, p in enumerate(tree.parents[1:], start=1):
            s[i] = s[p] * min(1.0, cond[i] * self.calibration(seq, depths[i], sources[i]))
        return s

    def size(self, seq: Sequence, tree: DraftTree, batch: int | BatchShape) -> DraftTree:
        """The subtree of `tree` to verify this step, priced in a batch of `batch` rows like it or, given the rest of
        the step's batch (`BatchShape`), for the whole step's expected tokens per second."""
        st = self._state(seq)
        stats = seq.stats.control
        stats.proposed_nodes += len(tree) - 1
        self.last_gain = 1.0
        if len(tree) == 1:
            return tree
        scores = self.scores(seq, tree)
        depths = tree.depths
        # at most the largest tree the curve was measured for
        order = sorted(range(1, len(tree)), key=lambda i: -scores[i])[: max(self.curve.sizes) - 1]
        ctx, cost = seq.committed, self.cost
        plain_rate = cost.step_rate(1.0, 1, ctx, batch)
        free = st.free_only
        draft_s = 0.0 if free else st.draft_s  # a model-free part alone costs next to nothing
        best_k, best_rate, best_total, gain, depth = 0, plain_rate, 0.0, 1.0, 0
        for k, i in enumerate(order, start=1):
            gain += scores[i]
            depth = max(depth, depths[i])
            drafting = cost.drafting(draft_s, depth)
            best_total = max(best_total, cost.step_rate(gain, k + 1, ctx, batch, drafting))  # drafting included
            # what verifying adds from now on: the drafting is spent (charged to every node too, DFlash on Zen 4
            # verified nothing on ~1 drafted step in 5 whose tree paid its verification)
            rate = cost.step_rate(gain, k + 1, ctx, batch)
            if rate > best_rate:
                best_k, best_rate = k, rate
        paid = best_total > plain_rate  # drafting this step beat plain decoding, its own time included
        if not free:  # what drafting with every part bought lately: the tree's gain, or the time lost
            spent = cost.drafting(st.draft_s, tree.max_depth)
            step_gain = best_total / plain_rate - 1.0 if paid else -spent * plain_rate
            st.value = self.config.decay * st.value + (1.0 - self.config.decay) * step_gain
        if st.probing:
            best_k = max(best_k, min(len(order), self.config.probe_nodes))  # a small probe
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
        kept_nodes = tree.best_nodes(scores, best_k)
        self.last_gain = 1.0 + sum(scores[i] for i in kept_nodes if i)
        kept = tree.subtree(kept_nodes)
        st.kept_depth = kept.max_depth
        return kept

    def observe(self, seq: Sequence, tree: DraftTree, accepted: Accepted) -> None:
        """Update the sequence's per-depth calibration from a verified tree and its accepted path."""
        st = self._state(seq)
        if len(tree) == 1:
            return
        decay = self.config.decay
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
                ev[0] = decay * ev[0] + (1.0 if took >= 0 and sources[took] == src else 0.0)
                ev[1] = decay * ev[1] + min(1.0, p)
                tried.add((src, d))
        # What was not tried this step forgets too: evidence from long ago must not keep a depth (or a source)
        # pruned, and so untried, for the rest of the request after a few early misses.
        for src, by_depth in st.evidence.items():
            for d, ev in enumerate(by_depth, start=1):
                if (src, d) not in tried:
                    ev[0] *= decay
                    ev[1] *= decay
        if st.probing:  # a probe that found acceptance ends the plain phase; one that did not backs off further
            st.probing = False
            if accepted.num_drafted_accepted > 0:
                st.plain_streak, st.backoff = 0, self.config.first_backoff
            else:
                st.plain_streak, st.backoff = 1, min(self.config.max_backoff, st.backoff * 2)


def size_batch(rows: list[tuple[Sequence, DraftTree | None, Controller | None]]) -> list[DraftTree]:
    """Each row's tree to verify in one step: (sequence, its drafter's tree or None when it did not draft, its
    controller or None when sizing is off), sized for the step's whole batch, every method's. The rows are sized
    one after another, each against the rows sized before it and the plain rows still to come (`BatchShape`), so a
    row keeps only nodes that raise the whole step's expected tokens per second on the measured cost curve: the
    step expects at least plain decoding's tokens per second for this batch (a probe aside)."""
    shape = BatchShape.plain([seq.committed for seq, _, _ in rows])
    trees = []
    for seq, tree, ctl in rows:
        if tree is None:  # plain decoding, or the controller keeps this sequence plain until its next probe
            if ctl is not None:
                ctl.skip(seq)
            tree = DraftTree.root_only(seq.root)
        elif ctl is not None:
            others = shape.plus(-1, seq.committed, -1.0)  # this row leaves the plain rows
            tree = ctl.size(seq, tree, others)
            shape = others.plus(len(tree), seq.committed, ctl.last_gain)
        trees.append(tree)
    return trees
