"""Greedy identity: every drafter's output equals plain greedy decoding token for token."""

from __future__ import annotations

import pytest

from spyglass.drafters.composite import CompositeDrafter
from spyglass.drafters.dflash import DFlashDrafter
from spyglass.drafters.longspec import LongSpecDrafter
from spyglass.drafters.ngram import NgramDrafter
from spyglass.drafters.small_lm import SmallLMDrafter, truncated_draft
from spyglass.drafters.streaming import StreamingDrafter
from spyglass.drafters.suffix import SuffixDrafter
from spyglass.drafters.tokenswift import build_tokenswift
from spyglass.engine import EngineConfig, RequestError, SpecEngine, plain_generate
from spyglass.models.llama import load_transformer
from spyglass.sampling import SamplingParams
from tests.tiny import DTYPES, free_tokens_curve, layer_copy_draft, make_prompts, trained_tiny, with_copy_head

N_PROMPTS = 8  # two waves of batch 4


def drafters(target):
    yield "ngram", NgramDrafter(n_min=1, n_max=3, draft_len=6, max_candidates=3)
    yield "suffix", SuffixDrafter(max_depth=8, max_nodes=24)
    yield "small-lm", SmallLMDrafter(truncated_draft(target, 1), gamma=4, max_batch=4, max_context=512)
    # reads the target's hidden state, from depth 1 on its parent node's output, and each token's predecessor, and
    # copies from the context
    draft = layer_copy_draft(target, feed_hidden=True, feed_own_hidden=True, prev_token=True, copy_head=True)
    yield "longspec", LongSpecDrafter(draft, gamma=4)
    yield "longspec-beam", LongSpecDrafter(layer_copy_draft(target), gamma=3, mode="beam", width=2)
    yield "longspec-cape", LongSpecDrafter(layer_copy_draft(target), gamma=4, mode="cape")
    # a random copy head spreads its mass thinly: any mass at all makes a span here
    span_draft = layer_copy_draft(target, copy_head=True)
    yield "longspec-span", LongSpecDrafter(span_draft, gamma=3, span=6, span_mass=1e-6)
    yield "glide", LongSpecDrafter(layer_copy_draft(target, feed_hidden=True, n_layers=2), gamma=4)
    learned = LongSpecDrafter(layer_copy_draft(target, feed_hidden=True), gamma=3, token_matched=True)
    parts = [SuffixDrafter(max_depth=6), learned]
    yield "composite", CompositeDrafter(parts)
    spans = LongSpecDrafter(
        layer_copy_draft(target, copy_head=True), gamma=3, span=6, span_mass=1e-6, token_matched=True
    )
    yield "composite-span", CompositeDrafter([SuffixDrafter(max_depth=6), spans])  # its pointer reads merged trees
    draft, head = trained_tiny(target)  # briefly trained tiny DFlash draft and DeLS head
    yield "dflash", DFlashDrafter(draft)  # a chain, sized by its acceptance profile
    yield "dflash-dels", DFlashDrafter(draft, head)
    # a random pointer's mass is thin: any mass at all makes a span; the rows mix in its copies
    yield "dflash-dels-span", DFlashDrafter(with_copy_head(draft), head, span=6, span_mass=1e-6)
    matched = DFlashDrafter(draft, head, token_matched=True)
    yield "composite-dflash", CompositeDrafter([SuffixDrafter(max_depth=6), matched])
    # partial KV budgets below most prompts' lengths, so selection, replacement and rebuilds all happen
    yield "tokenswift", build_tokenswift(target, "untrained", budget=24, sinks=4)
    yield "streaming", StreamingDrafter(budget=24, sinks=4, gamma=4)


@pytest.fixture(scope="module")
def llama_target(tiny_dir):
    return load_transformer(tiny_dir["llama"])


