"""A partial copy of the target's KV cache, for drafters that run the target itself over a small budget of
context (TokenSwift, StreamingLLM / MagicDec self-speculation).

Per sequence and per (layer, KV head) the partial cache holds `budget` entries, every one an exact copy of a
committed full-cache entry (keys keep the RoPE of their original position, so the order of entries does not
matter to attention), plus scratch slots for the tokens being drafted. Entries [0, sinks) are the first
`sinks` tokens (attention sinks); the rest follow a policy:

- "importance" (TokenSwift): at a rebuild, the other `budget - sinks` entries are the top positions by
  importance = sum over the GQA group of q . k, with q the newest token's query at that layer (its exact query
  over the full cache), chosen independently per layer and KV head and stored in decreasing importance. Newly
  committed tokens overwrite the least important entries (from the end backwards); once `rebuild_every` of them
  have been written (at most budget - sinks, when the next one would reach the sinks) the cache is rebuilt.
- "window" (StreamingLLM): the most recent `budget - sinks` tokens, in a ring.
- "static": selected by importance once, then never updated (an ablation: "no dynamic KV updates").

While the context fits the budget the partial cache is simply the whole context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spyglass.kv_cache import KVCache
from spyglass.models.llama import Segment, Transformer, apply_rope

POLICIES = ("importance", "window", "static")


@dataclass
class PartialState:
    slot: int  # slot in the partial KVCache
    filled: int = 0  # valid entries (<= budget)
    synced: int = 0  # committed full-cache tokens already taken into account
    replaced: int = 0  # tokens written over least-important entries since the last rebuild
    rebuilds: int = 0
    selected: bool = False  # a selection by importance has been made (the cache was ever over budget)


class PartialKV:
    def __init__(
        self,
        budget: int,
        sinks: int = 16,
        policy: str = "importance",
        scratch: int = 1,
        rebuild_every: int | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"partial KV policy must be one of {POLICIES}, got {policy!r}")
        if sinks < 0 or budget <= sinks:
            raise ValueError(f"the partial KV budget ({budget}) must exceed the sink tokens ({sinks})")
        if rebuild_every is not None and not 1 <= rebuild_every <= budget - sinks:
            raise ValueError(f"rebuild_every must be in [1, {budget - sinks}], got {rebuild_every}")
        self.budget, self.sinks, self.policy, self.scratch = budget, sinks, policy, scratch
        self.rebuild_every = rebuild_every or budget - sinks
        self.target: Transformer | None = None
        self.full: KVCache | None = None
        self.cache: KVCache | None = None
        self.pos: torch.Tensor | None = None  # [slots, layers, kv_heads, budget] original position of each entry

    def bind(self, target: Transformer, full: KVCache) -> None:
        if self.budget >= full.capacity:
            raise ValueError(
                f"the partial KV budget ({self.budget} tokens) must be smaller than the context "
                f"({full.capacity} tokens): with the whole context in budget there is nothing to save"
            )
        a = target.args
        self.target, self.full = target, full
        self.cache = KVCache(
            a.n_layers, a.n_kv_heads, a.head_dim, self.budget + self.scratch, full.max_slots, full.dtype, full.device
        )
        # each slot's rows are set when a sequence starts in it: on CPU the pages of slots never used stay unmapped
        self.pos = torch.empty((full.max_slots, a.n_layers, a.n_kv_heads, self.budget), dtype=torch.long)

    # --- per sequence ---------------------------------------------------------------------------------------
    def start(self, seq_slot: int) -> PartialState:
        if self.cache is None:
            raise RuntimeError("PartialKV is not bound to an engine's KV cache")
        st = PartialState(self.cache.allocate())
        self.pos[st.slot] = -1
        return st

    def release(self, st: PartialState | None) -> None:
        if st is not None and self.cache is not None:
            self.cache.release(st.slot)

    def slot_bytes(self) -> int:
        """Memory of one sequence's partial cache (fixed by the budget, whatever the lengths)."""
        return self.cache.slot_bytes() + self.pos[0].numel() * self.pos.element_size()

    def sync(self, st: PartialState, seq_slot: int, query_token: int | None = None) -> None:
        """Take the newly committed full-cache tokens in. `query_token` (the sequence's root, whose position is
        the committed length) supplies the importance query when a selection is due."""
        committed = self.full.lengths[seq_slot]
        if st.synced >= committed:
            return
        if not st.selected and committed <= self.budget:  # everything fits: copy what is new
            self._copy(st, seq_slot, list(range(st.synced, committed)), list(range(st.synced, committed)))
            st.filled = committed
        elif not st.selected or (
            self.policy == "importance" and st.replaced + committed - st.synced > self.rebuild_every
        ):
            if self.policy == "window":
                self._window(st, seq_slot, committed)
            else:
                self._rebuild(st, seq_slot, committed, query_token)
        elif self.policy == "window":
            new = list(range(max(st.synced, committed - (self.budget - self.sinks)), committed))
            self._copy(st, seq_slot, new, [self._ring(p) for p in new])
        elif self.policy == "importance":
            new = list(range(st.synced, committed))
            idx = [self.budget - 1 - (st.replaced + i) for i in range(len(new))]
            self._copy(st, seq_slot, new, idx)
            st.replaced += len(new)
        st.synced = committed
        self.cache.lengths[st.slot] = st.filled

    def _ring(self, p: int) -> int:
        return self.sinks + (p - self.sinks) % (self.budget - self.sinks)

    def _copy(self, st: PartialState, seq_slot: int, positions: list[int], index: list[int]) -> None:
        """Full-cache entries `positions` -> partial entries `index`, every layer and head alike."""
        if not positions:
            return
        src = torch.tensor(positions)
        dst = torch.tensor(index)
        for layer in range(self.full.n_layers):
            fk, fv = self.full.layer(seq_slot, layer)
            pk, pv = self.cache.layer(st.slot, layer)
            pk[:, dst] = fk[:, src]
            pv[:, dst] = fv[:, src]
        self.pos[st.slot][:, :, dst] = src

    def _window(self, st: PartialState, seq_slot: int, committed: int) -> None:
        keep = list(range(self.sinks)) + list(range(committed - (self.budget - self.sinks), committed))
        self._copy(st, seq_slot, keep, [p if p < self.sinks else self._ring(p) for p in keep])
        st.filled, st.selected = self.budget, True

    @torch.inference_mode()
    def _rebuild(self, st: PartialState, seq_slot: int, committed: int, query_token: int | None) -> None:
        """Sinks + the top `budget - sinks` positions by importance, per layer and KV head, best first."""
        if query_token is None:
            raise RuntimeError("a partial KV rebuild needs the query token")
        queries = self.queries(seq_slot, committed, query_token)  # [layers, heads, head_dim]
        a = self.target.args
        group = a.n_heads // a.n_kv_heads
        top = self.budget - self.sinks
        for layer in range(a.n_layers):
            fk, fv = self.full.layer(seq_slot, layer)
            k = fk[:, self.sinks : committed]  # [kv_heads, n, head_dim]
            q = queries[layer].view(a.n_kv_heads, group, a.head_dim).sum(1).to(k.dtype)  # sum over the group
            scores = torch.einsum("hd,hnd->hn", q, k).float()
            order = torch.topk(scores, top, dim=-1, sorted=True).indices + self.sinks  # [kv_heads, top]
            pk, pv = self.cache.layer(st.slot, layer)
            sink = torch.arange(self.sinks)
            pk[:, : self.sinks], pv[:, : self.sinks] = fk[:, sink], fv[:, sink]
            gather = order.unsqueeze(-1).expand(-1, -1, a.head_dim)
            pk[:, self.sinks : self.budget] = torch.gather(fk[:, :committed], 1, gather)
            pv[:, self.sinks : self.budget] = torch.gather(fv[:, :committed], 1, gather)
            self.pos[st.slot, layer, :, : self.sinks] = sink
            self.pos[st.slot, layer, :, self.sinks :] = order
        st.filled, st.selected, st.replaced = self.budget, True, 0
        st.rebuilds += 1

    @torch.inference_mode()
    def queries(self, seq_slot: int, committed: int, token: int) -> torch.Tensor:
        """The exact post-RoPE queries `[layers, heads, head_dim]` of `token` at position `committed` over the full
        cache: one single-token target forward whose K/V land past the committed length (overwritten by the next
        verify pass, never committed)."""
        t, a = self.target, self.target.args
        saved = getattr(t, "capture_layers", ())
        t.capture_layers = tuple(range(a.n_layers))
        try:
            pos, tok = torch.tensor([committed], device=t.device), torch.tensor([token], device=t.device)
            t([Segment(seq_slot, committed, tok, pos, None, "none")], self.full)
            outs = t.captured[0]
        finally:
            t.capture_layers = saved
        cos, sin = t._rope(pos)
        x = t.embed(tok)
        qs = []
        q_dim = a.n_heads * a.head_dim
        for i, block in enumerate(t.layers):
            q = block.wqkv(block.attn_norm(x))[:, :q_dim].view(1, a.n_heads, a.head_dim)
            qs.append(apply_rope(q, cos, sin)[0])
            x = outs[i]
        return torch.stack(qs)

    def check_exact(self, st: PartialState, seq_slot: int) -> bool:
        """Every valid partial entry equals the full-cache entry at its recorded position (tests)."""
        for layer in range(self.full.n_layers):
            fk, fv = self.full.layer(seq_slot, layer)
            pk, pv = self.cache.layer(st.slot, layer)
            pos = self.pos[st.slot, layer, :, : st.filled]
            if (pos < 0).any() or (pos >= self.full.lengths[seq_slot]).any():
                return False
            g = pos.unsqueeze(-1).expand(-1, -1, fk.shape[-1])
            if not (
                torch.equal(pk[:, : st.filled], torch.gather(fk, 1, g))
                and torch.equal(pv[:, : st.filled], torch.gather(fv, 1, g))
            ):
                return False
        return True
