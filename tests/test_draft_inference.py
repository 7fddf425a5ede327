"""The LongSpec draft block at inference (window cache + the target's KVCache, hybrid tree attention) computes
what its training forward (SDPA over the whole sequence, lagged cross-attention mask) computes.

A chain of n draft tokens after C committed ones: node d (position C + d) sees the target's K/V up to C - 1,
which is the training forward's cross mask with lag d + 1, so row d must equal that forward at C + d. Tiny
random target and draft, fp32; tolerance 1e-4 on logits of magnitude ~1.
"""

from __future__ import annotations

import pytest
import torch

from spyglass.drafters.base import DraftRequest
from spyglass.models.drafts.longspec import LongSpecDraft
from spyglass.models.llama import load_transformer
from spyglass.tree import DraftTree

LENGTH, COMMITTED = 40, 36


@pytest.fixture(scope="module")
def target_and_kv(tiny_dir):
    """Tiny target, a random sequence, and the target's last-layer K/V for it (from the KVCache, post-RoPE)."""
    target = load_transformer(tiny_dir["llama"])
    tokens = torch.randint(3, target.args.vocab_size, (LENGTH,), generator=torch.Generator().manual_seed(0))
    cache = target.new_cache(LENGTH + 8, 1)
    slot = cache.allocate()
    target.prefill(cache, slot, tokens)
    k, v = cache.layer(slot, target.args.n_layers - 1)
    return target, tokens, k[:, :LENGTH].clone(), v[:, :LENGTH].clone()


def layer_hidden(target, tokens: torch.Tensor, layers: tuple[int, ...] = (-1,)) -> dict[int, torch.Tensor]:
    """The target's hidden states `[L, H]` (layer outputs, the last one before the final norm) of `layers`, as
    extraction stores them and the engine hands them over, by layer index."""
    wanted = tuple(i % target.args.n_layers for i in layers)
    cache = target.new_cache(tokens.shape[0], 1)
    target.capture_layers = wanted
    try:
        target.prefill(cache, cache.allocate(), tokens)
        return {i: target.captured[0][i].clone() for i in wanted}
    finally:
        target.capture_layers = ()


def make_draft(
    target,
    window: int,
    feed_hidden: bool = False,
    feed_own_hidden: bool = False,
    hidden_layers=None,
    prev_token: bool = False,
    copy_head: bool = False,
) -> LongSpecDraft:
    torch.manual_seed(1)
    draft = LongSpecDraft.from_target(
        target,
        window=window,
        init_std=0.2,
        feed_hidden=feed_hidden,
        feed_own_hidden=feed_own_hidden,
        hidden_layers=hidden_layers,
        prev_token=prev_token,
        copy_head=copy_head,
    )  # init_std 0.2: non-flat logits
    # they start at zero (a draft without them); a trained one is not
    for proj in ("hidden_proj", "own_proj", "extra_hidden_proj", "prev_proj", "copy_gate"):
        if hasattr(draft, proj):
            torch.nn.init.normal_(getattr(draft, proj).weight, std=0.2)
    return draft.eval()


def training_logits(draft, tokens, k, v, lag: int, hidden: torch.Tensor | None = None) -> torch.Tensor:
    with torch.no_grad():
        positions = torch.arange(tokens.shape[0]).unsqueeze(0)
        h = None if hidden is None else hidden.unsqueeze(0)
        out = draft(tokens.unsqueeze(0), positions, k.unsqueeze(0), v.unsqueeze(0), lag=lag, target_h=h)
        if draft.cfg.copy_head:  # target-vocab log-probs: position j proposes the token after it
            return draft.mix(out, torch.cat([tokens[1:], tokens[-1:]]))[0]
        return out[0]


def test_chain_equals_training_forward(target_and_kv):
    target, tokens, k, v = target_and_kv
    draft = make_draft(target, window=64)  # the window covers the whole sequence
    positions = torch.arange(LENGTH)
    wk, wv = draft.window_kv(tokens[:COMMITTED], positions[:COMMITTED])
    got = draft_chain(draft, tokens, positions, wk, wv, k, v)
    assert got.shape == (LENGTH - COMMITTED, target.args.vocab_size)
    for d in range(LENGTH - COMMITTED):
        want = training_logits(draft, tokens, k, v, lag=d + 1)[COMMITTED + d]
        assert torch.allclose(got[d], want, atol=1e-4, rtol=1e-4), f"depth {d}: {(got[d] - want).abs().max():.3g}"
    assert got.std() > 0.1, "flat logits would make the comparison weak"


