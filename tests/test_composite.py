"""Composite drafting: merged trees, and later parts drafting only where the earlier ones are unsure."""

from __future__ import annotations

import pytest
import torch

from spyglass.controller import SpeculationController
from spyglass.cost import CostCurve
from spyglass.drafters.base import DrafterTraits, DraftRequest, StatelessDrafter
from spyglass.drafters.composite import CompositeDrafter, best_first, merge_trees
from spyglass.sampling import SamplingParams
from spyglass.sequence import Sequence
from spyglass.tree import DraftTree


class ChainDrafter(StatelessDrafter):
    """Proposes the chain [1, 2] (or `tokens`) with a first-level score looked up by the sequence's root, and
    records which sequences it drafted for."""

    traits = DrafterTraits(token_matched=True)

    def __init__(self, first_score: dict[int, float], tokens: tuple[int, ...] = (1, 2)) -> None:
        self.first_score, self.tokens, self.seen = first_score, list(tokens), []

    def propose(self, batch: list[Sequence], wants: list[DraftRequest]) -> list[DraftTree]:
        self.seen.append([s.root for s in batch])
        return [
            DraftTree.chain(
                s.root, self.tokens, scores=[1.0, self.first_score[s.root]] + [0.1] * (len(self.tokens) - 1)
            )
            for s in batch
        ]


def _seq(root: int) -> Sequence:
    return Sequence([1, 2, root], SamplingParams(max_new_tokens=4))


def test_merged_paths_keep_their_best_score_and_children_never_outscore_parents():
    a = DraftTree.chain(9, [1, 2], scores=[1.0, 0.4, 0.3])
    b = DraftTree(torch.tensor([9, 1, 3, 4]), [-1, 0, 1, 0], scores=[1.0, 0.6, 0.7, 0.2])
    m = merge_trees([a, b])
    assert m.tokens.tolist() == [9, 1, 2, 3, 4]
    assert m.parents == [-1, 0, 1, 1, 0]
    assert m.scores == [1.0, 0.6, 0.3, 0.6, 0.2]  # token 1: max(0.4, 0.6); token 3: 0.7 clamped to its parent's 0.6
    assert m.sources == [0, 3, 1, 2, 2]  # token 1 from both trees, 2 from a, 3 and 4 from b
    assert merge_trees([b], parts=[1]).sources == [0, 2, 2, 2]  # bits name the drafting part, not the list index
    assert m.subtree([0, 1, 3]).sources == [0, 3, 2]


def test_later_parts_draft_only_for_sequences_the_earlier_ones_are_unsure_of():
    sure, unsure = _seq(9), _seq(8)
    learned = ChainDrafter({8: 0.3, 9: 0.3}, tokens=(3,))
    composite = CompositeDrafter([ChainDrafter({9: 0.8, 8: 0.2}), learned])  # default: confident = 0.25
    for s in (sure, unsure):
        composite.start(s)
    trees = composite.propose([sure, unsure], [DraftRequest()] * 2)
    assert learned.seen == [[8]]
    assert trees[0].tokens.tolist() == [9, 1, 2]
    assert trees[1].tokens.tolist() == [8, 1, 2, 3]
    assert best_first(trees[0]) == (1, 0.8)

    composite.confident = None  # every part drafts for every sequence
    composite.propose([sure, unsure], [DraftRequest()] * 2)
    assert learned.seen[-1] == [9, 8]


def test_the_gate_trusts_the_earlier_parts_only_as_far_as_they_come_true():
    """A lookup that keeps claiming 0.8 for a first token the target never takes stops holding the learned part off
    once its misses outweigh the claim; where it is right, the gate keeps trusting it (never above its scores)."""
    from spyglass.verify import Accepted

    def run(next_token: int) -> list[int]:
        learned = ChainDrafter({9: 0.3}, tokens=(3,))
        composite = CompositeDrafter([ChainDrafter({9: 0.8}), learned])  # first token 1, scored 0.8
        seq = _seq(9)
        composite.start(seq)
        drafted = []
        for _ in range(8):
            n = len(learned.seen)
            composite.propose([seq], [DraftRequest()])
            drafted.append(len(learned.seen) - n)
            composite.commit(seq, Accepted([0], [next_token]))  # the target's next token, as verification says
        composite.release(seq)
        assert not composite._record and not composite._claims  # nothing kept past the sequence
        return drafted

    wrong = run(next_token=5)
    assert wrong[0] == 0 and wrong[-1] == 1 and wrong == sorted(wrong)  # held off, then let in for good
    assert run(next_token=1) == [0] * 8  # a lookup that comes true keeps the learned part off


