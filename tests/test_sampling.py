"""Logits processors against HF transformers' own (the oracle), per-row presence for tree nodes, and
SamplingParams validation.

HF's order in `generate` is repetition penalty, temperature, top-k, top-p, min-p; spyglass's `process` must
give the same probabilities as softmax of HF's processed scores for every combination.
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from spyglass.sampling import (
    SamplingParams,
    apply_repetition_penalty,
    needs_presence,
    presence_rows,
    process,
    sample,
    warp,
)
from spyglass.tree import DraftTree

V = 50
N = 8


def hf_scores(logits: torch.Tensor, params: SamplingParams, input_ids: torch.Tensor) -> torch.Tensor:
    """HF's processors in `generate`'s order; `input_ids` `[n, T]` is each row's context."""
    procs = []
    if params.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(float(params.repetition_penalty)))
    if not params.greedy:
        procs.append(TemperatureLogitsWarper(float(params.temperature)))
        if params.top_k > 0:
            procs.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1.0:
            procs.append(TopPLogitsWarper(params.top_p))
        if params.min_p > 0.0:
            procs.append(MinPLogitsWarper(params.min_p))
    scores = logits.clone()
    for proc in procs:
        scores = proc(input_ids, scores)
    return scores


def random_logits(seed: int, n: int = N, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * scale


NO_CONTEXT = torch.zeros(N, 1, dtype=torch.long)

WARP_SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.7),
    dict(temperature=1.8),
    dict(temperature=1.0, top_k=1),
    dict(temperature=1.3, top_k=5),
    dict(temperature=1.0, top_k=V + 10),  # larger than the vocabulary: no-op
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=0.8, top_p=0.3),
    dict(temperature=1.0, top_p=0.01),  # keeps only the argmax
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=1.5, min_p=0.3),
    dict(temperature=0.9, top_k=10, top_p=0.8),
    dict(temperature=1.2, top_p=0.95, min_p=0.05),
    dict(temperature=0.8, top_k=20, top_p=0.85, min_p=0.05),
    dict(temperature=2.0, top_k=30, top_p=0.7, min_p=0.2),
]


def assert_probs_close(ours: torch.Tensor, hf: torch.Tensor) -> None:
    assert ours.shape == hf.shape
    assert torch.all(ours >= 0)
    torch.testing.assert_close(ours.sum(-1), torch.ones(ours.shape[0]), atol=1e-5, rtol=0)
    torch.testing.assert_close(ours, torch.softmax(hf, dim=-1), atol=1e-6, rtol=1e-5)
    # the same support exactly: filtered tokens get probability 0 on both sides
    assert torch.equal(ours > 0, torch.isfinite(hf) & (torch.softmax(hf, dim=-1) > 0))


@pytest.mark.parametrize("settings", WARP_SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("seed", [0, 1])
def test_warp_matches_hf(settings: dict, seed: int) -> None:
    params = SamplingParams(**settings)
    logits = random_logits(seed)
    ours = warp(logits, params)
    assert_probs_close(ours, hf_scores(logits, params, NO_CONTEXT))
    assert torch.equal(process(logits, params, None), ours)


def test_warp_does_not_modify_input() -> None:
    logits = random_logits(3)
    before = logits.clone()
    warp(logits, SamplingParams(temperature=0.5, top_k=4, top_p=0.5, min_p=0.2))
    assert torch.equal(logits, before)


def test_top_k_and_top_p_keep_expected_counts() -> None:
    """Independent of HF: top-k keeps k tokens, a tiny top-p keeps only the argmax."""
    logits = random_logits(4)
    assert torch.all((warp(logits, SamplingParams(temperature=1.0, top_k=7)) > 0).sum(-1) == 7)
    probs = warp(logits, SamplingParams(temperature=1.0, top_p=1e-4))
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))
    assert torch.all(probs.max(-1).values == 1.0)


HISTORY = torch.tensor([3, 7, 7, 12, 0, 49, 3, 25])


