"""Composite drafting: several drafters' trees merged into one, verified in one pass.

Copying from the context (suffix) and predicting what the model writes next (LongSpec) are right at different
places: merged, each path keeps the best score any drafter gave it, and the engine's controller keeps the nodes
that pay. A later part drafts for a sequence only while the earlier parts are unsure of its next token (their
best first-level score below `confident`, discounted by how often their best first token has come true for the
sequence): where copying is likely right, the learned draft's few extra candidates rarely pay for its
step-by-step drafting. Between the controller's probes (`DraftRequest.free_only`) only the parts with a free part
propose, that part alone (`DrafterTraits.free`: suffix lookups, a span that goes on): they cost nothing, so they
should never wait for the learned part to pay again. Sampling is verified by token matching (merged trees carry no
single proposal distribution), which keeps the target's distribution exactly: every part must draft for it
(`DrafterTraits.token_matched`; `build_drafter` builds a composite's parts so).
"""

from __future__ import annotations

from spyglass.drafters.base import Drafter, DrafterTraits, DraftRequest
from spyglass.sequence import Sequence
from spyglass.tree import DraftTree, TrieBuilder
from spyglass.verify import Accepted


def merge_trees(trees: list[DraftTree], parts: list[int] | None = None) -> DraftTree:
    """One trie of every tree's paths under the common root; a node's score is the best any tree gave it
    (a tree without scores: 0.5 per depth), its source the set of drafters that proposed it (bit `parts[t]` for
    `trees[t]`; default t)."""
    trie = TrieBuilder(int(trees[0].tokens[0]))
    for t, tree in enumerate(trees):
        trie.graft(tree, 1 << (parts[t] if parts is not None else t))
    scores = trie.scores
    for i in range(1, len(scores)):  # a child never above its parent
        scores[i] = min(scores[i], scores[trie.parents[i]])
    return trie.tree()


def best_first(tree: DraftTree) -> tuple[int, float]:
    """The root's best-scored child's token and score ((-1, 0) for a root-only or unscored tree)."""
    if tree.scores is None:
        return -1, 0.0
    best = max(tree.children()[0], key=lambda i: tree.scores[i], default=None)
    return (-1, 0.0) if best is None else (int(tree.tokens[best]), tree.scores[best])


