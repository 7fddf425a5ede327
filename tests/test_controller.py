"""The speculation controller: prunes trees by expected accepted tokens per unit of verify time, converges to
plain decoding for a drafter that is always wrong, grows to the largest affordable tree for one that is always
right, and never changes the output."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, replace

import pytest
import torch

from spyglass.chain_controller import ChainDepthController
from spyglass.controller import ControllerConfig, SpeculationController
from spyglass.cost import CostCurve
from spyglass.drafters.base import DrafterTraits, DraftRequest, StatelessDrafter
from spyglass.engine import EngineConfig, SpecEngine, plain_generate
from spyglass.sampling import SamplingParams
from spyglass.sequence import Sequence
from spyglass.tree import COPY_SOURCE, SPAN_SOURCE, DraftTree
from spyglass.verify import Accepted


class OracleDrafter(StatelessDrafter):
    """Drafts a chain of `n` tokens: the plain-decoding continuation (always right) or a wrong token (always wrong)."""

    name = "oracle"

    def __init__(self, reference: list[int], prompt_len: int, n: int, right: bool) -> None:
        self.reference, self.prompt_len, self.n, self.right = reference, prompt_len, n, right
        self.calls = 0

    def propose(self, batch, wants):
        self.calls += 1
        trees = []
        for seq in batch:
            done = seq.num_generated
            nxt = self.reference[done : done + self.n]
            if not self.right:
                nxt = [(t + 1) % 96 for t in nxt]
            trees.append(DraftTree.chain(seq.root, nxt, scores=[1.0] * (len(nxt) + 1)))
        return trees


def _prompt(n=20, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 96, (n,), generator=g).tolist()


def test_curve_interpolates_and_extrapolates():
    c = CostCurve([100, 300], [1, 4, 8], [[1.0, 2.0, 3.0], [2.0, 4.0, 6.0]])
    assert c.time(1, 100) == 1.0
    assert abs(c.time(6, 100) - 2.5) < 1e-9
    assert abs(c.time(4, 200) - 3.0) < 1e-9
    assert abs(c.time(12, 100) - 4.0) < 1e-9  # past the largest size: the last slope
    assert c.time(1, 50) == 1.0


def test_measured_curve_grows_with_tokens(tiny_target):
    cache = tiny_target.new_cache(256, 2)
    curve = CostCurve.measure(tiny_target, cache, contexts=(32, 128), sizes=(1, 16, 64), repeats=1)
    assert curve.contexts == [32, 128] and len(curve.seconds) == 2
    assert all(t > 0 for row in curve.seconds for t in row)
    assert cache.free_slots == 2 and cache.lengths == [0, 0]  # nothing left behind
    assert curve.cpu


def test_the_default_curve_is_measured_up_to_the_cache_capacity(tiny_target):
    """A long window is priced where it is used: at half the capacity and at the capacity (less the largest tree),
    not extrapolated from 6K tokens; a short cache caps the default contexts at what it holds."""
    long = CostCurve.measure(tiny_target, tiny_target.new_cache(16384, 1), sizes=(1, 4), repeats=1)
    assert long.contexts == [256, 2048, 6144, 8192, 16384 - 4]
    short = CostCurve.measure(tiny_target, tiny_target.new_cache(1024, 1), sizes=(1, 4), repeats=1)
    assert short.contexts == [256, 1024 - 4]


def test_the_cost_curve_and_prefill_cost_are_kept_for_the_next_process(tiny_dir, tmp_path, monkeypatch):
    """Measured once per machine: a new process (here: the per-process memos cleared) takes the kept curve and
    prefill cost without a forward; another capacity is measured; SPYGLASS_REMEASURE=1 measures again."""
    from spyglass import cost
    from spyglass.kept import kept_path
    from spyglass.models.llama import load_transformer

    monkeypatch.setenv("SPYGLASS_MEASUREMENTS", str(tmp_path / "m.json"))
    monkeypatch.delenv("SPYGLASS_REMEASURE", raising=False)
    target = load_transformer(tiny_dir["llama"])
    forwards = []
    real = target.forward
    monkeypatch.setattr(target, "forward", lambda *a, **k: forwards.append(1) or real(*a, **k))

    def fresh_process():
        monkeypatch.setattr(cost, "_CURVES", {})
        monkeypatch.setattr(cost, "_PREFILL_COSTS", {})
        forwards.clear()

    cache = target.new_cache(512, 1)
    fresh_process()
    curve, prefill = cost.measured_curve(target, cache), cost.measured_prefill_cost(target, cache, 64)
    assert forwards and kept_path().exists()
    fresh_process()
    assert cost.measured_curve(target, cache) == curve and cost.measured_prefill_cost(target, cache, 64) == prefill
    assert not forwards
    cost.measured_curve(target, target.new_cache(1024, 1))
    assert forwards  # another capacity: measured
    fresh_process()
    monkeypatch.setenv("SPYGLASS_REMEASURE", "1")
    assert cost.measured_curve(target, cache).contexts == curve.contexts and forwards


def test_pruning_keeps_best_valid_subtree():
    tree = DraftTree(torch.tensor([9, 1, 2, 3, 4]), [-1, 0, 0, 1, 3], scores=[1.0, 0.9, 0.05, 0.8, 0.7])
    keep = tree.best_nodes(tree.scores, 3)
    assert keep == [0, 1, 3, 4]
    sub = tree.subtree(keep)
    assert sub.tokens.tolist() == [9, 1, 3, 4] and sub.parents == [-1, 0, 1, 2] and sub.scores[-1] == 0.7


def test_cheap_tokens_keep_big_trees_costly_tokens_prune():
    seq = Sequence(_prompt(), SamplingParams(max_new_tokens=4))
    tree = DraftTree.chain(5, [1, 2, 3, 4, 5, 6], scores=[1.0, 0.9, 0.8, 0.7, 0.3, 0.1, 0.05])
    free = SpeculationController(CostCurve.linear(1.0, 0.0))
    assert len(free.size(seq, tree, batch=1)) == 7  # extra tokens cost nothing: verify them all
    seq2 = Sequence(_prompt(), SamplingParams(max_new_tokens=4))
    dear = SpeculationController(CostCurve.linear(1.0, 0.5))
    kept = dear.size(seq2, tree, batch=1)
    # each extra node costs half a step: only nodes with score > ~0.5 marginal benefit per cost stay
    assert 2 <= len(kept) <= 5
    seq3 = Sequence(_prompt(), SamplingParams(max_new_tokens=4))
    assert len(SpeculationController(CostCurve.linear(1.0, 2.0)).size(seq3, tree, batch=1)) == 1


def test_a_kernel_switch_in_the_curve_sets_the_tree_size():
    """On CPUs where BLAS changes kernels between 3 and 4 tokens (3 cost about one step, 4 cost 1.5), two drafted
    nodes pay and a third does not; a curve timed only at powers of two prices 3 tokens at 1.25 steps and keeps
    one node."""
    tree = DraftTree.chain(5, [1, 2, 3, 4], scores=[1.0, 0.5, 0.25, 0.125, 0.0625])
    dense = CostCurve([1], [1, 2, 3, 4, 8], [[1.0, 1.0, 1.02, 1.5, 2.0]], cpu="synthetic")
    coarse = CostCurve([1], [1, 2, 4, 8], [[1.0, 1.0, 1.5, 2.0]], cpu="synthetic")
    kept = [
        len(SpeculationController(c).size(Sequence(_prompt(), SamplingParams()), tree, 1)) - 1 for c in (dense, coarse)
    ]
    assert kept == [2, 1]


def test_calibration_learns_from_rejections():
    ctl = SpeculationController(CostCurve.linear(1.0, 0.2))
    seq = Sequence(_prompt(), SamplingParams(max_new_tokens=4))
    tree = DraftTree.chain(5, [1, 2, 3], scores=[1.0, 0.9, 0.8, 0.7])
    before = ctl.scores(seq, tree)[1]
    for _ in range(10):
        ctl.observe(seq, tree, Accepted([0], [7]))
    assert ctl.scores(seq, tree)[1] < before / 4


def _engine(target, drafter, curve):
    return SpecEngine(target, drafter, EngineConfig(max_batch=4, max_context=256, controller=curve))


@pytest.mark.parametrize("step_s", [1.0, 1e-6])
def test_always_wrong_converges_to_plain_decoding(tiny_target, step_s):
    """With a 1 s decode step the drafter is nearly free, so it keeps proposing (a fresh match may pay) but its
    trees stop being verified; with a 1 us step drafting costs more than a step, so the drafter stops running
    except for rare probes."""
    prompt = _prompt()
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    ref = plain_generate(tiny_target, prompt, params)
    drafter = OracleDrafter(ref, len(prompt), 8, right=False)
    engine = _engine(tiny_target, drafter, CostCurve.linear(step_s, 0.05 * step_s))
    (seq,) = engine.run([prompt], params)
    assert seq.output_ids == ref
    ctl = seq.stats.control
    assert ctl.plain_steps >= 40  # within a few steps it stops speculating
    assert ctl.verified_nodes <= 4 * (ctl.drafted_steps + ctl.probe_steps)  # probes are small
    if step_s < 1e-3:
        assert drafter.calls <= 20
    assert seq.stats.steps >= 59  # one token per step, as plain decoding


def test_a_depth_left_untried_forgets_its_old_misses():
    """Depth 2 missed early, then only depth-1 trees were verified: its stale evidence fades, so deeper trees are
    tried again instead of staying pruned for the rest of the request."""
    ctl = SpeculationController(CostCurve.linear(1.0, 0.2))
    seq = Sequence(_prompt(), SamplingParams(max_new_tokens=4))
    deep = DraftTree.chain(5, [1, 2], scores=[1.0, 0.9, 0.8])
    for _ in range(5):
        ctl.observe(seq, deep, Accepted([0, 1], [1, 7]))  # depth 1 right, depth 2 wrong
    low = ctl.calibration(seq, 2)
    shallow = DraftTree.chain(5, [1], scores=[1.0, 0.9])
    for _ in range(30):
        ctl.observe(seq, shallow, Accepted([0, 1], [1, 7]))
    assert low < 0.5 and ctl.calibration(seq, 2) > 0.8


def test_each_source_of_a_merged_tree_is_calibrated_on_its_own_acceptance():
    """Two drafters' candidates for the next token score the same, but only one source's are ever accepted: the
    controller learns to verify that source's node alone (one factor for both would keep them equal)."""
    tree = DraftTree(torch.tensor([5, 1, 2]), [-1, 0, 0], scores=[1.0, 0.45, 0.45], sources=[0, 1, 2])
    taken = Accepted([0, 1], [1, 7])  # source 1's token accepted
    ctl = SpeculationController(CostCurve.linear(1.0, 0.4))
    seq = Sequence(_prompt(), SamplingParams(max_new_tokens=4))
    for _ in range(20):
        ctl.observe(seq, tree, taken)
    scores = ctl.scores(seq, tree)
    assert scores[1] > 0.9 and scores[2] < 0.1
    assert ctl.size(seq, tree, batch=1).tokens.tolist() == [5, 1]


