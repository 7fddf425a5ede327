"""LongSpec drafter: the trained one-block draft (`spyglass.training.draft_models.LongSpecDraft`) proposes a chain.

Per sequence it keeps only the self-attention K/V of the last `window - 1` committed tokens, in a ring (keys
carry their RoPE positions, so order inside the ring does not matter): memory is constant in the context. The
cross-attention reads the target's committed last-layer K/V in place from the engine's KVCache (`bind`), so
the long context costs the draft no memory at all. Both go through the hybrid tree attention.

Sampling: each draft token is drawn from the draft's processed distribution, which is handed to the verifier
for probability-ratio rejection, so the output keeps the target's distribution.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from spyglass.drafters.base import choose_draft_token, draft_generator
from spyglass.kv_cache import KVCache
from spyglass.models.llama import Transformer
from spyglass.sequence import Sequence
from spyglass.training.draft_models import LongSpecDraft
from spyglass.tree import DraftTree
from spyglass.verify import Accepted


@dataclass
class _Window:
    k: torch.Tensor  # [kv_heads, window - 1, head_dim], a ring
    v: torch.Tensor
    filled: int  # valid entries
    synced: int  # committed tokens already pushed
    generator: torch.Generator | None


def load_longspec_draft(checkpoint: str | Path, target: Transformer) -> LongSpecDraft:
    """A trainer checkpoint directory (`draft_config.json` + `draft.safetensors`) on top of `target`'s frozen
    embedding and head. Raises ValueError naming what does not fit."""
    root = Path(checkpoint)
    cfg_file, weights = root / "draft_config.json", root / "draft.safetensors"
    if not cfg_file.is_file() or not weights.is_file():
        raise ValueError(f"{root} is not a draft checkpoint (needs draft_config.json and draft.safetensors)")
    cfg = json.loads(cfg_file.read_text())
    kind = cfg.pop("kind", "longspec")
    if kind != "longspec":
        raise ValueError(f"{root} holds a {kind!r} draft, not a LongSpec one")
    a = target.args
    shape = {"hidden_size": a.hidden_size, "n_heads": a.n_heads, "n_kv_heads": a.n_kv_heads, "head_dim": a.head_dim}
    wrong = {k: (cfg.get(k), v) for k, v in shape.items() if cfg.get(k) != v}
    if wrong or cfg.get("vocab_size") != a.vocab_size:
        raise ValueError(f"draft checkpoint {root} does not fit the target (draft, target): {wrong or 'vocab size'}")
    draft = LongSpecDraft.from_target(target, **{k: v for k, v in cfg.items() if k not in shape})
    try:
        missing, unexpected = draft.load_state_dict(load_file(str(weights)), strict=False)
    except RuntimeError as e:  # a tensor of the wrong shape
        raise ValueError(f"draft checkpoint {root}: {e}") from e
    trained = {n for n, p in draft.named_parameters() if p.requires_grad}
    if unexpected or trained & set(missing):
        raise ValueError(f"draft checkpoint {root}: missing {sorted(trained & set(missing))}, unexpected {unexpected}")
    return draft.to(target.dtype).eval()


class LongSpecDrafter:
    name = "longspec"

    def __init__(self, draft: LongSpecDraft, gamma: int = 4) -> None:
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {gamma}")
        self.draft, self.gamma = draft, gamma
        self.ring = draft.cfg.window - 1  # + the token being drafted from = the training window
        self.cache: KVCache | None = None

    def bind(self, target: Transformer, cache: KVCache) -> None:
        self.cache, self.layer = cache, target.args.n_layers - 1

    def start(self, seq: Sequence) -> None:
        c = self.draft.cfg
        dtype = self.draft.wqkv.weight.dtype
        empty = torch.empty(c.n_kv_heads, self.ring, c.head_dim, dtype=dtype)
        seq.drafter_state = _Window(empty, torch.empty_like(empty), 0, 0, draft_generator(seq))

    def _sync(self, seq: Sequence, w: _Window, committed: int) -> None:
        """Push the committed tokens the ring has not seen (only the last `ring` of them matter)."""
        lo = max(w.synced, committed - self.ring)
        if lo < committed:
            k, v = self.draft.window_kv(seq.tokens[lo:committed], torch.arange(lo, committed))
            slots = torch.arange(lo, committed) % self.ring
            w.k[:, slots], w.v[:, slots] = k, v
            w.filled = min(self.ring, w.filled + committed - lo)
        w.synced = committed

    def propose(self, batch: list[Sequence]) -> list[DraftTree]:
        if self.cache is None:
            raise RuntimeError("LongSpecDrafter is not bound to an engine's KV cache")
        trees = []
        for seq in batch:
            w: _Window = seq.drafter_state
            committed = self.cache.lengths[seq.slot]  # every token but the root
            self._sync(seq, w, committed)
            tk, tv = self.cache.prefix(seq.slot, self.layer)
            room = self.cache.capacity - seq.num_tokens
            chain, dists = [int(seq.root)], []
            for _ in range(max(0, min(self.gamma, room))):
                logits = self.draft.draft_logits(
                    torch.tensor(chain),
                    torch.arange(committed, committed + len(chain)),
                    None,
                    w.k[:, : w.filled],
                    w.v[:, : w.filled],
                    tk,
                    tv,
                )
                tok, dist = choose_draft_token(seq, chain[1:], logits[-1:], w.generator)
                chain.append(tok)
                dists.append(dist)
            probs = torch.stack([torch.zeros_like(dists[0]), *dists]) if dists and not seq.params.greedy else None
            trees.append(DraftTree.chain(chain[0], chain[1:], probs))
        return trees

    def commit(self, seq: Sequence, accepted: Accepted) -> None:
        """Nothing to undo: the ring only ever holds committed tokens; the next propose catches up."""

    def release(self, seq: Sequence) -> None:
        seq.drafter_state = None

    def state_bytes(self, seq: Sequence) -> int:
        w: _Window | None = seq.drafter_state
        return 0 if w is None else 2 * w.k.numel() * w.k.element_size()
