"""GLIDE drafts (`n_layers` N > 1: draft layer m reads target layer L - N + m) in training and serving.

Serving keeps, per layer, the K/V of the last window - 1 committed tokens; a higher layer's entries come from
running the layers below over newly committed tokens (lag 1: token j reads the target up to j - 1), which is
what the training forward computes at lag 1. So the root of a chain (depth 0, lag 1) must equal the training
forward exactly, whatever the window and however the committed tokens arrived; deeper nodes differ (training
shows every position at the node's lag: GLIDE's approximation). Greedy identity and sampling fidelity with a
GLIDE draft run in test_engine_identity.py and test_sampling_fidelity.py.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from actors.trainer import warm_start
from spyglass.drafters.base import DraftRequest
from spyglass.drafters.longspec import LongSpecDrafter
from spyglass.models.drafts.longspec import LongSpecDraft
from spyglass.models.llama import load_transformer
from spyglass.sampling import SamplingParams
from spyglass.sequence import Sequence
from spyglass.weights import load_weights, save_weights

LENGTH = 40


@pytest.fixture(scope="module")
def target_and_cache(tiny_dir):
    """Tiny target (2 layers), a random sequence prefilled into a KVCache, and each layer's K/V of it."""
    target = load_transformer(tiny_dir["llama"])
    tokens = torch.randint(3, target.args.vocab_size, (LENGTH,), generator=torch.Generator().manual_seed(0))
    cache = target.new_cache(LENGTH + 8, 1)
    slot = cache.allocate()
    target.prefill(cache, slot, tokens)
    kv = [tuple(t[:, :LENGTH].clone() for t in cache.layer(slot, i)) for i in range(target.args.n_layers)]
    return target, tokens, cache, slot, kv


def glide(target, window: int) -> LongSpecDraft:
    torch.manual_seed(3)
    return LongSpecDraft.from_target(target, window=window, init_std=0.05, n_layers=2).eval()  # not flat, not peaked


def training_probs(draft, tokens, kv, lag: int) -> torch.Tensor:
    with torch.no_grad():
        ks = [k.unsqueeze(0) for k, _ in kv]
        vs = [v.unsqueeze(0) for _, v in kv]
        positions = torch.arange(tokens.shape[0]).unsqueeze(0)
        return torch.softmax(draft(tokens.unsqueeze(0), positions, ks, vs, lag=lag)[0], -1)


@pytest.mark.parametrize("window", [64, 8])  # 8: the context is longer than the window
@pytest.mark.parametrize("chunks", [(36,), (20, 30, 33, 36)], ids=["one-sync", "incremental"])
def test_chain_root_equals_training_forward(target_and_cache, window, chunks):
    """The drafter's ring, filled at once or a few tokens at a time, makes the root's distribution the
    training forward's at lag 1 (both layers read the target with the same staleness)."""
    target, tokens, cache, slot, kv = target_and_cache
    draft = glide(target, window)
    drafter = LongSpecDrafter(draft, gamma=3)
    drafter.bind(target, cache)
    assert drafter.layers_read == [0, 1] and drafter.name == "glide"
    full_length, state = cache.lengths[slot], None
    try:
        for committed in chunks:  # the target's cache grows as tokens are committed
            cache.lengths[slot] = committed
            seq = Sequence(tokens[: committed + 1].tolist(), SamplingParams(max_new_tokens=8))
            seq.slot = slot
            if state is None:
                drafter.start(seq)
                state = seq.drafter_state
            seq.drafter_state = state
            tree = drafter.propose([seq], [DraftRequest()])[0]
    finally:
        cache.lengths[slot] = full_length
    assert state.filled == min(window - 1, chunks[-1])
    committed = chunks[-1]
    want = training_probs(
        draft, tokens[: committed + 1], [(k[:, : committed + 1], v[:, : committed + 1]) for k, v in kv], 1
    )
    tok = int(tree.tokens[1])
    assert tok == int(want[committed].argmax())
    assert abs(tree.scores[1] - float(want[committed, tok])) < 1e-4
    assert want[committed].max() < 0.9, "a near-certain root would make the comparison weak"


def test_sync_is_incremental(target_and_cache):
    """Pushing committed tokens in chunks leaves the same ring as pushing them at once (every layer)."""
    target, tokens, cache, slot, kv = target_and_cache
    draft = glide(target, window=8)
    ring = 7
    targets = [(k, v) for k, v in kv]

    def fill(chunks):
        c = draft.cfg
        k = torch.zeros(2, c.n_kv_heads, ring, c.head_dim)
        v, pos = torch.zeros_like(k), torch.full((ring,), -1)
        start = 0
        for end in chunks:
            nk, nv = draft.sync_kv(tokens[start:end], start, (k, v, pos), targets, ring)
            lo = end - nk.shape[2]
            slots = torch.arange(lo, end) % ring
            k[:, :, slots], v[:, :, slots], pos[slots] = nk, nv, torch.arange(lo, end)
            start = end
        return k, v, pos

    a, b = fill([36]), fill([5, 6, 17, 30, 31, 36])
    assert torch.equal(a[2], b[2])
    assert torch.allclose(a[0], b[0], atol=1e-5) and torch.allclose(a[1], b[1], atol=1e-5)
    assert a[0][1].abs().sum() > 0  # the upper layer's entries are real