def test_a_source_first_seen_deep_in_the_tree_is_calibrated_from_there():
    """A composite's learned part may propose only below a copied prefix: its first trial is at depth 3."""
    ctl = SpeculationController(CostCurve.linear(1.0, 0.2))
    seq = Sequence(_prompt(), SamplingParams(max_new_tokens=4))
    tree = DraftTree(
        torch.tensor([5, 1, 2, 3, 4]), [-1, 0, 1, 2, 2], scores=[1.0, 0.9, 0.8, 0.5, 0.5], sources=[0, 1, 1, 1, 2]
    )
    for _ in range(10):
        ctl.observe(seq, tree, Accepted([0, 1, 2, 4], [1, 2, 4, 9]))  # the deep source-2 node is the one taken
    assert ctl.calibration(seq, 3, source=2) > 1.5 > 0.5 > ctl.calibration(seq, 3, source=1)
    assert ctl.calibration(seq, 1, source=1) == pytest.approx(1 / 0.9, rel=0.05)


def test_always_right_grows_to_the_largest_tree(tiny_target):
    prompt = _prompt(seed=2)
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    ref = plain_generate(tiny_target, prompt, params)
    drafter = OracleDrafter(ref, len(prompt), 12, right=True)
    curve = CostCurve.linear(1.0, 0.05, max_size=16)
    engine = _engine(tiny_target, drafter, curve)
    (seq,) = engine.run([prompt], params)
    assert seq.output_ids == ref
    assert seq.stats.control.plain_steps == 0
    assert seq.stats.steps <= 60 / 12 + 2  # every step verifies and accepts the whole 12-token chain


