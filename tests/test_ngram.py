"""NgramDrafter (prompt lookup): which continuations it finds, and the draft tree it builds from them."""

from __future__ import annotations

import pytest
import torch

from spyglass.drafters.base import DraftRequest
from spyglass.drafters.ngram import NgramDrafter
from spyglass.sampling import SamplingParams
from spyglass.sequence import Sequence


def t(*tokens: int) -> torch.Tensor:
    return torch.tensor(tokens, dtype=torch.long)


def test_longest_ngram_wins() -> None:
    # the 2-gram (2, 3) occurred once, followed by 4; the 1-gram (3) more recently, followed by 5
    seq = t(7, 2, 3, 4, 0, 3, 5, 6, 2, 3)
    assert NgramDrafter(n_min=1, n_max=3, draft_len=3).continuations(seq) == [[4, 0, 3]]
    # capped at 1-grams, both occurrences of 3 count, most recent first
    assert NgramDrafter(n_min=1, n_max=1, draft_len=3).continuations(seq) == [[5, 6, 2], [4, 0, 3]]


def test_longer_match_preferred_over_more_recent_shorter() -> None:
    seq = t(1, 2, 3, 50, 51, 9, 3, 60, 61, 1, 2, 3)
    assert NgramDrafter(n_max=3, draft_len=2).continuations(seq) == [[50, 51]]
    assert NgramDrafter(n_max=2, draft_len=2).continuations(seq) == [[50, 51]]
    assert NgramDrafter(n_max=1, draft_len=2, max_candidates=3).continuations(seq) == [[60, 61], [50, 51]]


def test_most_recent_occurrence_first() -> None:
    seq = t(1, 5, 6, 1, 7, 8, 1, 9, 4, 1)
    drafter = NgramDrafter(n_max=1, draft_len=2, max_candidates=3)
    assert drafter.continuations(seq) == [[9, 4], [7, 8], [5, 6]]
    assert NgramDrafter(n_max=1, draft_len=2, max_candidates=2).continuations(seq) == [[9, 4], [7, 8]]
    assert NgramDrafter(n_max=1, draft_len=2, max_candidates=1).continuations(seq) == [[9, 4]]


def test_distinct_continuations_only() -> None:
    # (1) is followed by (5, 6) twice, then by (7, 7): duplicates are skipped and do not use up a candidate
    seq = t(1, 7, 7, 1, 5, 6, 1, 5, 6, 1)
    assert NgramDrafter(n_max=1, draft_len=2, max_candidates=2).continuations(seq) == [[5, 6], [7, 7]]
    # all occurrences alike: a single path
    assert NgramDrafter(n_max=1, draft_len=2, max_candidates=4).continuations(t(1, 5, 1, 5, 1)) == [[5, 1]]


def test_draft_len_respected() -> None:
    seq = torch.arange(40).remainder(10)  # 0..9 repeated: the last 3-gram recurs with long continuations
    for draft_len in (1, 4, 9):
        paths = NgramDrafter(n_max=3, draft_len=draft_len, max_candidates=3).continuations(seq)
        assert paths and all(len(p) == draft_len for p in paths)
    # a match near the end has a shorter continuation (it may run into the current n-gram, never past it)
    seq = t(4, 1, 2, 3, 1, 2)
    assert NgramDrafter(n_max=2, draft_len=8).continuations(seq) == [[3, 1, 2]]


def test_self_overlapping_match() -> None:
    assert NgramDrafter(n_max=3, draft_len=4).continuations(t(3, 3, 3)) == [[3]]


def test_n_min_respected() -> None:
    seq = t(1, 5, 6, 9, 1)  # only a 1-gram matches
    assert NgramDrafter(n_min=2, n_max=3).continuations(seq) == []
    assert NgramDrafter(n_min=1, n_max=3, draft_len=2).continuations(seq) == [[5, 6]]


@pytest.mark.parametrize("tokens", [[1, 2, 3, 4], [8], [2, 2, 9]])
def test_no_match_gives_root_only_tree(tokens: list[int]) -> None:
    drafter = NgramDrafter()
    seq = t(*tokens)
    assert drafter.continuations(seq) == []
    tree = drafter.propose_one(seq)
    assert len(tree) == 1 and int(tree.tokens[0]) == tokens[-1] and tree.parents == [-1]


def test_tree_merges_shared_prefixes() -> None:
    seq = t(1, 5, 6, 8, 1, 5, 7, 9, 1)
    drafter = NgramDrafter(n_max=1, draft_len=3, max_candidates=2)
    assert drafter.continuations(seq) == [[5, 7, 9], [5, 6, 8]]
    tree = drafter.propose_one(seq)
    assert tree.tokens.tolist() == [1, 5, 7, 9, 6, 8]
    assert tree.parents == [-1, 0, 1, 2, 1, 4]
    assert tree.children()[1] == [2, 4]
    assert len(tree) <= 1 + drafter.draft_len * drafter.max_candidates


def test_single_candidate_gives_chain() -> None:
    seq = t(4, 1, 2, 3, 5, 6, 9, 1, 2)
    tree = NgramDrafter(draft_len=3).propose_one(seq)
    assert tree.is_chain
    assert tree.tokens.tolist() == [2, 3, 5, 6]


def test_propose_batch_uses_sequence_tokens() -> None:
    params = SamplingParams(max_new_tokens=4)
    a = Sequence([1, 5, 6, 1], params)
    b = Sequence([3, 4], params)
    drafter = NgramDrafter(draft_len=2)
    trees = drafter.propose([a, b], [DraftRequest()] * 2)
    assert [tr.tokens.tolist() for tr in trees] == [[1, 5, 6], [4]]
    assert all(int(tr.tokens[0]) == s.root for tr, s in zip(trees, [a, b], strict=True))
    a.append(5)  # the output extends the context: now the 2-gram (1, 5) matches
    assert drafter.propose([a], [DraftRequest()])[0].tokens.tolist() == [5, 6, 1]
    assert drafter.state_bytes(a) == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(n_min=0),
        dict(n_min=3, n_max=2),
        dict(n_min=-1, n_max=2),
        dict(draft_len=0),
        dict(max_candidates=0),
        dict(draft_len=-2),
    ],
)
def test_invalid_constructor_args(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        NgramDrafter(**kwargs)
