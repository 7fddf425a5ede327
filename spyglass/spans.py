"""Context spans: where a copy head's pointer says the next token comes from the context, the text that followed
that place becomes a chain of draft nodes for no further draft step (`longspec-span`, `dflash-span`).

A recurring phrase splits the pointer's mass between its places, so a span's source is chosen among the few
places with the most mass by how far the text before each agrees with the text before the node.
"""

from __future__ import annotations

import torch

from spyglass.sequence import Sequence

SPAN = 16  # the longest copied continuation (the controller keeps what pays of it)
SPAN_MASS = 0.1  # the copy mass on a token's places that makes it a copy
SPAN_CANDIDATES = 4  # the places a span's source is chosen from (the most copy mass)
MATCH_LOOKBACK = 32  # how far back a span's source is compared with the text before the node


def text_before(seq: Sequence, drafted: list[int], c: int) -> list[int]:
    """The last tokens up to a node (the context to the root at position `c`, then the node's `drafted` path),
    newest first."""
    return (seq.tokens[max(0, c + 1 - MATCH_LOOKBACK) : c + 1].tolist() + drafted)[::-1]


def agreement(before: list[int], seq: Sequence, at: int) -> int:
    """How many tokens `before` (newest first) and the context up to position `at` agree on, going backwards."""
    source = seq.tokens[max(0, at + 1 - MATCH_LOOKBACK) : at + 1].tolist()[::-1]
    n = min(len(source), len(before))
    return next((m for m in range(n) if source[m] != before[m]), n)


def copy_source(
    seq: Sequence, before: list[int], tok: int, mass: torch.Tensor, after: torch.Tensor, span_mass: float
) -> tuple[int, int] | None:
    """The context position a copied `tok` comes from and how far its preceding text agrees with `before`, or None
    if `tok` is not a copy (less than `span_mass` of the pointer's `mass` `[S]` on the positions proposing it;
    position j proposes `after[j]`, the token after it). Ties go to the most mass."""
    if not len(after):
        return None
    at = torch.where(after.to(mass.device) == tok, mass, 0.0)  # (the sequence's tokens live on the CPU)
    top = at.topk(min(SPAN_CANDIDATES, len(at)))
    if float(top.values.sum()) < span_mass:
        return None
    agree = {a: agreement(before, seq, a) for a in (top.indices[top.values > 0] + 1).tolist()}
    source = max(agree, key=agree.__getitem__)  # `agree` keeps topk's order
    return source, agree[source]


def lookup_conditional(match: int) -> float:
    """Suffix lookup's estimate that the token after a match of `match` tokens comes true: m / (m + 1)."""
    return match / (match + 1)


def copied_score(parent_score: float, match: int) -> float | None:
    """A copied token's score where the text up to it agrees with its source's for `match` tokens (itself included):
    suffix lookup's estimate after the match - 1 before it, so the chain controller prices it as a span's token
    (COPY_SOURCE); None where fewer than 2 agree (the draft's own score stands)."""
    return parent_score * lookup_conditional(match - 1) if match >= 2 else None


def continuation(seq: Sequence, at: int, c: int, room: int, score: float, match: int) -> list[tuple[int, float]]:
    """What followed context position `at` (up to the root, position `c`; at most `room` tokens), each with its
    score: `score` times m / (m + 1) per token, as suffix lookup scores a match of length m, where m starts at
    `match` (how far the text up to the node agrees with the context up to `at`) and grows with each token."""
    out = []
    for t in seq.tokens[at + 1 : min(at + 1 + room, c + 1)].tolist():
        score *= lookup_conditional(match)
        out.append((t, score))
        match += 1
    return out


def pointer_continuation(seq: Sequence, pointer: int, c: int, room: int) -> list[tuple[int, float]] | None:
    """Where the root (position `c`) is the context's token at `pointer` (the last copy goes on), `continuation` of
    what followed it there, scored from 1; None otherwise."""
    if not (0 < pointer < c and int(seq.tokens[pointer]) == int(seq.root)):
        return None
    return continuation(seq, pointer, c, room, 1.0, agreement(text_before(seq, [], c), seq, pointer))


def next_pointer(seq: Sequence, pointer: int, chain: list[int] | None, origins: list[int], new: list[int]) -> int:
    """Where a copy stands once a step has committed `new` (accepted drafted tokens, then the target's own): the
    context position whose token should be the new root, or -1 where the committed text left the copy.

    `chain` is the chain proposed this step (root first; None if none was) and `origins` each node's source
    position in the context (-1: drafted, not copied). Without a chain the copy at `pointer` goes on as long as
    the target's own tokens agree with it, so a copy that the controller did not verify is still followed."""
    m = len(new)
    if chain is None:
        c, tokens = seq.committed, seq.tokens
        agree = 0 < pointer < c - m and torch.equal(tokens[pointer : pointer + m + 1], tokens[c - m : c + 1])
        return pointer + m if agree else -1
    k = next((i for i, t in enumerate(new) if i + 1 >= len(chain) or chain[i + 1] != t), m)
    if k == m:  # the new root is a node of the chain
        return origins[m]
    if k == m - 1 == len(chain) - 1 and origins[k] >= 0:  # the chain ran out: the copy may go on past it
        return origins[k] + 1
    return -1
