"""Prompt-lookup drafting: find the last n-gram earlier in prompt + output and propose what followed.

Long-context tasks (editing a file, answering from a document) copy spans of the context, so the
continuation of an earlier occurrence is often right. Several matches with different continuations
form a small tree (shared prefixes merged), which costs little extra in one verify pass.
"""

from __future__ import annotations

import torch

from spyglass.drafters.base import StatelessDrafter
from spyglass.sequence import Sequence
from spyglass.tree import DraftTree


class NgramDrafter(StatelessDrafter):
    name = "ngram"

    def __init__(self, n_min: int = 1, n_max: int = 3, draft_len: int = 8, max_candidates: int = 2) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        if draft_len < 1 or max_candidates < 1:
            raise ValueError("draft_len and max_candidates must be >= 1")
        self.n_min, self.n_max = n_min, n_max
        self.draft_len = draft_len
        self.max_candidates = max_candidates

    def propose(self, batch: list[Sequence]) -> list[DraftTree]:
        return [self.propose_one(s.tokens) for s in batch]

    def propose_one(self, tokens: torch.Tensor) -> DraftTree:
        root = int(tokens[-1])
        paths = self.continuations(tokens)
        if not paths:
            return DraftTree.root_only(root)
        return DraftTree.from_paths(root, paths, max_nodes=1 + self.draft_len * self.max_candidates)

    def continuations(self, tokens: torch.Tensor) -> list[list[int]]:
        """Distinct continuations of the longest matching n-gram, most recent occurrence first."""
        length = tokens.shape[0]
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            pattern = tokens[-n:]
            windows = tokens[: length - 1].unfold(0, n, 1)  # every earlier n-gram with a continuation
            starts = (windows == pattern).all(dim=1).nonzero().flatten()
            if starts.numel() == 0:
                continue
            paths: list[list[int]] = []
            for s in starts.flip(0).tolist():
                cont = tokens[s + n : s + n + self.draft_len].tolist()
                if cont and cont not in paths:
                    paths.append(cont)
                    if len(paths) == self.max_candidates:
                        break
            return paths
        return []