# Drafters that read nothing of the target's internals (or read them exactly as another listed drafter does): on
# the second model family they would repeat the first family's run, so only the family-sensitive ones run there.
# (DFlash reads the target's hidden states, so one DFlash variant runs on both: the composite, which drafts with
# DFlash wherever its suffix lookup is unsure and gets something accepted on the Qwen2 model, where the briefly
# trained draft's top-1 chain never is.)
FAMILY_INDEPENDENT = {
    "ngram", "suffix", "longspec-beam", "longspec-cape", "longspec-span", "composite", "composite-span", "dflash",
    "dflash-dels", "dflash-dels-span",
}  # fmt: skip


def check_identity(target, params: SamplingParams, batches=(1, 4), skip=frozenset()) -> None:
    """Every drafter (but `skip`), every batch size: output equal to plain decoding, drafts accepted, no slot
    leaked."""
    prompts = make_prompts(target.args.vocab_size, N_PROMPTS, seed=len(target.layers))
    reference = [plain_generate(target, p, params) for p in prompts]
    differ = []  # every drafter runs before a difference fails the test, so the message names them all
    for name, drafter in drafters(target):
        if name in skip:
            continue
        for batch in batches:
            engine = SpecEngine(
                target, drafter, EngineConfig(max_batch=batch, max_context=512, controller=free_tokens_curve())
            )
            seqs = engine.run(prompts, params)
            bad = [i for i, (seq, ref) in enumerate(zip(seqs, reference, strict=True)) if seq.output_ids != ref]
            if bad:
                differ.append(f"{name} batch {batch} prompts {bad}")
                continue
            # the drafter really drafted and something was accepted beyond the bonus token
            taus = [s.stats.summary(s.num_generated)["tau"] for s in seqs]
            assert max(taus) > 1.0, f"{name}: nothing was ever accepted"
            assert engine.cache.free_slots == batch, "KV slots leaked"
            if batch == 4:
                assert max(max(s.stats.batch_sizes) for s in seqs) == 4, "sequences were not batched"
    assert not differ, f"output differs from plain decoding ({target.dtype}): {'; '.join(differ)}"


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_identity_batch1_and_batch4(load_tiny, family, dtype):
    """In fp32 and in bf16: a verify pass must round exactly as the one-token steps of plain decoding in the same
    dtype."""
    skip = FAMILY_INDEPENDENT if family == "qwen2" else frozenset()  # Qwen2: the second family
    check_identity(load_tiny(family, dtype), SamplingParams(max_new_tokens=32, ignore_eos=True), skip=skip)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=24, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_new_tokens=24, contextual_penalty=1.5, penalty_window=8, ignore_eos=True),
    ],
    ids=["rep-penalty", "ctx-penalty"],
)
def test_greedy_identity_with_penalties(llama_target, params):
    """The penalties see drafted ancestors exactly as plain decoding sees its own tokens (family-independent
    logic, so on the Llama model only, and at batch 4, where drafted and committed tokens of several sequences
    mix: the suite's time goes where it buys coverage)."""
    check_identity(llama_target, params, batches=(4,))


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_engine_serves_every_method_in_one_batch(load_tiny, dtype):
    """A replica's engine: every drafter (and plain decoding) over one KV pool, requests of different methods in the
    same continuous batch and the same target forwards; each output equals plain decoding (in the target's dtype),
    and the pool does not grow with the number of methods."""
    llama_target = load_tiny("llama", dtype)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    named = {"ar": None, **dict(drafters(llama_target))}
    prompts = make_prompts(llama_target.args.vocab_size, len(named), seed=3)
    config = EngineConfig(max_batch=4, max_context=512, controller=free_tokens_curve())
    engine = SpecEngine(llama_target, config=config, drafters=named)
    one = SpecEngine(llama_target, config=config, drafters={"ar": None})
    assert engine.cache.nbytes == one.cache.nbytes
    methods = list(named)
    seqs = engine.run(prompts, params, method=methods)
    for seq, prompt, method in zip(seqs, prompts, methods, strict=True):
        assert seq.method == method
        assert seq.output_ids == plain_generate(llama_target, prompt, params), f"{method} differs in a mixed batch"
        assert max(seq.stats.batch_sizes) == 4, f"{method} never shared a forward"
    assert max(s.stats.summary(s.num_generated)["tau"] for s in seqs) > 1.0
    assert engine.cache.free_slots == 4, "KV slots leaked"
    with pytest.raises(RequestError, match="unknown method 'no-such-method'"):
        engine.add_request(prompts[0], params, method="no-such-method")
    with pytest.raises(ValueError, match="either one drafter"):
        SpecEngine(llama_target, NgramDrafter(), config, drafters={"ar": None})


