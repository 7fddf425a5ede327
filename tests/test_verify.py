"""Acceptance: the greedy walk, token-matching sampling on any tree, and Leviathan rejection sampling on
chains with proposal distributions. The sampling tests are statistical (fixed seeds, chi-square or
binomial tests at p > 0.001 over 20,000 draws) and check the one property that makes decoding lossless:
every emitted token is distributed as the target's distribution at its node.

Failure power: with P and Q below, drawing the residual from p instead of norm(max(p - q, 0)) makes the first
token distributed as min(p, q) + (1 - sum(min(p, q))) p = [.325, .225, .225, .15, .075] instead of P, a
chi-square statistic of about 2200 at 20,000 draws. These mutations of a scratch copy of verify.py were each
caught: residual from p; acceptance with min(1, q/p); always accepting; the wrong target row (p_rows[i]); the
bonus from the root's row; token matching sampling every node from the root's row.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from scipy import stats

from spyglass.sampling import SamplingParams
from spyglass.tree import DraftTree
from spyglass.verify import Accepted, accept, target_rows

V = 5
DRAWS = 20_000
ALPHA = 1e-3
SAMPLE = SamplingParams(temperature=1.0)
P = torch.tensor([0.45, 0.25, 0.15, 0.10, 0.05])
Q = torch.tensor([0.10, 0.10, 0.20, 0.30, 0.30])


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny tensors: intra-op threads only add synchronisation cost (large on a loaded machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def chi_square_p(samples: list[int], probs: torch.Tensor) -> float:
    """Goodness of fit of integer samples to `probs`; cells with expected count < 5 must have no samples."""
    counts = np.bincount(np.asarray(samples, dtype=np.int64), minlength=probs.numel()).astype(float)
    expected = probs.double().numpy() * len(samples)
    big = expected >= 5
    assert counts[expected == 0].sum() == 0, "a token with probability 0 was emitted"
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


def logits_for(*rows: torch.Tensor) -> torch.Tensor:
    """Target logits whose softmax (temperature 1) is each given distribution."""
    return torch.stack(rows).log()


# ----------------------------------------------------------------------------------------------- greedy


def one_hot_logits(argmaxes: list[int], vocab: int = 20) -> torch.Tensor:
    """Row i has its maximum at argmaxes[i], with a runner-up elsewhere."""
    logits = torch.zeros(len(argmaxes), vocab)
    for i, a in enumerate(argmaxes):
        logits[i, a] = 5.0
        logits[i, (a + 1) % vocab] = 4.0
    return logits


# tokens by node:  0:10 (root) -> 1:11, 2:12 ; 1 -> 3:13 ; 2 -> 4:14, 5:15 ; 5 -> 6:16
GREEDY_TREE = DraftTree(torch.tensor([10, 11, 12, 13, 14, 15, 16]), [-1, 0, 0, 1, 2, 2, 5])
HIST = torch.tensor([1, 2, 3, 10])


@pytest.mark.parametrize(
    "argmaxes, path, tokens",
    [
        # root picks its second child 12, node 2 picks its second child 15, node 6 predicts a bonus 7
        ([12, 13, 15, 0, 0, 16, 7], [0, 2, 5, 6], [12, 15, 16, 7]),
        # node 5's prediction 3 is no child: stop there with bonus 3 (node 1 would accept 13 but is off-path)
        ([12, 13, 15, 0, 0, 3, 0], [0, 2, 5], [12, 15, 3]),
        # first child of the root, then its only child, then the leaf's bonus
        ([11, 13, 0, 9, 0, 0, 0], [0, 1, 3], [11, 13, 9]),
        # nothing accepted: the root's argmax is the bonus
        ([14, 13, 15, 0, 0, 16, 0], [0], [14]),
    ],
)
def test_greedy_walk(argmaxes: list[int], path: list[int], tokens: list[int]) -> None:
    acc = accept(GREEDY_TREE, one_hot_logits(argmaxes), HIST, SamplingParams())
    assert acc.path == path
    assert acc.tokens == tokens
    assert acc.num_drafted_accepted == len(path) - 1


def test_greedy_root_only() -> None:
    acc = accept(DraftTree.root_only(10), one_hot_logits([17]), HIST, SamplingParams())
    assert acc == Accepted([0], [17])
    assert acc.num_drafted_accepted == 0


def test_greedy_ignores_proposal_probs() -> None:
    tree = DraftTree.chain(10, [11, 12], probs=torch.full((3, 20), 0.05))
    acc = accept(tree, one_hot_logits([11, 4, 0]), HIST, SamplingParams())
    assert acc == Accepted([0, 1], [11, 4])


def test_greedy_with_repetition_penalty_per_path() -> None:
    """Row 0: 12 (2.0) narrowly beats 11 (1.9) but 12 is in the history, so 11 wins under a penalty. Row 1 (node
    11): 11 (3.0) beats its child 13 (2.8), but 11 is now an ancestor, so the walk continues to 13."""
    tree = DraftTree.from_paths(10, [[11, 13], [12]])  # nodes: 0:10, 1:11, 2:13, 3:12
    logits = torch.zeros(4, 20)
    logits[0, 12], logits[0, 11] = 2.0, 1.9
    logits[1, 11], logits[1, 13] = 3.0, 2.8
    logits[2, 5] = 1.0
    history = torch.tensor([12, 10])
    assert accept(tree, logits, history, SamplingParams()) == Accepted([0, 3], [12, 0])
    penalised = SamplingParams(repetition_penalty=1.2)
    assert accept(tree, logits, history, penalised) == Accepted([0, 1, 2], [11, 13, 5])


# ----------------------------------------------------------------------------------------- token matching


def one_step_tree(children: list[int]) -> DraftTree:
    return DraftTree.from_paths(0, [[c] for c in children])


@pytest.mark.parametrize("children", [[], [2], [0, 3], [0, 1, 2, 3, 4]], ids=lambda c: f"children={c}")
def test_token_matching_first_token_distributed_as_target(children: list[int]) -> None:
    tree = one_step_tree(children)
    child_rows = [torch.roll(P, k + 1) for k in range(len(children))]  # a different target at each child
    logits = logits_for(P, *child_rows)
    history = torch.tensor([3, 0])
    g = torch.Generator().manual_seed(1234 + len(children))
    first, bonus_by_child = [], {c: [] for c in range(1, len(tree))}
    for _ in range(DRAWS):
        acc = accept(tree, logits, history, SAMPLE, g)
        x = acc.tokens[0]
        first.append(x)
        if x in children:
            node = 1 + children.index(x)
            assert acc.path == [0, node] and len(acc.tokens) == 2
            bonus_by_child[node].append(acc.tokens[1])
        else:
            assert acc.path == [0] and len(acc.tokens) == 1
    assert chi_square_p(first, P) > ALPHA
    for node, bonus in bonus_by_child.items():
        assert len(bonus) > 500
        assert chi_square_p(bonus, child_rows[node - 1]) > ALPHA


def test_token_matching_deep_tree_path_consistent_and_seeded() -> None:
    tree = DraftTree.from_paths(0, [[0, 1, 2], [0, 3], [1, 1], [4]])
    logits = torch.randn(len(tree), V, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.9, top_k=4)
    kids = tree.children()
    runs = []
    for seed in (7, 7):
        g = torch.Generator().manual_seed(seed)
        runs.append([accept(tree, logits, torch.tensor([0]), params, g) for _ in range(300)])
    assert runs[0] == runs[1], "a seeded generator makes acceptance reproducible"
    depths = set()
    for acc in runs[0]:
        assert acc.path[0] == 0 and len(acc.tokens) == len(acc.path)
        for a, b in zip(acc.path, acc.path[1:], strict=False):
            assert tree.parents[b] == a
        assert acc.tokens[:-1] == [int(tree.tokens[n]) for n in acc.path[1:]]
        assert all(int(tree.tokens[c]) != acc.tokens[-1] for c in kids[acc.path[-1]])  # stopped for a reason
        depths.add(len(acc.path) - 1)
    assert depths >= {0, 1, 2}


# ----------------------------------------------------------------------------------------------- Leviathan


def leviathan_draws(rows: list[torch.Tensor], qs: list[torch.Tensor], seed: int) -> list[tuple[list[int], Accepted]]:
    """Draft a chain of len(qs) tokens from the q rows, then accept against target rows (len(qs) + 1)."""
    g = torch.Generator().manual_seed(seed)
    logits = logits_for(*rows)
    probs = torch.stack([torch.zeros(V), *qs])
    out = []
    for _ in range(DRAWS):
        drafted = [int(torch.multinomial(q, 1, generator=g)) for q in qs]
        tree = DraftTree.chain(0, drafted, probs=probs)
        out.append((drafted, accept(tree, logits, torch.tensor([0]), SAMPLE, g)))
    return out


def test_leviathan_one_step() -> None:
    p_bonus = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2])
    draws = leviathan_draws([P, p_bonus], [Q], seed=11)
    first, bonus, accepted = [], [], 0
    for drafted, acc in draws:
        first.append(acc.tokens[0])
        if acc.path == [0, 1]:
            accepted += 1
            assert acc.tokens[0] == drafted[0] and len(acc.tokens) == 2
            bonus.append(acc.tokens[1])
        else:
            assert acc.path == [0] and len(acc.tokens) == 1
    assert chi_square_p(first, P) > ALPHA
    assert chi_square_p(bonus, p_bonus) > ALPHA
    alpha = float(torch.minimum(P, Q).sum())
    assert stats.binomtest(accepted, DRAWS, alpha).pvalue > ALPHA


def test_leviathan_two_steps_second_token_distributed_as_target() -> None:
    p2 = torch.tensor([0.05, 0.15, 0.20, 0.30, 0.30])
    q2 = torch.tensor([0.40, 0.30, 0.10, 0.10, 0.10])
    p3 = torch.tensor([0.10, 0.10, 0.60, 0.10, 0.10])
    draws = leviathan_draws([P, p2, p3], [Q, q2], seed=12)
    first, second, third, both = [], [], [], 0
    for drafted, acc in draws:
        k = acc.num_drafted_accepted
        assert acc.path == list(range(k + 1)) and len(acc.tokens) == k + 1
        assert acc.tokens[:k] == drafted[:k]
        first.append(acc.tokens[0])
        if k >= 1:
            second.append(acc.tokens[1])
        if k == 2:
            both += 1
            third.append(acc.tokens[2])
    assert chi_square_p(first, P) > ALPHA
    assert chi_square_p(second, p2) > ALPHA
    assert chi_square_p(third, p3) > ALPHA
    alpha1, alpha2 = float(torch.minimum(P, Q).sum()), float(torch.minimum(p2, q2).sum())
    assert stats.binomtest(len(second), DRAWS, alpha1).pvalue > ALPHA
    assert stats.binomtest(both, len(second), alpha2).pvalue > ALPHA


def test_leviathan_q_equal_p_always_accepts() -> None:
    g = torch.Generator().manual_seed(3)
    tree_probs = torch.stack([torch.zeros(V), P, P])
    logits = logits_for(P, P, P)
    for _ in range(500):
        drafted = [int(torch.multinomial(P, 1, generator=g)) for _ in range(2)]
        acc = accept(DraftTree.chain(0, drafted, probs=tree_probs), logits, torch.tensor([0]), SAMPLE, g)
        assert acc.path == [0, 1, 2] and acc.tokens[:2] == drafted


def test_leviathan_rejects_token_the_target_cannot_emit() -> None:
    p = torch.tensor([0.5, 0.5, 0.0, 0.0, 0.0])
    g = torch.Generator().manual_seed(4)
    logits = logits_for(p, p)
    tree = DraftTree.chain(0, [3], probs=torch.stack([torch.zeros(V), Q]))
    for _ in range(500):
        acc = accept(tree, logits, torch.tensor([0]), SAMPLE, g)
        assert acc.path == [0] and acc.tokens[0] in (0, 1)


def test_target_rows_sampling_are_probabilities() -> None:
    tree = DraftTree.from_paths(0, [[1, 2], [3]])
    logits = torch.randn(len(tree), V, generator=torch.Generator().manual_seed(5))
    rows = target_rows(logits, tree, torch.tensor([4, 0]), SamplingParams(temperature=0.7, repetition_penalty=1.3))
    assert rows.shape == (len(tree), V)
    torch.testing.assert_close(rows.sum(-1), torch.ones(len(tree)))