def test_one_layer_checkpoint_warm_starts_the_top_layer(target_and_cache, tmp_path):
    """`init_from` a LongSpec (one-layer) draft into a GLIDE one: it fills the top layer, the new lower layer
    starts as an identity, so step 0 is the old draft; a one-block checkpoint's old key names still load."""
    target, tokens, _, _, kv = target_and_cache
    torch.manual_seed(0)
    one = LongSpecDraft.from_target(target, window=16, init_std=0.2).eval()
    legacy = {k.removeprefix("layers.0."): v for k, v in one.trainable_state_dict().items()}
    assert "wqkv.weight" in legacy  # the names the one-block draft used to save
    save_file(legacy, str(tmp_path / "draft.safetensors"))
    two = LongSpecDraft.from_target(target, window=16, init_std=0.2, n_layers=2).eval()
    warm_start(two, tmp_path)
    assert torch.equal(two.layers[1].wqkv.weight, one.layers[0].wqkv.weight)
    positions = torch.arange(LENGTH).unsqueeze(0)
    with torch.no_grad():
        old = one(tokens.unsqueeze(0), positions, kv[1][0].unsqueeze(0), kv[1][1].unsqueeze(0), lag=2)
        new = two(
            tokens.unsqueeze(0),
            positions,
            [kv[0][0].unsqueeze(0), kv[1][0].unsqueeze(0)],
            [kv[0][1].unsqueeze(0), kv[1][1].unsqueeze(0)],
            lag=2,
        )
    assert torch.allclose(old, new, atol=1e-5)
    with pytest.raises(ValueError, match="2 layer"):
        two(tokens.unsqueeze(0), positions, kv[1][0].unsqueeze(0), kv[1][1].unsqueeze(0))


def test_export_in_bf16_halves_the_file_and_loads(target_and_cache, tmp_path, monkeypatch):
    """`export_draft` ships the weights in bf16: half the bytes of the trainer's fp32 checkpoint, and the loader
    casts them back to the target's dtype."""
    import json
    import sys

    from actors import export_draft
    from spyglass.drafters.longspec import load_longspec_draft

    target = target_and_cache[0]
    torch.manual_seed(3)
    draft = LongSpecDraft.from_target(target, window=8, n_layers=2, draft_vocab=64).eval()
    ckpt = tmp_path / "run" / "train-glide" / "checkpoints" / "step-000002"
    ckpt.mkdir(parents=True)
    state = draft.trainable_state_dict()
    state["vocab_ids"] = (state["vocab_ids"] + 1000).float()  # older trainer checkpoints hold the ids as floats
    save_file(state, str(ckpt / "draft.safetensors"))
    (ckpt / "draft_config.json").write_text(json.dumps({"kind": "longspec", **draft.cfg.to_dict()}))
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 2, "train": {"batch_size": 2, "split": "train"}}))
    (ckpt.parents[1] / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0, "step_s": 1.0}\n')
    manifest = {"seq_len": 16, "contexts": 4, "tokens": 64, "position_tag": "plain"}
    (tmp_path / "run" / "extract" / "train").mkdir(parents=True)
    (tmp_path / "run" / "extract" / "train" / "manifest.json").write_text(json.dumps(manifest))
    out = tmp_path / "shipped"
    argv = ["export_draft", str(tmp_path / "run"), str(out), "--train-dir", "train-glide"]
    monkeypatch.setattr(sys, "argv", argv)
    export_draft.main()
    assert (out / "draft.safetensors.xz").stat().st_size < 0.55 * (ckpt / "draft.safetensors").stat().st_size
    assert not (out / "draft.safetensors").exists()
    assert json.loads((out / "training.json").read_text())["steps"] == 2
    state = load_weights(out / "draft.safetensors.xz", torch.bfloat16)
    shipped = state["vocab_ids"]  # ids above 256 are not exact in bf16
    assert shipped.dtype == torch.int64 and torch.equal(shipped, draft.vocab_ids + 1000)
    save_weights({**state, "vocab_ids": draft.vocab_ids}, out / "draft.safetensors.xz")
    loaded = load_longspec_draft(out, target)
    assert loaded.cfg.n_layers == 2 and loaded.dtype == target.dtype
    w, w16 = draft.layers[1].w_down.weight, loaded.layers[1].w_down.weight
    assert torch.allclose(w, w16, rtol=1e-2, atol=1e-3) and not torch.equal(w, w16)
