"""LongSpec training options: multi-lag loss, top-k distillation, the reduced (frequency-ranked) head, init from a
target layer, the per-lag diagnosis."""

from __future__ import annotations

import pytest
import torch

from actors.trainer import diagnose_line, rank_vocab
from spyglass.models.drafts.longspec import LongSpecDraft
from spyglass.models.llama import load_transformer
from spyglass.training.losses import LongSpecLoss, soft_topk_ce
from tests.tiny import make_tiny_model


def _target(tmp_path):
    return load_transformer(make_tiny_model(tmp_path / "m", vocab=96), dtype=torch.float32)


def _plain_checkpoint(target, tmp_path):
    """A draft reading neither hidden state, and the checkpoint directory `init_from` would read it from."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    old = LongSpecDraft.from_target(target, window=8)
    ckpt = tmp_path / "old"
    ckpt.mkdir()
    save_file(old.trainable_state_dict(), str(ckpt / "draft.safetensors"))
    return old, ckpt


def _fit_lag1(draft, loss_fn, batch, steps: int = 60) -> dict:
    """Train `draft` at lag 1 on one batch; the last step's metrics."""
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(steps):
        opt.zero_grad()
        loss, metrics = loss_fn(draft, batch, 1)
        loss.backward()
        opt.step()
    return metrics


def _batch(target, b=2, length=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, target.args.vocab_size, (b, length), generator=g)
    positions = torch.arange(length).repeat(b, 1)
    kv = torch.randn(b, 2, target.args.n_kv_heads, length, target.args.head_dim, generator=g)
    logits = torch.randn(b, length, target.args.vocab_size, generator=g)
    lp, ids = torch.log_softmax(logits, -1).topk(4, -1)
    return {"tokens": tokens, "positions": positions, "kv.1": kv, "topk_ids": ids, "topk_logprobs": lp}


def test_soft_topk_ce_matches_hand_computation():
    logp = torch.log_softmax(torch.tensor([[0.0, 1.0, 2.0, 3.0]]), -1)
    ids = torch.tensor([[3, 1, -1]])  # the third id is not scored by the draft head
    lps = torch.tensor([[-0.5, -1.5, -0.1]])
    p = torch.softmax(torch.tensor([-0.5, -1.5]), -1)
    want = -(p[0] * logp[0, 3] + p[1] * logp[0, 1])
    picked = logp.gather(-1, ids.clamp(min=0))
    assert torch.allclose(soft_topk_ce(picked, ids >= 0, lps), want.view(1))
    # nothing scored: contributes zero rather than NaN
    assert soft_topk_ce(picked, torch.zeros_like(ids, dtype=torch.bool), lps).item() == 0.0


@pytest.mark.parametrize("own", [False, True], ids=["plain", "own-hidden"])
def test_multi_lag_forward_equals_single_lags(tmp_path, own):
    """Lags asked together or one at a time give the same logits (a `feed_own_hidden` draft runs the lags below
    the largest either way), and `logits_from` only drops rows."""
    target = _target(tmp_path)
    torch.manual_seed(0)
    draft = LongSpecDraft.from_target(target, window=8, feed_own_hidden=own)
    if own:
        torch.nn.init.normal_(draft.own_proj.weight, std=0.2)
    b = _batch(target)
    kv = b["kv.1"]
    both = draft(b["tokens"], b["positions"], kv[:, 0], kv[:, 1], lag=(1, 3))
    for i, lag in enumerate((1, 3)):
        one = draft(b["tokens"], b["positions"], kv[:, 0], kv[:, 1], lag=lag)
        assert torch.allclose(both[i], one, atol=1e-5)
        tail = draft(b["tokens"], b["positions"], kv[:, 0], kv[:, 1], lag=lag, logits_from=10)
        assert torch.allclose(tail, one[:, 10:], atol=1e-5)
    assert not torch.allclose(both[0], both[1])