def test_greedy_identity_batch4_with_controller(tiny_target):
    from spyglass.drafters.ngram import NgramDrafter

    prompts = [_prompt(24, s) * 2 for s in range(4)]  # repeated text: n-gram drafting has something to find
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    engine = _engine(tiny_target, NgramDrafter(), "measure")
    seqs = engine.run(prompts, params)
    for p, s in zip(prompts, seqs, strict=True):
        assert s.output_ids == plain_generate(tiny_target, p, params)
        assert "controller" in s.stats.summary(s.num_generated)


def test_a_drafter_slower_than_its_gain_is_dropped():
    """Right half the time but costing a whole step to draft: plain decoding is faster, so the controller stops
    running the drafter until a probe. The tree already drafted is still verified where that pays by itself
    (its drafting is spent; verifying is free on this curve)."""
    tree = DraftTree.chain(5, [1, 2], scores=[1.0, 0.5, 0.25])
    ctl = SpeculationController(CostCurve.linear(1.0, 0.0))
    seq = Sequence(_prompt(), SamplingParams(max_new_tokens=4))
    assert len(ctl.size(seq, tree, batch=1)) == 3  # free drafting: verify it
    assert ctl.wants_draft(seq)
    seq2 = Sequence(_prompt(), SamplingParams(max_new_tokens=4))
    ctl.note_draft_time(seq2, 2.0)
    assert len(ctl.size(seq2, tree, batch=1)) == 3
    assert not ctl.wants_draft(seq2)  # and it stops running the drafter until a probe


