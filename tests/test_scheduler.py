"""The engine's scheduler: chunked prefill whose forwards run a few layers a step while others decode, counted in
steps (no clocks).

Running sequences get a token in every step while another prompt is prefilled, a long prompt shares the prefill with
prompts admitted after it, and greedy outputs stay those of plain decoding."""

from __future__ import annotations

import math

import pytest
import torch

from spyglass.cost import PrefillCost
from spyglass.drafters.suffix import SuffixDrafter
from spyglass.engine import PREFILL_STEP_ROUNDS, EngineConfig, SpecEngine, StagedPrefill, plain_generate
from spyglass.models import llama
from spyglass.models.llama import Segment, load_transformer
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
    chunk, layers = 32, tiny_target.args.n_layers
    assert layers >= 2
    engine = SpecEngine(
        tiny_target,
        SuffixDrafter(max_depth=6) if drafter else None,
        EngineConfig(
            max_batch=2, max_context=512, prefill_chunk=chunk, prefill_layers=1, controller=free_tokens_curve()
        ),
    )
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
            # a step runs one layer of a chunk's forward: the chunk is committed with its last layer
            committed = engine.cache.lengths[b.slot] - prefilled
            ran = steps_to_first % layers
            assert committed == (chunk if ran == 0 else 0)
            assert ran == 0 or engine.staged.forward.layers_run == ran
    assert engine.round_s > 0  # the rounds are timed (the unit of the default prefill budget)
    # the first token comes with the step that completes the prefill: a layer of each chunk a step
    assert steps_to_first == math.ceil(len(long) / chunk) * layers
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
    config = EngineConfig(max_batch=4, max_context=512, prefill_chunk=16, prefill_layers=tiny_target.args.n_layers)
    engine = SpecEngine(tiny_target, None, config)  # one whole chunk a step while anything decodes
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


def test_an_abort_drops_the_prefill_forward_under_way(tiny_target):
    vocab = tiny_target.args.vocab_size
    config = EngineConfig(max_batch=2, max_context=512, prefill_chunk=32, prefill_layers=1)
    engine = SpecEngine(tiny_target, None, config)
    engine.add_request(prompt(vocab, 8, 5), GREEDY)
    engine.step()  # decodes from now on
    seq = engine.add_request(prompt(vocab, 300, 6), GREEDY)
    engine.step()  # the first layer of its first chunk
    assert engine.staged is not None and engine.staged.picks[0][0] is seq and engine.cache.lengths[seq.slot] == 0
    assert engine.abort(seq.seq_id) and engine.staged is None and engine.cache.free_slots == 1
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    again = engine.add_request(prompt(vocab, 100, 7), params)  # the freed slot, its K/V computed afresh
    while not again.finished:
        engine.step()
    assert again.output_ids == plain_generate(tiny_target, prompt(vocab, 100, 7), params)


