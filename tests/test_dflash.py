"""DFlash block drafting and the DeLS-Spec local head: lossless in the shared suites, fusion and prior by hand,
the local head trains on the target's embedding/head alone, the context-feature cache equals a recomputation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from spyglass.drafters.dels import (
    LocalHead,
    LocalHeadConfig,
    load_local_head,
    read_frozen_io,
    save_local_head,
    token_counts,
    unigram_log_prior,
    window_weights,
)
from spyglass.drafters.dflash import DFlashDraft, DFlashDrafter, dflash_loss, fuse, load_dflash, save_dflash
from spyglass.engine import EngineConfig, SpecEngine, plain_generate
from spyglass.models.llama import Segment, load_transformer
from spyglass.sampling import SamplingParams
from tests.test_engine_identity import make_prompts
from tests.test_sampling_fidelity import (  # noqa: F401 - the shared fidelity suite's fixtures and helpers
    N_SAMPLES,
    VOCAB,
    chi_square_p,
    exact_joint,
    prompt,
    sampling_model,
)

_TRAINED: dict[tuple, tuple] = {}


def full_features(target, tokens: torch.Tensor, layers) -> torch.Tensor:
    """Concatenated hidden states of `tokens` from one fresh target forward (no cache reuse)."""
    cache = target.new_cache(tokens.shape[0] + 1, 1)
    slot = cache.allocate()
    target.capture_layers = tuple(layers)
    try:
        target([Segment(slot, 0, tokens, torch.arange(tokens.shape[0]), None, "none")], cache)
        return torch.cat([target.captured[0][i] for i in layers], dim=-1).clone()
    finally:
        target.capture_layers = ()


def trained_tiny(target, block: int = 6, steps: int = 120, prefix: list[int] | None = None):
    """A DFlash draft and a local head trained for a few seconds on the target's own text (greedy continuations
    of random prompts, plus sampled continuations of `prefix` if given), so the lossless suites exercise
    acceptance: random weights would almost never be accepted. Cached per target and prompt."""
    key = (id(target), tuple(prefix or ()))
    if key in _TRAINED:
        return _TRAINED[key][:2]
    torch.manual_seed(0)
    vocab = target.args.vocab_size
    texts = []
    for p in make_prompts(vocab, 12, seed=99):
        out = plain_generate(target, p, SamplingParams(max_new_tokens=40, ignore_eos=True))
        texts.append(torch.tensor(p + out))
    if prefix is not None:  # distillation on the very distribution the fidelity test samples
        for i in range(48):
            sp = SamplingParams(temperature=1.0, seed=i, max_new_tokens=block + 2, ignore_eos=True)
            texts.append(torch.tensor(prefix + plain_generate(target, prefix, sp)))
    layers = tuple(range(target.args.n_layers))
    draft = DFlashDraft.from_target(target, target_layers=layers, n_layers=1, block_size=block).float().train()
    feats = [full_features(target, t, layers) for t in texts]
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    for step in range(steps):
        i = step % len(texts)
        t = texts[i]
        anchors = torch.arange(1, t.shape[0] - block - 1)
        loss, _ = dflash_loss(draft, feats[i], t, anchors)
        opt.zero_grad()
        loss.backward()
        opt.step()
    head = LocalHead(LocalHeadConfig(target.args.hidden_size, vocab, 32, 16, window=6), target.embed.weight,
                     target.lm_head.weight)  # fmt: skip
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    flat = torch.cat(texts)
    for _ in range(60):
        starts = torch.randint(0, flat.shape[0] - 6, (32,))
        loss = head.window_loss(flat[starts.unsqueeze(1) + torch.arange(6)])
        opt.zero_grad()
        loss.backward()
        opt.step()
    head.log_unigram.copy_(unigram_log_prior(token_counts(flat, vocab)))
    _TRAINED[key] = (draft.eval(), head.eval(), target)  # (the target keeps its id from being reused)
    return _TRAINED[key][:2]


def dflash_drafters(target):
    draft, head = trained_tiny(target)
    yield "dflash", DFlashDrafter(draft)
    yield "dflash-dels", DFlashDrafter(draft, head)


# Greedy identity (batch 1 and 4): DFlash and DFlash + DeLS run in the shared suite, tests/test_engine_identity.py.


def sample_joint_all_nodes(model, drafter, prompt, temperature: float, top_p: float):  # noqa: F811
    """The shared suite's `sample_joint` with the controller off, so every node of every tree (chain and
    alternatives) is verified: at batch 500 the controller would rightly prune a tiny draft's trees to nothing."""
    engine = SpecEngine(model, drafter, EngineConfig(max_batch=500, max_context=64, controller="off"))
    counts = np.zeros((VOCAB,) * 3, dtype=np.int64)
    params = [
        SamplingParams(temperature=temperature, top_p=top_p, seed=1000 + i, max_new_tokens=3, ignore_eos=True)
        for i in range(N_SAMPLES)
    ]
    steps = drafted = 0
    for s in engine.run([prompt] * N_SAMPLES, params):
        a, b, c = s.output_ids
        counts[a, b, c] += 1
        steps += s.stats.steps
        drafted += sum(s.stats.new_tokens_per_step) - s.stats.steps
    return counts, drafted / max(steps, 1)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.8, 0.9)], ids=["T1", "T0.8-topp0.9"])
