"""DFlash block drafting and the DeLS-Spec local head: lossless in the shared suites, fusion and prior by hand,
the local head trains on the target's embedding/head alone, the context-feature cache equals a recomputation."""

from __future__ import annotations

import math

import pytest
import torch

from spyglass.drafters.base import DraftRequest
from spyglass.drafters.dflash import DFlashDrafter, fuse, mix_copies
from spyglass.engine import EngineConfig, SpecEngine, plain_generate
from spyglass.models.drafts.dels import (
    LocalHead,
    LocalHeadConfig,
    load_local_head,
    read_frozen_io,
    save_local_head,
    token_counts,
    unigram_log_prior,
)
from spyglass.models.drafts.dflash import DFlashDraft, load_dflash, save_dflash
from spyglass.models.llama import load_transformer
from spyglass.sampling import SamplingParams
from spyglass.training.losses import dflash_loss, window_weights
from tests.tiny import fit_local_head, full_features, make_prompts, trained_tiny, with_copy_head

# Greedy identity (batch 1 and 4) and sampling fidelity: DFlash and DFlash + DeLS run in the shared suites,
# tests/test_engine_identity.py and tests/test_sampling_fidelity.py.


def test_fusion_and_unigram_prior_by_hand():
    long = torch.tensor([1.0, 2.0, 3.0])
    short = torch.tensor([0.5, -1.0, 2.0])
    prior = torch.tensor([math.log(0.5), math.log(0.25), math.log(0.25)])
    # l = l_L + 0.3 * l_S - 0.3 * log p
    want = torch.tensor([1.15 + 0.3 * 0.6931472, 1.7 + 0.3 * 1.3862944, 3.6 + 0.3 * 1.3862944])
    torch.testing.assert_close(fuse(long, short, prior), want)
    torch.testing.assert_close(fuse(long, short, prior, alpha=0.0, beta=0.0), long)
    counts = token_counts(torch.tensor([[0, 0, 2], [0, 2, 0]]), 4)
    assert counts.tolist() == [4, 0, 2, 0]
    # add-one smoothing: (4+1, 0+1, 2+1, 0+1) / 10
    torch.testing.assert_close(unigram_log_prior(counts), torch.tensor([0.5, 0.1, 0.3, 0.1]).log())
    torch.testing.assert_close(window_weights(3), torch.tensor([1.0, math.exp(-1 / 7), math.exp(-2 / 7)]))


class _StubHead:
    """A local head that always votes for token `fav` (strongly), with a flat prior."""

    def __init__(self, vocab: int, fav: int) -> None:
        self.fav, self.vocab, self.seen = fav, vocab, []
        self.log_unigram = torch.zeros(vocab)

    def eval(self):
        return self

    def step(self, token, h):
        self.seen.append(token)
        return torch.zeros(1)

    def logits(self, h):
        out = torch.zeros(self.vocab)
        out[self.fav] = 100.0
        return out


def test_fusion_position_by_position_first_from_dflash_alone(tiny_dir):
    target = load_transformer(tiny_dir["llama"])
    draft = DFlashDraft.from_target(target, target_layers=(0, 1), n_layers=1, block_size=5)
    stub = _StubHead(target.args.vocab_size, fav=7)
    drafter = DFlashDrafter(draft, stub, alpha=0.3, beta=0.3)
    long = torch.zeros(4, target.args.vocab_size)
    long[:, 3] = 5.0  # DFlash alone would pick 3 everywhere
    tree = drafter._tree(11, long)
    assert tree.tokens.tolist() == [11, 3, 7, 7, 7]  # 0.3 * 100 beats 5 from the second drafted position on
    assert stub.seen == [3, 7, 7]  # the head reads the drafted tokens only (never the root), left to right
    assert tree.scores[0] == 1.0 and all(a >= b for a, b in zip(tree.scores, tree.scores[1:], strict=False))


