"""Preallocated per-sequence KV slots with a committed length.

Each slot holds `[layers, kv_heads, capacity, head_dim]` for K and for V, all slots in one tensor so a
batched kernel (flash-attn's kvcache entry point) reads every sequence's prefix in place by slot index.
Tokens of a verify pass (the draft tree) are written right after the committed length; `commit(slot,
start, path)` then moves the accepted entries into place so nothing but accepted tokens is ever kept.

A released slot may keep its prompt's K/V for the next prompt that starts the same way (`release(slot, keep=...)`,
`kept`, `allocate(slot)`: vLLM's in-memory prefix caching, a slot at a time): a new prompt takes a free slot that
keeps nothing (a used one before a fresh one), and drops a kept prefix, the one kept longest ago, only when every free
slot keeps one. A fresh slot's pages fault in as a prefill writes them: ~0.2 s more of the kernel's time for 5.6-6.8K
fp32 tokens than in a used slot, on a 20-27 s prefill (2-core Zen 3 VM, `bench/probes/slot_pages.py`), against a
whole prefill for a prefix dropped and asked for again (several questions about each of several documents in turn).
A served replica makes its whole pool resident when it is built (`reserve`), so none of this happens inside a step.
"""

from __future__ import annotations

import time

import torch

GIB = 1 << 30


class CacheFullError(RuntimeError):
    """Raised when a sequence would exceed its slot's capacity."""


class ContextCapacityError(ValueError):
    """A context capacity the model or the machine cannot hold (the message names the numbers)."""


def kv_bytes_per_token(args, dtype: torch.dtype) -> int:
    """K and V of one token in every layer: 2 x layers x KV heads x head dim x the dtype's size."""
    return 2 * args.n_layers * args.n_kv_heads * args.head_dim * dtype.itemsize