class LookupDrafter(ChainDrafter):
    traits = DrafterTraits(free="all", token_matched=True)


def test_between_probes_only_the_model_free_part_proposes():
    """A sequence the controller keeps off drafting still gets the free lookup's tree, never the learned part's,
    and is not charged the learned part's cost for it; the probe runs every part, and so does the step after a
    free tree that paid, unless drafting with every part has been losing time. A drafter without a free part
    does not propose between probes."""
    learned = ChainDrafter({8: 0.9}, tokens=(3,))
    composite = CompositeDrafter([LookupDrafter({8: 0.2}), learned])
    assert composite.traits.free == "part" and CompositeDrafter([learned]).traits.free == "none"
    curve = CostCurve.linear(base=1.0, per_token=0.1)

    def plain_phase(ctl: SpeculationController) -> Sequence:
        seq = _seq(8)
        composite.start(seq)
        ctl.skip(seq)  # one plain step: backoff 4, no probe yet
        ctl._state(seq).draft_s = 3.0  # the learned part costs three target steps
        return seq

    ctl = SpeculationController(curve, free_part=True)
    seq = plain_phase(ctl)
    assert (want := ctl.wants_draft(seq)) and want.free_only
    (tree,) = composite.propose([seq], [want])
    assert learned.seen == [] and tree.tokens.tolist() == [8, 1, 2]
    for _ in range(3):
        ctl.skip(seq)
    assert (want := ctl.wants_draft(seq)) and not want.free_only  # the probe: every part drafts
    composite.propose([seq], [want])
    assert learned.seen == [[8]]

    seq = plain_phase(ctl)
    assert (want := ctl.wants_draft(seq)) and want.free_only
    sized = ctl.size(seq, DraftTree.chain(8, [1, 2], scores=[1.0, 0.99, 0.98]), batch=1)
    assert len(sized) == 3  # nearly sure free tokens pay (charged three steps of drafting they would not)
    assert (want := ctl.wants_draft(seq)) and not want.free_only  # they paid: back to drafting with every part

    seq = _seq(8)  # but not while drafting with every part has been losing time (TokenSwift's pass at T=1)
    composite.start(seq)
    ctl._state(seq).draft_s = 3.0
    assert (want := ctl.wants_draft(seq)) and not want.free_only
    ctl.size(seq, DraftTree.chain(8, [1], scores=[1.0, 0.3]), batch=1)  # does not pay three steps of drafting
    assert ctl._state(seq).value < 0
    assert (want := ctl.wants_draft(seq)) and want.free_only
    assert len(ctl.size(seq, DraftTree.chain(8, [1, 2], scores=[1.0, 0.99, 0.98]), batch=1)) == 3
    assert (want := ctl.wants_draft(seq)) and want.free_only  # the free tree paid; the learned part waits for its probe

    plain = SpeculationController(curve)
    seq = plain_phase(plain)
    assert not plain.wants_draft(seq)


def test_a_composite_composes_its_parts_traits_and_refuses_a_sampled_part():
    """Its traits come from its parts' (which it leaves as they are): free between probes where a part is, the
    hidden layers any part reads; a part that draws sampled chains would lose their distributions in the merge."""

    class Reader(ChainDrafter):
        traits = DrafterTraits(token_matched=True, hidden_layers=(-1, 2))

    class Sampled(ChainDrafter):
        traits = DrafterTraits(drafts_chain=True)

    lookup, reader = LookupDrafter({8: 0.2}), Reader({8: 0.9})
    composite = CompositeDrafter([lookup, reader, LookupDrafter({8: 0.2})])
    assert composite.traits == DrafterTraits(free="part", token_matched=True, hidden_layers=(-1, 2))
    assert lookup.traits == LookupDrafter.traits and reader.traits == Reader.traits
    assert CompositeDrafter([lookup, LookupDrafter({8: 0.2})]).traits.free == "all"
    with pytest.raises(ValueError, match="token matching"):
        CompositeDrafter([lookup, Sampled({8: 0.9})])
