"""A separate draft language model with the target's tokenizer and its own KV cache.

It drafts a chain of up to `gamma` tokens one at a time (per sequence only as deep as the controller asks),
batched over all sequences in the step. When sampling it draws each token from its own processed distribution
and hands that distribution to the verifier, so probability-ratio rejection sampling keeps the output
distributed as the target's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from spyglass.drafters.base import DrafterTraits, DraftRequest, choose_draft_token, draft_generator, requested_depth
from spyglass.kv_cache import KVCache
from spyglass.models.llama import Segment, Transformer, load_transformer
from spyglass.models.loader import resolve_model
from spyglass.sequence import Sequence
from spyglass.tree import DraftTree
from spyglass.verify import Accepted


@dataclass
class _DraftState:
    slot: int
    generator: torch.Generator | None


class SmallLMDrafter:
    name = "small-lm"
    # one token per depth, one draft forward per depth, and only as deep as the controller asks (`DraftRequest.depth`)
    traits = DrafterTraits(drafts_chain=True, cost_by_depth=True)

    def __init__(self, draft: Transformer, gamma: int = 4, max_batch: int = 4, max_context: int = 8192) -> None:
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {gamma}")
        self.draft = draft
        self.gamma = gamma
        self.cache = draft.new_cache(max_context, max_batch)

    def bind(self, target: Transformer, cache: KVCache) -> None:
        """The draft keeps its own model and cache."""

    def start(self, seq: Sequence) -> None:
        state = _DraftState(self.cache.allocate(), draft_generator(seq))
        seq.drafter_state = state
        # The draft holds every token but the root; the root is fed with the next proposal.
        self.draft.prefill(self.cache, state.slot, seq.tokens[:-1].clone())

    def propose(self, batch: list[Sequence], wants: list[DraftRequest]) -> list[DraftTree]:
        states: list[_DraftState] = [s.drafter_state for s in batch]
        for s, st in zip(batch, states, strict=True):  # drop what an earlier, unverified proposal drafted
            self.cache.truncate(st.slot, s.committed)
        depth = [requested_depth(s, w, self.gamma, self.cache.capacity) for s, w in zip(batch, wants, strict=True)]
        drafted: list[list[int]] = [[] for _ in batch]
        dists: list[list[torch.Tensor]] = [[] for _ in batch]
        # Step 0 feeds every token the draft has not seen yet (the root plus any catch-up). A step asks for every
        # row's logits, so its few rows run the decode steps' `rows` kernel, not a prefill plan (`lanes` computes
        # 16 rows for one; a truncated draft shares the target's layers and their plan) and takes the last.
        feeds = [s.tokens[self.cache.lengths[st.slot] :].clone() for s, st in zip(batch, states, strict=True)]
        for d in range(max(depth, default=0)):
            rows = [i for i in range(len(batch)) if depth[i] > d]
            segments = []
            for i in rows:
                slot, start = states[i].slot, self.cache.lengths[states[i].slot]
                segments.append(Segment(slot, start, feeds[i], torch.arange(start, start + len(feeds[i])), None, "all"))
            logits = self.draft(segments, self.cache)
            for i, seg, lg in zip(rows, segments, logits, strict=True):
                self.cache.commit(seg.slot, seg.start, list(range(len(seg.tokens))))
                tok, dist = choose_draft_token(batch[i], drafted[i], lg[-1:], states[i].generator)
                drafted[i].append(tok)
                dists[i].append(dist)
                feeds[i] = torch.tensor([tok])
        trees = []
        for seq, toks, ds in zip(batch, drafted, dists, strict=True):
            sampled = bool(ds) and not seq.params.greedy
            trees.append(DraftTree.sampled_chain(seq.root, toks, ds) if sampled else DraftTree.chain(seq.root, toks))
        return trees

    def commit(self, seq: Sequence, accepted: Accepted) -> None:
        # The draft cache holds the sequence up to the root plus drafted tokens 1..gamma-1; keep the
        # part the target agreed with. Everything after it is re-fed next round.
        self.cache.truncate(seq.drafter_state.slot, seq.committed)

    def release(self, seq: Sequence) -> None:
        st: _DraftState | None = seq.drafter_state
        if st is not None:
            self.cache.release(st.slot)
            seq.drafter_state = None

    def state_bytes(self, seq: Sequence) -> int:
        return self.cache.slot_bytes() if seq.drafter_state is not None else 0


def load_draft_model(target: Transformer, source: Transformer | str | None, layers: int | None = None) -> Transformer:
    """The draft model: a loaded one, a model source (a path or name `resolve_model` knows, in the target's dtype),
    or the target's first `layers` layers. No default: the target's own first layers accept almost nothing on
    SmolLM2, and a silent slow default is worse than a clear error."""
    if isinstance(source, Transformer):
        return source
    if source:
        dtype = str(target.dtype).removeprefix("torch.")
        path = resolve_model(str(source), dtype=dtype).path
        return load_transformer(path, dtype=target.dtype, device=target.device)
    if layers:
        return truncated_draft(target, layers)
    raise ValueError("method small-lm needs a draft model: --draft-model SOURCE (or --draft-layers N)")


def truncated_draft(target: Transformer, n_layers: int) -> Transformer:
    """A draft made of the target's first `n_layers` layers, final norm and head, sharing their weights.

    A usable default when no smaller model with the same tokenizer is at hand (layer-skip
    self-speculation); it costs no extra weight memory, only its own KV cache.
    """
    if not 1 <= n_layers <= target.args.n_layers:
        raise ValueError(f"n_layers must be in [1, {target.args.n_layers}], got {n_layers}")
    with torch.device("meta"):
        draft = Transformer(replace(target.args, n_layers=0), torch.empty(0))
    draft.args = replace(target.args, n_layers=n_layers)
    draft.embed, draft.norm, draft.lm_head = target.embed, target.norm, target.lm_head
    draft.layers = nn.ModuleList(target.layers[:n_layers])
    draft.inv_freq = target.inv_freq
    draft.rope_scaling = target.rope_scaling
    draft.attention_backend = target.attention_backend
    draft.linear_backend = target.linear_backend  # (the layers are the target's, flags and all)
    draft.model_id = f"{target.model_id}[:{n_layers}]"
    return draft
