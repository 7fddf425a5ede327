"""Chains sized by their acceptance profile: the speculation controller's policy for drafters that draft one token
per depth (`drafts_chain`: LongSpec, GLIDE, a small LM, DFlash's chain). `controller_for` (below,
where both policies are visible) gives it to them; every tuned constant is in `ControllerConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field

from spyglass.controller import DEFAULT_CONFIG, BasePolicy, Controller, ControllerConfig, SpeculationController
from spyglass.cost import BatchShape, CostCurve
from spyglass.drafters.base import DraftRequest
from spyglass.sequence import Sequence
from spyglass.tree import DRAFT_SOURCE, SPAN_SOURCE, DraftTree
from spyglass.verify import Accepted

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
    drafted: int = 0  # drafted steps so far (every `chain_explore`-th drafts one depth deeper)
    plain_streak: int = 0
    draft_s: float = 0.0  # drafting time (per depth with `cost_by_depth`), decayed mean
    free_only: bool = False  # this step asked for the free part alone (`DraftRequest.free_only`)


class ChainDepthController(BasePolicy):
    """Sizes a drafted chain (LongSpec, GLIDE, a small LM: one token per depth) by the acceptance profile the
    sequence has shown, not by the draft's scores at this step.

    Why: the per-step sizing of SpeculationController verifies nothing when a step's scores are low, then stops
    drafting until a probe, and learns only from what it verified; a learned draft's scores are rough (LongSpec
    v10's tokens scored 0.2-0.3 were accepted 40% of the time), so a few early misses kept it plain. Here each
    step verifies the depth D that maximises

        (1 + sum over d <= D of P(the first d drafted tokens accepted)) / (verify D + 1 tokens + drafting)

    (D = 0: plain decoding, where one depth is still drafted every `chain_probe` steps), and every drafted token
    counts as evidence: a verified one by its verdict, an unverified one (a probe's, or one drafted a depth beyond
    D every `chain_explore`-th step) once the target has committed the token at its place (under greedy decoding
    exactly what verification would have said; under sampling an under-count, so a sampled sequence's probes verify
    their first token). D depends on the sequence's history only, so a sampled chain keeps the distribution the
    verifier assumes.

    A chain may end in a span copied from the context (`DraftTree.sources` SPAN_SOURCE, `longspec-span`,
    `dflash-span`): those nodes cost no drafting and are right or wrong by how far the copy's source matches, which
    their scores tell step by step (suffix lookup's estimate), so they enter the sum with their own conditional,
    calibrated by how the sequence's spans have fared (token-matched chains only: a sampled chain's sizing stays
    history-only). A copied drafted token (COPY_SOURCE) is priced so too, and counts for the profile as well. A
    drafter with a model-free part (a copy that goes on) proposes from it alone between probes, priced without
    the draft step's time; and an unverified token counts as soon as the target has committed its place, so a
    probe's chain is evidence from the next step on, not once all of it is committed.
    """

    def _new_state(self) -> _ChainControl:
        return _ChainControl()

    def _count(self, st: _ChainControl, depth: int, hit: bool, node: _Node) -> None:
        """A verdict on a chain's node at `depth`: a span's conditional counts for the spans' calibration, a drafted
        token for the profile (a copied token for both)."""
        span, drafted = node
        decay = self.config.profile_decay
        if span is not None:
            st.span[0] = decay * st.span[0] + float(hit)
            st.span[1] = decay * st.span[1] + span
        if not drafted:
            return
        while len(st.accepted) < depth:
            st.accepted.append([self.config.chain_prior, 1.0])
        ev = st.accepted[depth - 1]
        ev[0] = decay * ev[0] + float(hit)
        ev[1] = decay * ev[1] + 1.0

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
        batch: int | BatchShape,
        limit: int,
        nodes: list[_Node] | None = None,
        free: bool = False,
    ) -> int:
        """`nodes`: the chain's, whose span conditionals are calibrated here by the sequence's spans so far; `free`:
        no draft step was run (a model-free proposal). Sets `gains` (per depth, the tokens expected)."""
        cost, c = self.cost, self.config
        draft_s = 0.0 if free else st.draft_s
        best, best_rate = 0, cost.step_rate(1.0, 1, context, batch)
        gain = p = 1.0
        self.gains = [1.0]
        calibration = (st.span[0] + c.span_prior) / (st.span[1] + c.span_prior)
        for d in range(1, limit + 1):
            if nodes and nodes[d - 1][0] is not None:
                p *= min(1.0, nodes[d - 1][0] * calibration)
            else:
                hits, trials = st.accepted[d - 1] if d <= len(st.accepted) else (c.chain_prior, 1.0)
                p *= hits / trials
            gain += p
            self.gains.append(gain)
            rate = cost.step_rate(gain, d + 1, context, batch, cost.drafting(draft_s, d))
            if rate > best_rate:
                best, best_rate = d, rate
        return best

    def wants_draft(self, seq: Sequence, batch: int = 1) -> DraftRequest | None:
        st = self._state(seq)
        self._resolve(seq, st)
        st.free_only = False
        if st.deepest == 0:  # the first step drafts as deep as the drafter goes: evidence for every depth
            return DraftRequest()
        depth = self._best_depth(st, seq.committed, batch, st.deepest)
        if depth == 0:
            if st.plain_streak >= self.config.chain_probe:
                return DraftRequest(1)
            st.free_only = self.free_part  # a model-free part (a copy that goes on) still proposes
            return DraftRequest(1, free_only=True) if self.free_part else None
        st.drafted += 1
        return DraftRequest(min(st.deepest, depth + (st.drafted % self.config.chain_explore == 0)))

    def size(self, seq: Sequence, tree: DraftTree, batch: int | BatchShape) -> DraftTree:
        st = self._state(seq)
        stats = seq.stats.control
        stats.proposed_nodes += len(tree) - 1
        st.deepest = max(st.deepest, tree.max_depth)
        st.nodes = self._nodes(tree)
        st.verified = self._best_depth(st, seq.committed, batch, tree.max_depth, st.nodes, st.free_only)
        probe = st.verified == 0 and st.plain_streak >= self.config.chain_probe
        if probe and not seq.params.greedy:
            # A sampled token matches the one the target then samples less often than rejection sampling would
            # accept it (sum p*q against sum min(p, q)), so unverified probes would keep a sampled chain plain:
            # verify the probe's first token (a decision from the history only, so still exact).
            st.verified = min(1, tree.max_depth)
        self.last_gain = self.gains[min(st.verified, len(self.gains) - 1)]
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


def controller_for(drafter, curve: CostCurve, config: ControllerConfig = DEFAULT_CONFIG) -> Controller:
    """The controller a drafter gets: ChainDepthController for a chain (`drafts_chain`: sized per step from its
    scores, LongSpec made 1.08x on one Zen 4 machine where a fixed depth-1 chain would have made 1.23x,
    bench/probes/replay.py policies), SpeculationController otherwise."""
    traits = drafter.traits
    return (ChainDepthController if traits.drafts_chain else SpeculationController)(
        curve, config, cost_by_depth=traits.cost_by_depth, free_part=traits.free == "part"
    )