def test_a_depth_costed_drafter_is_charged_for_the_depth_it_keeps():
    """A probe drafted 4 levels deep in 0.8 s; a drafter that drafts only as deep as asked costs 0.2 s per level, so
    one likely node pays (1.5 tokens for 1.1 + 0.2 s) where a flat charge of the probe's 0.8 s would not: the
    depth-costed drafter drafts again next step, the other waits for a probe. Both verify that node now."""
    tree = DraftTree.chain(5, [1, 2, 3, 4], scores=[1.0, 0.5, 0.025, 0.001, 0.0001])
    kept, again = [], []
    for by_depth in (False, True):
        ctl = SpeculationController(CostCurve.linear(1.0, 0.1), cost_by_depth=by_depth)
        seq = Sequence(_prompt(), SamplingParams(max_new_tokens=4))
        ctl.note_draft_time(seq, 0.8, depth=4)
        kept.append(len(ctl.size(seq, tree, batch=1)) - 1)
        again.append(ctl.wants_draft(seq) is not None)
    assert kept == [1, 1] and again == [False, True]


def test_rejection_sampled_chains_are_sized_without_their_own_scores():
    """Pruning a sampled chain by its tokens' probabilities would bias rejection sampling: the kept length must
    not depend on what was sampled."""
    probs = torch.full((4, 8), 1 / 8)
    sizes = set()
    for scores in ([1.0, 0.9, 0.8, 0.7], [1.0, 0.05, 0.01, 0.001]):
        ctl = SpeculationController(CostCurve.linear(1.0, 0.3))
        seq = Sequence(_prompt(), SamplingParams(max_new_tokens=4, temperature=1.0, seed=0))
        sizes.add(len(ctl.size(seq, DraftTree.chain(5, [1, 2, 3], probs, scores), batch=1)))
    assert len(sizes) == 1


def test_the_depth_that_paid_bounds_the_next_draft():
    """After verifying a subtree of depth k the controller asks for k + 1 levels (drafting deeper would only be
    pruned); a probe or a sequence it has no evidence on asks for the drafter's own depth (None)."""
    ctl = SpeculationController(CostCurve.linear(1.0, 0.5))
    seq = Sequence(_prompt(), SamplingParams(max_new_tokens=4))
    assert (want := ctl.wants_draft(seq)) and want.depth is None
    tree = DraftTree.chain(5, [1, 2, 3, 4, 5, 6], scores=[1.0, 0.95, 0.9, 0.5, 0.2, 0.1, 0.05])
    kept = ctl.size(seq, tree, batch=1)
    assert 1 <= kept.max_depth < tree.max_depth
    assert (want := ctl.wants_draft(seq)) and want.depth == kept.max_depth + 1
    ctl.size(seq, DraftTree.chain(5, [1], scores=[1.0, 0.01]), batch=1)  # not worth verifying: plain decoding
    ctl.skip(seq)
    while not (want := ctl.wants_draft(seq)):
        ctl.skip(seq)
    assert want.depth is None  # the probe drafts at full depth


@pytest.mark.parametrize("kind", ["longspec", "small-lm"])
def test_depth_costed_drafters_draft_only_as_deep_as_the_controller_asks(tiny_target, kind):
    """Per sequence of one batch; and what was drafted for a shallow request leaves the draft's state consistent
    (the run still equals plain decoding)."""
    from spyglass.drafters.longspec import LongSpecDrafter
    from spyglass.drafters.small_lm import SmallLMDrafter, truncated_draft
    from tests.tiny import layer_copy_draft

    if kind == "longspec":
        drafter = LongSpecDrafter(layer_copy_draft(tiny_target), gamma=5)
    else:
        drafter = SmallLMDrafter(truncated_draft(tiny_target, 1), gamma=5, max_batch=2, max_context=128)
    assert drafter.traits.cost_by_depth
    engine = SpecEngine(tiny_target, drafter, EngineConfig(max_batch=2, max_context=128, controller="off"))
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompts = [_prompt(), _prompt(seed=2)]
    seqs = [engine.add_request(p, params) for p in prompts]
    engine.step()
    assert [t.max_depth for t in drafter.propose(seqs, [DraftRequest()] * 2)] == [5, 5]
    assert [t.max_depth for t in drafter.propose(seqs, [DraftRequest(2), DraftRequest()])] == [2, 5]
    while engine.has_work:
        engine.step()
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.output_ids == plain_generate(tiny_target, prompt, params)


