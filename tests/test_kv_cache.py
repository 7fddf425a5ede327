"""KVCache: slot allocation and reuse, writes, commit of accepted tree paths, truncation, zero-copy views."""

from __future__ import annotations

import resource

import pytest
import torch
from torch.overrides import TorchFunctionMode

from spyglass.kv_cache import CacheFullError, KVCache

LAYERS, HEADS, DIM, CAP = 3, 2, 4, 24


def make_cache(capacity: int = CAP, max_slots: int = 2) -> KVCache:
    return KVCache(LAYERS, HEADS, DIM, capacity, max_slots)


def write_all_layers(cache: KVCache, slot: int, start: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Write `n` distinct random entries at `start` in every layer; return them as `[layers, heads, n, dim]`."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(LAYERS, HEADS, n, DIM, generator=g)
    v = torch.randn(LAYERS, HEADS, n, DIM, generator=g)
    for layer in range(LAYERS):
        cache.write(slot, layer, start, k[layer], v[layer])
    return k, v


def committed(cache: KVCache, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The committed K and V of every layer, stacked as `[layers, heads, length, dim]` (copies)."""
    ks, vs = zip(*(cache.prefix(slot, layer) for layer in range(LAYERS)), strict=True)
    return torch.stack(ks).clone(), torch.stack(vs).clone()


class CountSetitem(TorchFunctionMode):
    """Counts tensor writes through indexing (`t[...] = x`) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__setitem__:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def cache_with_prefix() -> tuple[KVCache, int, torch.Tensor, torch.Tensor]:
    """A slot with 5 committed tokens."""
    cache = make_cache()
    slot = cache.allocate()
    k, v = write_all_layers(cache, slot, 0, 5, seed=1)
    cache.commit(slot, 0, list(range(5)))
    return cache, slot, k, v


def test_commit_chain_keeps_entries_in_place(cache_with_prefix) -> None:
    cache, slot, pk, pv = cache_with_prefix
    tk, tv = write_all_layers(cache, slot, 5, 4, seed=2)
    with CountSetitem() as mode:
        cache.commit(slot, 5, [0, 1, 2])
    assert mode.count == 0, "a chain prefix is already in place: commit must not move anything"
    assert cache.lengths[slot] == 8
    k, v = committed(cache, slot)
    assert torch.equal(k, torch.cat([pk, tk[:, :, :3]], dim=2))
    assert torch.equal(v, torch.cat([pv, tv[:, :, :3]], dim=2))


def test_move_counter_sees_a_tree_commit(cache_with_prefix) -> None:
    """Guards the test above: the counter does see the writes of a real move."""
    cache, slot, _, _ = cache_with_prefix
    write_all_layers(cache, slot, 5, 4, seed=2)
    with CountSetitem() as mode:
        cache.commit(slot, 5, [0, 2])
    assert mode.count > 0


@pytest.mark.parametrize(
    "path",
    [
        [0, 2, 5, 6],  # gaps everywhere
        [0, 1, 3, 4],  # a chain prefix, then a gap
        [0, 2, 3],  # overlapping shift: dst 6 <- src 7, dst 7 <- src 8
        [0, 6],
        [0],
    ],
)
def test_commit_tree_path_moves_exactly_those_entries(cache_with_prefix, path: list[int]) -> None:
    cache, slot, pk, pv = cache_with_prefix
    tk, tv = write_all_layers(cache, slot, 5, 7, seed=3)
    cache.commit(slot, 5, path)
    assert cache.lengths[slot] == 5 + len(path)
    k, v = committed(cache, slot)
    assert k.shape == (LAYERS, HEADS, 5 + len(path), DIM)
    for layer in range(LAYERS):
        # the old prefix is untouched, the accepted entries are packed right after it, for K and for V
        assert torch.equal(k[layer, :, :5], pk[layer])
        assert torch.equal(v[layer, :, :5], pv[layer])
        assert torch.equal(k[layer, :, 5:], tk[layer][:, path])
        assert torch.equal(v[layer, :, 5:], tv[layer][:, path])


def test_commit_twice_grows_length(cache_with_prefix) -> None:
    cache, slot, pk, _ = cache_with_prefix
    t1, _ = write_all_layers(cache, slot, 5, 4, seed=4)
    cache.commit(slot, 5, [0, 2])
    t2, _ = write_all_layers(cache, slot, 7, 3, seed=5)
    cache.commit(slot, 7, [0, 1, 2])
    assert cache.lengths[slot] == 10
    k, _ = committed(cache, slot)
    assert torch.equal(k, torch.cat([pk, t1[:, :, [0, 2]], t2], dim=2))


def test_truncate(cache_with_prefix) -> None:
    cache, slot, pk, pv = cache_with_prefix
    cache.truncate(slot, 3)
    assert cache.lengths[slot] == 3
    k, v = committed(cache, slot)
    assert torch.equal(k, pk[:, :, :3]) and torch.equal(v, pv[:, :, :3])
    cache.truncate(slot, 10)  # never grows
    assert cache.lengths[slot] == 3
    cache.truncate(slot, 0)
    assert cache.lengths[slot] == 0
    assert cache.prefix(slot, 0)[0].shape == (HEADS, 0, DIM)


def test_allocate_release_reuse() -> None:
    cache = make_cache(max_slots=2)
    assert cache.free_slots == 2
    a, b = cache.allocate(), cache.allocate()
    assert a != b and {a, b} <= {0, 1}
    assert cache.free_slots == 0
    write_all_layers(cache, a, 0, 4, seed=6)
    cache.commit(a, 0, [0, 1, 2, 3])
    storage = cache.layer(a, 0)[0].data_ptr()
    cache.release(a)
    cache.release(a)  # idempotent
    assert cache.free_slots == 1
    again = cache.allocate()
    assert again == a
    assert cache.lengths[again] == 0
    assert cache.layer(again, 0)[0].data_ptr() == storage, "a released slot's buffers are reused"
    assert cache.free_slots == 0


def test_cache_full_when_slots_run_out() -> None:
    cache = make_cache(max_slots=2)
    cache.allocate()
    cache.allocate()
    with pytest.raises(CacheFullError):
        cache.allocate()


def test_cache_full_when_writing_past_capacity() -> None:
    cache = make_cache(capacity=8)
    slot = cache.allocate()
    write_all_layers(cache, slot, 5, 3, seed=7)  # fills exactly up to the capacity
    with pytest.raises(CacheFullError):
        write_all_layers(cache, slot, 6, 3, seed=8)
    with pytest.raises(CacheFullError):
        write_all_layers(cache, slot, 0, 9, seed=9)


def test_prefix_returns_views() -> None:
    cache = make_cache()
    slot = cache.allocate()
    write_all_layers(cache, slot, 0, 6, seed=10)
    cache.commit(slot, 0, list(range(6)))
    for layer in range(LAYERS):
        k, v = cache.prefix(slot, layer)
        full_k, full_v = cache.layer(slot, layer)
        assert k.shape == v.shape == (HEADS, 6, DIM)
        assert k.untyped_storage().data_ptr() == full_k.untyped_storage().data_ptr()
        assert v.untyped_storage().data_ptr() == full_v.untyped_storage().data_ptr()
        assert k.data_ptr() == full_k.data_ptr() and v.data_ptr() == full_v.data_ptr()
        # a write through the cache is visible in a view taken earlier
        cache.write(slot, layer, 2, torch.full((HEADS, 1, DIM), 7.0), torch.full((HEADS, 1, DIM), -7.0))
        assert torch.all(k[:, 2] == 7.0) and torch.all(v[:, 2] == -7.0)


def test_slot_bytes() -> None:
    cache = KVCache(2, 3, 8, 16, 1, dtype=torch.float16)
    assert cache.slot_bytes() == 2 * 2 * 3 * 16 * 8 * 2


def test_a_released_slot_keeps_its_prefix_until_it_is_needed():
    cache = make_cache(max_slots=3)
    a, b, c = cache.allocate(), cache.allocate(), cache.allocate()
    for slot, seed in ((a, 1), (b, 2)):
        write_all_layers(cache, slot, 0, 6, seed)
        cache.lengths[slot] = 6
    cache.release(a, keep=torch.arange(6))
    cache.release(b, keep=torch.arange(6, 12))
    cache.release(c)  # keeps nothing
    cache.release(b, keep=torch.arange(3))  # released twice: the first keep stands
    assert list(cache.kept) == [a, b] and cache.kept[b].tolist() == list(range(6, 12))
    assert cache.allocate() == c  # a slot that keeps nothing first
    assert cache.allocate() == a and list(cache.kept) == [b]  # then the one kept longest ago, its K/V dropped
    cache.release(a)
    assert cache.allocate(b) == b and cache.kept == {} and cache.lengths[b] == 0  # taken as it is
    with pytest.raises(ValueError, match="not free"):
        cache.allocate(b)
    cache.release(b, keep=torch.arange(7))  # more tokens than it committed (0 now): nothing kept
    assert cache.kept == {}


def test_a_kept_slot_taken_back_holds_the_same_k_v():
    cache = make_cache()
    slot = cache.allocate()
    write_all_layers(cache, slot, 0, 8, seed=3)
    cache.lengths[slot] = 8
    k, v = committed(cache, slot)
    cache.release(slot, keep=torch.arange(8))
    assert cache.allocate(slot) == slot
    cache.lengths[slot] = 5
    k2, v2 = committed(cache, slot)
    assert torch.equal(k2, k[:, :, :5]) and torch.equal(v2, v[:, :, :5])


def test_new_prompts_keep_the_earlier_prefixes_while_a_free_slot_keeps_nothing():
    """One prompt after another: each takes a free slot that keeps nothing (a used one first) while there is one, so
    the earlier prompts' K/V stay kept; then the one kept longest ago is dropped."""
    cache = make_cache(max_slots=4)
    taken = []
    for i in range(5):
        slot = cache.allocate()
        taken.append(slot)
        cache.lengths[slot] = 3
        cache.release(slot, keep=torch.full((3,), i) if i != 1 else None)  # the second keeps nothing
    assert taken == [0, 1, 1, 2, 3]  # the used slot that keeps nothing before a fresh one
    assert [int(t[0]) for t in cache.kept.values()] == [0, 2, 3, 4]
    assert cache.allocate() == 0 and [int(t[0]) for t in cache.kept.values()] == [2, 3, 4]


def faults_writing(cache: KVCache) -> int:
    """Minor page faults of this process while every entry of the pool is written."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for t in cache.all_layers():
        t.fill_(1.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_reserve_makes_every_slot_resident_and_used():
    """`torch.empty` only maps the pool, so its first writes fault its pages in; after `reserve` they are resident
    (writing the whole pool faults almost nothing in: a pool that was not reserved faults once per page, unless the
    allocator handed back pages already resident), and every slot counts as used, so allocation keeps its order."""
    reserved = KVCache(4, 2, 64, 8192, 4)  # K and V 64 MiB each
    reserved.reserve()
    assert torch.count_nonzero(reserved.all_layers()[0]) == 0
    assert faults_writing(reserved) < reserved.nbytes // 4096 // 10
    assert [reserved.allocate() for _ in range(4)] == [0, 1, 2, 3]


def test_slots_know_the_prefixes_they_hold_alike():
    """`same_prefix`: a prefix copied from one slot to others is the same K/V in each (and between the copies),
    until a slot is written below it, truncated, released or allocated again."""
    cache = make_cache(max_slots=4)
    a, b, c, d = (cache.allocate() for _ in range(4))
    write_all_layers(cache, a, 0, 20, seed=1)
    cache.lengths[a] = 20
    cache.copy_prefix(a, b, 16)
    cache.copy_prefix(b, c, 12)
    assert [cache.same_prefix(x, y) for x, y in ((a, b), (b, a), (a, c), (b, c))] == [16, 16, 12, 12]
    assert cache.same_prefix(a, d) == 0 and cache.same_prefix(a, a) == 0
    k_a, k_c = (committed(cache, s)[0] for s in (a, c))
    assert torch.equal(k_a[:, :, :12], k_c)
    write_all_layers(cache, b, 10, 2, seed=2)  # b written below what it shared
    assert (cache.same_prefix(a, b), cache.same_prefix(b, c), cache.same_prefix(a, c)) == (10, 10, 12)
    cache.commit(c, 8, [0])
    assert cache.same_prefix(a, c) == 8
    cache.truncate(a, 5)
    assert (cache.same_prefix(a, b), cache.same_prefix(a, c), cache.same_prefix(b, c)) == (5, 5, 8)
    cache.release(b)
    assert cache.same_prefix(a, b) == cache.same_prefix(c, b) == 0 and cache.same_prefix(a, c) == 5
    cache.copy_prefix(c, d, 8)
    cache.copy_prefix(a, d, 3)  # d's earlier copy is gone: only what it now holds of a (and a of c) counts
    assert (cache.same_prefix(d, a), cache.same_prefix(d, c)) == (3, 3)
    with pytest.raises(ValueError, match="onto itself"):
        cache.copy_prefix(a, a, 2)