def test_own_hidden_draft_warm_starts_exactly_and_trains_the_recursion(tmp_path):
    """A draft without the recursion loads into one with it (zero projection: the same logits at step 0), and
    training the deeper lags moves the new projection."""
    from actors.trainer import warm_start

    target = _target(tmp_path)
    old, ckpt = _plain_checkpoint(target, tmp_path)
    new = LongSpecDraft.from_target(target, window=8, feed_own_hidden=True)
    warm_start(new, ckpt)
    b = _batch(target)
    kv = b["kv.1"]
    with torch.no_grad():
        same = new(b["tokens"], b["positions"], kv[:, 0], kv[:, 1], lag=(1, 2, 3))
        want = old(b["tokens"], b["positions"], kv[:, 0], kv[:, 1], lag=(1, 2, 3))
    assert torch.allclose(same, want, atol=1e-5)
    loss_fn = LongSpecLoss(kv_layer=1, lag_min=1, lag_max=3, all_lags=True)
    opt = torch.optim.AdamW([p for p in new.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(5):
        opt.zero_grad()
        loss, _ = loss_fn(new, b, (1, 2, 3))
        loss.backward()
        opt.step()
    assert new.own_proj.weight.abs().max() > 1e-4


def test_all_lags_loss_reports_each_lag_and_trains(tmp_path):
    target = _target(tmp_path)
    torch.manual_seed(0)
    draft = LongSpecDraft.from_target(target, window=8, draft_vocab=64)
    draft.set_vocab(rank_vocab(_batch(target)["tokens"], 64, target.args.vocab_size))
    loss_fn = LongSpecLoss(kv_layer=1, lag_min=1, lag_max=3, distill_weight=0.5, soft_distill=True, all_lags=True)
    assert loss_fn.lag(0, 0) == (1, 2, 3)
    batch = _batch(target)
    loss, metrics = loss_fn(draft, batch, loss_fn.lag(0, 0))
    assert {"agree_lag1", "agree_lag2", "agree_lag3"} <= set(metrics)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    first = float(loss)
    for _ in range(30):
        opt.zero_grad()
        loss, _ = loss_fn(draft, batch, (1, 2, 3))
        loss.backward()
        opt.step()
    assert float(loss) < first - 0.5


def test_reduced_head_maps_back_to_target_vocab(tmp_path):
    target = _target(tmp_path)
    draft = LongSpecDraft.from_target(target, window=8, draft_vocab=10)
    ids = torch.tensor([3, 5, 7, 11, 13, 17, 19, 23, 29, 31])
    draft.set_vocab(ids)
    assert torch.equal(draft.lm_head.weight, target.lm_head.weight[ids].float())
    sub = torch.randn(2, 10)
    full = draft.to_full_vocab(sub)
    assert full.shape == (2, target.args.vocab_size)
    assert torch.equal(full[:, ids], sub)
    assert torch.isinf(full[:, 4]).all() and int(full.argmax(-1)[0]) in ids.tolist()
    table = draft.full_to_draft_ids()
    assert table[17] == 5 and table[4] == -1
    assert "vocab_ids" in draft.trainable_state_dict()


def test_rank_vocab_picks_most_frequent():
    tokens = torch.tensor([[5, 5, 5, 2, 2, 9, 1]])
    assert rank_vocab(tokens, 2, 12).tolist() == [2, 5]


def test_init_layer_copies_the_target_layer(tmp_path):
    target = _target(tmp_path)
    draft = LongSpecDraft.from_target(target, window=8, init_layer=0, intermediate_size=target.args.intermediate_size)
    assert torch.equal(draft.layers[0].wqkv.weight, target.layers[0].wqkv.weight.float())
    assert torch.equal(draft.layers[0].w_down.weight, target.layers[0].w_down.weight.float())


def test_diagnose_line_lists_every_lag():
    line = diagnose_line(100, {"eval_agree_lag1": 0.5, "eval_agree_lag2": 0.25, "loss": 1.0})
    assert "step 100" in line and "lag 1: 0.500" in line and "lag 2: 0.250" in line


def test_feed_hidden_draft_warm_starts_from_a_kv_only_one_and_learns_to_read_it(tmp_path):
    """`init_from`: a K/V-only draft's weights load into a `feed_hidden` one, whose zero-initialised projection
    makes it the same draft at step 0; training then uses the hidden states (here they carry the answer)."""
    from safetensors.torch import save_file

    from actors.trainer import warm_start

    target = _target(tmp_path)
    old, ckpt = _plain_checkpoint(target, tmp_path)
    torch.manual_seed(1)
    new = LongSpecDraft.from_target(target, window=8, feed_hidden=True)
    warm_start(new, ckpt)
    batch = _batch(target)
    kv = batch["kv.1"]
    # hidden row t holds the embedding of token t + 2: at lag 1, query t reads row t - 1, i.e. its next token
    nxt = torch.nn.functional.pad(batch["tokens"][:, 1:], (0, 1))
    batch["hidden.1"] = target.embed(nxt).detach() * 10
    with torch.no_grad():
        same = new(batch["tokens"], batch["positions"], kv[:, 0], kv[:, 1], lag=1, target_h=batch["hidden.1"])
        want = old(batch["tokens"], batch["positions"], kv[:, 0], kv[:, 1], lag=1)
    assert torch.allclose(same, want, atol=1e-5)
    with torch.no_grad():
        new.hidden_proj.weight.normal_(std=0.02)
    loss_fn = LongSpecLoss(kv_layer=1, lag_min=1, lag_max=1, hidden_layers=[1])
    assert "hidden.1" in loss_fn.required_keys()
    metrics = _fit_lag1(new, loss_fn, batch)
    assert float(metrics["token_accuracy"]) > 0.9  # random tokens: only the hidden states tell the next one
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file({"nope": torch.zeros(1)}, str(bad / "draft.safetensors"))
    with pytest.raises(ValueError, match="does not"):
        warm_start(new, bad)


def test_multi_layer_features_warm_start_exactly_and_train_the_lower_layer(tmp_path):
    """`hidden_layers`: a draft reading the last layer's hidden state loads into one that also reads a lower
    layer's (its zero projection: the same logits at step 0); training then uses the lower layer, which here
    alone carries the answer. The trainer refuses a draft whose layers the extraction did not store."""
    from safetensors.torch import save_file

    from actors.trainer import TrainSpec, warm_start

    target = _target(tmp_path)
    torch.manual_seed(0)
    old = LongSpecDraft.from_target(target, window=8, feed_hidden=True)
    ckpt = tmp_path / "one-layer"
    ckpt.mkdir()
    save_file(old.trainable_state_dict(), str(ckpt / "draft.safetensors"))
    new = LongSpecDraft.from_target(target, window=8, feed_hidden=True, hidden_layers=[0, -1])
    assert new.feature_layers(2) == [0, 1]
    warm_start(new, ckpt)
    batch = _batch(target)
    kv = batch["kv.1"]
    nxt = torch.nn.functional.pad(batch["tokens"][:, 1:], (0, 1))  # at lag 1, query t reads row t - 1
    batch["hidden.0"] = target.embed(nxt).detach() * 10
    batch["hidden.1"] = torch.randn_like(batch["hidden.0"])  # noise in the last layer
    both = torch.cat([batch["hidden.0"], batch["hidden.1"]], -1)
    with torch.no_grad():
        same = new(batch["tokens"], batch["positions"], kv[:, 0], kv[:, 1], lag=1, target_h=both)
        want = old(batch["tokens"], batch["positions"], kv[:, 0], kv[:, 1], lag=1, target_h=batch["hidden.1"])
    assert torch.allclose(same, want, atol=1e-5)
    with torch.no_grad():
        new.extra_hidden_proj.weight.normal_(std=0.02)
    loss_fn = LongSpecLoss(kv_layer=1, lag_min=1, lag_max=1, hidden_layers=[0, 1])
    assert {"hidden.0", "hidden.1"} <= set(loss_fn.required_keys())
    metrics = _fit_lag1(new, loss_fn, batch)
    assert float(metrics["token_accuracy"]) > 0.9  # random tokens: only the lower layer tells the next one
    spec = TrainSpec.from_dict({"draft_options": {"feed_hidden": True, "hidden_layers": [0, -1]}})
    manifest = {"n_layers": 2, "kv_layers": [1], "hidden_layers": [1]}
    with pytest.raises(ValueError, match=r"add \[0\] to extract.hidden_layers"):
        spec.feature_layers(manifest)
    assert spec.feature_layers({**manifest, "hidden_layers": [0, 1]}) == [0, 1]


def test_copy_predictions_propose_what_followed_the_latest_earlier_ngram():
    from spyglass.training.losses import copy_predictions

    #                 0  1  2  3  4  5  6  7  8  9
    row = torch.tensor([[5, 6, 7, 5, 6, 8, 5, 6, 9, 4]])
    got = copy_predictions(row)[0].tolist()
    # t=4 ("5 6" seen at 0-1, then 7); t=7 ("5 6" latest at 3-4, then 8); t=3 ("5" is no 2-gram: nothing);
    # t=5, t=6, t=8, t=9: their 2-grams ("6 8", "8 5", "6 9", "9 4") never occurred before
    assert got == [-1, -1, -1, -1, 7, -1, -1, 8, -1, -1]
    # the longest order wins: "1 2 3" -> 4 although "2 3" was followed by 9 more recently
    row = torch.tensor([[1, 2, 3, 4, 2, 3, 9, 1, 2, 3]])
    assert copy_predictions(row)[0, -1].item() == 4
    assert copy_predictions(row, orders=(2,))[0, -1].item() == 9


def test_copy_weight_weighs_the_copyable_positions(tmp_path):
    """Equal weights reproduce the plain mean; `copy_weight` moves the loss toward the copyable positions' loss,
    and the metrics report agreement there and their share."""
    target = _target(tmp_path)
    torch.manual_seed(0)
    draft = LongSpecDraft.from_target(target, window=8)
    batch = _batch(target, b=1, length=24)
    batch["tokens"][0, 12:18] = batch["tokens"][0, 2:8]  # a copied stretch
    batch["topk_ids"][0, 13:17, 0] = batch["tokens"][0, 4:8]  # where the target follows the copy
    plain = LongSpecLoss(kv_layer=1, lag_min=1, lag_max=1)
    heavy = LongSpecLoss(kv_layer=1, lag_min=1, lag_max=1, copy_weight=50.0)
    with torch.no_grad():
        logits = draft(batch["tokens"], batch["positions"], batch["kv.1"][:, 0], batch["kv.1"][:, 1], lag=1)
        logp = torch.log_softmax(logits[0, :-1].float(), -1)
        nll = -logp.gather(-1, batch["tokens"][0, 1:, None])[:, 0]
        loss, metrics = plain(draft, batch, 1)
        assert torch.allclose(loss, nll.mean(), atol=1e-5)
        assert metrics["copyable"].item() == pytest.approx(4 / 23)
        heavy_loss, _ = heavy(draft, batch, 1)
    copied = nll[13:17].mean()
    assert abs(heavy_loss - copied) < abs(loss - copied)
    with pytest.raises(ValueError, match="copy_weight"):
        LongSpecLoss(kv_layer=1, copy_weight=0.0)


def test_weights_a_warm_start_lacks_learn_at_their_own_rate(tmp_path):
    """`new_lr_scale`: a new input's projection (here `prev_token`'s) starts from zero on a trained draft and gets
    its own, higher learning rate; every weight the checkpoint has keeps the run's rate."""
    from actors.trainer import TrainSpec, param_groups

    target = _target(tmp_path)
    _, ckpt = _plain_checkpoint(target, tmp_path)
    draft = LongSpecDraft.from_target(target, window=8, prev_token=True)
    assert torch.count_nonzero(draft.prev_proj.weight) == 0  # a no-op until trained
    spec = TrainSpec(lr=1e-4, new_lr_scale=20.0, init_from=str(ckpt))
    old, new = param_groups(draft, spec)
    assert [p is draft.prev_proj.weight for p in new["params"]] == [True] and new["lr"] == pytest.approx(2e-3)
    assert "lr" not in old and len(old["params"]) + 1 == sum(p.requires_grad for p in draft.parameters())
    (only,) = param_groups(draft, TrainSpec(lr=1e-4))  # no warm start: one group
    assert len(only["params"]) == len(old["params"]) + 1
    # `fast_params`: a part the checkpoint has, named by prefix, keeps the higher rate (its second pass)
    _, fast = param_groups(
        draft, TrainSpec(lr=1e-4, new_lr_scale=20.0, init_from=str(ckpt), fast_params=["layers.0.wo."])
    )
    assert {id(p) for p in fast["params"]} == {
        id(draft.prev_proj.weight),
        *(id(layer.wo.weight) for layer in draft.layers),
    }


def test_copy_head_loss_is_its_dense_mixture(tmp_path):
    """The loss reads a copy-head draft's proposal sparsely (at the label and the target's top-k, per context); it
    must give the log-probs and the argmax of the dense target-vocab mixture serving uses (`mix`), including
    tokens the reduced head does not score."""
    from spyglass.training.losses import proposal_argmax, proposal_logp

    target = _target(tmp_path)
    torch.manual_seed(0)
    draft = LongSpecDraft.from_target(target, window=8, draft_vocab=64, copy_head=True, init_std=0.2)
    draft.set_vocab(rank_vocab(_batch(target)["tokens"], 64, target.args.vocab_size))
    torch.nn.init.normal_(draft.copy_gate.weight, std=0.5)
    b = _batch(target, length=32)
    tokens, kv = b["tokens"], b["kv.1"]
    after = torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)
    ids = torch.cat([tokens[:, 1:].unsqueeze(-1), b["topk_ids"][:, :-1]], dim=-1)
    rows = draft.full_to_draft_ids()[ids]
    with torch.no_grad():
        outs = draft(tokens, b["positions"], kv[:, 0], kv[:, 1], lag=(1, 2))
    for i in range(2):
        out = outs.select((i, slice(None), slice(None, -1)))
        dense = draft.mix(out, after.unsqueeze(1))  # [B, L-1, V]
        assert torch.allclose(dense.exp().sum(-1), torch.ones(dense.shape[:-1]), atol=1e-5)
        want = dense.gather(-1, ids)
        got = proposal_logp(out, ids, rows, after)
        scored = rows >= 0
        assert torch.allclose(got[scored], want[scored], atol=1e-5)
        assert torch.equal(proposal_argmax(out, draft.vocab_ids, draft.full_to_draft_ids(), after), dense.argmax(-1))
        copied_only = dense.argmax(-1)[~torch.isin(dense.argmax(-1), draft.vocab_ids)]
        assert copied_only.numel() > 0, "some first proposals are copies the reduced head could not make"


def test_copy_head_learns_to_copy(tmp_path):
    """Contexts that repeat a random phrase, with keys that identify their token (all at position 0: no RoPE to
    undo): a draft with a copy head learns
    to propose what followed the current token last time, on phrases it never saw; the same draft without one
    only memorises its training phrases."""
    target = _target(tmp_path)
    g = torch.Generator().manual_seed(3)
    key_of = torch.randn(target.args.vocab_size, target.args.n_kv_heads, target.args.head_dim, generator=g)

    def repeats(n: int) -> dict:
        phrase = torch.stack([torch.randperm(target.args.vocab_size, generator=g)[:8] for _ in range(n)])
        tokens = phrase.repeat(1, 4)  # [n, 32]
        kv = torch.stack([key_of[tokens], key_of[tokens]], dim=1).permute(0, 1, 3, 2, 4)  # [n, 2, kvh, L, D]
        after = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1).unsqueeze(-1)
        return {"tokens": tokens, "positions": torch.zeros(n, 32, dtype=torch.long), "kv.1": kv, "topk_ids": after}

    train, held_out = repeats(64), repeats(16)
    loss_fn = LongSpecLoss(kv_layer=1, distill_weight=1.0, loss_from=12)
    agreement = {}
    for copy in (False, True):
        torch.manual_seed(0)
        draft = LongSpecDraft.from_target(target, window=4, copy_head=copy)
        _fit_lag1(draft, loss_fn, train, steps=80)
        with torch.no_grad():
            agreement[copy] = float(loss_fn(draft, held_out, 1)[1]["top1_agreement"])
    assert agreement[True] > 0.8 and agreement[False] < 0.3, agreement