def test_small_lm_draft_from_a_loaded_model_or_the_targets_layers(tiny_dir):
    """What the CLI and the verifier's YAML options (`draft_layers: N`) resolve to; no silent default."""
    from spyglass.drafters import build_drafter
    from spyglass.models.llama import load_transformer

    target = load_transformer(tiny_dir["llama"])
    with pytest.raises(ValueError, match="needs a draft model"):
        build_drafter("small-lm", target)
    assert build_drafter("small-lm", target, draft_layers=1).draft.args.n_layers == 1
    other = load_transformer(tiny_dir["qwen2"])
    assert build_drafter("small-lm", target, draft_model=other).draft is other


def test_one_step_that_does_not_pay_stops_a_costly_drafter_until_a_probe():
    """A learned draft (drafting 5% of a step) that paid on its first step, then proposes an unsure tree: that step
    is decoded plainly and the drafter waits for a probe, even though drafting has paid on average; a sequence whose
    first tree did not pay waits too."""
    curve = CostCurve.linear(1.0, 0.05)
    sure, unsure = DraftTree.chain(5, [1], scores=[1.0, 0.9]), DraftTree.chain(5, [1], scores=[1.0, 0.02])
    ctl = SpeculationController(curve, cost_by_depth=True)
    once = Sequence(_prompt(), SamplingParams(max_new_tokens=4))
    ctl.note_draft_time(once, 0.05)
    kept = ctl.size(once, sure, batch=1)
    assert len(kept) == 2
    ctl.observe(once, kept, Accepted([0, 1], [1, 7]))
    assert (want := ctl.wants_draft(once)) and want.depth == 2  # one level beyond the depth that paid
    assert len(ctl.size(once, unsure, batch=1)) == 1  # this step is decoded plainly
    assert ctl._state(once).value > 0 and not ctl.wants_draft(once)

    never = Sequence(_prompt(), SamplingParams(max_new_tokens=4))
    ctl.note_draft_time(never, 0.05)
    assert ctl.wants_draft(never)
    assert len(ctl.size(never, unsure, batch=1)) == 1
    assert not ctl.wants_draft(never)  # no evidence that drafting pays: back off until a probe


def test_short_backoff_caps_the_plain_steps_between_failed_probes():
    """Probes that accept nothing double the wait before the next one, up to `max_backoff` (64 by default; 16 was
    tried so that a draft that missed early still gets tried on later stretches of the output)."""
    curve = CostCurve.linear(1.0, 0.05)
    tree = DraftTree.chain(5, [1, 2], scores=[1.0, 0.9, 0.8])

    def waits(short: bool) -> list[int]:
        config = replace(ControllerConfig(), max_backoff=16) if short else ControllerConfig()
        ctl = SpeculationController(curve, config, cost_by_depth=True)
        seq = Sequence(_prompt(), SamplingParams(max_new_tokens=4))
        ctl.note_draft_time(seq, 5.0)  # five steps per depth: it never pays, only probes verify
        out, plain = [], 0
        for _ in range(300):
            kept = ctl.size(seq, tree, batch=1) if ctl.wants_draft(seq) else ctl.skip(seq)
            if kept is not None and len(kept) > 1:
                ctl.observe(seq, kept, Accepted([0], [9]))  # nothing accepted
                out.append(plain)
                plain = 0
            else:
                plain += 1
        return out

    # the first step verifies the tree it drafted (worth verifying once drafted), then the wait after each probe:
    # the backoff less the probe step itself
    assert waits(False)[:7] == [0, 3, 7, 15, 31, 63, 63]
    assert waits(True)[:7] == [0, 3, 7, 15, 15, 15, 15]


class ChainOracle(OracleDrafter):
    """An OracleDrafter that drafts one depth at a time, only as deep as the controller asks."""

    traits = DrafterTraits(drafts_chain=True, cost_by_depth=True)

    def propose(self, batch, wants):
        trees = super().propose(batch, wants)
        out = []
        for want, t in zip(wants, trees, strict=True):
            depth = min(d for d in (want.depth, t.max_depth) if d is not None)
            out.append(t.subtree(list(range(depth + 1))))
        return out


