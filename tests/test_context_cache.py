"""Context cache on a real redis-server: format, prefix reuse through the engine, failure as a miss."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import redis
import torch

from spyglass.context_cache import (
    ContextCache,
    FormatError,
    decode_tensor,
    encode_tensor,
    kv_blocks_from_cache,
    kv_namespace,
)
from spyglass.engine import EngineConfig, SpecEngine, plain_generate
from spyglass.models.llama import load_transformer
from spyglass.sampling import SamplingParams
from tests.redis_server import RedisServer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_roundtrip_and_corruption(dtype):
    t = torch.randn(2, 3, 4, 5).to(dtype)
    buf = encode_tensor(t)
    assert torch.equal(decode_tensor(buf), t)
    with pytest.raises(FormatError):
        decode_tensor(buf[:-3])
    flipped = bytearray(buf)
    flipped[-1] ^= 0xFF
    with pytest.raises(FormatError, match="checksum"):
        decode_tensor(bytes(flipped))
    with pytest.raises(FormatError):
        decode_tensor(b"PKL!" + buf[4:])


def test_keys_chain_the_whole_prefix():
    cc = ContextCache(None, "m", block_size=4)
    a = cc.block_keys(list(range(12)))
    b = cc.block_keys([99] + list(range(1, 12)))
    assert len(a) == 3 and len(set(a)) == 3
    assert all(x != y for x, y in zip(a, b, strict=True))  # a change in block 0 changes every later key
    assert cc.block_keys(list(range(12)))[:2] == cc.block_keys(list(range(9)))[:2]
    assert ContextCache(None, "other", block_size=4).block_keys(list(range(12)))[0] != a[0]


def test_engine_reuses_cached_prefix(tiny_target, redis_server):
    cc = ContextCache(redis_server.url, f"test-{id(tiny_target)}", block_size=16, async_writes=False)
    prompt = torch.randint(3, tiny_target.args.vocab_size, (75,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    reference = plain_generate(tiny_target, prompt, params)
    outs = []
    for _ in range(2):
        engine = SpecEngine(
            tiny_target, None, EngineConfig(max_batch=2, max_context=256, prefill_chunk=16), context_cache=cc
        )
        (seq,) = engine.run([prompt], params)
        outs.append(seq)
    assert outs[0].stats.cached_prefix_tokens == 0
    assert outs[1].stats.cached_prefix_tokens == 64  # 4 full blocks of 16 (75 tokens, >= 1 left to compute)
    assert cc.stats.hits == 4 and cc.stats.stored_blocks == 4
    assert outs[0].output_ids == outs[1].output_ids == reference


def test_hidden_state_drafter_prefills_whole_prompt_and_stores_it(tiny_target, redis_server):
    """The cache holds K/V only: a drafter that reads the prompt's hidden states (TokenSwift) gets its whole prompt
    prefilled on a hit too (the same context as on a miss), while a plain request in the same engine reuses it."""
    from spyglass.drafters.tokenswift import build_tokenswift

    cc = ContextCache(redis_server.url, f"hidden-{id(tiny_target)}", block_size=16, async_writes=False)
    prompt = torch.randint(3, tiny_target.args.vocab_size, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    drafters = {"tokenswift": build_tokenswift(tiny_target, "untrained", budget=20, sinks=4), "ar": None}
    engine = SpecEngine(
        tiny_target,
        config=EngineConfig(max_batch=2, max_context=256, prefill_chunk=16),
        context_cache=cc,
        drafters=drafters,
    )
    (first,) = engine.run([prompt], params, method="tokenswift")
    assert first.stats.cached_prefix_tokens == 0 and cc.stats.stored_blocks == 4  # stored for the other methods
    (again,) = engine.run([prompt], params, method="tokenswift")
    assert again.stats.cached_prefix_tokens == 0  # a hit is not used: its hidden states are not cached
    engine.cache.kept.clear()  # the store's blocks, not a released slot's K/V
    (plain,) = engine.run([prompt], params, method="ar")
    assert plain.stats.cached_prefix_tokens == 64
    assert first.output_ids == again.output_ids == plain.output_ids == plain_generate(tiny_target, prompt, params)


def test_newest_hidden_drafter_uses_a_hit(tiny_target, redis_server):
    """A LongSpec draft fed the target's hidden state keeps only the newest committed token's: on a hit the computed
    tail ends with the prompt's last token, so the hit is used and the draft starts from the same vector."""
    from spyglass.drafters.longspec import LongSpecDrafter
    from spyglass.models.drafts.longspec import LongSpecDraft

    torch.manual_seed(1)
    draft = LongSpecDraft.from_target(tiny_target, window=16, init_std=0.2, feed_hidden=True).eval()
    torch.nn.init.normal_(draft.hidden_proj.weight, std=0.2)
    drafter = LongSpecDrafter(draft, gamma=3)
    assert drafter.traits.hidden_layers and drafter.traits.newest_hidden_only
    cc = ContextCache(redis_server.url, f"newest-{id(tiny_target)}", block_size=16, async_writes=False)
    prompt = torch.randint(3, tiny_target.args.vocab_size, (70,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    engine = SpecEngine(
        tiny_target, drafter, EngineConfig(max_batch=2, max_context=256, prefill_chunk=16), context_cache=cc
    )
    seen = []
    start = drafter.start
    drafter.start = lambda seq: (start(seq), seen.append(seq.drafter_state.hidden.clone()))
    (miss,) = engine.run([prompt], params)
    engine.cache.kept.clear()  # the store's blocks, not a released slot's K/V
    (hit,) = engine.run([prompt], params)
    assert miss.stats.cached_prefix_tokens == 0 and hit.stats.cached_prefix_tokens == 64
    torch.testing.assert_close(seen[1], seen[0], rtol=1e-5, atol=1e-5)
    assert miss.output_ids == hit.output_ids == plain_generate(tiny_target, prompt, params)


def test_size_limit_evicts_oldest(redis_server):
    cc = ContextCache(redis_server.url, "evict", block_size=4, max_bytes=3000, async_writes=False)
    client = redis.Redis.from_url(redis_server.url)
    client.delete("spyglass:ctx-bytes", "spyglass:ctx-index")
    for i in range(6):
        tokens = [i] * 4
        cc.store(tokens, {0: torch.randn(2, 2, 1, 4, 16)})  # ~1 KB each
    assert cc.stats.evicted_blocks >= 3
    assert int(client.get("spyglass:ctx-bytes")) <= 3000
    assert cc.lookup([5] * 4 + [0]) and not cc.lookup([0] * 4 + [0])  # newest kept, oldest gone


def test_redis_down_is_a_miss(tiny_target, tmp_path):
    server = RedisServer(tmp_path)
    cc = ContextCache(server.url, "down", block_size=8, async_writes=False)
    server.stop()
    prompt = list(range(3, 40))
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    engine = SpecEngine(
        tiny_target, None, EngineConfig(max_batch=1, max_context=128, prefill_chunk=8), context_cache=cc
    )
    (seq,) = engine.run([prompt], params)
    assert seq.output_ids == plain_generate(tiny_target, prompt, params)
    assert seq.stats.cached_prefix_tokens == 0 and cc.stats.errors >= 1


def test_corrupt_block_is_ignored_deleted_and_rewritten(redis_server):
    cc = ContextCache(redis_server.url, "corrupt", block_size=4, async_writes=False)
    client = redis.Redis.from_url(redis_server.url)
    tokens = list(range(12))
    blocks = {i: torch.full((2, 1, 1, 4, 2), float(i)) for i in range(3)}
    cc.store(tokens, blocks)
    keys = cc.block_keys(tokens)
    raw = client.get(keys[1])
    client.set(keys[1], raw[:-1] + bytes([raw[-1] ^ 0xFF]))  # one flipped byte: the checksum catches it
    errors = cc.stats.errors
    got = cc.lookup(tokens)
    assert len(got) == 1 and torch.equal(got[0], blocks[0])  # the good prefix before it is still used
    assert cc.stats.errors == errors + 1 and not client.exists(keys[1])
    cc.store(tokens, blocks)  # the next prefill stores a good copy again
    assert [torch.equal(a, blocks[i]) for i, a in enumerate(cc.lookup(tokens))] == [True] * 3


def test_partial_hit_loads_the_shared_blocks_only(tiny_target, redis_server):
    """A prompt sharing its first 70 tokens with a cached one loads the 4 whole blocks of 16 inside them, computes the
    rest, and decodes as plain decoding does."""
    cc = ContextCache(redis_server.url, f"partial-{id(tiny_target)}", block_size=16, async_writes=False)
    g = torch.Generator().manual_seed(1)
    first = torch.randint(3, tiny_target.args.vocab_size, (100,), generator=g).tolist()
    second = first[:70] + torch.randint(3, tiny_target.args.vocab_size, (40,), generator=g).tolist()
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    config = EngineConfig(max_batch=1, max_context=256, prefill_chunk=16)
    SpecEngine(tiny_target, None, config, context_cache=cc).run([first], params)
    misses = cc.stats.misses
    (seq,) = SpecEngine(tiny_target, None, config, context_cache=cc).run([second], params)
    assert seq.stats.cached_prefix_tokens == 64 and cc.stats.misses == misses + 1  # stopped at the 5th block
    assert seq.output_ids == plain_generate(tiny_target, second, params)
    assert len(cc.lookup(second)) == 6  # its own blocks were stored after the shared ones: a full hit now


def test_a_hit_loads_any_whole_blocks_where_chunks_may_be_cut(tiny_dir, redis_server):
    """With a row-invariant prefill (`lanes`), a hit is not held to whole 48-token chunks: all 4 shared blocks of 16
    load (a fixed-chunk engine would load 48 tokens), and the output is still plain decoding's."""
    model = load_transformer(tiny_dir["llama"], dtype=torch.bfloat16, linear_backend="prefill:lanes")
    cc = ContextCache(redis_server.url, f"blocks-{id(model)}", block_size=16, async_writes=False)
    g = torch.Generator().manual_seed(2)
    first = torch.randint(3, model.args.vocab_size, (100,), generator=g).tolist()
    second = first[:70] + torch.randint(3, model.args.vocab_size, (40,), generator=g).tolist()
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    config = EngineConfig(max_batch=1, max_context=256, prefill_chunk=48)
    SpecEngine(model, None, config, context_cache=cc).run([first], params)
    engine = SpecEngine(model, None, config, context_cache=cc)
    assert engine.any_chunk and engine._cache_grain(cc) == 16
    (seq,) = engine.run([second], params)
    assert seq.stats.cached_prefix_tokens == 64
    assert seq.output_ids == plain_generate(model, second, params)


def test_eviction_under_the_limit_drops_whole_old_prefixes_first(redis_server):
    """Long prefixes (8 blocks) stored until the limit is passed: the oldest prefix loses its first blocks first, so
    a lookup of it finds nothing (never a gapped prefix), the newest stays whole, the total within the limit."""
    cc = ContextCache(redis_server.url, "evict-long", block_size=4, max_bytes=20_000, async_writes=False)
    client = redis.Redis.from_url(redis_server.url)
    client.delete("spyglass:ctx-bytes", "spyglass:ctx-index")
    prefixes = [[p * 100 + i for i in range(32)] for p in range(3)]
    blocks = {b: torch.randn(2, 2, 1, 4, 16) for b in range(8)}  # ~1 KB each: a prefix is ~8.3 KB
    for tokens in prefixes:
        cc.store(tokens, blocks)
    assert int(client.get("spyglass:ctx-bytes")) <= 20_000 and cc.stats.evicted_blocks >= 4
    assert cc.lookup(prefixes[0]) == []
    newest = cc.lookup(prefixes[2])
    assert len(newest) == 8 and all(torch.equal(a, blocks[b]) for b, a in enumerate(newest))


@pytest.mark.bf16
def test_bf16_blocks_hold_half_the_bytes_and_are_never_read_in_fp32(load_tiny, redis_server):
    """Blocks are the K/V dtype's own bytes: a bf16 block round-trips bitwise with half an fp32 block's payload;
    the namespace carries the dtype, and even under a bf16 namespace an fp32 engine loads none of its blocks."""
    fp32, bf16 = load_tiny("llama", torch.float32), load_tiny("llama", torch.bfloat16)
    prompt = torch.randint(3, fp32.args.vocab_size, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    caches = {
        dt: ContextCache(redis_server.url, kv_namespace(f"dtype-{id(fp32)}", dt), block_size=16, async_writes=False)
        for dt in (torch.float32, torch.bfloat16)
    }
    assert caches[torch.float32].block_keys(prompt) != caches[torch.bfloat16].block_keys(prompt)
    client = redis.Redis.from_url(redis_server.url)
    payload = {}
    for dt, target in ((torch.float32, fp32), (torch.bfloat16, bf16)):
        kv = target.new_cache(64, 1)
        slot = kv.allocate()
        target.prefill(kv, slot, torch.tensor(prompt))
        views = kv_blocks_from_cache(kv, slot, 0, 2, 16)  # (K, V) views of the slot, stored as their stack
        caches[dt].store(prompt, views)
        blocks = {b: torch.stack(kv_pair) for b, kv_pair in views.items()}
        (back, again) = caches[dt].lookup(prompt)
        assert back.dtype == dt and again.dtype == dt
        assert torch.equal(back.view(torch.uint8), blocks[0].view(torch.uint8))  # bitwise
        assert torch.equal(again.view(torch.uint8), blocks[1].view(torch.uint8))
        raw = client.get(caches[dt].block_keys(prompt)[0])
        payload[dt] = len(raw) - len(encode_tensor(blocks[0][:, :, :, :0]))  # the value less its (same-size) header
    assert payload[torch.float32] == 2 * payload[torch.bfloat16] == 2 * blocks[0].numel() * 2
    # an fp32 engine under its own namespace misses, and under the bf16 one refuses the bf16 blocks
    reference = plain_generate(fp32, prompt, params)
    fresh = ContextCache(redis_server.url, kv_namespace(f"fresh-{id(fp32)}", torch.float32), 16, async_writes=False)
    for cache in (fresh, caches[torch.bfloat16]):
        engine = SpecEngine(
            fp32, None, EngineConfig(max_batch=1, max_context=64, prefill_chunk=16), context_cache=cache
        )
        (seq,) = engine.run([prompt], params)
        assert seq.stats.cached_prefix_tokens == 0
        assert seq.output_ids == reference
    # while a bf16 engine reuses its own
    engine = SpecEngine(
        bf16, None, EngineConfig(max_batch=1, max_context=64, prefill_chunk=16), context_cache=caches[torch.bfloat16]
    )
    (seq,) = engine.run([prompt], params)
    assert seq.stats.cached_prefix_tokens == 32
    assert seq.output_ids == plain_generate(bf16, prompt, params)
    with pytest.raises(ValueError, match="not a dtype"):
        kv_namespace("m", "fp16")


class GatedCache(ContextCache):
    """A real cache whose writer waits for `gate`: blocks stay 'being written' until the test opens it."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.gate = threading.Event()

    def _write(self, keys, blocks) -> None:
        self.gate.wait()
        super()._write(keys, blocks)


def test_a_lookup_waits_for_blocks_still_being_written(redis_server):
    cc = GatedCache(redis_server.url, f"gated-{uuid.uuid4().hex}", block_size=4)
    tokens = list(range(3, 23))
    cc.store(tokens, {b: torch.full((2, 1, 1, 4, 2), float(b)) for b in range(5)})
    assert cc.writing(tokens, 19) and not cc.writing(list(range(100, 120)))
    found = []
    reader = threading.Thread(target=lambda: found.extend(cc.lookup(tokens, max_tokens=19)))
    reader.start()
    cc.gate.set()
    reader.join(timeout=30)
    assert [float(b[0, 0, 0, 0, 0]) for b in found] == [0.0, 1.0, 2.0, 3.0]  # every block of the 19-token prefix
    assert not cc.writing(tokens, 19) and cc.stats.stored_blocks == 5 and cc.stats.write_s > 0


def test_a_follow_up_waits_for_its_prefix_while_others_decode_then_loads_all_of_it(tiny_target, redis_server):
    """The first request has finished (its slot is free) and its blocks are still being written: a follow-up with
    the same prompt waits while another stream decodes, then loads the whole prefix from the cache."""
    cc = GatedCache(redis_server.url, f"follow-{uuid.uuid4().hex}", block_size=16)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, tiny_target.args.vocab_size, (75,), generator=g).tolist()
    busy = torch.randint(3, tiny_target.args.vocab_size, (20,), generator=g).tolist()  # shares nothing
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    config = EngineConfig(max_batch=2, max_context=256, prefill_chunk=32)  # a step prefills 4 chunks: all 75 tokens
    engine = SpecEngine(tiny_target, None, config, context_cache=cc)
    first = engine.add_request(prompt, SamplingParams(max_new_tokens=2, ignore_eos=True))
    other = engine.add_request(busy, params)
    while not first.finished:
        engine.step()
    assert cc.writing(prompt, 74) and cc.stats.copy_s > 0  # its 4 full blocks wait for the (gated) writer
    engine.cache.kept.clear()  # its slot reused meanwhile (`test_a_follow_up_takes_the_released_slot`: kept)
    second = engine.add_request(prompt, params)
    before = other.num_generated
    engine.step()
    assert second in engine.waiting and other.num_generated > before  # the other decodes on, the second waits
    cc.gate.set()
    cc.flush()
    engine.step()
    assert second.stats.cached_prefix_tokens == 64 and second.stats.live_prefix_tokens == 0  # all but a partial block
    while engine.has_work:
        engine.step()
    assert second.output_ids == plain_generate(tiny_target, prompt, params)
    assert first.output_ids == plain_generate(tiny_target, prompt, SamplingParams(max_new_tokens=2, ignore_eos=True))


def test_a_follow_up_copies_its_prefix_from_the_slot_that_holds_it(tiny_target, redis_server):
    """While the first request still decodes, a follow-up with the same prompt is admitted at once and copies the
    prompt's K/V from the first one's slot (no wait for the cache's writer, no Redis round trip): whole prefill
    chunks where chunks have a fixed size, any length where they may be cut, >= 1 token left; outputs equal plain
    decoding."""
    cc = GatedCache(redis_server.url, f"live-{uuid.uuid4().hex}", block_size=16)  # never opened: no cache hit
    prompt = torch.randint(3, tiny_target.args.vocab_size, (75,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    engine = SpecEngine(
        tiny_target, None, EngineConfig(max_batch=2, max_context=256, prefill_chunk=32), context_cache=cc
    )
    first = engine.add_request(prompt, params)
    engine.step()
    second = engine.add_request(prompt, params)
    engine.step()
    assert second not in engine.waiting
    copied = 74 if engine.any_chunk else 64
    assert second.stats.live_prefix_tokens == second.stats.cached_prefix_tokens == copied
    while engine.has_work:
        engine.step()
    assert first.output_ids == second.output_ids == plain_generate(tiny_target, prompt, params)
    cc.gate.set()


def test_questions_about_one_document_wait_for_it_then_copy_it(tiny_target, redis_server):
    """Several prompts sharing a long prefix arrive together: the first prefills it, the others wait until it is
    done and copy it from its slot rather than computing it again; every output equals plain decoding."""
    cc = ContextCache(redis_server.url, f"shared-{uuid.uuid4().hex}", block_size=16)
    g = torch.Generator().manual_seed(2)
    doc = torch.randint(3, tiny_target.args.vocab_size, (130,), generator=g).tolist()
    asks = [doc + torch.randint(3, tiny_target.args.vocab_size, (5,), generator=g).tolist() for _ in range(3)]
    other = torch.randint(3, tiny_target.args.vocab_size, (135,), generator=g).tolist()  # shares nothing
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    engine = SpecEngine(
        tiny_target, None, EngineConfig(max_batch=4, max_context=256, prefill_chunk=32), context_cache=cc
    )
    seqs = [engine.add_request(p, params) for p in [*asks, other]]
    engine.step()
    assert list(engine.waiting) == seqs[1:3]  # the unrelated prompt is admitted beside the first
    while engine.has_work:
        engine.step()
    # copied from the first one's slot: the 130 shared tokens, or whole 32-token chunks of them where chunks are fixed
    shared = 130 if engine.any_chunk else 128
    assert [s.stats.cached_prefix_tokens for s in seqs] == [0, shared, shared, 0]
    assert [s.stats.live_prefix_tokens for s in seqs] == [0, shared, shared, 0]
    for s, p in zip(seqs, [*asks, other], strict=True):
        assert s.output_ids == plain_generate(tiny_target, p, params)


def test_blocks_the_writer_has_not_copied_when_their_slot_is_reused_are_stored_as_they_were(tiny_target, redis_server):
    """The engine hands a prompt's blocks to the writer as views of its slot; a request that ends before the writer
    reached them has them copied at its slot's release, so another prompt prefilled into that slot changes nothing
    the cache stores: the blocks equal the first prompt's own K/V bit for bit, and a follow-up loads them and
    decodes as plain decoding does."""
    cc = GatedCache(redis_server.url, f"reuse-{uuid.uuid4().hex}", block_size=16)
    g = torch.Generator().manual_seed(3)
    prompt, other = (torch.randint(3, tiny_target.args.vocab_size, (75,), generator=g).tolist() for _ in range(2))
    engine = SpecEngine(
        tiny_target, None, EngineConfig(max_batch=1, max_context=256, prefill_chunk=32), context_cache=cc
    )
    short = SamplingParams(max_new_tokens=2, ignore_eos=True)
    (first,) = engine.run([prompt], short)
    assert cc.writing(prompt, 74) and cc.stats.copy_s > 0 and not engine._copying  # copied at the release
    (second,) = engine.run([other], short)  # the same slot, now holding another prompt's K/V
    assert second.slot == first.slot
    cc.gate.set()
    cc.flush()
    kv = tiny_target.new_cache(128, 1)
    slot = kv.allocate()
    tiny_target.prefill(kv, slot, torch.tensor(prompt))
    stored = cc.lookup(prompt, 74)
    assert len(stored) == 4
    for b, block in enumerate(stored):
        assert torch.equal(block, kv.read_span(slot, 16 * b, 16 * (b + 1)))
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    (again,) = engine.run([prompt], params)
    assert again.stats.cached_prefix_tokens == 64
    assert again.output_ids == plain_generate(tiny_target, prompt, params)


@pytest.mark.parametrize("with_redis", [False, True])
def test_a_follow_up_takes_the_released_slot(tiny_target, redis_server, with_redis):
    """A request that comes after the first has finished takes the first one's released slot as it is (no copy, no
    Redis: an engine without a context cache does it too); an unrelated prompt that needs the slot drops what it
    kept. Outputs equal plain decoding."""
    cc = ContextCache(redis_server.url, f"kept-{uuid.uuid4().hex}", block_size=16) if with_redis else None
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, tiny_target.args.vocab_size, (75,), generator=g).tolist()
    unrelated = torch.randint(3, tiny_target.args.vocab_size, (40,), generator=g).tolist()
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    engine = SpecEngine(
        tiny_target, None, EngineConfig(max_batch=1, max_context=256, prefill_chunk=32), context_cache=cc
    )
    (first,) = engine.run([prompt], params)
    assert engine.cache.kept[first.slot].tolist() == prompt
    (second,) = engine.run([prompt], params)
    taken = 74 if engine.any_chunk else 64
    assert second.slot == first.slot
    assert second.stats.live_prefix_tokens == second.stats.cached_prefix_tokens == taken
    (other,) = engine.run([unrelated], params)
    assert other.stats.cached_prefix_tokens == 0 and list(engine.cache.kept.values())[0].tolist() == unrelated
    if cc is not None:
        cc.flush()
        assert cc.stats.stored_blocks == 4 + 2  # min_uses 1: each prompt's new blocks on first sight
    (third,) = engine.run([prompt], params)
    assert third.stats.live_prefix_tokens == 0
    assert third.stats.cached_prefix_tokens == (64 if cc is not None else 0)  # from Redis, or computed again
    want = plain_generate(tiny_target, prompt, params)
    assert first.output_ids == second.output_ids == third.output_ids == want
    assert other.output_ids == plain_generate(tiny_target, unrelated, params)


def test_questions_about_several_documents_in_turn_find_each_documents_slot(tiny_target):
    """Questions about three documents in turn, one request at a time: each new document takes a free slot that keeps
    nothing, so the earlier documents' K/V stay kept, and a second question about the first document takes its slot
    as it is. Outputs equal plain decoding."""
    g = torch.Generator().manual_seed(11)
    docs = [torch.randint(3, tiny_target.args.vocab_size, (70,), generator=g).tolist() for _ in range(3)]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    engine = SpecEngine(tiny_target, None, EngineConfig(max_batch=3, max_context=256, prefill_chunk=32))
    firsts = [engine.run([doc + [5]], params)[0] for doc in docs]
    assert len({s.slot for s in firsts}) == 3 and all(s.stats.live_prefix_tokens == 0 for s in firsts)
    (again,) = engine.run([docs[0] + [6, 7]], params)
    assert again.slot == firsts[0].slot
    assert again.stats.live_prefix_tokens == (70 if engine.any_chunk else 64)
    assert again.output_ids == plain_generate(tiny_target, docs[0] + [6, 7], params)
    assert firsts[2].output_ids == plain_generate(tiny_target, docs[2] + [5], params)


def test_min_uses_stores_a_prefix_the_second_time_a_prompt_holds_it(tiny_target, redis_server):
    """With `min_uses` 2 a prompt seen once is not written to Redis; a second prompt holding its blocks (here taken
    from the released slot) stores them, counted across replicas, and a new engine then loads them."""
    ns = f"uses-{uuid.uuid4().hex}"
    cc = ContextCache(redis_server.url, ns, block_size=16, async_writes=False, min_uses=2)
    prompt = torch.randint(3, tiny_target.args.vocab_size, (75,), generator=torch.Generator().manual_seed(8)).tolist()
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    config = EngineConfig(max_batch=2, max_context=256, prefill_chunk=16)
    engine = SpecEngine(tiny_target, None, config, context_cache=cc)
    (first,) = engine.run([prompt], params)
    assert cc.stats.stored_blocks == 0 and not redis.Redis.from_url(redis_server.url).exists(*cc.block_keys(prompt))
    (second,) = engine.run([prompt], params)
    assert second.stats.live_prefix_tokens == (74 if engine.any_chunk else 64)
    assert cc.stats.stored_blocks == 4  # its second use: stored
    other = ContextCache(redis_server.url, ns, block_size=16, async_writes=False, min_uses=2)  # another replica
    (third,) = SpecEngine(tiny_target, None, config, context_cache=other).run([prompt], params)
    assert third.stats.cached_prefix_tokens == 64 and third.stats.live_prefix_tokens == 0
    assert first.output_ids == second.output_ids == third.output_ids == plain_generate(tiny_target, prompt, params)
    # uses are counted per block in Redis: a prompt seen once on each of two replicas is stored by the second
    fresh = torch.randint(3, tiny_target.args.vocab_size, (40,), generator=torch.Generator().manual_seed(9)).tolist()
    blocks = {b: torch.full((2, 1, 1, 16, 2), float(b)) for b in range(2)}
    cc.store(fresh, blocks)
    assert not cc.lookup(fresh)
    other.store(fresh, blocks)
    assert len(cc.lookup(fresh)) == 2


def test_min_uses_must_be_a_positive_integer():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="min_uses"):
            ContextCache(None, "m", min_uses=bad)


def test_write_share_must_be_in_0_1():
    for bad in (0, -0.5, 1.5):
        with pytest.raises(ValueError, match="write_share"):
            ContextCache(None, "m", write_share=bad)


def test_the_writer_pauses_after_each_block_to_keep_its_share_of_the_time(redis_server):
    """The asynchronous writer works at most `write_share` of its time: after a block it pauses (1 / share - 1) times
    as long as the block took, so a prompt's blocks reach Redis in pieces between the engine's steps. Its own time
    (`write_s`) leaves the pauses out; the pauses make the writes' wall time at least write_s / share."""
    share = 0.25
    cc = ContextCache(redis_server.url, f"share-{uuid.uuid4().hex}", block_size=64, write_share=share)
    tokens = list(range(8 * 64))
    blocks = {b: torch.randn(2, 4, 2, 64, 64) for b in range(8)}  # 256 KiB each
    t0 = time.perf_counter()
    cc.store(tokens, blocks)
    cc.flush()
    wall = time.perf_counter() - t0
    assert cc.stats.stored_blocks == 8 and len(cc.lookup(tokens)) == 8
    assert 0 < cc.stats.write_s and wall >= cc.stats.write_s / share