def test_a_steps_prefill_layers_are_timed_against_the_latency_target_and_bad_values_are_refused(tiny_target):
    engine = SpecEngine(tiny_target, None, EngineConfig(max_batch=2, max_context=512))
    cost, n = engine.prefill_cost, tiny_target.args.n_layers
    assert cost.base > 0 and cost.per_context >= 0 and cost.fixed >= 0  # a chunk later in a prompt costs no less

    def staged(start: int) -> StagedPrefill:
        seg = Segment(0, start, torch.zeros(64, dtype=torch.long), torch.arange(start, start + 64), None, "last")
        return StagedPrefill([(None, start, 64)], tiny_target.staged([seg], engine.cache))  # never run

    per_layer = cost.seconds([(0, 64)]) / n
    engine.config.prefill_step_s = 1e-12
    assert engine.prefill_layers(staged(0)) == 1  # the floor: a step always makes progress
    engine.config.prefill_step_s = per_layer * 2.5
    assert engine.prefill_layers(staged(0)) == 2  # before any layer ran: by the measured cost
    assert engine.prefill_layers(staged(10**6)) <= 2  # a chunk far into a prompt takes no more layers a step
    later = staged(0)
    later.forward.layers_run, later.seconds = 2, per_layer * 2 * 10  # its layers ran 10x slower than measured
    assert engine.prefill_layers(later) == 1  # by what they took
    engine.config.prefill_step_s = 1e3
    assert engine.prefill_layers(staged(0)) >= n  # the whole forward in a step
    engine.config.prefill_step_s = None  # the default: twice a round lately
    engine.round_times.clear()
    engine.round_times.extend([per_layer * 2.5 / PREFILL_STEP_ROUNDS] * 3)
    assert engine.prefill_layers(staged(0)) == 2
    engine.round_times.append(per_layer * 100)  # one slow round (a drafter's first, with its set-up)
    assert engine.prefill_layers(staged(0)) == 2  # buys no long prefill
    engine.round_times.extend([per_layer * 4.5 / PREFILL_STEP_ROUNDS] * 5)  # longer rounds (a larger batch)
    assert engine.prefill_layers(staged(0)) == 4
    assert PrefillCost(1e-3, 1e-6, fixed=0.05).seconds([(0, 100), (1000, 50)]) == pytest.approx(0.05 + 0.1 + 0.1)
    for bad in ({"prefill_layers": 0}, {"prefill_step_s": 0.0}, {"prefill_chunk": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SpecEngine(tiny_target, None, EngineConfig(max_batch=1, max_context=512, **bad))


def test_a_forward_run_a_layer_at_a_time_between_other_forwards_is_the_forward_run_at_once(tiny_target):
    """The K/V and logits of a prefill chunk whose layers run one at a time, with another slot's decode forward
    between them, equal those of the same chunk's forward run at once, bit for bit."""
    vocab = tiny_target.args.vocab_size
    ids = torch.tensor(prompt(vocab, 48, 30))

    def chunk(slot):
        return [Segment(slot, 0, ids, torch.arange(48), None, "last")]

    once = tiny_target.new_cache(64, 1)
    slot = once.allocate()
    expected = tiny_target(chunk(slot), once)[0]
    cache = tiny_target.new_cache(64, 2)
    other, mine = cache.allocate(), cache.allocate()
    tiny_target.prefill(cache, other, torch.tensor(prompt(vocab, 5, 31)))
    staged = tiny_target.staged(chunk(mine), cache)
    logits = None
    for i in range(tiny_target.args.n_layers):
        decode = Segment(other, cache.lengths[other], torch.tensor([i + 3]), torch.tensor([cache.lengths[other]]),
                         None, "all")  # fmt: skip
        tiny_target([decode], cache)
        cache.commit(other, cache.lengths[other], [0])
        logits = staged.run(1)
        assert (logits is None) == (i < tiny_target.args.n_layers - 1)
    assert torch.equal(logits[0], expected)
    for layer in range(cache.n_layers):
        for a, b in zip(cache.layer(mine, layer), once.layer(slot, layer), strict=True):
            assert torch.equal(a[:, :48], b[:, :48])


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def any_chunk_target(request, tiny_dir):
    """A tiny target whose prefill is row-invariant (`lanes`): the engine may cut chunks to its budget."""
    model = load_transformer(tiny_dir["llama"], dtype=request.param, linear_backend="prefill:lanes")
    assert model.prefill_row_invariant
    return model


def test_a_prefill_forward_spread_over_steps_keeps_plain_decodings_tokens(any_chunk_target):
    """With a row-invariant prefill, a forward while another stream decodes takes a chunk's tokens (64 here, from
    any point of the prompt) and runs a layer a step; both outputs still equal plain decoding's, which prefills in
    256-token forwards run at once."""
    model, vocab = any_chunk_target, any_chunk_target.args.vocab_size
    short, long = prompt(vocab, 12, 11), prompt(vocab, 300, 12)
    config = EngineConfig(max_batch=2, max_context=512, prefill_chunk=64, prefill_layers=1)
    engine = SpecEngine(model, SuffixDrafter(max_depth=6), config)
    assert engine.any_chunk
    a = engine.add_request(short, GREEDY)
    engine.step()
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    b = engine.add_request(long, params)
    steps = 0
    while b.num_generated == 0:
        before = a.num_generated
        engine.step()
        steps += 1
        assert a.num_generated > before or a.finished
    assert steps == math.ceil(300 / 64) * model.args.n_layers
    while engine.has_work:
        engine.step()
    assert a.output_ids == plain_generate(model, short, GREEDY)
    assert b.output_ids == plain_generate(model, long, params)


def test_short_prompts_admitted_together_share_one_prefill_forward(any_chunk_target, monkeypatch):
    """Where chunks may have any size, the prompts a step prefills go through one forward (not one each), and every
    output still equals plain decoding's (which prefills each prompt alone)."""
    model, vocab = any_chunk_target, any_chunk_target.args.vocab_size
    prompts = [prompt(vocab, n, 20 + n) for n in (9, 35, 50, 20)]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    config = EngineConfig(max_batch=4, max_context=512, controller=free_tokens_curve())
    engine = SpecEngine(model, SuffixDrafter(max_depth=6), config)
    forwards = []
    staged, stacked = model.staged, model._forward_stacked  # prefill forwards, and the rounds on the kernels
    monkeypatch.setattr(
        model, "staged", lambda segs, cache: forwards.append([len(s.tokens) for s in segs]) or staged(segs, cache)
    )
    monkeypatch.setattr(
        model,
        "_forward_stacked",
        lambda ops, segs, cache: forwards.append([len(s.tokens) for s in segs]) or stacked(ops, segs, cache),
    )
    seqs = [engine.add_request(p, params) for p in prompts]
    engine.step()
    assert all(s.num_generated >= 1 for s in seqs)  # every prompt's first token in the first step
    prefills = [f for f in forwards if sorted(f) == sorted(len(p) for p in prompts)]
    assert len(prefills) == 1 and len(forwards) == 2  # one prefill forward, one round of the four
    while engine.has_work:
        engine.step()
    for p, s in zip(prompts, seqs, strict=True):
        assert s.output_ids == plain_generate(model, p, params)


@pytest.mark.parametrize("drafter", [None, "suffix"])
def test_questions_about_one_document_decode_together_reading_it_once(tiny_target, drafter, monkeypatch):
    """Questions about a long document sent once its first request decodes copy its K/V from that slot, and their
    decode steps (or verify passes) read the copied prefix's whole attention chunks once for all of them
    (`layer_stack`'s groups); every output equals plain decoding's."""
    vocab = tiny_target.args.vocab_size
    doc = prompt(vocab, 900, seed=11)
    asks = [doc + prompt(vocab, 6, seed=12 + i) for i in range(3)]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    engine = SpecEngine(
        tiny_target, SuffixDrafter(max_depth=6) if drafter else None, EngineConfig(max_batch=4, max_context=1024)
    )
    grouped = []
    shared = llama._shared_prefixes

    def spy(*a):
        groups, keys = shared(*a)
        grouped.append(sum(g != i for i, g in enumerate(groups)))
        return groups, keys

    monkeypatch.setattr(llama, "_shared_prefixes", spy)
    first = engine.add_request(asks[0], params)
    while not engine.running:
        engine.step()
    rest = [engine.add_request(p, params) for p in asks[1:]]
    while engine.has_work:
        engine.step()
    copied = [s.stats.live_prefix_tokens for s in rest]
    assert copied[0] == copied[1] >= 512
    assert max(grouped) == 2  # both copies joined the first request's group
    for s, p in zip([first, *rest], asks, strict=True):
        assert s.output_ids == plain_generate(tiny_target, p, params)
