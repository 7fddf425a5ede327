"""The engine's scheduler: chunked prefill under a per-step token budget, counted in steps (no clocks).

Running sequences get a token in every step while another prompt is prefilled, a long prompt shares the budget with
prompts admitted after it, and greedy outputs stay those of plain decoding."""

from __future__ import annotations

import math

import pytest
import torch

from spyglass.cost import PrefillCost
from spyglass.drafters.suffix import SuffixDrafter
from spyglass.engine import PREFILL_GRAIN, EngineConfig, SpecEngine, plain_generate
from spyglass.models.llama import load_transformer
from spyglass.sampling import SamplingParams
from tests.tiny import free_tokens_curve

GREEDY = SamplingParams(max_new_tokens=200, ignore_eos=True)  # long enough to decode through the other's prefill


def prompt(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


@pytest.mark.parametrize("drafter", [None, "suffix"])
def test_a_decoding_sequence_gets_a_token_every_step_while_a_long_prompt_is_prefilled(tiny_target, drafter):
    vocab = tiny_target.args.vocab_size
    short, long = prompt(vocab, 12, 1), prompt(vocab, 300, 2)
    budget = 32
    engine = SpecEngine(
        tiny_target,
        SuffixDrafter(max_depth=6) if drafter else None,
        EngineConfig(
            max_batch=2, max_context=512, prefill_chunk=budget, prefill_budget=budget, controller=free_tokens_curve()
        ),  # fmt: skip
    )
    assert engine.prefill_budget() == budget and engine.prefill_chunk == budget
    a = engine.add_request(short, GREEDY)
    engine.step()  # a's prefill (nobody decodes yet) and its first round
    assert a.num_generated >= 1
    b = engine.add_request(long, SamplingParams(max_new_tokens=8, ignore_eos=True))
    steps_to_first = 0
    while b.num_generated == 0:
        before, prefilled = a.num_generated, engine.cache.lengths[b.slot] if b.slot is not None else 0
        engine.step()
        steps_to_first += 1
        assert a.num_generated > before or a.finished, "the decoding stream stalled during the other's prefill"
        if b.num_generated == 0:
            assert engine.cache.lengths[b.slot] - prefilled <= budget  # the step's prefill stayed in its budget
    # the first token comes with the step that completes the prefill: no later than the budget implies
    assert steps_to_first == math.ceil(len(long) / budget)
    assert a.num_generated >= steps_to_first  # a advanced in every one of those steps
    while engine.has_work:
        engine.step()
    assert a.output_ids == plain_generate(tiny_target, short, GREEDY)
    assert b.output_ids == plain_generate(tiny_target, long, SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert engine.cache.free_slots == 2


def test_a_long_prompt_does_not_starve_a_short_one_admitted_after_it(tiny_target):
    vocab = tiny_target.args.vocab_size
    long, short = prompt(vocab, 400, 3), prompt(vocab, 40, 4)
    engine = SpecEngine(tiny_target, None, EngineConfig(max_batch=2, max_context=512, prefill_chunk=16))
    assert engine.prefill_chunk == 16  # a prompt's chunk size: fixed by the configuration, not by the load
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    first = engine.add_request(long, params)
    second = engine.add_request(short, params)
    steps = 0
    while second.num_generated == 0:
        engine.step()
        steps += 1
    assert first.num_generated == 0, "the short prompt waited for the long one"
    # the short prompt has less work left: its 3 chunks go first, within the first step's 4
    assert steps == 1
    while engine.has_work:
        engine.step()
    assert first.output_ids == plain_generate(tiny_target, long, params)
    assert second.output_ids == plain_generate(tiny_target, short, params)


def test_prompts_admitted_together_finish_one_after_another(tiny_target):
    vocab = tiny_target.args.vocab_size
    engine = SpecEngine(tiny_target, None, EngineConfig(max_batch=2, max_context=512, prefill_chunk=16))
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    first, second = (engine.add_request(prompt(vocab, 128, seed), params) for seed in (7, 8))
    engine.step()  # 4 chunks of 16 tokens, all to the first (equal work left: the earlier admitted goes first)
    assert engine.cache.lengths[first.slot] == 64 and engine.cache.lengths[second.slot] == 0
    engine.step()
    assert first.num_generated >= 1 and second.num_generated == 0  # its first token did not wait for the other


def test_a_long_prompt_is_not_starved_by_short_ones_arriving_all_the_time(tiny_target):
    vocab = tiny_target.args.vocab_size
    config = EngineConfig(max_batch=4, max_context=512, prefill_chunk=16, prefill_budget=16)
    engine = SpecEngine(tiny_target, None, config)
    assert engine.prefill_budget() == 16  # one chunk a step while anything decodes
    long = engine.add_request(prompt(vocab, 200, 9), SamplingParams(max_new_tokens=4, ignore_eos=True))
    engine.add_request(prompt(vocab, 16, 10), SamplingParams(max_new_tokens=60, ignore_eos=True))  # decodes on
    steps = 0
    while long.num_generated == 0:
        # a new one-chunk prompt every step: shortest-first alone would give every step's budget to them
        if engine.cache.free_slots:
            engine.add_request(prompt(vocab, 16, 100 + steps), SamplingParams(max_new_tokens=1, ignore_eos=True))
        engine.step()
        steps += 1
        assert steps <= 2 * math.ceil(200 / 16) + 2, "the long prompt starved"
    while engine.has_work:
        engine.step()
    assert long.output_ids == plain_generate(tiny_target, prompt(vocab, 200, 9), long.params)


def test_abort_while_prefilling_frees_the_slot(tiny_target):
    vocab = tiny_target.args.vocab_size
    engine = SpecEngine(tiny_target, None, EngineConfig(max_batch=1, max_context=512, prefill_chunk=32))
    decoding = engine.add_request(prompt(vocab, 8, 5), GREEDY)
    engine.step()
    engine.abort(decoding.seq_id)
    seq = engine.add_request(prompt(vocab, 300, 6), GREEDY)
    engine.add_request(prompt(vocab, 300, 6), GREEDY)  # waits for the slot
    engine.step()  # admitted; with nobody decoding the step prefills 4 chunks, not all 300 tokens
    assert seq in engine.prefilling and 0 < engine.cache.lengths[seq.slot] < 300
    assert engine.abort(seq.seq_id) and seq.finish_reason == "abort"
    engine.step()  # the slot went to the waiting request
    assert not engine.waiting and len(engine.prefilling) == 1 and engine.cache.free_slots == 0


def test_the_budget_is_measured_against_the_latency_target_and_bad_values_are_refused(tiny_target):
    small = SpecEngine(tiny_target, None, EngineConfig(max_batch=1, max_context=512, prefill_step_s=1e-9))
    assert small.prefill_budget() == small.prefill_unit  # the floor: a step always makes progress
    big = SpecEngine(tiny_target, None, EngineConfig(max_batch=1, max_context=512, prefill_step_s=1e3))
    assert big.prefill_budget() == 4 * big.prefill_chunk  # at most what a step prefills with nobody decoding
    cost = big.prefill_cost
    assert cost.base > 0 and cost.per_context >= 0  # a chunk later in a prompt costs no less
    mid = SpecEngine(tiny_target, None, EngineConfig(max_batch=1, max_context=512, prefill_step_s=cost.base * 100))
    assert mid.prefill_budget(0) >= mid.prefill_budget(10**6)
    for bad in ({"prefill_budget": 0}, {"prefill_step_s": 0.0}, {"prefill_chunk": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SpecEngine(tiny_target, None, EngineConfig(max_batch=1, max_context=512, **bad))


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def any_chunk_target(request, tiny_dir):
    """A tiny target whose prefill is row-invariant (`lanes`): the engine may cut chunks to its budget."""
    model = load_transformer(tiny_dir["llama"], dtype=request.param, linear_backend="prefill:lanes")
    assert model.prefill_row_invariant
    return model


def test_chunks_cut_to_the_budget_keep_plain_decodings_tokens(any_chunk_target):
    """With a row-invariant prefill a step prefills what its budget holds (48 tokens, not the 256-token chunk), the
    decoding stream advancing every step; both outputs still equal plain decoding's, which prefills in whole chunks."""
    model, vocab = any_chunk_target, any_chunk_target.args.vocab_size
    short, long = prompt(vocab, 12, 11), prompt(vocab, 300, 12)
    config = EngineConfig(max_batch=2, max_context=512, prefill_chunk=256, prefill_budget=48)
    engine = SpecEngine(model, SuffixDrafter(max_depth=6), config)
    assert engine.any_chunk and engine.prefill_budget() == 48
    a = engine.add_request(short, GREEDY)
    engine.step()
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    b = engine.add_request(long, params)
    steps = 0
    while b.num_generated == 0:
        before, prefilled = a.num_generated, engine.cache.lengths[b.slot] if b.slot is not None else 0
        engine.step()
        steps += 1
        assert a.num_generated > before or a.finished
        if b.num_generated == 0:
            assert engine.cache.lengths[b.slot] - prefilled == 48
    assert steps == math.ceil(300 / 48)
    while engine.has_work:
        engine.step()
    assert a.output_ids == plain_generate(model, short, GREEDY)
    assert b.output_ids == plain_generate(model, long, params)


def test_the_measured_budget_is_in_grains_where_chunks_may_be_cut(any_chunk_target):
    engine = SpecEngine(any_chunk_target, None, EngineConfig(max_batch=1, max_context=512, prefill_step_s=1e-9))
    assert engine.any_chunk and engine.prefill_unit == PREFILL_GRAIN
    assert engine.prefill_budget() == PREFILL_GRAIN  # the floor: a grain, not a whole chunk
    cost = engine.prefill_cost
    engine.config.prefill_step_s = cost.seconds_per_token(0) * 100
    assert engine.prefill_budget(0) % PREFILL_GRAIN == 0 and PREFILL_GRAIN <= engine.prefill_budget(0) <= 4 * 256


def test_short_prompts_admitted_together_share_one_prefill_forward(any_chunk_target):
    """Where chunks may have any size, the prompts a step prefills go through one forward (not one each), and every
    output still equals plain decoding's (which prefills each prompt alone)."""
    model, vocab = any_chunk_target, any_chunk_target.args.vocab_size
    prompts = [prompt(vocab, n, 20 + n) for n in (9, 35, 50, 20)]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    config = EngineConfig(max_batch=4, max_context=512, controller=free_tokens_curve())
    engine = SpecEngine(model, SuffixDrafter(max_depth=6), config)
    forwards = []
    real = engine._forward
    engine._forward = lambda segments: forwards.append([len(s.tokens) for s in segments]) or real(segments)
    seqs = [engine.add_request(p, params) for p in prompts]
    engine.step()
    assert all(s.num_generated >= 1 for s in seqs)  # every prompt's first token in the first step
    prefills = [f for f in forwards if sorted(f) == sorted(len(p) for p in prompts)]
    assert len(prefills) == 1 and len(forwards) == 2  # one prefill forward, one round of the four
    while engine.has_work:
        engine.step()
    for p, s in zip(prompts, seqs, strict=True):
        assert s.output_ids == plain_generate(model, p, params)


def test_a_steps_prefill_time_pays_the_forwards_fixed_cost_first(any_chunk_target):
    """The budget is what fits in `prefill_step_s` after a forward's fixed cost (measured with the cost per token at
    start-up): 0.25 s at 1 ms a token after 50 ms of fixed cost is 200 tokens, not 250."""
    cost = PrefillCost(base=1e-3, per_context=0.0, fixed=0.05)
    assert cost.tokens_in(0.25, 0) == pytest.approx(200) and cost.tokens_in(0.04, 0) == 0
    engine = SpecEngine(any_chunk_target, None, EngineConfig(max_batch=1, max_context=512))
    measured = engine.prefill_cost
    assert measured.fixed >= 0 and measured.base > 0 and measured.per_context >= 0
    engine.config.prefill_step_s = measured.fixed + measured.seconds_per_token(0) * 100
    assert engine.prefill_budget(0) == 96  # the 100 tokens after the fixed cost, in whole grains