@pytest.mark.parametrize("right", [True, False])
def test_chains_are_sized_by_their_acceptance_profile(tiny_target, right):
    """A chain drafter that is always right verifies deeper than one token; one that is always wrong is soon
    verified not at all, but still drafts a probe now and then; the output is plain decoding's either way."""
    prompt = _prompt(24)
    params = SamplingParams(max_new_tokens=60)
    ref = plain_generate(tiny_target, prompt, params)
    drafter = ChainOracle(ref, len(prompt), 4, right)
    engine = SpecEngine(tiny_target, drafter, EngineConfig(1, 256, controller=CostCurve.linear(1.0, 0.3)))
    assert isinstance(engine.controller, ChainDepthController)
    (seq,) = engine.run([prompt], params)
    assert seq.output_ids == ref
    c = seq.stats.control
    if right:
        assert c.verified_nodes / c.drafted_steps > 1.5 and c.plain_steps == 0
    else:
        assert c.drafted_steps <= 3 and c.probe_steps >= 3
        assert drafter.calls < 0.5 * (c.drafted_steps + c.plain_steps)  # plain steps mostly skip the drafter


def test_a_chain_profile_learns_from_chains_it_did_not_verify():
    """Chains that were only drafted (probes) are scored against the tokens the target then committed: a sequence
    that went plain comes back to verifying once its probes match, without verifying anything first."""
    ctl = ChainDepthController(CostCurve.linear(1.0, 0.3), cost_by_depth=True)
    seq = Sequence(_prompt(), SamplingParams(max_new_tokens=400))
    seq.append(7)

    def target(i: int) -> int:  # the target's token at index i of the sequence
        return 10 + i % 50

    verified = []
    for step in range(150):
        good = step >= 40  # the draft is wrong for 40 steps, then right
        i = seq.num_tokens
        if ctl.wants_draft(seq):
            tree = DraftTree.chain(seq.root, [target(i) if good else 99, target(i + 1) if good else 99])
            kept = ctl.size(seq, tree, batch=1)
            verified.append((step, kept.max_depth))
            n = kept.max_depth if good else 0
            accepted = Accepted(list(range(n + 1)), [target(i + j) for j in range(n + 1)])
            ctl.observe(seq, kept, accepted)
            for t in accepted.tokens:
                seq.append(t)
        else:
            ctl.skip(seq)
            seq.append(target(i))
    assert any(d == 0 for s, d in verified if s < 40)  # the wrong draft went unverified (probes)
    assert not any(d >= 1 for s, d in verified if 10 <= s < 40)
    assert any(d >= 1 for s, d in verified if s >= 40)  # and verification came back
    assert [d for s, d in verified][-1] == 2  # the whole chain, now that it is always right


def _chain_control(free_part: bool = False):
    """A chain controller, a sequence whose root is 7, and the sequence's control state."""
    ctl = ChainDepthController(CostCurve.linear(1.0, 0.3), free_part=free_part)
    seq = Sequence(_prompt(), SamplingParams(max_new_tokens=50))
    seq.append(7)
    return ctl, seq, ctl._state(seq)


def _chain_7_to_10(sources: list[int]) -> DraftTree:
    return DraftTree(torch.tensor([7, 8, 9, 10]), [-1, 0, 1, 2], None, [1.0, 0.95, 0.9, 0.86], sources)


def test_an_unverified_chain_counts_token_by_token_as_the_target_commits():
    """A probe's chain is evidence as soon as each of its places is committed, not once the whole chain is."""
    ctl, seq, st = _chain_control()
    st.deepest = 3
    st.pending = [(seq.num_tokens - 1, [11, 12, 13], 1, [(None, True)] * 3)]
    seq.append(11)
    ctl.wants_draft(seq)
    assert len(st.accepted) == 1 and st.accepted[0][0] > ctl.config.chain_prior and len(st.pending) == 1
    seq.append(99)  # the second drafted token was wrong: counted, and the third is never scored
    ctl.wants_draft(seq)
    assert len(st.accepted) == 2 and st.accepted[1][0] < ctl.config.chain_prior and st.pending == []


def test_a_copied_token_is_sized_as_a_span_and_counted_for_both():
    """A copied token (COPY_SOURCE) is priced by its own conditional and the spans' calibration, like a span node,
    and its verdict is evidence of the drafted profile too (what a draft step's first token does)."""
    ctl, seq, st = _chain_control()
    st.deepest, st.accepted, st.span = 3, [[0.0, 10.0]], [10.0, 10.0]  # drafted tokens never right, spans are
    kept = ctl.size(seq, _chain_7_to_10([0, COPY_SOURCE, SPAN_SOURCE, SPAN_SOURCE]), batch=1)
    assert kept.max_depth == 3  # as drafted tokens (sources 1), the profile's zero would verify none
    ctl.observe(seq, kept, Accepted([0, 1, 2, 3], [8, 9, 10, 11]))
    assert st.accepted[0][0] == pytest.approx(1.0) and st.span[0] == pytest.approx(0.95**3 * 10 + 0.95**2 + 0.95 + 1)
    assert ctl.size(seq, _chain_7_to_10([0, 1, 1, 1]), batch=1).max_depth == 0