def available_memory(device: str | torch.device = "cpu") -> int:
    """Bytes that can still be allocated: free GPU memory, or the host's MemAvailable."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        import psutil  # comes with Ray, absent from a core-only install: /proc/meminfo then
    except ImportError:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("cannot tell the available memory: no psutil and no MemAvailable in /proc/meminfo") from None
    return int(psutil.virtual_memory().available)


def context_capacity(
    args, requested: int | None = None, *, max_batch: int, dtype: torch.dtype, device: str | torch.device = "cpu"
) -> int:
    """The KV capacity per sequence: the model's own window (`args.max_position`), or `requested` as a cap
    (2..window). Raises ContextCapacityError if it is out of range, or if the K/V of `max_batch` sequences at that
    capacity (every KV slot the caller will allocate) does not fit in the memory available on `device`."""
    window = args.max_position
    if requested is None:
        capacity = window
    elif isinstance(requested, bool) or not isinstance(requested, int) or not 2 <= requested <= window:
        raise ContextCapacityError(
            f"max_context must be an integer in [2, {window}] (the model's context window), got {requested!r}"
        )
    else:
        capacity = requested
    per_token = kv_bytes_per_token(args, dtype)
    need = per_token * capacity * max_batch
    free = available_memory(device)
    if need > free:
        raise ContextCapacityError(
            f"the KV cache of {max_batch} sequence slot(s) x {capacity} tokens needs {need / GIB:.2f} GiB "
            f"({per_token} bytes per token: 2 x {args.n_layers} layers x {args.n_kv_heads} KV heads x "
            f"{args.head_dim} x {dtype.itemsize} bytes) but {free / GIB:.2f} GiB is available: "
            "lower max_context (--max-context), max_batch or the number of methods served"
        )
    return capacity


class KVCache:
    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        capacity: int,
        max_slots: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        self.n_layers = n_layers
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.capacity = capacity
        self.max_slots = max_slots
        self.dtype = dtype
        self.device = torch.device(device)
        # On CPU torch.empty only maps pages, which become resident when written; a GPU reserves it all up front.
        shape = (max_slots, n_layers, n_kv_heads, capacity, head_dim)
        self._k = torch.empty(shape, dtype=dtype, device=self.device)
        self._v = torch.empty(shape, dtype=dtype, device=self.device)
        self.lengths = [0] * max_slots
        self._free = list(range(max_slots - 1, -1, -1))
        self.kept: dict[int, torch.Tensor] = {}  # free slot -> the tokens whose K/V it still holds, oldest first
        self._used: set[int] = set()  # slots allocated before (their pages resident)
        self._views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (slot, layer) -> layer()
        # slot -> {other slot: how many leading positions of both hold the same K/V, bit for bit} (copy_prefix)
        self._same: dict[int, dict[int, int]] = {}

    # --- slot management -------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self, slot: int | None = None) -> int:
        """A free slot with nothing committed: `slot` itself (a kept slot whose K/V the caller reuses, then setting
        `lengths[slot]`); else one that keeps nothing, used before (its pages resident) before fresh; else the one
        kept longest ago (its K/V dropped)."""
        if not self._free:
            raise CacheFullError(f"all {self.max_slots} KV slots are in use")
        if slot is None:
            plain = [s for s in self._free if s not in self.kept]
            warm = [s for s in plain if s in self._used]
            slot = (warm or plain)[-1] if plain else next(iter(self.kept))
        elif slot not in self._free:
            raise ValueError(f"slot {slot} is not free")
        self._free.remove(slot)
        self._used.add(slot)
        self.kept.pop(slot, None)
        self.lengths[slot] = 0
        self.overwrite(slot, 0)
        return slot

    def release(self, slot: int, keep: torch.Tensor | None = None) -> None:
        """Free a slot; `keep`: the tokens at its start whose committed K/V it keeps for a later prompt (`kept`)."""
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} is not in [0, {self.max_slots})")
        if slot in self._free:
            return
        if keep is not None and 0 < len(keep) <= self.lengths[slot]:
            self.kept[slot] = keep
        self.lengths[slot] = 0
        self.overwrite(slot, 0)
        self._free.append(slot)

    def reserve(self) -> float:
        """Make every slot's pages resident now; returns the seconds it took. On the CPU `torch.empty` only maps
        them, and each page would fault in when a prefill or a prefix copy first writes it: a 5.6K-token fp32 prefix
        copied into a fresh slot took 0.10 s against 0.02 s into a used one (2-core Zen 3), inside an engine step
        that other streams wait on. A GPU pool is reserved when allocated."""
        t0 = time.perf_counter()
        if self.device.type == "cpu":
            self._k.zero_()
            self._v.zero_()
            self._used.update(range(self.max_slots))
        return time.perf_counter() - t0

    def slot_bytes(self) -> int:
        return kv_bytes_per_token(self, self.dtype) * self.capacity

    @property
    def nbytes(self) -> int:
        """Bytes of K/V allocated for all slots."""
        return self._k.nbytes + self._v.nbytes

    # --- prefixes held by several slots -------------------------------------------------
    def same_prefix(self, a: int, b: int) -> int:
        """How many leading positions slots `a` and `b` hold with the same K/V, bit for bit, as far as the cache
        knows (one was copied from the other, or both from a third, and neither has been written there since)."""
        return self._same.get(a, {}).get(b, 0)

    def overwrite(self, slot: int, at: int) -> None:
        """Positions from `at` on of `slot` are about to be written: what it shares with other slots ends there."""
        for other, n in list(self._same.get(slot, {}).items()):
            if n > at:
                self._share(slot, other, at)

    def _share(self, a: int, b: int, n: int) -> None:
        for x, y in ((a, b), (b, a)):
            if n > 0:
                self._same.setdefault(x, {})[y] = n
            else:
                self._same.get(x, {}).pop(y, None)

    # --- access ------------------------------------------------------------------------
    def layer(self, slot: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-capacity K and V views `[kv_heads, capacity, head_dim]` of one layer (no copy), made once: a decode
        step asks for every layer's."""
        views = self._views.get((slot, layer))
        if views is None:
            views = self._views[slot, layer] = (self._k[slot][layer], self._v[slot][layer])
        return views

    def all_layers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every slot and layer, `[max_slots, layers, kv_heads, capacity, head_dim]`."""
        return self._k, self._v

    def all_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V views `[max_slots, kv_heads, capacity, head_dim]` of one layer for every slot."""
        return self._k[:, layer], self._v[:, layer]

    def prefix(self, slot: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The committed K and V of one layer, as views."""
        n = self.lengths[slot]
        k, v = self.layer(slot, layer)
        return k[:, :n], v[:, :n]

    def write(self, slot: int, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write `[kv_heads, n, head_dim]` entries at positions start..start+n (after the committed part)."""
        n = k.shape[1]
        if start < 0:
            raise ValueError(f"write position {start} is negative")
        if start + n > self.capacity:
            raise CacheFullError(f"slot {slot}: {start + n} tokens exceed the capacity {self.capacity}")
        self.overwrite(slot, start)
        ck, cv = self.layer(slot, layer)
        ck[:, start : start + n] = k
        cv[:, start : start + n] = v

    def read_span(self, slot: int, lo: int, hi: int) -> torch.Tensor:
        """A copy of positions [lo, hi) of every layer as `[2, layers, kv_heads, hi - lo, head_dim]`."""
        return torch.stack(self.span_views(slot, lo, hi))

    def span_views(self, slot: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [lo, hi) of every layer, K and V, as views `[layers, kv_heads, hi - lo, head_dim]` (no copy)."""
        return self._k[slot][:, :, lo:hi], self._v[slot][:, :, lo:hi]

    def write_span(self, slot: int, lo: int, kv: torch.Tensor) -> None:
        """Inverse of `read_span` (does not change the committed length)."""
        hi = lo + kv.shape[3]
        if hi > self.capacity:
            raise CacheFullError(f"slot {slot}: {hi} tokens exceed the capacity {self.capacity}")
        self.overwrite(slot, lo)
        self._k[slot][:, :, lo:hi] = kv[0]
        self._v[slot][:, :, lo:hi] = kv[1]

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Positions [0, n) of slot `src` into slot `dst`, which then holds n committed tokens (the same K/V as `src`
        there, and as the slots sharing them with `src`: `same_prefix`)."""
        if not 0 <= n <= self.lengths[src]:
            raise ValueError(f"slot {src} holds {self.lengths[src]} committed tokens, not {n}")
        if src == dst:
            raise ValueError(f"slot {src} copied onto itself")
        self.overwrite(dst, 0)
        self._k[dst][:, :, :n] = self._k[src][:, :, :n]
        self._v[dst][:, :, :n] = self._v[src][:, :, :n]
        self.lengths[dst] = n
        for other, m in [(src, n), *self._same.get(src, {}).items()]:
            if other != dst:
                self._share(dst, other, min(n, m))

    def commit(self, slot: int, start: int, path: list[int]) -> None:
        """Keep the tree entries `start + path[j]` as positions `start + j`; the committed length grows."""
        n = len(path)
        self.overwrite(slot, start)
        if path != list(range(n)):  # a chain prefix is already in place
            src = torch.tensor(path, device=self.device) + start
            for cache in (self._k[slot], self._v[slot]):
                cache[:, :, start : start + n] = cache[:, :, src]
        self.lengths[slot] = start + n

    def truncate(self, slot: int, length: int) -> None:
        self.lengths[slot] = min(self.lengths[slot], length)
        self.overwrite(slot, self.lengths[slot])