def draft_chain(draft, tokens, positions, wk, wv, k, v, backend: str = "cpu") -> torch.Tensor:
    return draft.draft_logits(
        tokens[COMMITTED:], positions[COMMITTED:], None, wk, wv, k[:, :COMMITTED], v[:, :COMMITTED], backend
    )


def test_root_with_a_sliding_window(target_and_kv):
    """With a window shorter than the context, the cache holds the last window - 1 committed tokens, so the
    root (the token after them) sees exactly the training forward's window."""
    target, tokens, k, v = target_and_kv
    window = 16
    draft = make_draft(target, window=window)
    positions = torch.arange(LENGTH)
    lo = COMMITTED - (window - 1)
    wk, wv = draft.window_kv(tokens[lo:COMMITTED], positions[lo:COMMITTED])
    got = draft_chain(draft, tokens, positions, wk, wv, k, v)[0]
    want = training_logits(draft, tokens, k, v, lag=1)[COMMITTED]
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), f"max diff {(got - want).abs().max():.3g}"
    wider = draft.window_kv(tokens[lo - 4 : COMMITTED], positions[lo - 4 : COMMITTED])
    assert not torch.allclose(draft_chain(draft, tokens, positions, *wider, k, v)[0], want, atol=1e-4)


def test_tree_hybrid_equals_reference(target_and_kv):
    """A branching draft tree through the hybrid ("cpu") and the naive ("reference") attention."""
    target, tokens, k, v = target_and_kv
    draft = make_draft(target, window=64)
    tree = DraftTree(tokens[COMMITTED - 7 : COMMITTED].clone(), [-1, 0, 0, 1, 1, 2, 5])
    wk, wv = draft.window_kv(tokens[:COMMITTED], torch.arange(COMMITTED))
    args = (tree.tokens, tree.positions(COMMITTED), tree.mask(), wk, wv, k[:, :COMMITTED], v[:, :COMMITTED])
    hybrid = draft.draft_logits(*args, backend="cpu")
    reference = draft.draft_logits(*args, backend="reference")
    assert torch.allclose(hybrid, reference, atol=1e-4, rtol=1e-4), f"max diff {(hybrid - reference).abs().max():.3g}"
    chain_root = draft.draft_logits(tree.tokens[:1], tree.positions(COMMITTED)[:1], None, *args[3:], backend="cpu")
    assert torch.allclose(hybrid[0], chain_root[0], atol=1e-5), "the root sees no other tree node"
    siblings = hybrid[1], hybrid[2]  # same parent, different tokens: distinct rows
    assert not torch.allclose(*siblings)