@pytest.mark.parametrize("penalty", [1.3, 2.0, 0.7])
@pytest.mark.parametrize("settings", WARP_SETTINGS[::3], ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_repetition_penalty_matches_hf(settings: dict, penalty: float) -> None:
    params = SamplingParams(repetition_penalty=penalty, **settings)
    logits = random_logits(5)
    presence = presence_rows(HISTORY, V, N)
    assert presence.shape == (N, V) and presence.dtype == torch.bool
    assert presence[0].nonzero().flatten().tolist() == sorted(set(HISTORY.tolist()))
    input_ids = HISTORY[None].expand(N, -1)
    assert_probs_close(process(logits, params, presence), hf_scores(logits, params, input_ids))


@pytest.mark.parametrize("penalty", [1.5, 0.6])
def test_greedy_process_returns_penalised_logits(penalty: float) -> None:
    params = SamplingParams(temperature=0.0, repetition_penalty=penalty)
    logits = random_logits(6)
    logits[:, 5] = 0.0  # a zero logit stays zero either way
    presence = presence_rows(torch.cat([HISTORY, torch.tensor([5])]), V, N)
    out = process(logits, params, presence)
    expected = hf_scores(logits, params, torch.cat([HISTORY, torch.tensor([5])])[None].expand(N, -1))
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    assert torch.equal(out.argmax(-1), expected.argmax(-1))
    # untouched where absent; positive logits shrink and negative ones grow in magnitude (penalty > 1)
    assert torch.equal(out[:, ~presence[0]], logits[:, ~presence[0]])
    assert torch.equal(apply_repetition_penalty(logits, presence, penalty), out)


def test_greedy_process_without_penalty_is_identity() -> None:
    logits = random_logits(7)
    params = SamplingParams()
    assert params.greedy and not needs_presence(params)
    assert torch.equal(process(logits, params, None), logits)
    assert torch.equal(process(logits, params, presence_rows(HISTORY, V, N)), logits)


def test_penalty_changes_greedy_choice() -> None:
    logits = torch.zeros(1, V)
    logits[0, 7], logits[0, 8] = 2.0, 1.9
    presence = presence_rows(torch.tensor([7]), V, 1)
    assert int(process(logits, SamplingParams(repetition_penalty=1.2), presence).argmax()) == 8
    assert int(process(logits, SamplingParams(), presence).argmax()) == 7


def _ancestor_tokens(tree: DraftTree, node: int) -> list[int]:
    """Tokens on the path root..node (both included)."""
    toks = []
    while node >= 0:
        toks.append(int(tree.tokens[node]))
        node = tree.parents[node]
    return toks[::-1]


def test_presence_rows_tree_ancestors_not_siblings() -> None:
    # root 30; siblings 40 and 41 under the root; 42 under 40; 43 under 41; 44 under 42
    tree = DraftTree.from_paths(30, [[40, 42, 44], [41, 43]])
    history = torch.tensor([1, 2, 30])
    presence = presence_rows(history, V, len(tree), tree.tokens, tree.ancestor_mask())
    expected = {
        0: {1, 2, 30},
        1: {1, 2, 30, 40},
        2: {1, 2, 30, 40, 42},
        3: {1, 2, 30, 40, 42, 44},
        4: {1, 2, 30, 41},
        5: {1, 2, 30, 41, 43},
    }
    assert tree.tokens.tolist() == [30, 40, 42, 44, 41, 43]
    for row, toks in expected.items():
        assert set(presence[row].nonzero().flatten().tolist()) == toks, f"row {row}"


@pytest.mark.parametrize(
    "settings",
    [dict(temperature=0.0), dict(temperature=0.9, top_k=12, top_p=0.9), dict(temperature=1.0, min_p=0.1)],
    ids=["greedy", "topk-topp", "minp"],
)
def test_tree_rows_match_hf_per_row_context(settings: dict) -> None:
    """Row i is processed with history + the tokens of its ancestors: HF on exactly that context."""
    params = SamplingParams(repetition_penalty=1.8, **settings)
    history = torch.tensor([4, 9, 9, 17, 30])
    tree = DraftTree.from_paths(30, [[40, 42, 44], [41, 43], [40, 9]])
    logits = random_logits(8, n=len(tree))
    logits[:, 40:45] += 3.0  # make the drafted tokens likely, so that penalising them matters
    presence = presence_rows(history, V, len(tree), tree.tokens, tree.ancestor_mask())
    ours = process(logits, params, presence)
    for i in range(len(tree)):
        ctx = torch.cat([history, torch.tensor(_ancestor_tokens(tree, i)[1:], dtype=torch.long)])[None]
        hf = hf_scores(logits[i : i + 1], params, ctx)
        if params.greedy:
            torch.testing.assert_close(ours[i : i + 1], hf, atol=0, rtol=0)
        else:
            assert_probs_close(ours[i : i + 1], hf)
    # and a sibling's token is not penalised: 41 (node 4) is penalised only in rows 4 and 5
    assert presence[:, 41].nonzero().flatten().tolist() == [4, 5]


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", -0.2),
        ("top_k", -1),
        ("min_p", 1.0),
        ("min_p", -0.1),
        ("max_new_tokens", 0),
        ("max_new_tokens", -3),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
    ],
)
def test_params_validation(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_params_valid_edges() -> None:
    p = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, max_new_tokens=1)
    assert p.greedy
    assert not SamplingParams(temperature=1e-3).greedy
    assert needs_presence(SamplingParams(repetition_penalty=1.1))


def test_sample_draws_each_token_by_its_probability() -> None:
    """Inverse-CDF sampling: frequencies match the (unnormalised) weights within 4 standard errors, a
    zero-weight token is never drawn, and a seeded generator repeats its draws."""
    weights = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.5, 0.0, 0.25, 0.25])
    g = torch.Generator().manual_seed(0)
    n = 20_000
    counts = torch.bincount(torch.tensor([sample(weights, g) for _ in range(n)]), minlength=len(weights))
    expected = weights / weights.sum()
    assert int(counts[weights == 0].sum()) == 0
    se = (expected * (1 - expected) / n).sqrt()
    assert torch.all((counts / n - expected).abs() <= 4 * se + 1e-9), counts
    first, second = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    assert [sample(weights, first) for _ in range(20)] == [sample(weights, second) for _ in range(20)]
    one_hot = torch.zeros(5)
    one_hot[4] = 1e-30  # a single tiny weight, last: the only token there is to draw
    assert {sample(one_hot, g) for _ in range(50)} == {4}
