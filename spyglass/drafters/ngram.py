"""Prompt-lookup drafting: find the last n-gram earlier in prompt + output and propose what followed.

Long-context tasks (editing a file, answering from a document) copy spans of the context, so the
continuation of an earlier occurrence is often right. Several matches with different continuations
form a small tree (shared prefixes merged), which costs little extra in one verify pass.

Each extra tree token costs verify time (on CPU in fp32 about a sixth of a decode step), so the
draft length adapts per sequence: it grows by 2 after a step that accepted a whole candidate and
shrinks by 1 otherwise (the schedule HF assisted generation uses), within [1, draft_len].
"""

from __future__ import annotations

import torch

from spyglass.drafters.base import DrafterTraits, DraftRequest, StatelessDrafter
from spyglass.sequence import Sequence
from spyglass.tree import DraftTree
from spyglass.verify import Accepted

SCAN_MATCHES = 64  # most recent occurrences considered per step (bounds the cost on repetitive text)


class NgramDrafter(StatelessDrafter):
    name = "ngram"
    traits = DrafterTraits(free="all", token_matched=True)  # a lookup: costs next to nothing beside a target step

    def __init__(
        self, n_min: int = 1, n_max: int = 3, draft_len: int = 12, max_candidates: int = 2, adaptive: bool = True
    ) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        if draft_len < 1 or max_candidates < 1:
            raise ValueError("draft_len and max_candidates must be >= 1")
        self.n_min, self.n_max = n_min, n_max
        self.draft_len = draft_len
        self.max_candidates = max_candidates
        self.adaptive = adaptive

    def start(self, seq: Sequence) -> None:
        seq.drafter_state = [min(4, self.draft_len) if self.adaptive else self.draft_len, 0]  # budget, depth

    def propose(self, batch: list[Sequence], wants: list[DraftRequest]) -> list[DraftTree]:
        trees = []
        for seq in batch:
            state = seq.drafter_state or [self.draft_len, 0]
            tree = self.propose_one(seq.tokens, state[0])
            state[1] = tree.max_depth
            trees.append(tree)
        return trees

    def commit(self, seq: Sequence, accepted: Accepted) -> None:
        state = seq.drafter_state
        if self.adaptive and state is not None and state[1] > 0:
            full = accepted.num_drafted_accepted >= state[1]
            state[0] = min(self.draft_len, state[0] + 2) if full else max(1, state[0] - 1)

    def propose_one(self, tokens: torch.Tensor, budget: int | None = None) -> DraftTree:
        budget = budget or self.draft_len
        root = int(tokens[-1])
        paths = [p[:budget] for p in self.continuations(tokens)]
        if not paths:
            return DraftTree.root_only(root)
        return DraftTree.from_paths(root, paths, max_nodes=1 + budget * self.max_candidates)

    def continuations(self, tokens: torch.Tensor) -> list[list[int]]:
        """Distinct continuations of the longest matching n-gram: full-length ones first, then the most
        recent. (The most recent match of a repeating pattern sits near the end and has a short tail.)"""
        length = tokens.shape[0]
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            pattern = tokens[-n:]
            windows = tokens[: length - 1].unfold(0, n, 1)  # every earlier n-gram with a continuation
            starts = (windows == pattern).all(dim=1).nonzero().flatten()
            if starts.numel() == 0:
                continue
            found: list[list[int]] = []
            for s in starts.flip(0)[:SCAN_MATCHES].tolist():
                cont = tokens[s + n : s + n + self.draft_len].tolist()
                if cont and cont not in found:
                    found.append(cont)
            found.sort(key=len, reverse=True)  # stable: equally long ones stay most recent first
            return found[: self.max_candidates]
        return []