def test_a_free_part_proposes_between_probes_and_is_not_charged_for_drafting():
    """A chain drafter with a model-free part (a copy that goes on) still proposes while its drafted tokens do not
    pay (`DraftRequest.free_only`), and that proposal is sized without the draft step's time."""
    ctl, seq, st = _chain_control(free_part=True)
    st.deepest, st.accepted, st.draft_s = 4, [[0.0, 10.0]], 100.0  # drafted tokens never right, drafting costly
    st.span = [10.0, 10.0]  # spans as good as their scores say
    assert (want := ctl.wants_draft(seq)) and want.free_only
    spans = _chain_7_to_10([0] + [SPAN_SOURCE] * 3)
    assert ctl.size(seq, spans, batch=1).max_depth == 3
    st.free_only = False  # the same tree from a draft step costs its 100 s
    assert ctl.size(seq, spans, batch=1).max_depth == 0


@pytest.mark.parametrize("temperature, probe_depth", [(0.0, 0), (1.0, 1)])
def test_probes_of_a_sampled_chain_verify_their_first_token(temperature, probe_depth):
    """A sampled draft token equals the token the target samples less often than rejection sampling accepts it,
    so a sampled sequence's probes verify one token (unverified, they would keep it plain); a greedy sequence's
    probes stay unverified (a match is exactly acceptance there)."""
    ctl = ChainDepthController(CostCurve.linear(1.0, 0.3), cost_by_depth=True)
    seq = Sequence(_prompt(), SamplingParams(max_new_tokens=400, temperature=temperature, seed=0))
    seq.append(7)
    probes = []
    for _ in range(60):
        token = 10 + seq.num_tokens % 50  # the target's token; the draft always proposes 99
        if ctl.wants_draft(seq):
            before = seq.stats.control.probe_steps
            kept = ctl.size(seq, DraftTree.chain(seq.root, [99, 99]), batch=1)
            if seq.stats.control.probe_steps > before:
                probes.append(kept.max_depth)
            ctl.observe(seq, kept, Accepted([0], [token]))
        else:
            ctl.skip(seq)
        seq.append(token)
    assert len(probes) >= 4 and set(probes) == {probe_depth}


def test_only_chain_drafters_get_the_profile_controller(tiny_target):
    """Each with the engine's controller constants; the constants are fixed once given."""
    curve = CostCurve.linear(1.0, 0.05)
    config = replace(ControllerConfig(), max_backoff=16, chain_probe=4)
    tree_drafter = OracleDrafter([1], 1, 2, True)
    tree_ctl = SpecEngine(tiny_target, tree_drafter, EngineConfig(1, 64, controller=curve, control=config)).controller
    assert type(tree_ctl) is SpeculationController and tree_ctl.config is config
    chain = ChainOracle([1], 1, 2, True)
    chain_ctl = SpecEngine(tiny_target, chain, EngineConfig(1, 64, controller=curve, control=config)).controller
    assert type(chain_ctl) is ChainDepthController and chain_ctl.config is config
    assert SpecEngine(tiny_target, chain, EngineConfig(1, 64, controller=curve)).controller.config == ControllerConfig()
    with pytest.raises(FrozenInstanceError):
        config.max_backoff = 64


def test_a_chain_ending_in_a_span_is_sized_by_the_spans_scores():
    """LongSpec's span nodes (SPAN_SOURCE) enter the chain's sizing with their own conditionals: a long, confident
    span is verified past the depth the drafted profile alone would pay for; spans that keep failing lose the
    controller's trust (their calibration), and the same chain without span tags is sized by the profile alone."""

    ctl = ChainDepthController(CostCurve.linear(1.0, 0.1))
    seq = Sequence(_prompt(), SamplingParams(max_new_tokens=400))
    seq.append(7)

    def chain(spanned: bool) -> DraftTree:
        scores = [1.0, 0.5] + [0.5 * 0.95**k for k in range(1, 7)]
        sources = [0, 1] + [SPAN_SOURCE if spanned else 1] * 6
        return DraftTree(
            torch.tensor([seq.root, 11, 12, 13, 14, 15, 16, 17]), list(range(-1, 7)), None, scores, sources
        )

    assert ctl.wants_draft(seq)  # first step: no profile yet
    ctl._state(seq).deepest = 7
    assert ctl.size(seq, chain(spanned=False), batch=1).max_depth == 2  # the profile's prior (0.4) pays for 2
    ctl._state(seq).verified = 0
    assert ctl.size(seq, chain(spanned=True), batch=1).max_depth == 7
    # spans that fail right after the drafted token: their calibration falls and the verified chain shortens
    depths = []
    for _ in range(30):
        kept = ctl.size(seq, chain(spanned=True), batch=1)
        depths.append(kept.max_depth)
        ctl.observe(seq, kept, Accepted([0, 1], [11, 99]))
    assert depths[0] == 7 and depths[-1] <= 2
    assert ctl._state(seq).span[0] < 0.2 * ctl._state(seq).span[1]


