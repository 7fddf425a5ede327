"""TokenSwift's contextual penalty: the formula on hand-computed examples, the window, per-path rows, errors."""

from __future__ import annotations

import pytest
import torch

from spyglass.engine import EngineConfig, SpecEngine, plain_generate
from spyglass.sampling import SamplingParams, needs_presence, penalty_masks, process, process_in_context, window_rows
from spyglass.tree import DraftTree
from spyglass.verify import target_rows

V = 6


def test_sign_aware_formula_on_a_hand_computed_example():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0]])
    params = SamplingParams(contextual_penalty=2.0, penalty_window=3)
    # last 3 tokens are 5, 0, 1 (token 3 is older, outside the window); 0 appears twice but is penalised once
    history = torch.tensor([3, 0, 3, 5, 0, 1])
    out = process_in_context(logits, params, history)
    assert torch.equal(out, torch.tensor([[1.0, -2.0, 0.5, 3.0, -2.0, 0.0]]))


def test_sampling_probabilities_follow_the_formula():
    logits = torch.tensor([[1.2, -0.4, 0.3, 0.0, 2.0, -1.0]])
    theta, t = 1.5, 0.7
    params = SamplingParams(temperature=t, contextual_penalty=theta, penalty_window=2)
    probs = process_in_context(logits, params, torch.tensor([4, 2, 1]))  # window {2, 1}
    by_hand = torch.tensor([1.2, -0.4 * theta, 0.3 / theta, 0.0, 2.0, -1.0]) / t
    assert torch.allclose(probs[0], torch.softmax(by_hand, -1), atol=1e-6)


def test_window_respected_and_both_penalties_stack():
    history = torch.tensor([0, 1, 2, 3])
    assert window_rows(history, V, 1, 2)[0].nonzero().flatten().tolist() == [2, 3]
    assert window_rows(history, V, 1, 100)[0].nonzero().flatten().tolist() == [0, 1, 2, 3]
    params = SamplingParams(repetition_penalty=2.0, contextual_penalty=3.0, penalty_window=1)
    out = process_in_context(torch.full((1, V), 6.0), params, history)
    # tokens 0-2: repetition only; 3: both (6 / 2 / 3); 4, 5: untouched
    assert out[0].tolist() == [3.0, 3.0, 3.0, 1.0, 6.0, 6.0]


def test_tree_rows_slide_the_window_along_each_path():
    # history ... 5 6 7 (7 is the root); tree: 7 -> 8 -> 9, 7 -> 4
    tree = DraftTree(torch.tensor([7, 8, 9, 4]), [-1, 0, 1, 0])
    rows = window_rows(torch.tensor([5, 6, 7]), 10, 4, 2, tree.tokens, tree.ancestor_mask())
    got = [r.nonzero().flatten().tolist() for r in rows]
    assert got == [[6, 7], [7, 8], [8, 9], [4, 7]]
    # window inside the path: only the last node
    rows = window_rows(torch.tensor([5, 6, 7]), 10, 4, 1, tree.tokens, tree.ancestor_mask())
    assert [r.nonzero().flatten().tolist() for r in rows] == [[7], [8], [9], [4]]


def test_target_rows_equal_plain_rows_of_each_path():
    """What verification computes for a node equals what plain decoding computes after that path."""
    g = torch.Generator().manual_seed(0)
    tree = DraftTree(torch.tensor([7, 8, 9, 4, 8]), [-1, 0, 1, 0, 3])
    logits = torch.randn(len(tree), 10, generator=g)
    history = torch.tensor([5, 6, 8, 3, 7])
    params = SamplingParams(temperature=0.9, contextual_penalty=1.7, penalty_window=3, repetition_penalty=1.1)
    rows = target_rows(logits, tree, history, params)
    paths = {0: [], 1: [8], 2: [8, 9], 3: [4], 4: [4, 8]}
    for node, path in paths.items():
        ctx = torch.cat([history, torch.tensor(path, dtype=torch.long)])
        assert torch.allclose(rows[node], process_in_context(logits[node : node + 1], params, ctx)[0])


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("contextual_penalty", 0.9, "contextual_penalty must be >= 1"),
        ("contextual_penalty", float("nan"), "contextual_penalty must be a finite number"),
        ("penalty_window", 0, "penalty_window must be > 0"),
        ("penalty_window", -5, "penalty_window must be > 0"),
    ],
)
def test_bad_values_are_clear_errors(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_off_by_default():
    p = SamplingParams()
    assert p.contextual_penalty == 1.0 and not needs_presence(p)
    assert penalty_masks(p, torch.tensor([1, 2]), V) == (None, None)
    logits = torch.randn(2, V)
    assert torch.equal(process(logits, p, None), logits)


def test_plain_decoding_and_engine_apply_it(tiny_target):
    """The penalty changes greedy output, and the engine (drafting or not) gives plain decoding's output."""
    from spyglass.drafters.ngram import NgramDrafter

    prompt = [5, 9, 5, 9, 5, 9, 11, 12, 5, 9]
    plain = SamplingParams(max_new_tokens=20, ignore_eos=True)
    pen = SamplingParams(max_new_tokens=20, ignore_eos=True, contextual_penalty=2.5, penalty_window=4)
    ref = plain_generate(tiny_target, prompt, pen)
    assert ref != plain_generate(tiny_target, prompt, plain)
    for drafter in (None, NgramDrafter(n_min=1, n_max=3, draft_len=4, max_candidates=3)):
        engine = SpecEngine(tiny_target, drafter, EngineConfig(max_batch=2, max_context=128, controller="off"))
        assert [s.output_ids for s in engine.run([prompt, prompt], pen)] == [ref, ref]


def test_request_field_travels_sdk_proto_gateway_verifier():
    """SDK -> wire -> gateway dict -> verifier SamplingParams, and a bad value is a clear ValueError there."""
    from services.gateway import request_to_dict
    from services.verifier import VerifierConfig, sampling_from_request
    from spyglass.client import build_request

    req = build_request("hi", temperature=0.5, contextual_penalty=1.25, penalty_window=64, max_new_tokens=8)
    wire = type(req).FromString(req.SerializeToString())
    params = sampling_from_request(request_to_dict(wire, "r1"), VerifierConfig())
    assert (params.contextual_penalty, params.penalty_window, params.temperature) == (1.25, 64, 0.5)
    unset = sampling_from_request(request_to_dict(build_request("hi"), "r2"), VerifierConfig())
    assert (unset.contextual_penalty, unset.penalty_window) == (1.0, 1024)
    with pytest.raises(ValueError, match="contextual_penalty must be >= 1"):
        sampling_from_request(request_to_dict(build_request("hi", contextual_penalty=0.5), "r3"), VerifierConfig())


@pytest.mark.parametrize(
    "argv,needle",
    [(["--contextual-penalty", "0.8"], "contextual_penalty"), (["--penalty-window", "0"], "penalty_window")],
)
def test_cli_bad_penalty_gives_clear_error(argv, needle, capsys):
    from cli.main import main

    assert main(["generate", "--prompt", "hi", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spyglass: error:") and needle in err
