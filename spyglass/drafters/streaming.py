"""StreamingLLM / MagicDec-style self-speculation: the target drafts a chain for itself over a partial KV cache
holding only the attention sinks and the most recent tokens (`spyglass.partial_kv.PartialKV`, policy "window").

The baseline TokenSwift is measured against: no trained parts, one target forward over the small cache per
drafted token (so drafting costs gamma cheap target passes), then one verify pass over the full cache. When
sampling, each draft token is drawn from the target's processed distribution over the partial cache and that
distribution goes to the verifier's probability-ratio rejection, so the output is plain sampling's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spyglass.drafters.base import DrafterTraits, DraftRequest, choose_draft_token, draft_generator
from spyglass.kv_cache import KVCache
from spyglass.models.llama import Segment, Transformer
from spyglass.partial_kv import PartialKV, PartialState
from spyglass.sequence import Sequence
from spyglass.tree import DraftTree
from spyglass.verify import Accepted


@dataclass
class _State:
    partial: PartialState
    generator: torch.Generator | None


class StreamingDrafter:
    name = "streaming"
    traits = DrafterTraits()  # gamma passes whatever depth is asked; a sampled chain carries its distributions

    def __init__(self, budget: int | None = None, sinks: int = 4, gamma: int = 4, policy: str = "window") -> None:
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {gamma}")
        self.budget, self.sinks, self.gamma, self.policy = budget, sinks, gamma, policy
        self.pkv: PartialKV | None = None
        self.target: Transformer | None = None

    def bind(self, target: Transformer, cache: KVCache) -> None:
        budget = self.budget if self.budget is not None else min(2048, cache.capacity // 4)
        self.pkv = PartialKV(budget, min(self.sinks, budget - 1), self.policy, self.gamma + 1)
        self.pkv.bind(target, cache)
        self.target = target

    def start(self, seq: Sequence) -> None:
        seq.drafter_state = _State(self.pkv.start(seq.slot), draft_generator(seq))

    @torch.inference_mode()
    def propose(self, batch: list[Sequence], wants: list[DraftRequest]) -> list[DraftTree]:
        if self.pkv is None:
            raise RuntimeError("StreamingDrafter is not bound to an engine")
        states: list[_State] = [s.drafter_state for s in batch]
        for seq, st in zip(batch, states, strict=True):
            self.pkv.sync(st.partial, seq.slot, seq.root)
        gamma = max(0, min(self.gamma, *(self.pkv.full.capacity - s.num_tokens for s in batch)))
        chains: list[list[int]] = [[s.root] for s in batch]
        dists: list[list[torch.Tensor]] = [[] for _ in batch]
        for i in range(gamma):
            segments = []
            for seq, st, chain in zip(batch, states, chains, strict=True):
                p = st.partial
                pos = torch.tensor([seq.committed + i])
                segments.append(Segment(p.slot, p.filled + i, torch.tensor([chain[-1]]), pos, None, "last"))
            logits = self.target(segments, self.pkv.cache)
            for seq, st, seg, chain, ds, lg in zip(batch, states, segments, chains, dists, logits, strict=True):
                self.pkv.cache.commit(st.partial.slot, seg.start, [0])  # the next draft token sees this one
                tok, dist = choose_draft_token(seq, chain[1:], lg, st.generator)
                chain.append(tok)
                ds.append(dist)
        trees = []
        for seq, st, chain, ds in zip(batch, states, chains, dists, strict=True):
            self.pkv.cache.lengths[st.partial.slot] = st.partial.filled  # drop the drafted tokens' scratch
            # P(accepted) estimate per node for the engine's controller (the draft's probability of the path), greedy
            # only: with rejection sampling, pruning by the sampled tokens' own probabilities would condition the
            # proposal on its outcome and bias the output (measured: chi-square p = 3e-10), so sampled chains get
            # no scores and the controller sizes them by its token-independent prior
            if not seq.params.greedy:
                trees.append(DraftTree.sampled_chain(chain[0], chain[1:], ds) if ds else DraftTree.root_only(chain[0]))
                continue
            scores, s = [1.0], 1.0
            for tok, row in zip(chain[1:], ds, strict=True):
                s *= float(torch.softmax(row, -1)[tok])
                scores.append(s)
            trees.append(DraftTree.chain(chain[0], chain[1:], None, scores))
        return trees

    def commit(self, seq: Sequence, accepted: Accepted) -> None:
        """Nothing to do: the next propose copies the newly committed entries from the full cache."""

    def release(self, seq: Sequence) -> None:
        st: _State | None = seq.drafter_state
        if st is not None and self.pkv is not None:
            self.pkv.release(st.partial)
        seq.drafter_state = None

    def partial_bytes(self, seq: Sequence) -> int:
        return self.pkv.slot_bytes() if self.pkv is not None and seq.drafter_state is not None else 0

    def state_bytes(self, seq: Sequence) -> int:
        return self.partial_bytes(seq)