def test_local_head_trains_without_the_target_layers(tiny_dir, monkeypatch, tmp_path):
    import spyglass.models.llama as llama

    def refuse(*a, **k):
        raise AssertionError("the target's transformer was loaded")

    monkeypatch.setattr(llama, "load_transformer", refuse)
    monkeypatch.setattr(llama.Transformer, "__init__", refuse)
    read = []
    import safetensors

    real_open = safetensors.safe_open

    class Recording:
        def __init__(self, *a, **k):
            self.f = real_open(*a, **k)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr("spyglass.models.drafts.dels.safe_open", Recording)
    embed, head_w = read_frozen_io(tiny_dir["llama"])
    assert set(read) == {"model.embed_tokens.weight", "lm_head.weight"}
    assert embed.shape == (128, 64) and head_w.shape == (128, 64)
    torch.manual_seed(0)
    head = LocalHead(LocalHeadConfig(64, 128, 32, 16, window=8), embed, head_w).train()
    # a learnable pattern: windows of a repeated ramp
    ramp = torch.arange(3, 3 + 40) % 50 + 3
    data = ramp.repeat(20)
    losses = fit_local_head(head, data, steps=40, window=8, batch=16)
    assert losses[-1] < 0.5 * losses[0]
    assert all(not p.requires_grad for p in head._frozen)
    assert {n for n, _ in head.named_parameters()} == {"gru.weight_ih_l0", "gru.weight_hh_l0", "w_rank.weight",
                                                       "w_up.weight"}  # fmt: skip
    # the incremental inference path gives the teacher-forced logits
    head.eval()
    toks = data[:5]
    full = head.sequence_logits(toks.unsqueeze(0))[0]
    h = None
    for i, t in enumerate(toks.tolist()):
        h = head.step(t, h)
        torch.testing.assert_close(head.logits(h), full[i], rtol=1e-4, atol=1e-4)
    monkeypatch.undo()
    save_local_head(head, tmp_path / "head")  # stored in bf16, loaded as the fp32 head runs
    target = load_transformer(tiny_dir["llama"])
    again = load_local_head(tmp_path / "head", target)
    for name, t in head.state_dict().items():
        loaded = again.state_dict()[name]
        assert loaded.dtype == torch.float32 and torch.equal(loaded, t.bfloat16().float()), name
    torch.testing.assert_close(again.sequence_logits(toks.unsqueeze(0)), full.unsqueeze(0), rtol=0.05, atol=0.05)