@pytest.mark.parametrize("method", ["dflash", "dflash-dels"])
def test_first_three_tokens_match_plain_sampling(sampling_model, prompt, method, temperature, top_p):  # noqa: F811
    """The shared chi-square suite (tests/test_sampling_fidelity.py) with DFlash and DFlash + DeLS."""
    model = load_transformer(sampling_model)
    draft, head = trained_tiny(model, block=4, steps=240, prefix=prompt)
    drafter = DFlashDrafter(draft, head if method == "dflash-dels" else None)
    probs = exact_joint(sampling_model, prompt, temperature, top_p)
    counts, accepted_per_step = sample_joint_all_nodes(model, drafter, prompt, temperature, top_p)
    assert counts.sum() == N_SAMPLES
    p_value = chi_square_p(counts, probs)
    assert p_value > 1e-3, f"{method}: chi-square p = {p_value:.2e}"
    assert accepted_per_step > 0.05, f"{method}: accepted {accepted_per_step:.3f} drafted tokens per step"


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
    drafter = DFlashDrafter(draft, stub, alpha=0.3, beta=0.3, max_alternatives=0)
    long = torch.zeros(4, target.args.vocab_size)
    long[:, 3] = 5.0  # DFlash alone would pick 3 everywhere
    tree = drafter._tree(11, long)
    assert tree.tokens.tolist() == [11, 3, 7, 7, 7]  # 0.3 * 100 beats 5 from the second drafted position on
    assert stub.seen == [3, 7, 7]  # the head reads the drafted tokens only (never the root), left to right
    assert tree.scores[0] == 1.0 and all(a >= b for a, b in zip(tree.scores, tree.scores[1:], strict=False))
    plain = DFlashDrafter(draft, None, max_alternatives=2, alt_threshold=1.1, max_alt_positions=1)._tree(11, long)
    assert len(plain) == 5 + 2 and plain.parents[5:] == [0, 0]  # two alternatives to the first position


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

    monkeypatch.setattr("spyglass.drafters.dels.safe_open", Recording)
    embed, head_w = read_frozen_io(tiny_dir["llama"])
    assert set(read) == {"model.embed_tokens.weight", "lm_head.weight"}
    assert embed.shape == (128, 64) and head_w.shape == (128, 64)
    torch.manual_seed(0)
    head = LocalHead(LocalHeadConfig(64, 128, 32, 16, window=8), embed, head_w).train()
    # a learnable pattern: windows of a repeated ramp
    ramp = torch.arange(3, 3 + 40) % 50 + 3
    data = ramp.repeat(20)
    losses = []
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    for _ in range(40):
        starts = torch.randint(0, data.shape[0] - 8, (16,))
        loss = head.window_loss(data[starts.unsqueeze(1) + torch.arange(8)])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
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
    save_local_head(head, tmp_path / "head")
    target = load_transformer(tiny_dir["llama"])
    again = load_local_head(tmp_path / "head", target)
    torch.testing.assert_close(again.sequence_logits(toks.unsqueeze(0)), full.unsqueeze(0))


class _Checking(DFlashDrafter):
    """After every commit, the feature cache must equal a from-scratch recomputation over the committed tokens."""

    checks = 0
    rejections = 0

    def commit(self, seq, accepted):
        super().commit(seq, accepted)
        st = seq.drafter_state
        committed = seq.committed
        assert st.n == committed and st.pos[: st.n].tolist() == list(range(committed))
        feats = full_features(self.target, seq.tokens[:committed], self.hidden_layers)
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
    feats = {i: full_features(target, tokens, (i,)) for i in drafter.hidden_layers}
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


def test_packaged_drafts_serve_the_default_model(smollm2):
    """`dflash` / `dflash-dels` with no checkpoint argument load the drafts shipped in the package."""
    from spyglass.drafters import METHODS, build_drafter

    target, tok = smollm2
    assert {"dflash", "dflash-dels"} <= set(METHODS)
    ids = tok.encode("def fibonacci(n):\n    if n < 2:\n        return n\n", add_special_tokens=False)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    ref = plain_generate(target, ids, params)
    for method in ("dflash", "dflash-dels"):
        drafter = build_drafter(method, target)
        assert drafter.name == method and drafter.hidden_layers == (1, 14, 27)
        assert (drafter.local is not None) == (method == "dflash-dels")
        engine = SpecEngine(target, drafter, EngineConfig(max_batch=1, max_context=256, controller="off"))
        (seq,) = engine.run([ids], params)
        assert seq.output_ids == ref