def test_a_sequences_first_drafting_step_is_not_timed(tiny_target):
    """Its one-off costs (the drafter's buffers, lazily built matrices: ~45 ms for the DeLS head against a ~5 ms
    step) would read as the price of every drafting step and keep the controller on plain decoding."""
    prompt = _prompt()
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    ref = plain_generate(tiny_target, prompt, params)
    engine = _engine(tiny_target, OracleDrafter(ref, len(prompt), 2, right=True), CostCurve.linear(1.0, 0.05))
    seq = engine.add_request(prompt, params)
    while seq.control is None:  # prefill, then the first drafting step
        engine.step()
    assert seq.drafted_before and seq.control.draft_s == 0.0
    engine.step()
    assert seq.control.draft_s > 0.0


# A compute-bound curve shaped like SmolLM2 fp32's on 2 cores: a decode step 40-75 ms, each extra token 5-10 ms
BATCH_CURVE = CostCurve(
    [256, 4096],
    [1, 2, 4, 8, 16, 32, 64],
    [[0.040, 0.048, 0.062, 0.090, 0.150, 0.270, 0.510], [0.075, 0.085, 0.100, 0.130, 0.200, 0.340, 0.620]],
    cpu="synthetic",
)


@pytest.mark.parametrize("policy", [SpeculationController, ChainDepthController])
@pytest.mark.parametrize("batch", [2, 4, 8, 16])
def test_a_batched_step_never_expects_fewer_tokens_per_second_than_plain_decoding(policy, batch):
    """Trees sized for the step's whole batch: whatever mix of sure and doubtful chains the rows bring, the sized
    step's expected tokens per second on the measured curve is at least plain decoding's for that batch."""
    from spyglass.controller import size_batch
    from spyglass.cost import BatchShape

    g = torch.Generator().manual_seed(batch)
    ctl = policy(BATCH_CURVE, ControllerConfig(), cost_by_depth=False)
    rows, chains = [], []
    for i in range(batch):
        seq = Sequence(_prompt(int(torch.randint(50, 4000, (), generator=g)), seed=i), SamplingParams())
        seq.drafted_before = True
        sure = float(torch.rand((), generator=g)) ** 0.3  # per-token chance given the parent: 0.0-1.0, mostly high
        depth = int(torch.randint(1, 9, (), generator=g))
        scores = [sure**d for d in range(depth + 1)]
        rows.append((seq, DraftTree.chain(seq.root, list(range(3, 3 + depth)), scores=scores), ctl))
        chains.append(scores)
    trees = size_batch(rows)
    kept = [len(t) - 1 for t in trees]

    def expected_gain(i: int, d: int) -> float:  # what the policy believes of depth d (no evidence yet: its prior)
        if policy is SpeculationController:
            return 1.0 + sum(chains[i][1 : d + 1])
        return 1.0 + sum(ControllerConfig().chain_prior ** k for k in range(1, d + 1))

    step = BatchShape()
    for i, ((seq, _, _), d) in enumerate(zip(rows, kept, strict=True)):
        step = step.plus(d + 1, seq.committed, expected_gain(i, d))
    plain = BatchShape.plain([seq.committed for seq, _, _ in rows])
    assert step.gain / step.time(BATCH_CURVE) >= plain.gain / plain.time(BATCH_CURVE) * (1 - 1e-9)
    if policy is SpeculationController:
        assert any(kept), "no row kept a node: the check above would be vacuous"


def test_a_row_keeps_fewer_nodes_in_a_speculating_batch_than_among_plain_rows():
    """The rows are priced for the whole step: a tree that pays beside plain rows pays less beside rows that already
    verify long trees (each extra token costs the same, the step's rate is higher), never more."""
    from spyglass.cost import BatchShape

    tree_scores = [0.8**d for d in range(9)]
    seq = Sequence(_prompt(500), SamplingParams())
    tree = DraftTree.chain(seq.root, list(range(3, 11)), scores=tree_scores)
    among_plain = SpeculationController(BATCH_CURVE).size(seq, tree, BatchShape.plain([500] * 3))
    seq2 = Sequence(_prompt(500), SamplingParams())
    among_trees = SpeculationController(BATCH_CURVE).size(seq2, tree, BatchShape(3 * 6, 3 * 6 * 500, 3 * 4.0))
    assert len(among_trees) <= len(among_plain) and len(among_plain) > 1
