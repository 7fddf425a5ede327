"""The one protocol every drafter implements (one file per method beside this one)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

import torch

from spyglass.sampling import needs_presence, process_in_context, sample
from spyglass.sequence import Sequence
from spyglass.tree import DraftTree
from spyglass.verify import Accepted

if TYPE_CHECKING:
    from spyglass.kv_cache import KVCache
    from spyglass.models.llama import Transformer


@runtime_checkable
class Drafter(Protocol):
    name: str

    def bind(self, target: Transformer, cache: KVCache) -> None:
        """Called once by the engine with its target and KVCache, for drafters that read the target's K/V in
        place (LongSpec, GLIDE: `cache.prefix(seq.slot, layer)` is the committed K/V, no copy)."""

    def start(self, seq: Sequence) -> None:
        """Called once after the target's prefill (the sequence holds the prompt and its first token)."""

    def propose(self, batch: list[Sequence]) -> list[DraftTree]:
        """One draft tree per sequence, rooted at `seq.root`."""

    def commit(self, seq: Sequence, accepted: Accepted) -> None:
        """Called after verification, once `accepted.tokens` have been appended to `seq`."""

    def release(self, seq: Sequence) -> None:
        """The sequence finished or was aborted: free whatever the drafter holds for it."""

    def state_bytes(self, seq: Sequence) -> int:
        """Memory the drafter holds for this sequence."""


# Optional: `seq.draft_depth` (None or an int) is how deep the engine's controller expects a tree to be worth
# drafting this step (one level deeper than what it verified last time); a drafter whose cost grows with depth
# (LongSpec) may stop there. Deeper nodes would only be pruned.


def requested_depth(seq: Sequence, gamma: int, capacity: int) -> int:
    """How deep to draft for `seq`: the drafter's own `gamma`, the controller's hint and the room left in the cache."""
    return max(0, min(gamma, seq.draft_depth or gamma, capacity - seq.num_tokens))


# Optional: a drafter with `has_free_part = True` (a composite with a model-free part) keeps proposing between
# the controller's probes with `seq.draft_free_only` set: only its model-free parts draft then.


# Optional, for drafters that read the target's hidden states (TokenSwift, DFlash). A drafter with a non-empty
# `hidden_layers: tuple[int, ...]` (layer indices, negative from the end; the output of that layer, before the
# final norm) gets, after every target forward that commits tokens of a sequence (prefill chunks and verify
# passes), `observe_hidden(seq, start, hidden, kept)`: `hidden[layer]` holds one row per token of that forward
# and rows `kept[j]` are now committed at position `start + j` (verify: the accepted path, root first).
# It is called before `commit` (verify) and before `start` (prefill).


class StatelessDrafter:
    """Defaults for drafters that keep no per-sequence state."""

    name = "stateless"

    def bind(self, target: Transformer, cache: KVCache) -> None:
        pass

    def start(self, seq: Sequence) -> None:
        pass

    def commit(self, seq: Sequence, accepted: Accepted) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass

    def state_bytes(self, seq: Sequence) -> int:
        return 0


class NullDrafter(StatelessDrafter):
    """Proposes nothing: the engine then does plain decoding through the full speculative machinery."""

    name = "null"

    def propose(self, batch: list[Sequence]) -> list[DraftTree]:
        return [DraftTree.root_only(s.root) for s in batch]


def choose_draft_token(
    seq: Sequence, drafted: list[int], logits: torch.Tensor, generator: torch.Generator | None, top: bool = False
) -> tuple[int, torch.Tensor]:
    """The next chain token from draft logits `[1, V]` under the sequence's sampling parameters (penalties see
    the history plus the tokens drafted so far): the argmax when greedy or `top` (a tree verified by token
    matching accepts the likeliest token most often), else a sample. Returns the token and the processed row,
    which is the proposal distribution the verifier's rejection step needs."""
    history = seq.tokens
    if drafted and needs_presence(seq.params):
        history = torch.cat([seq.tokens, torch.tensor(drafted, dtype=torch.long)])
    row = process_in_context(logits, seq.params, history)[0]
    if seq.params.greedy or top:
        return int(row.argmax()), row
    return sample(row, generator), row


T = TypeVar("T")


def load_once(loaded: dict | None, kind: str, path: str | Path, load: Callable[[Path], T]) -> T:
    """`load(path)`, or what `loaded` (a replica's memo, by kind and resolved path) already holds: the drafters of
    one replica share each draft checkpoint's weights, which they only read (per-sequence state is each drafter's
    own). None: no memo, a fresh load."""
    path = Path(path)
    if loaded is None:
        return load(path)
    key = (kind, str(path.resolve()))
    if key not in loaded:
        loaded[key] = load(path)
    return loaded[key]


def draft_generator(seq: Sequence) -> torch.Generator | None:
    """The drafter's own random stream for a sampled sequence, seeded from the sequence's, so a seeded request
    drafts (and so runs) the same way twice; None when greedy."""
    if seq.generator is None:
        return None
    gen = torch.Generator()
    gen.manual_seed(int(torch.randint(0, 2**62, (), generator=seq.generator)))
    return gen