class _Checking(DFlashDrafter):
    """After every commit, the feature cache must equal a from-scratch recomputation over the committed tokens."""

    checks = 0
    rejections = 0

    def commit(self, seq, accepted):
        super().commit(seq, accepted)
        st = seq.drafter_state
        committed = seq.committed
        assert st.n == committed and st.pos[: st.n].tolist() == list(range(committed))
        feats = full_features(self.target, seq.tokens[:committed], self.traits.hidden_layers)
        want = self.draft.context_kv(feats, torch.arange(committed))
        for (k, v), (wk, wv) in zip(st.view(), want, strict=True):
            torch.testing.assert_close(k, wk, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(v, wv, rtol=1e-4, atol=1e-4)
        _Checking.checks += 1
        if len(accepted.path) < self.block:
            _Checking.rejections += 1


def test_feature_cache_is_cropped_exactly_on_rejection(tiny_dir):
    target = load_transformer(tiny_dir["llama"])
    draft, head = trained_tiny(target)
    drafter = _Checking(draft, head)
    drafter.target = load_transformer(tiny_dir["llama"])  # its own copy: recomputing must not touch the engine's
    prompts = make_prompts(target.args.vocab_size, 4, seed=5)
    engine = SpecEngine(target, drafter, EngineConfig(max_batch=2, max_context=256, prefill_chunk=16))
    engine.run(prompts, SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert _Checking.checks > 10 and _Checking.rejections > 0
    # a re-commit from an earlier position crops everything at or after it first
    seq = engine.add_request(prompts[0], SamplingParams(max_new_tokens=1))
    st_drafter = DFlashDrafter(draft)
    tokens = torch.tensor(prompts[0])
    feats = {i: full_features(target, tokens, (i,)) for i in drafter.traits.hidden_layers}
    st_drafter.observe_hidden(seq, 0, feats, list(range(len(tokens))))
    st_drafter.observe_hidden(seq, 3, {i: f[3:5] for i, f in feats.items()}, [0, 1])
    assert seq.drafter_state.pos[: seq.drafter_state.n].tolist() == [0, 1, 2, 3, 4]
    # positions never observed (a prefix from the Redis context cache) are simply not in the stream
    seq.drafter_state = None
    st_drafter.observe_hidden(seq, 6, {i: f[6:] for i, f in feats.items()}, list(range(len(tokens) - 6)))
    assert seq.drafter_state.pos[: seq.drafter_state.n].tolist() == list(range(6, len(tokens)))
    assert st_drafter.state_bytes(seq) > 0
    st_drafter.release(seq)
    assert st_drafter.state_bytes(seq) == 0


class _Recording(DFlashDrafter):
    trees: list = []

    def propose(self, batch, wants):
        out = super().propose(batch, wants)
        _Recording.trees.extend(zip([s.params.greedy for s in batch], out, strict=True))
        return out


def test_sampled_requests_hand_the_fused_distribution_to_the_verifier(tiny_dir):
    """Under sampling the tree is a chain sampled from the fused rows, and those rows are its proposal q (the
    verifier's rejection step); greedy requests keep argmax chains and no proposal."""
    target = load_transformer(tiny_dir["llama"])
    draft, head = trained_tiny(target)
    drafter = _Recording(draft, head)
    prompts = make_prompts(target.args.vocab_size, 4, seed=6)
    params = [
        SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.7 if i % 2 else 0.0, seed=i)
        for i in range(len(prompts))
    ]
    engine = SpecEngine(target, drafter, EngineConfig(max_batch=4, max_context=256, controller="off"))
    engine.run(prompts, params)
    sampled = [t for greedy, t in _Recording.trees if not greedy and len(t) > 1]
    greedy = [t for greedy, t in _Recording.trees if greedy and len(t) > 1]
    assert sampled and greedy
    for tree in sampled:
        assert tree.is_chain and tree.probs is not None and tree.probs.shape[0] == len(tree)
        torch.testing.assert_close(tree.probs[1:].sum(-1), torch.ones(len(tree) - 1))
        assert all(float(tree.probs[i, tok]) > 0 for i, tok in enumerate(tree.tokens.tolist()) if i > 0)
    assert all(t.probs is None and t.is_chain for t in greedy)


def test_in_a_composite_sampled_requests_get_the_argmax_chain_and_plain_samplings_stream(tiny_dir):
    """A composite verifies its merged tree by token matching: there DFlash proposes the chain of its processed
    rows' argmaxes under sampling and draws nothing from the sequence's stream, so a seeded request's output is
    plain sampling's token for token. Alone, the chain is sampled (more than one chain over repeated proposals)."""
    from spyglass.drafters.composite import CompositeDrafter

    target = load_transformer(tiny_dir["llama"])
    draft, head = trained_tiny(target)
    prompt = make_prompts(target.args.vocab_size, 1, seed=8)[0]
    sampled = SamplingParams(max_new_tokens=8, temperature=1.0, seed=0, ignore_eos=True)

    def proposals(drafter, n):
        engine = SpecEngine(target, drafter, EngineConfig(max_batch=1, max_context=256, controller="off"))
        seq = engine.add_request(prompt, sampled)
        engine.step()
        return [tuple(drafter.propose([seq], [DraftRequest()])[0].tokens.tolist()) for _ in range(n)]

    composite = CompositeDrafter([DFlashDrafter(draft, head, token_matched=True)])
    assert composite.parts[0].traits.token_matched
    assert len(set(proposals(composite, 4))) == 1
    assert len(set(proposals(DFlashDrafter(draft, head), 8))) > 1
    engine = SpecEngine(target, composite, EngineConfig(max_batch=1, max_context=256, controller="off"))
    params = SamplingParams(max_new_tokens=24, temperature=0.3, seed=5, ignore_eos=True)  # argmaxes often drawn
    (seq,) = engine.run([prompt], params)
    assert seq.output_ids == plain_generate(target, prompt, params)
    assert sum(seq.stats.new_tokens_per_step) > seq.stats.steps  # drafts were accepted along the way


def test_target_init_starts_from_the_targets_own_context_keys_and_values(tiny_dir):
    """Initialised from the target, the first draft layer's context K/V are the target's K/V of the layer it copies
    (the deepest tapped layer feeds it), so training starts from what the target itself attends to."""
    target = load_transformer(tiny_dir["llama"])
    last = target.args.n_layers - 1
    draft = DFlashDraft.from_target(target, init_from_target=True, target_layers=(last - 1,), n_layers=1)
    tokens = torch.tensor(make_prompts(target.args.vocab_size, 1, seed=9)[0])
    n = tokens.shape[0]
    cache = target.new_cache(n + 1, 1)
    slot = cache.allocate()
    target.prefill(cache, slot, tokens)
    with torch.no_grad():
        k, v = draft.context_kv(full_features(target, tokens, (last - 1,)), torch.arange(n))[0]
    want_k, want_v = cache.layer(slot, last)
    torch.testing.assert_close(k, want_k[:, :n], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(v, want_v[:, :n], atol=1e-5, rtol=1e-4)


def test_distillation_labels_are_the_next_token_choices(tiny_dir):
    """`labels[p]` is the target's choice after position p: labels equal to the text shifted by one give the text
    loss exactly; other labels give another loss."""
    target = load_transformer(tiny_dir["llama"])
    draft = DFlashDraft.from_target(target, target_layers=(0, 1), n_layers=1, block_size=4)
    tokens = torch.tensor(make_prompts(target.args.vocab_size, 1, seed=4)[0])
    feats = full_features(target, tokens, (0, 1))
    anchors = torch.tensor([2, 5, 9])
    with torch.no_grad():
        text, _ = dflash_loss(draft, feats, tokens, anchors)
        shifted, _ = dflash_loss(draft, feats, tokens, anchors, labels=torch.cat([tokens[1:], tokens[:1]]))
        other, _ = dflash_loss(draft, feats, tokens, anchors, labels=tokens)
    assert float(shifted) == pytest.approx(float(text), rel=1e-6)
    assert abs(float(other) - float(text)) > 1e-3


def test_checkpoint_round_trip_and_errors(tiny_dir, tmp_path):
    target = load_transformer(tiny_dir["qwen2"])
    draft = DFlashDraft.from_target(target, target_layers=(0, 1), n_layers=1, block_size=4)
    save_dflash(draft, tmp_path / "d", dtype=torch.float32)
    again = load_dflash(tmp_path / "d", target)
    for (n, a), (_, b) in zip(draft.state_dict().items(), again.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, msg=n)
    other = load_transformer(tiny_dir["llama"])
    # the target's embedding and head are shared, not checkpointed
    assert not any(k.startswith(("embed", "lm_head")) for k in draft.state_dict())
    load_dflash(tmp_path / "d", other)  # same shapes: fits
    with pytest.raises(ValueError, match="not a DFlash checkpoint"):
        load_dflash(tmp_path, target)


def test_block_attention_equals_attention_over_the_concatenated_repeated_keys():
    """Serving's attention (the hybrid tree attention, context read in place, the block all visible) is the training
    path's SDPA over [context; block]."""
    from spyglass.attention import tree_attention

    torch.manual_seed(0)
    heads, kv_heads, n, s, d = 6, 2, 4, 37, 8
    q = torch.randn(heads, n, d)
    ctx_k, ctx_v = torch.randn(kv_heads, s, d), torch.randn(kv_heads, s, d)
    k, v = torch.randn(kv_heads, n, d), torch.randn(kv_heads, n, d)
    g = heads // kv_heads
    full_k = torch.cat([ctx_k, k], 1).repeat_interleave(g, 0)
    full_v = torch.cat([ctx_v, v], 1).repeat_interleave(g, 0)
    want = torch.nn.functional.scaled_dot_product_attention(q[None], full_k[None], full_v[None])[0]
    got = tree_attention(q, ctx_k[:, :s], ctx_v, k, v, torch.ones(n, n, dtype=torch.bool), backend="auto")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_reduced_vocabulary_proposes_only_its_tokens_and_stays_lossless(tiny_dir, tmp_path):
    """A draft served over its training softmax's rows (`vocab_ids`, saved with the checkpoint): the same logits
    there, -inf elsewhere, only those tokens proposed, and the output still plain decoding's."""
    target = load_transformer(tiny_dir["llama"])
    draft, head = trained_tiny(target)
    save_dflash(draft, tmp_path / "full", dtype=torch.float32)
    reduced = load_dflash(tmp_path / "full", target)
    assert reduced.vocab_ids is None
    vocab = torch.arange(3, target.args.vocab_size, 2)
    reduced.vocab_ids = vocab
    save_dflash(reduced, tmp_path / "reduced", dtype=torch.float32)
    reduced = load_dflash(tmp_path / "reduced", target)
    assert torch.equal(reduced.vocab_ids, vocab)
    hid = torch.randn(3, target.args.hidden_size)
    full, part = draft.logits(hid), reduced.logits(hid)
    torch.testing.assert_close(part[:, vocab], full[:, vocab])
    outside = torch.ones(target.args.vocab_size, dtype=torch.bool)
    outside[vocab] = False
    assert torch.isneginf(part[:, outside]).all()
    # DeLS fused over those rows only: the full fusion's values there, -inf outside
    fused, _ = DFlashDrafter(reduced, head)._position_logits(part, [5], None)
    want = fuse(part[1], head.logits(head.step(5, None)), head.log_unigram, 0.3, 0.3)
    torch.testing.assert_close(fused[vocab], want[vocab], rtol=1e-5, atol=1e-5)
    assert torch.isneginf(fused[outside]).all()

    proposed: list[int] = []

    class Recording(DFlashDrafter):
        def propose(self, batch, wants):
            trees = super().propose(batch, wants)
            proposed.extend(t for tree in trees for t in tree.tokens[1:].tolist())
            return trees

    prompts = make_prompts(target.args.vocab_size, 4, seed=9)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    engine = SpecEngine(target, Recording(reduced, head), EngineConfig(max_batch=4, max_context=256, controller="off"))
    seqs = engine.run(prompts, params)
    assert proposed and set(proposed) <= set(vocab.tolist())
    assert [s.output_ids for s in seqs] == [plain_generate(target, p, params) for p in prompts]
    bad = tmp_path / "bad"
    reduced.vocab_ids = torch.tensor([0, target.args.vocab_size])
    save_dflash(reduced, bad, dtype=torch.float32)
    with pytest.raises(ValueError, match="vocab_ids do not index"):
        load_dflash(bad, target)


def test_warm_start_from_a_checkpoint_with_another_block_size(tiny_dir, tmp_path):
    """`--init-from`: a new recipe (here block 4 instead of 8) starts from a trained draft's weights."""
    from spyglass.training.dflash import warm_start

    target = load_transformer(tiny_dir["qwen2"])
    torch.manual_seed(0)
    trained = DFlashDraft.from_target(target, target_layers=(0, 1), n_layers=1, block_size=8)
    save_dflash(trained, tmp_path / "d", dtype=torch.float32)
    fresh = DFlashDraft.from_target(target, target_layers=(0, 1), n_layers=1, block_size=4)
    assert not torch.equal(fresh.fc.weight, trained.fc.weight)
    warm_start(fresh, tmp_path / "d", target)
    assert fresh.cfg.block_size == 4
    for (n, a), (_, b) in zip(fresh.state_dict().items(), trained.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, msg=n)
    other = DFlashDraft.from_target(target, target_layers=(1,), n_layers=1, block_size=4)
    with pytest.raises(ValueError, match="reading target layers"):
        warm_start(other, tmp_path / "d", target)


def test_warm_start_onto_other_target_layers_keeps_fc(tiny_dir, tmp_path):
    """A draft tapping as many target layers but other ones starts from the checkpoint's weights, `fc` included
    (each new layer takes the old one's columns); it keeps its own layers."""
    from spyglass.training.dflash import warm_start

    target = load_transformer(tiny_dir["qwen2"])
    torch.manual_seed(0)
    trained = DFlashDraft.from_target(target, target_layers=(0,), n_layers=1)
    save_dflash(trained, tmp_path / "d", dtype=torch.float32)
    moved = DFlashDraft.from_target(target, target_layers=(1,), n_layers=1)
    warm_start(moved, tmp_path / "d", target)
    assert moved.cfg.target_layers == (1,)
    for (n, a), (_, b) in zip(moved.state_dict().items(), trained.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, msg=n)


def test_copy_mixture_by_hand():
    """The head's probabilities weighted by exp(keep), plus each key position's mass on the token after it; a
    token neither proposes has log-probability -inf."""
    logits = torch.tensor([[0.0, math.log(3.0), float("-inf"), 0.0, float("-inf")]])  # head: 0.2, 0.6, 0, 0.2, 0
    keep = torch.tensor([math.log(0.5)])
    mass = torch.tensor([[0.1, 0.3, 0.1]])  # positions 0, 1, 2 propose tokens 2, 3, 2
    got = mix_copies(logits, keep, mass, torch.tensor([2, 3, 2]))
    torch.testing.assert_close(got.exp(), torch.tensor([[0.1, 0.3, 0.2, 0.4, 0.0]]))
    assert got[0, 4] == float("-inf")


def _keys(target, tokens: torch.Tensor) -> torch.Tensor:
    """The target's last-layer keys `[kvh, L, D]` of `tokens` (what the training run hands the copy head)."""
    cache = target.new_cache(tokens.shape[0] + 1, 1)
    slot = cache.allocate()
    target.prefill(cache, slot, tokens)
    return cache.layer(slot, target.args.n_layers - 1)[0][:, : tokens.shape[0]].clone()


def test_a_copy_head_loss_is_the_mixtures(tiny_dir):
    """A copy head whose gate keeps everything on the LM head gives the plain loss; one that copies makes a target
    outside the reduced vocabulary count where the context holds it, and learns to copy what the context repeats."""
    target = load_transformer(tiny_dir["llama"])
    plain = DFlashDraft.from_target(target, target_layers=(0, 1), n_layers=1, block_size=4).float()
    copying = with_copy_head(plain).float()
    text = torch.randint(3, target.args.vocab_size, (30,), generator=torch.Generator().manual_seed(4))
    tokens = torch.cat([text, text])  # the second half repeats the first
    feats, keys, anchors = full_features(target, tokens, (0, 1)), _keys(target, tokens), torch.arange(1, 55, 3)
    with pytest.raises(ValueError, match="last-layer keys"):
        dflash_loss(copying, feats, tokens, anchors)
    with torch.no_grad():
        copying.copy_gate.bias.copy_(torch.tensor([0.0] + [-1e4] * plain.cfg.n_kv_heads))
        base, _ = dflash_loss(plain, feats, tokens, anchors)
        same, _ = dflash_loss(copying, feats, tokens, anchors, keys=keys)
        assert float(same) == pytest.approx(float(base), rel=1e-5)
        copying.copy_gate.bias.copy_(torch.tensor([-1e4] + [0.0] * plain.cfg.n_kv_heads))  # all mass copied
        ids = torch.arange(8)  # a vocabulary that holds no target: only copies can score
        loss, _ = dflash_loss(copying, feats, tokens, anchors, vocab_ids=ids, keys=keys)
        assert 0 < float(loss) < 1e3
    fresh = with_copy_head(plain).float().train()
    opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    anchors = torch.arange(31, 55)  # the repeated half: copyable
    losses = []
    for _ in range(40):
        loss, _ = dflash_loss(fresh, feats, tokens, anchors, keys=keys)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]


def _after_prefill(drafter, target, prompt, max_new_tokens=8):
    engine = SpecEngine(target, drafter, EngineConfig(max_batch=1, max_context=256, controller="off"))
    seq = engine.add_request(prompt, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
    engine.step()  # prefill: the root is the target's first token
    return engine, seq


COPY_PROMPT = [5, 6, 21, 22, 23, 24, 25, 26, 27, 9, 8]


def _copying(tiny_dir):
    """A span drafter (a copy-head draft) with COPY_PROMPT prefilled, and block rows whose first token is 23."""
    target = load_transformer(tiny_dir["llama"])
    draft, _ = trained_tiny(target)
    drafter = DFlashDrafter(with_copy_head(draft), span=4, span_mass=0.3)
    _, seq = _after_prefill(drafter, target, COPY_PROMPT)
    rows = torch.zeros(drafter.block - 1, target.args.vocab_size)
    rows[0, 23] = 5.0  # the block's first drafted token: 23
    return target, draft, drafter, seq, rows


def _mass_on_22(drafter, positions: int, weight: float = 0.5) -> torch.Tensor:
    """The pointer's mass per block row over `positions` context positions, all of it on position 3 (token 22),
    which proposes 23, at position 4."""
    mass = torch.zeros(positions)
    mass[3] = weight
    return mass.expand(drafter.block - 1, -1)


def test_a_copied_first_token_brings_the_contexts_continuation(tiny_dir):
    """Where the pointer's mass for the first drafted token sits on a context position, the chain goes on with what
    followed that position (tagged as a span); the pointer then stays where an accepted copy ended and the next
    chain is the context's continuation with no block forward. Less mass than `span_mass`: the block's chain."""
    from spyglass.tree import DRAFT_SOURCE, SPAN_SOURCE
    from spyglass.verify import Accepted

    target, draft, drafter, seq, rows = _copying(tiny_dir)
    c = seq.committed
    tree = drafter._span_tree(seq, rows, _mass_on_22(drafter, c), cap=256)
    assert tree.tokens.tolist() == [seq.root, 23, 24, 25, 26, 27] and tree.is_chain
    assert tree.sources == [0, DRAFT_SOURCE] + [SPAN_SOURCE] * 4
    # the target accepts 23 24 and says 25: the pointer moves to position 6 (token 25), where the root now is
    st = seq.drafter_state
    seq.append(23), seq.append(24), seq.append(25)  # (what the engine does; no KV needed for the pointer's chain)
    drafter.commit(seq, Accepted([0, 1, 2], [23, 24, 25]))
    assert st.pointer == 6 and st.chain is None
    forwards = []
    run = drafter.draft.blocks_hidden
    drafter.draft.blocks_hidden = lambda *a, **k: forwards.append(1) or run(*a, **k)
    followed = drafter._follow_pointer(seq, cap=256)
    assert followed.tokens.tolist() == [25, 26, 27, 9, 8] and followed.sources == [0] + [SPAN_SOURCE] * 4
    assert not forwards
    # the controller verified none of it, but the target says 26: the copy goes on, and through a plain step too
    seq.append(26)
    drafter.commit(seq, Accepted([0], [26]))
    assert st.pointer == 7
    seq.append(27)
    drafter.commit(seq, Accepted([0], [27]))  # nothing proposed this step
    assert st.pointer == 8
    between_probes = [DraftRequest(free_only=True)]  # the copy's continuation, no block forward
    (free,) = drafter.propose([seq], between_probes)
    assert free.tokens.tolist()[:3] == [27, 9, 8] and set(free.sources[1:]) == {SPAN_SOURCE} and not forwards
    # a root that departs from the context, or too little mass: no span (and between probes, nothing)
    seq.append(99)
    drafter.commit(seq, Accepted([0], [99]))
    assert st.pointer == -1 and drafter._follow_pointer(seq, cap=256) is None
    (free,) = drafter.propose([seq], between_probes)
    assert len(free) == 1 and not forwards
    engine2, seq2 = _after_prefill(DFlashDrafter(with_copy_head(draft), span=4, span_mass=0.3), target, COPY_PROMPT)
    plain = engine2.drafter._span_tree(seq2, rows, _mass_on_22(drafter, c, 0.25), cap=256)
    assert plain.sources is None and len(plain) == drafter.block


def test_a_copied_token_whose_text_before_agrees_with_its_source_is_sized_as_a_span(tiny_dir):
    """A copied token whose preceding text agrees with its source's (here the root and the token before it) is as
    sure as a span's next token: tagged COPY_SOURCE with suffix lookup's estimate, (m - 1) / m for m agreeing
    tokens counting itself, so the controller prices it with the spans rather than by the drafted profile."""
    from spyglass.tree import COPY_SOURCE, SPAN_SOURCE

    _, _, drafter, seq, rows = _copying(tiny_dir)
    seq.append(22)  # the root is now 22, as before the source: 22 23 agree, the token before them does not
    tree = drafter._span_tree(seq, rows, _mass_on_22(drafter, seq.committed), cap=256)
    assert tree.tokens.tolist() == [22, 23, 24, 25, 26, 27]
    assert tree.sources == [0, COPY_SOURCE] + [SPAN_SOURCE] * 4
    assert tree.scores[1] == pytest.approx(tree.scores[0] / 2)
    assert tree.scores[2] == pytest.approx(tree.scores[1] * 2 / 3)  # the span goes on from m = 2


def test_span_options_are_checked(tiny_dir):
    target = load_transformer(tiny_dir["llama"])
    draft = DFlashDraft.from_target(target, target_layers=(0, 1), n_layers=1, block_size=4)
    with pytest.raises(ValueError, match="no copy head"):
        DFlashDrafter(draft, span=4)
    with pytest.raises(ValueError, match="span must be"):
        DFlashDrafter(with_copy_head(draft), span=4, span_mass=0.0)
    assert DFlashDrafter(with_copy_head(draft), span=4).name == "dflash-span"


def test_a_copy_head_is_added_to_a_warm_started_draft_and_checkpointed(tiny_dir, tmp_path):
    """`--copy-head --init-from` a draft trained without one: its weights carry over and the copy head starts
    fresh; the checkpoint keeps the head. A copy-head checkpoint cannot warm-start a draft without one."""
    from spyglass.training.dflash import warm_start

    target = load_transformer(tiny_dir["llama"])
    trained = DFlashDraft.from_target(target, target_layers=(0, 1), n_layers=1, block_size=4)
    save_dflash(trained, tmp_path / "plain", dtype=torch.float32)
    grown = DFlashDraft.from_target(target, target_layers=(0, 1), n_layers=1, block_size=4, copy_head=True)
    warm_start(grown, tmp_path / "plain", target)
    torch.testing.assert_close(grown.fc.weight, trained.fc.weight)
    save_dflash(grown, tmp_path / "copy", dtype=torch.float32)
    again = load_dflash(tmp_path / "copy", target)
    assert again.cfg.copy_head
    torch.testing.assert_close(again.copy_q.weight, grown.copy_q.weight)
    with pytest.raises(ValueError, match="has a copy head"):
        warm_start(DFlashDraft.from_target(target, target_layers=(0, 1), n_layers=1), tmp_path / "copy", target)


def test_packaged_drafts_serve_the_default_model(smollm2):
    """`dflash` / `dflash-dels` / `dflash-span` with no checkpoint argument load the drafts shipped in the package
    (the DFlash draft with its copy head)."""
    from spyglass.drafters import METHODS, build_drafter

    target, tok = smollm2
    assert {"dflash", "dflash-dels"} <= set(METHODS)
    ids = tok.encode("def fibonacci(n):\n    if n < 2:\n        return n\n", add_special_tokens=False)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    ref = plain_generate(target, ids, params)
    assert {"dflash-span", "dflash-dels-span"} <= set(METHODS)
    for method in ("dflash", "dflash-dels", "dflash-span"):
        drafter = build_drafter(method, target)
        assert drafter.name == method and drafter.traits.hidden_layers == (1, 14, 29)
        assert drafter.draft.vocab_ids.numel() == 8192  # served over the rows it was trained on
        assert drafter.draft.cfg.copy_head and bool(drafter.span) == method.endswith("-span")
        assert (drafter.local is not None) == (method == "dflash-dels")
        engine = SpecEngine(target, drafter, EngineConfig(max_batch=1, max_context=256, controller="off"))
        (seq,) = engine.run([ids], params)
        assert seq.output_ids == ref
    composite = build_drafter("composite-dflash", target)  # suffix lookups + the shipped DFlash + DeLS
    assert composite.name == "composite-dflash" and [p.name for p in composite.parts] == ["suffix", "dflash-dels"]
    engine = SpecEngine(target, composite, EngineConfig(max_batch=1, max_context=256, controller="off"))
    assert engine.run([ids], params)[0].output_ids == ref


def test_the_local_head_is_prepared_when_the_drafter_binds(tiny_dir):
    """The fused matrix the DeLS head multiplies is built when the engine binds the drafter, not in a request."""
    target = load_transformer(tiny_dir["llama"])
    draft, head = trained_tiny(target)
    drafter = DFlashDrafter(draft, head)  # eval() drops a matrix built from earlier weights
    assert head._fused is None
    SpecEngine(target, drafter, EngineConfig(max_batch=1, max_context=64))
    assert head._fused is not None
