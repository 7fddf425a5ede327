"""Redis-backed store of prefix KV blocks, shared by the verifier's prefill and training extraction.

A block holds the K/V of `block_size` tokens for every layer. Its key chains the hash of the whole
token prefix up to the block's end, under a namespace (model id, dtype, position scheme), so a
block is only ever reused after exactly the same tokens. Values use a small typed binary format
with a CRC32 (no pickle). A miss, a corrupt value or any Redis failure only costs recomputation.
The total size is bounded: the oldest blocks are evicted first.

Writes go through a writer thread (the engine loop only copies the blocks out of its KV pool). The cache
knows which blocks are queued or being written, so a request that arrives right after another with the same
prefix can wait for them (`writing`, and `lookup` waits up to `write_wait_s`) instead of recomputing what
is about to be stored.

A block may be stored only once prompts have held it `min_uses` times (counted in Redis, so on any replica, for
`USES_TTL_S`): a prompt seen once costs no write (~300 MB for a 6.7K-token fp32 prompt, which on a 2-core machine
slows the engine beside the writer by about a second), while a prefix that comes back is stored the second time.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import struct
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

MAGIC = b"SPKV"
VERSION = 1
_HEADER = struct.Struct("<4sHBB")  # magic, version, dtype code, ndim
_TAIL = struct.Struct("<QI")  # after the shape: payload bytes, its CRC32
_DTYPES = {0: torch.float32, 1: torch.bfloat16, 2: torch.float16}
_CODES = {v: k for k, v in _DTYPES.items()}
USES_TTL_S = 3600  # how long a block's count of uses lasts (`ContextCache.min_uses`)


def kv_namespace(model_id: str, dtype: torch.dtype | str) -> str:
    """The namespace of a model's blocks in one K/V dtype: blocks hold the K/V dtype's own bytes (bf16: half of
    fp32's), and a cache written in one dtype is never read in another (`load_blocks_into_cache` refuses a block
    of another dtype besides)."""
    name = str(dtype).removeprefix("torch.")
    if not isinstance(getattr(torch, name, None), torch.dtype):
        raise ValueError(f"not a dtype: {dtype!r}")
    return f"{model_id}:{name}"


class FormatError(ValueError):
    """A stored value that is not a valid block (wrong magic/version, truncated, checksum mismatch)."""


def encode_tensor(t: torch.Tensor | tuple[torch.Tensor, ...]) -> bytearray:
    """The block's value: header, shape, payload length and CRC32, then the tensor's bytes, copied once. `t` may be
    a strided view, or a tuple of same-shaped parts stored as their stack (a block's K and V in the KV pool)."""
    parts = [p.detach().cpu() for p in (t if isinstance(t, tuple) else (t,))]
    dtype, shape = parts[0].dtype, tuple(parts[0].shape)
    if any(p.dtype != dtype or tuple(p.shape) != shape for p in parts):
        raise ValueError("a block's parts must share one dtype and shape")
    if isinstance(t, tuple):
        shape = (len(parts), *shape)
    part_bytes = parts[0].numel() * parts[0].element_size()
    head = _HEADER.size + 4 * len(shape) + _TAIL.size
    out = bytearray(head + part_bytes * len(parts))
    for i, part in enumerate(parts if part_bytes else []):
        # numpy's copy: one thread (a torch copy here would start a thread team beside the engine's)
        src = (part if part.dim() else part.reshape(1)).view(torch.uint8).numpy()
        dst = np.frombuffer(out, dtype=np.uint8, count=part_bytes, offset=head + i * part_bytes)
        dst.reshape(src.shape)[...] = src
    _HEADER.pack_into(out, 0, MAGIC, VERSION, _CODES[dtype], len(shape))
    struct.pack_into(f"<{len(shape)}I", out, _HEADER.size, *shape)
    _TAIL.pack_into(out, head - _TAIL.size, len(out) - head, zlib.crc32(memoryview(out)[head:]))
    return out


def decode_tensor(buf: bytes) -> torch.Tensor:
    if len(buf) < _HEADER.size:
        raise FormatError("value too short for a header")
    magic, version, code, ndim = _HEADER.unpack_from(buf)
    if magic != MAGIC or version != VERSION or code not in _DTYPES:
        raise FormatError(f"bad header (magic {magic!r}, version {version}, dtype code {code})")
    off = _HEADER.size
    dims = struct.unpack_from(f"<{ndim}I", buf, off)
    off += 4 * ndim
    length, crc = _TAIL.unpack_from(buf, off)
    payload = memoryview(buf)[off + _TAIL.size :]
    if len(payload) != length or zlib.crc32(payload) != crc:
        raise FormatError("payload truncated or checksum mismatch")
    if not length:
        return torch.empty(dims, dtype=_DTYPES[code])
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(_DTYPES[code]).reshape(dims)


Block = torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # a block's K/V stacked, or its K and its V


class PendingCopy:
    """Blocks handed to the writer as views of memory their owner will reuse (a KV slot). The writer encodes them
    in order through `encode`; the owner calls `release` before it reuses the memory, which copies the blocks not
    encoded yet (after the one being encoded, if any), so the writer goes on from those copies: nothing is lost and
    the owner never waits for the writer's Redis round trips. The time `release` spends copying goes to
    `stats.copy_s`."""

    def __init__(self, blocks: list[Block], stats: CacheStats) -> None:
        self._blocks = blocks
        self._stats = stats
        self._next = 0  # blocks before it are encoded (or skipped) and need no copy
        self._lock = threading.Lock()  # held while a block is encoded or copied

    def encode(self, i: int) -> bytearray:
        with self._lock:
            self._next = i + 1
            return encode_tensor(self._blocks[i])

    def skip(self, i: int) -> None:
        """Block i will not be encoded (stored already, or not used often enough): `release` need not copy it."""
        with self._lock:
            self._next = max(self._next, i + 1)

    def release(self) -> int:
        """Copy the blocks the writer has not encoded yet; returns how many it copied."""
        t0 = time.perf_counter()
        with self._lock:
            rest = range(self._next, len(self._blocks))
            for i in rest:
                block = self._blocks[i]
                self._blocks[i] = tuple(p.clone() for p in block) if isinstance(block, tuple) else block.clone()
            self._next = len(self._blocks)
        if rest:
            self._stats.copy_s += time.perf_counter() - t0
        return len(rest)


@dataclass
class CacheStats:
    hits: int = 0  # blocks read
    misses: int = 0  # lookups that stopped at a missing block
    hit_tokens: int = 0
    stored_blocks: int = 0
    errors: int = 0
    evicted_blocks: int = 0
    write_s: float = 0.0  # the writer's time (encoding, checksums, Redis round trips, not its pauses): off the loop
    copy_s: float = 0.0  # the engine loop's time copying, before it reuses a slot, the blocks the writer has not yet
    wait_s: float = 0.0  # lookups' time waiting for blocks still being written


@dataclass
class ContextCache:
    """Prefix-block store. `url=None` disables it (every lookup misses, nothing is stored), unless `client` gives a
    store with redis-py's interface (bench/gpu_check.py's in-process one, where there is no Redis)."""

    url: str | None
    namespace: str
    block_size: int = 256
    max_bytes: int = 4 << 30
    async_writes: bool = True
    write_wait_s: float = 30.0  # longest a lookup waits for its prefix's blocks still being written
    min_uses: int = 1  # prompts that must have held a block before it is stored (the verifier's default: 2)
    # The most of its time the writer works: after each block it pauses (1 / share - 1) times as long as the block
    # took, so that its work (the block's copy, checksum and Redis write) comes between the engine's steps in small
    # pieces instead of taking a core from a step's threads for the whole prompt at once. 1.0: no pause.
    write_share: float = 0.5
    stats: CacheStats = field(default_factory=CacheStats)
    client: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.min_uses, bool) or not isinstance(self.min_uses, int) or self.min_uses < 1:
            raise ValueError(f"min_uses must be an integer >= 1, got {self.min_uses!r}")
        if not 0 < self.write_share <= 1:
            raise ValueError(f"write_share must be in (0, 1], got {self.write_share!r}")
        self._redis = self.client
        if self.url:
            import redis  # only a cache on a Redis URL needs it: the core runs without redis (tests/test_core_imports)

            self._redis = redis.Redis.from_url(self.url, socket_timeout=5.0, socket_connect_timeout=2.0)
        self._queue: queue.Queue | None = None
        self._pending: dict[str, int] = {}  # key -> queued writes of it not yet done
        self._written = threading.Condition()
        self._prefix = f"spyglass:ctx:{self.namespace}"

    # --- keys ----------------------------------------------------------------------------------
    def block_keys(self, tokens: torch.Tensor | list[int], n_blocks: int | None = None) -> list[str]:
        """Chained keys: key i covers tokens [0, (i+1) * block_size)."""
        ids = torch.as_tensor(tokens, dtype=torch.int64)
        total = ids.shape[0] // self.block_size if n_blocks is None else n_blocks
        keys, h = [], hashlib.sha256(self.namespace.encode())
        for i in range(total):
            block = ids[i * self.block_size : (i + 1) * self.block_size]
            h.update(block.numpy().tobytes())
            keys.append(f"{self._prefix}:{h.copy().hexdigest()[:40]}")
        return keys

    # --- read ----------------------------------------------------------------------------------
    def _lookup_keys(self, tokens: torch.Tensor | list[int], max_tokens: int | None) -> list[str]:
        limit = len(tokens) if max_tokens is None else min(max_tokens, len(tokens))
        return self.block_keys(tokens[:limit], limit // self.block_size)

    def writing(self, tokens: torch.Tensor | list[int], max_tokens: int | None = None) -> bool:
        """Whether some block a lookup of `tokens` would read is queued or being written."""
        if self._redis is None or not self._pending:
            return False
        keys = self._lookup_keys(tokens, max_tokens)
        with self._written:
            return any(k in self._pending for k in keys)

    def lookup(self, tokens: torch.Tensor | list[int], max_tokens: int | None = None) -> list[torch.Tensor]:
        """The longest run of cached blocks from the start of `tokens` (at most `max_tokens` tokens), after the
        writes of those blocks still queued have been done (waiting `write_wait_s` at most)."""
        if self._redis is None:
            return []
        keys = self._lookup_keys(tokens, max_tokens)
        if not keys:
            return []
        if self._pending:
            t0 = time.perf_counter()
            with self._written:
                self._written.wait_for(lambda: not any(k in self._pending for k in keys), self.write_wait_s)
            self.stats.wait_s += time.perf_counter() - t0
        blocks: list[torch.Tensor] = []
        try:
            pipe = self._redis.pipeline(transaction=False)
            for k in keys:
                pipe.exists(k)
            flags = pipe.execute()
            n = next((i for i, f in enumerate(flags) if not f), len(keys))
            for k in keys[:n]:
                raw = self._redis.get(k)
                if raw is None:
                    break
                try:
                    blocks.append(decode_tensor(raw))
                except FormatError as e:
                    # drop it, so the next prefill of this prefix stores a good copy (stores skip existing keys)
                    log.warning("context cache: corrupt block %s ignored and deleted (%s)", k, e)
                    self.stats.errors += 1
                    self._drop(k, len(raw))
                    break
                self._redis.zadd(self._index_key, {k: time.time()})
        except Exception as e:  # noqa: BLE001 - any Redis failure is a miss
            log.warning("context cache unavailable, recomputing: %s", e)
            self.stats.errors += 1
        if len(blocks) < len(keys):
            self.stats.misses += 1
        self.stats.hits += len(blocks)
        self.stats.hit_tokens += len(blocks) * self.block_size
        return blocks

    def _drop(self, key: str, size: int) -> None:
        pipe = self._redis.pipeline(transaction=False)
        pipe.delete(key)
        pipe.zrem(self._index_key, key)
        pipe.decrby("spyglass:ctx-bytes", size)
        pipe.execute()

    # --- write ---------------------------------------------------------------------------------
    def store(self, tokens: torch.Tensor | list[int], blocks: dict[int, Block]) -> PendingCopy | None:
        """Store block tensors by block index. With asynchronous writes the blocks may be views of memory the
        caller reuses later (the slot's K/V in its KV pool): the writer copies each into its value, and the caller
        calls `release()` on the returned `PendingCopy` before it changes that memory. None: nothing to release."""
        if self._redis is None or not blocks:
            return None
        order = sorted(blocks)
        chained = self.block_keys(tokens, order[-1] + 1)
        keys = [chained[i] for i in order]
        pending = PendingCopy([blocks[i] for i in order], self.stats)
        if not self.async_writes:
            self._write(keys, pending)
            return None
        with self._written:
            for key in keys:
                self._pending[key] = self._pending.get(key, 0) + 1
        self._writer().put((keys, pending))
        return pending

    def flush(self, timeout: float = 30.0) -> None:
        """Wait for queued asynchronous writes (tests, shutdown)."""
        with self._written:
            self._written.wait_for(lambda: not self._pending, timeout)

    @property
    def _index_key(self) -> str:
        return "spyglass:ctx-index"

    def _writer(self) -> queue.Queue:
        if self._queue is None:
            self._queue = queue.Queue(maxsize=64)
            threading.Thread(target=self._drain, name="context-cache-writer", daemon=True).start()
        return self._queue

    def _drain(self) -> None:
        while True:
            keys, pending = self._queue.get()
            try:
                self._write(keys, pending)
            finally:
                with self._written:
                    for key in keys:
                        left = self._pending.pop(key) - 1
                        if left:
                            self._pending[key] = left
                    self._written.notify_all()
                self._queue.task_done()

    def _write(self, keys: list[str], blocks: PendingCopy) -> None:
        """Store the blocks not stored yet (block i under keys[i]), each encoded right before it is sent; written
        asynchronously, pausing after each block and at the end (`write_share`)."""
        t0 = since = time.perf_counter()
        paused = 0.0

        def pace() -> None:  # pause for the work since the last pause, as `write_share` asks
            nonlocal since, paused
            now = time.perf_counter()
            if self.async_writes and self.write_share < 1:
                time.sleep((now - since) * (1 / self.write_share - 1))
                paused += time.perf_counter() - now
            since = time.perf_counter()

        try:
            pipe = self._redis.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            if self.min_uses > 1:
                for key in keys:
                    pipe.incr(f"{key}:uses")
                    pipe.expire(f"{key}:uses", USES_TTL_S)
            found = pipe.execute()
            stored, uses = found[: len(keys)], found[len(keys) :: 2]  # uses: the counts after this one, if counted
            for i, key in enumerate(keys):
                if stored[i] or (uses and uses[i] < self.min_uses):
                    blocks.skip(i)
                    continue
                value = blocks.encode(i)
                pipe = self._redis.pipeline(transaction=False)
                pipe.set(key, value)
                pipe.zadd(self._index_key, {key: time.time()})
                pipe.incrby("spyglass:ctx-bytes", len(value))
                pipe.execute()
                self.stats.stored_blocks += 1
                pace()
            self._evict()
            pace()
        except Exception as e:  # noqa: BLE001 - a failed store only costs a later recomputation
            log.warning("context cache store failed: %s", e)
            self.stats.errors += 1
        finally:
            self.stats.write_s += time.perf_counter() - t0 - paused

    def _evict(self) -> None:
        used = int(self._redis.get("spyglass:ctx-bytes") or 0)
        while used > self.max_bytes:
            oldest = self._redis.zpopmin(self._index_key, 1)
            if not oldest:
                self._redis.set("spyglass:ctx-bytes", 0)
                return
            for key, _ in oldest:
                size = self._redis.strlen(key)
                self._redis.delete(key)
                used = self._redis.decrby("spyglass:ctx-bytes", size)
                self.stats.evicted_blocks += 1


def kv_blocks_from_cache(kv, slot: int, first_block: int, last_block: int, block_size: int) -> dict[int, Block]:
    """Blocks [first, last) of a KVCache slot as views (K, V), each `[layers, kv_heads, block, head_dim]`: no copy
    (the writer copies them into their values; `ContextCache.store` says how long they must stay unchanged)."""
    return {b: kv.span_views(slot, b * block_size, (b + 1) * block_size) for b in range(first_block, last_block)}


def load_blocks_into_cache(kv, slot: int, blocks: list[torch.Tensor], block_size: int) -> int:
    """Write looked-up blocks at the start of a slot and commit them; returns the tokens loaded."""
    expected = (2, kv.n_layers, kv.n_kv_heads, block_size, kv.head_dim)
    loaded = 0
    for block in blocks:
        if tuple(block.shape) != expected or block.dtype != kv.dtype:
            log.warning("context cache: block %s/%s does not fit %s", tuple(block.shape), block.dtype, expected)
            break
        kv.write_span(slot, loaded, block)
        loaded += block_size
    kv.lengths[slot] = loaded
    return loaded