class CompositeDrafter:
    traits: DrafterTraits  # set in __init__, composed from its parts' (never changing them)

    # The gate reads the earlier parts' scores as far as they come true for the sequence: their best first token
    # against the target's next one, decayed by this much per step, scales the score the gate compares (a lookup
    # that keeps claiming long matches where the output departs from the context stops holding the learned part off).
    decay = 0.9

    def __init__(self, parts: list[Drafter], name: str = "composite", confident: float | None = 0.25) -> None:
        """`confident`: skip the later parts for a sequence whose earlier parts' best first token has at least this
        score (None: every part always drafts). 0.25: suffix lookups scored 0.25-0.5 are right often enough that
        LongSpec's extra candidates there rarely paid for its drafting (replayed over v12's drafts on the dev
        prompts, bench/probes/replay.py composite: mean 2.53x at 0.5, 2.61-2.65x at 0.2-0.3, 2.59x drafting only where
        suffix has nothing; suffix alone 2.59x)."""
        if not parts:
            raise ValueError("a composite drafter needs at least one part")
        sampled = [p.name for p in parts if not p.traits.token_matched]
        if sampled:  # merged trees carry no proposal distributions: a sampled chain would draw for nothing
            raise ValueError(f"a composite's parts must draft for token matching (token_matched), not {sampled}")
        self.parts, self.name, self.confident = parts, name, confident
        frees = {p.traits.free for p in parts}
        self.traits = DrafterTraits(
            # free as a whole if every part is, else its free parts propose alone between probes
            free="all" if frees == {"all"} else "none" if frees == {"none"} else "part",
            token_matched=True,
            hidden_layers=tuple(sorted({i for p in parts for i in p.traits.hidden_layers})),
            newest_hidden_only=all(p.traits.newest_hidden_only for p in parts if p.traits.hidden_layers),
        )
        self._claims: dict[str, tuple[int, float]] = {}  # seq_id -> the gating parts' best first token, score
        self._record: dict[str, list[float]] = {}  # seq_id -> decayed [right, claimed] (a neutral prior of 1, 1)

    def _each(self, seq: Sequence):
        """Run a part with its own per-sequence state swapped in."""
        states = seq.drafter_state or [None] * len(self.parts)
        for i, part in enumerate(self.parts):
            seq.drafter_state = states[i]
            yield part
            states[i] = seq.drafter_state
        seq.drafter_state = states

    def bind(self, target, cache) -> None:
        for p in self.parts:
            p.bind(target, cache)

    def start(self, seq: Sequence) -> None:
        for part in self._each(seq):
            part.start(seq)

    def observe_hidden(self, seq: Sequence, start: int, hidden, kept) -> None:
        for part in self._each(seq):
            if part.traits.hidden_layers:
                part.observe_hidden(seq, start, hidden, kept)

    def propose(self, batch: list[Sequence], wants: list[DraftRequest]) -> list[DraftTree]:
        """Each part proposes with the sequence's request: between probes (`free_only`) the parts with a free part
        propose that part alone (a span part its copy that goes on), the others not at all."""
        saved = [s.drafter_state for s in batch]
        trees: list[list[DraftTree]] = [[] for _ in batch]
        drafted: list[list[int]] = [[] for _ in batch]  # which part drafted each of them
        for i, part in enumerate(self.parts):
            free = part.traits.free != "none"
            # what the earlier parts claim for each sequence's next token: their best first token and its score
            claims = [max(map(best_first, ts), key=lambda c: c[1], default=(-1, 0.0)) for ts in trees]
            if i == len(self.parts) - 1:  # the gate's evidence, checked against the target in `commit`
                self._claims.update((s.seq_id, c) for s, c in zip(batch, claims, strict=True))
            rows = [
                j
                for j, (s, w, (_, score)) in enumerate(zip(batch, wants, claims, strict=True))
                if not self._sure(s, score) and (free or not w.free_only)
            ]
            if not rows:
                break
            for j in rows:
                batch[j].drafter_state = saved[j][i]
            for j, tree in zip(rows, part.propose([batch[j] for j in rows], [wants[j] for j in rows]), strict=True):
                saved[j][i] = batch[j].drafter_state
                trees[j].append(tree)
                drafted[j].append(i)
        for s, st in zip(batch, saved, strict=True):
            s.drafter_state = st
        return [
            merge_trees(ts, parts) if ts else DraftTree.root_only(s.root)
            for s, ts, parts in zip(batch, trees, drafted, strict=True)
        ]

    def _sure(self, seq: Sequence, score: float) -> bool:
        """The parts so far give the next token at least `confident` odds (`score`: their best first token's; merging
        keeps each node's best score), scaled by how far their claims have come true for this sequence."""
        if self.confident is None:
            return False
        right, claimed = self._record.get(seq.seq_id, (1.0, 1.0))
        trust = min(1.0, right / claimed)  # discounted where they overclaim, never raised
        return score * trust >= self.confident

    def commit(self, seq: Sequence, accepted: Accepted) -> None:
        token, score = self._claims.pop(seq.seq_id, (-1, 0.0))
        if score > 0:
            right, claimed = self._record.get(seq.seq_id, (1.0, 1.0))
            hit = float(accepted.tokens[0] == token)
            self._record[seq.seq_id] = [self.decay * right + hit, self.decay * claimed + score]
        for part in self._each(seq):
            part.commit(seq, accepted)

    def release(self, seq: Sequence) -> None:
        for part in self._each(seq):
            part.release(seq)
        seq.drafter_state = None
        self._claims.pop(seq.seq_id, None)
        self._record.pop(seq.seq_id, None)

    def state_bytes(self, seq: Sequence) -> int:
        total = 0
        for part in self._each(seq):
            total += part.state_bytes(seq)
        return total