def test_plain_engine_equals_reference(tiny_target):
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    prompts = make_prompts(tiny_target.args.vocab_size, 6, seed=7)
    engine = SpecEngine(tiny_target, None, EngineConfig(max_batch=3, max_context=512, controller=free_tokens_curve()))
    seqs = engine.run(prompts, params)
    assert [s.output_ids for s in seqs] == [plain_generate(tiny_target, p, params) for p in prompts]
    assert all(s.stats.summary(s.num_generated)["tau"] == 1.0 for s in seqs)


def test_stops_eos_context_full_and_abort(tiny_target):
    eos = tiny_target.args.eos_token_ids[0]
    # EOS: plain decoding and the engine stop at the same place
    params = SamplingParams(max_new_tokens=40)
    prompts = make_prompts(tiny_target.args.vocab_size, 8, seed=11)
    prompts = [p + [eos] * 3 for p in prompts]  # make EOS a likely n-gram continuation
    engine = SpecEngine(
        tiny_target, NgramDrafter(), EngineConfig(max_batch=4, max_context=512, controller=free_tokens_curve())
    )
    reasons = []
    for seq in engine.run(prompts, params):
        ref = plain_generate(tiny_target, seq.tokens[: seq.num_prompt].tolist(), params)
        assert seq.output_ids == ref
        assert seq.finish_reason == ("stop" if ref[-1] == eos else "length")
        reasons.append(seq.finish_reason)
    assert "stop" in reasons and "length" in reasons  # both endings were exercised
    # context full: generation ends with "length" and is a prefix of the unbounded output
    prompt = prompts[0]
    engine = SpecEngine(tiny_target, NgramDrafter(), EngineConfig(max_batch=1, max_context=len(prompt) + 5))
    (seq,) = engine.run([prompt], SamplingParams(max_new_tokens=40, ignore_eos=True))
    full = plain_generate(tiny_target, prompt, SamplingParams(max_new_tokens=40, ignore_eos=True))
    assert seq.finish_reason == "length" and 1 <= seq.num_generated <= 6
    assert seq.output_ids == full[: seq.num_generated]
    # abort: the sequence ends and its KV slot returns to the pool
    engine = SpecEngine(
        tiny_target, NgramDrafter(), EngineConfig(max_batch=2, max_context=512, controller=free_tokens_curve())
    )
    a = engine.add_request(prompt, SamplingParams(max_new_tokens=30, ignore_eos=True))
    b = engine.add_request(prompt, SamplingParams(max_new_tokens=30, ignore_eos=True))
    engine.step()
    assert engine.cache.free_slots == 0
    assert engine.abort(a.seq_id) and a.finish_reason == "abort"
    assert engine.cache.free_slots == 1 and not engine.abort("no-such-id")
    while engine.has_work:
        engine.step()
    assert b.num_generated == 30 and engine.cache.free_slots == 2


def test_rejects_bad_requests(tiny_target):
    from spyglass.engine import RequestError

    engine = SpecEngine(tiny_target, None, EngineConfig(max_batch=1, max_context=32, controller=free_tokens_curve()))
    params = SamplingParams(max_new_tokens=4)
    with pytest.raises(RequestError, match="empty"):
        engine.add_request([], params)
    with pytest.raises(RequestError, match="context holds 32"):
        engine.add_request(list(range(3, 40)), params)
    with pytest.raises(RequestError, match="token ids"):
        engine.add_request([5, tiny_target.args.vocab_size], params)
    assert not engine.has_work