@pytest.mark.parametrize("inputs", ["kv-only", "feed-hidden", "own-hidden", "multi-layer", "prev-token", "copy-head"])
@pytest.mark.parametrize("window", [64, 16, 8])  # 16, 8: the context is longer than the window
def test_serving_drafter_equals_training_forward_per_depth(target_and_kv, window, inputs):
    """The serving drafter (ring window + incremental per-depth steps over the live KVCache, and with
    `feed_hidden` the target's hidden state of the newest committed token - of a low and the last layer with
    `hidden_layers` - with `feed_own_hidden` also each node's parent's output) proposes, at every depth d, the
    training forward's argmax with lag d + 1, with the same probability. `prev-token`: the shipped draft's inputs
    (`feed_hidden`, `feed_own_hidden`) and each token's predecessor, in the ring (synced committed tokens, the
    first one's predecessor from before the ring) and in the tree (a node's parent). `copy-head`: the shipped
    draft's inputs and a copy head over the target's keys, each position proposing the token after it."""
    from spyglass.drafters.longspec import LongSpecDrafter
    from spyglass.sampling import SamplingParams
    from spyglass.sequence import Sequence

    target, tokens, k, v = target_and_kv
    feed_hidden = inputs != "kv-only"
    layers = (0, -1) if inputs == "multi-layer" else (-1,)
    draft = make_draft(
        target,
        window=window,
        feed_hidden=feed_hidden,
        feed_own_hidden=inputs in ("own-hidden", "multi-layer", "prev-token", "copy-head"),
        hidden_layers=list(layers) if inputs == "multi-layer" else None,
        prev_token=inputs == "prev-token",
        copy_head=inputs == "copy-head",
    )
    cache = target.new_cache(LENGTH + 8, 1)
    slot = cache.allocate()
    target.prefill(cache, slot, tokens[:COMMITTED])
    drafter = LongSpecDrafter(draft, gamma=4)
    drafter.bind(target, cache)
    seq = Sequence(tokens[: COMMITTED + 1].tolist(), SamplingParams(max_new_tokens=8))
    seq.slot = slot
    by_layer = layer_hidden(target, tokens[:COMMITTED], layers) if feed_hidden else {}
    hidden = torch.cat(list(by_layer.values()), -1) if feed_hidden else None  # side by side, in `layers` order
    assert drafter.traits.hidden_layers == (layers if feed_hidden else ())
    if feed_hidden:  # as the engine does after a prefill: before start()
        drafter.observe_hidden(seq, 0, by_layer, list(range(COMMITTED)))
    drafter.start(seq)
    tree = drafter.propose([seq], [DraftRequest()])[0]
    assert tree.is_chain and len(tree) == 5
    full = torch.cat([tokens[: COMMITTED + 1], tree.tokens[1:]])
    kk = torch.cat([k[:, :COMMITTED], torch.zeros(k.shape[0], 5, k.shape[2])], dim=1)  # unseen: masked anyway
    vv = torch.cat([v[:, :COMMITTED], torch.zeros(v.shape[0], 5, v.shape[2])], dim=1)
    hh = None if hidden is None else torch.cat([hidden, torch.full((5, hidden.shape[1]), 1e3)])  # unseen rows
    for d in range(4):
        want = torch.softmax(training_logits(draft, full, kk, vv, lag=d + 1, hidden=hh)[COMMITTED + d], -1)
        tok = int(tree.tokens[d + 1])
        assert tok == int(want.argmax()), f"window {window} depth {d}: a different token"
        got_p = tree.scores[d + 1] / tree.scores[d]
        assert abs(got_p - float(want[tok])) < 1e-4, f"window {window} depth {d}: {got_p} vs {float(want[tok])}"
    for i in by_layer:  # each layer's hidden state matters: another one changes the proposal's probabilities
        drafter.observe_hidden(seq, 0, {**by_layer, i: -by_layer[i]}, list(range(COMMITTED)))
        other = drafter.propose([seq], [DraftRequest()])[0]
        assert abs(other.scores[1] - tree.scores[1]) > 1e-4, f"layer {i}'s hidden state is not read"
    if inputs == "prev-token":  # the predecessor matters at every depth, the root's included
        plain = make_draft(target, window=window, feed_hidden=True, feed_own_hidden=True)
        plain.load_state_dict({k: w for k, w in draft.state_dict().items() if not k.startswith("prev_")})
        for d in range(4):
            without = training_logits(plain, full, kk, vv, lag=d + 1, hidden=hh)[COMMITTED + d]
            with_prev = training_logits(draft, full, kk, vv, lag=d + 1, hidden=hh)[COMMITTED + d]
            assert not torch.allclose(without, with_prev, atol=1e-3), f"depth {d}: the predecessor is not read"
    if inputs == "copy-head":  # the copies matter at every depth
        plain = make_draft(target, window=window, feed_hidden=True, feed_own_hidden=True)
        plain.load_state_dict({k: w for k, w in draft.state_dict().items() if not k.startswith("copy_")})
        for d in range(4):
            without = torch.log_softmax(training_logits(plain, full, kk, vv, lag=d + 1, hidden=hh)[COMMITTED + d], -1)
            with_copy = training_logits(draft, full, kk, vv, lag=d + 1, hidden=hh)[COMMITTED + d]
            assert not torch.allclose(without, with_copy, atol=1e-3), f"depth {d}: the copy head is not read"
    if inputs == "own-hidden":  # the recursion matters: without it depth 1 on would differ
        plain = make_draft(target, window=window, feed_hidden=True)
        plain.load_state_dict({k: w for k, w in draft.state_dict().items() if not k.startswith("own_")})
        for d in range(1, 4):
            without = training_logits(plain, full, kk, vv, lag=d + 1, hidden=hh)[COMMITTED + d]
            with_own = training_logits(draft, full, kk, vv, lag=d + 1, hidden=hh)[COMMITTED + d]
            assert not torch.allclose(without, with_own, atol=1e-3), f"depth {d}: the parent's output is not read"
        root_without = training_logits(plain, full, kk, vv, lag=1, hidden=hh)[COMMITTED]
        root_with = training_logits(draft, full, kk, vv, lag=1, hidden=hh)[COMMITTED]
        # the two drafts time their own linear kernels (spyglass.models.linear): equal up to fp32 rounding
        assert torch.allclose(root_without, root_with, atol=1e-4), "the root has no parent to read"
