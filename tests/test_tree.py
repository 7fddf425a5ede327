"""DraftTree: builders, depths and positions, the ancestor mask, children and validation."""

from __future__ import annotations

import random

import pytest
import torch

from spyglass.tree import DraftTree

# A hand-built tree (node: token):
#            0:100
#          /       \
#      1:101        2:102
#      /   \           \
#  3:103   4:104      5:105
#            |
#          6:106
PARENTS = [-1, 0, 0, 1, 1, 2, 4]
TOKENS = [100, 101, 102, 103, 104, 105, 106]
EXPECTED_MASK = [
    # 0  1  2  3  4  5  6
    [1, 0, 0, 0, 0, 0, 0],
    [1, 1, 0, 0, 0, 0, 0],
    [1, 0, 1, 0, 0, 0, 0],
    [1, 1, 0, 1, 0, 0, 0],
    [1, 1, 0, 0, 1, 0, 0],
    [1, 0, 1, 0, 0, 1, 0],
    [1, 1, 0, 0, 1, 0, 1],
]


@pytest.fixture
def tree() -> DraftTree:
    return DraftTree(torch.tensor(TOKENS), PARENTS)


def test_chain() -> None:
    probs = torch.rand(4, 7)
    t = DraftTree.chain(9, [3, 4, 5], probs)
    assert t.tokens.tolist() == [9, 3, 4, 5]
    assert t.tokens.dtype == torch.int64
    assert t.parents == [-1, 0, 1, 2]
    assert t.probs is probs
    assert len(t) == 4
    assert t.is_chain
    assert t.depths == [0, 1, 2, 3]
    assert t.max_depth == 3
    assert t.mask() is None
    assert torch.equal(t.ancestor_mask(), torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    assert t.children() == [[1], [2], [3], []]


def test_root_only() -> None:
    t = DraftTree.root_only(7)
    assert t.tokens.tolist() == [7] and t.parents == [-1]
    assert len(t) == 1 and t.is_chain and t.max_depth == 0
    assert t.mask() is None
    assert t.children() == [[]]
    assert DraftTree.chain(7, []).parents == [-1]


def test_from_paths_merges_shared_prefixes() -> None:
    t = DraftTree.from_paths(0, [[1, 2, 3], [1, 2, 4], [1, 5], [6], [1, 2, 3]])
    assert t.tokens.tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert t.parents == [-1, 0, 1, 2, 2, 1, 0]
    assert t.depths == [0, 1, 2, 3, 3, 2, 1]
    assert not t.is_chain
    assert t.probs is None


def test_from_paths_single_path_is_chain() -> None:
    t = DraftTree.from_paths(0, [[4, 4, 4], [4, 4]])
    assert t.tokens.tolist() == [0, 4, 4, 4]
    assert t.is_chain and t.mask() is None


def test_from_paths_same_token_under_different_parents_is_not_merged() -> None:
    t = DraftTree.from_paths(0, [[1, 3], [2, 3]])
    assert t.tokens.tolist() == [0, 1, 3, 2, 3]
    assert t.parents == [-1, 0, 1, 0, 3]


@pytest.mark.parametrize("max_nodes", [1, 2, 4, 5, 7, 100])
def test_from_paths_max_nodes(max_nodes: int) -> None:
    paths = [[1, 2, 3], [1, 2, 4], [1, 5], [6]]
    full = DraftTree.from_paths(0, paths)
    t = DraftTree.from_paths(0, paths, max_nodes=max_nodes)
    n = min(max_nodes, len(full))
    assert len(t) == n
    assert t.tokens.tolist() == full.tokens.tolist()[:n]
    assert t.parents == full.parents[:n]


def _path_tokens(t: DraftTree, node: int) -> list[int]:
    toks = []
    while node > 0:
        toks.append(int(t.tokens[node]))
        node = t.parents[node]
    return toks[::-1]


def test_from_paths_random_is_topological_trie() -> None:
    rng = random.Random(0)
    for _ in range(50):
        paths = [[rng.randrange(3) for _ in range(rng.randint(0, 5))] for _ in range(rng.randint(0, 6))]
        max_nodes = rng.choice([None, 1, 3, 6, 10])
        t = DraftTree.from_paths(99, paths, max_nodes=max_nodes)
        assert t.parents[0] == -1 and int(t.tokens[0]) == 99
        assert all(0 <= p < i for i, p in enumerate(t.parents[1:], start=1))
        if max_nodes is not None:
            assert len(t) <= max_nodes
        # a trie: no two children of a node carry the same token; every node spells a prefix of some path
        for kids in t.children():
            toks = [int(t.tokens[c]) for c in kids]
            assert len(toks) == len(set(toks))
        prefixes = {()} | {tuple(p[:k]) for p in paths for k in range(len(p) + 1)}
        spelled = [tuple(_path_tokens(t, i)) for i in range(len(t))]
        assert set(spelled) <= prefixes
        if max_nodes is None:
            assert set(spelled) == prefixes


def test_depths_and_positions(tree: DraftTree) -> None:
    assert tree.depths == [0, 1, 1, 2, 2, 2, 3]
    assert tree.max_depth == 3
    pos = tree.positions(10)
    assert pos.dtype == torch.int64
    assert pos.tolist() == [10, 11, 11, 12, 12, 12, 13]
    assert tree.positions(0).tolist() == tree.depths


def test_ancestor_mask(tree: DraftTree) -> None:
    expected = torch.tensor(EXPECTED_MASK, dtype=torch.bool)
    assert torch.equal(tree.ancestor_mask(), expected)
    mask = tree.mask()
    assert mask is not None and mask.dtype == torch.bool
    assert torch.equal(mask, expected)


def test_children(tree: DraftTree) -> None:
    assert tree.children() == [[1, 2], [3, 4], [5], [], [6], [], []]
    assert not tree.is_chain


@pytest.mark.parametrize(
    "tokens, parents",
    [
        ([1, 2, 3], [0, 0, 1]),  # root must have parent -1
        ([1, 2, 3], [-1, 0, 2]),  # self loop
        ([1, 2, 3], [-1, 2, 0]),  # parent after the node
        ([1, 2, 3], [-1, -1, 0]),  # a second root
        ([1, 2, 3], [-1, 0, -2]),
        ([1, 2, 3], [-1, 0]),  # one parent short
        ([1, 2], [-1, 0, 1]),  # one parent too many
    ],
)
def test_invalid_parents_raise(tokens: list[int], parents: list[int]) -> None:
    with pytest.raises(ValueError):
        DraftTree(torch.tensor(tokens), parents)
