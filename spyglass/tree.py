"""Draft trees: the root is the sequence's last token (not yet in the KV cache); every other node is
a drafted token whose parent is an earlier node. Nodes are stored in topological order (parent index <
node index), so a chain is simply parents = [-1, 0, 1, ...].
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# `DraftTree.sources` of a chain with spans (LongSpec's, DFlash's): its drafted nodes, and the nodes copied from the
# context after a drafted token, which the chain controller sizes by their own scores; a drafted token that the
# context's agreement vouches for (DFlash's copied token) is both
DRAFT_SOURCE, SPAN_SOURCE = 1, 2
COPY_SOURCE = DRAFT_SOURCE | SPAN_SOURCE


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [n] int64, tokens[0] is the root
    parents: list[int]  # parents[0] == -1
    # Optional proposal distributions: probs[i] is the distribution node i's token was drawn from
    # (row 0 unused). Only meaningful for sampled chains (probability-ratio rejection sampling).
    probs: torch.Tensor | None = None
    # Optional per-node estimate of P(node is accepted) (root 1.0, never larger than its parent's): what the
    # engine's speculation controller sizes the tree by. None = no estimate (the controller learns one).
    scores: list[float] | None = None
    # Optional per-node tag of which drafter(s) proposed it (a composite's bit per part; root 0): the controller
    # calibrates each source's scores against its own acceptance.
    sources: list[int] | None = None
    _depths: list[int] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.parents or len(self.parents) != self.tokens.shape[0] or self.parents[0] != -1:
            raise ValueError("a draft tree needs one parent per token and the root first")
        for i, p in enumerate(self.parents[1:], start=1):
            if not 0 <= p < i:
                raise ValueError(f"node {i} has parent {p}: nodes must follow their parents")
        if self.scores is not None and len(self.scores) != len(self.parents):
            raise ValueError("a draft tree needs one score per node")
        if self.sources is not None and len(self.sources) != len(self.parents):
            raise ValueError("a draft tree needs one source per node")

    @classmethod
    def root_only(cls, root: int) -> DraftTree:
        return cls(torch.tensor([root]), [-1])

    @classmethod
    def chain(
        cls, root: int, tokens: list[int], probs: torch.Tensor | None = None, scores: list[float] | None = None
    ) -> DraftTree:
        return cls(torch.tensor([root, *tokens]), list(range(-1, len(tokens))), probs, scores)

    @classmethod
    def sampled_chain(cls, root: int, tokens: list[int], rows: list[torch.Tensor]) -> DraftTree:
        """A chain whose i-th token was drawn from `rows[i]`, the verifier's proposal q (the root's row is zeros)."""
        return cls.chain(root, tokens, torch.stack([torch.zeros_like(rows[0]), *rows]))

    def subtree(self, keep: list[int]) -> DraftTree:
        """The nodes `keep` (ascending, root first, each one's parent kept too), re-indexed."""
        if keep == list(range(len(self.parents))):
            return self
        index = {old: new for new, old in enumerate(keep)}
        try:
            parents = [-1] + [index[self.parents[i]] for i in keep[1:]]
        except KeyError as e:
            raise ValueError(f"subtree keeps a node without its parent {e}") from None
        probs = self.probs[keep] if self.probs is not None else None
        scores = [self.scores[i] for i in keep] if self.scores is not None else None
        sources = [self.sources[i] for i in keep] if self.sources is not None else None
        return DraftTree(self.tokens[keep], parents, probs, scores, sources)

    def best_nodes(self, scores: list[float], k: int) -> list[int]:
        """The root and the k non-root nodes of highest score (ties: earlier first), ascending. With scores that
        never exceed a parent's, every kept node's parent is kept: a valid subtree."""
        order = sorted(range(1, len(self.parents)), key=lambda i: (-scores[i], i))[:k]
        keep = set(order)
        for i in order:  # guard against scores that grow along a path: keep ancestors
            p = self.parents[i]
            while p > 0 and p not in keep:
                keep.add(p)
                p = self.parents[p]
        return [0, *sorted(keep)]

    @classmethod
    def from_paths(cls, root: int, paths: list[list[int]], max_nodes: int | None = None) -> DraftTree:
        """Merge token paths into a trie under the root (shared prefixes share nodes)."""
        tokens, parents = [root], [-1]
        children: dict[tuple[int, int], int] = {}
        for path in paths:
            node = 0
            for tok in path:
                key = (node, tok)
                if key not in children:
                    if max_nodes is not None and len(tokens) >= max_nodes:
                        break
                    children[key] = len(tokens)
                    tokens.append(tok)
                    parents.append(node)
                node = children[key]
        return cls(torch.tensor(tokens), parents)

    def __len__(self) -> int:
        return len(self.parents)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @property
    def depths(self) -> list[int]:
        if self._depths is None:
            d = [0] * len(self.parents)
            for i, p in enumerate(self.parents[1:], start=1):
                d[i] = d[p] + 1
            self._depths = d
        return self._depths

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    def positions(self, start: int) -> torch.Tensor:
        """Position ids: the root sits at `start` (the committed length), a node at start + depth."""
        return torch.tensor(self.depths) + start

    def mask(self) -> torch.Tensor | None:
        """`[n, n]` bool: node i sees node j iff j is i or an ancestor of i. None for a chain (causal)."""
        if self.is_chain:
            return None
        return self.ancestor_mask()

    def ancestor_mask(self) -> torch.Tensor:
        n = len(self.parents)
        m = torch.eye(n, dtype=torch.bool)
        for i, p in enumerate(self.parents[1:], start=1):
            m[i] |= m[p]
        return m

    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in self.parents]
        for i, p in enumerate(self.parents[1:], start=1):
            kids[p].append(i)
        return kids


class TrieBuilder:
    """A scored, source-tagged draft tree grown path by path: one node per (parent, token), keeping the best
    score any path gave it and the union of the paths' source bits (composite merges, TokenSwift's trees)."""

    def __init__(self, root: int) -> None:
        self.tokens, self.parents, self.scores, self.sources = [root], [-1], [1.0], [0]
        self._index: dict[tuple[int, int], int] = {}

    def add(self, parent: int, token: int, score: float, source: int) -> int:
        """The node for `token` under `parent` (created if new)."""
        node = self._index.get((parent, token))
        if node is None:
            node = self._index[(parent, token)] = len(self.tokens)
            self.tokens.append(token)
            self.parents.append(parent)
            self.scores.append(score)
            self.sources.append(source)
        else:
            self.scores[node] = max(self.scores[node], score)
            self.sources[node] |= source
        return node

    def graft(self, tree: DraftTree, source: int) -> None:
        """Every path of `tree` (same root) under this root, with its scores (unscored: 0.5 per depth)."""
        if int(tree.tokens[0]) != self.tokens[0]:
            raise ValueError("trees to merge must share their root")
        scores = tree.scores or [1.0] + [0.5**d for d in tree.depths[1:]]
        mapped = [0]
        for i in range(1, len(tree)):
            mapped.append(self.add(mapped[tree.parents[i]], int(tree.tokens[i]), scores[i], source))

    def tree(self) -> DraftTree:
        return DraftTree(torch.tensor(self.tokens), self.parents, scores=self.scores, sources=self.sources)
