"""The one protocol every drafter implements (one file per method beside this one)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol, TypeVar, runtime_checkable

import torch

from spyglass.sampling import needs_presence, process_in_context, sample
from spyglass.sequence import Sequence
from spyglass.tree import DraftTree
from spyglass.verify import Accepted

if TYPE_CHECKING:
    from spyglass.kv_cache import KVCache
    from spyglass.models.llama import Transformer


FREE_KINDS = ("none", "part", "all")


@dataclass(frozen=True)
class DrafterTraits:
    """What the engine, its speculation controller and a composite know of a drafter: declared once, as the class's
    `traits` (or, where they follow its configuration, set once in `__init__`), and never changed afterwards.

    - `free`: what it proposes with no draft step (a lookup, a copied span that goes on), costing next to nothing
      beside a target step. "none": every proposal runs its draft; "all": every proposal is free (model-free:
      suffix, n-gram; timed like any drafter, which shows it); "part": asked `DraftRequest.free_only`, it proposes
      its free part alone (root-only where that has nothing), which the controller asks between its probes. A
      composite's parts that are not "none" keep proposing between probes.
    - `token_matched`: its trees carry no proposal distributions, so a sampled request's tree is verified by token
      matching: it drafts argmaxes (or top candidates) and draws from no random stream. A composite's parts must be.
    - `drafts_chain`: one token per depth (the controller sizes it by its acceptance profile: ChainDepthController).
    - `cost_by_depth`: one draft step per depth, and only as deep as `DraftRequest.depth` asks (the controller then
      charges drafting per kept depth).
    - `hidden_layers`: the target layers whose hidden states it reads (indices, negative from the end; the output
      of that layer, before the final norm): the engine then calls `observe_hidden` (below). Empty: none.
    - `newest_hidden_only`: of the prompt's hidden states it keeps only the last token's (LongSpec's feed_hidden),
      so a context-cache hit, which still computes the prompt's last token, gives it what a miss does; without it a
      drafter with `hidden_layers` gets its whole prompt prefilled (the cache holds K/V only)."""

    free: Literal["none", "part", "all"] = "none"
    token_matched: bool = False
    drafts_chain: bool = False
    cost_by_depth: bool = False
    hidden_layers: tuple[int, ...] = ()
    newest_hidden_only: bool = False

    def __post_init__(self) -> None:
        if self.free not in FREE_KINDS:
            raise ValueError(f"free must be one of {', '.join(FREE_KINDS)}, got {self.free!r}")


@dataclass(frozen=True)
class DraftRequest:
    """What the engine's speculation controller wants from the drafter for one sequence at this step."""

    # How deep a tree is worth drafting (one level deeper than what it verified last time; deeper nodes would only
    # be pruned); None: as deep as the drafter goes. A `cost_by_depth` drafter stops there.
    depth: int | None = None
    # Between the controller's probes: propose only the free part (`DrafterTraits.free`), no draft step.
    free_only: bool = False


@runtime_checkable
class Drafter(Protocol):
    name: str
    traits: DrafterTraits

    def bind(self, target: Transformer, cache: KVCache) -> None:
        """Called once by the engine with its target and KVCache, for drafters that read the target's K/V in
        place (LongSpec, GLIDE: `cache.prefix(seq.slot, layer)` is the committed K/V, no copy)."""

    def start(self, seq: Sequence) -> None:
        """Called once after the target's prefill (the sequence holds the prompt and its first token)."""

    def propose(self, batch: list[Sequence], wants: list[DraftRequest]) -> list[DraftTree]:
        """One draft tree per sequence, rooted at `seq.root`; `wants[i]` is what the controller wants for
        `batch[i]` (a plain `DraftRequest()` without one)."""

    def commit(self, seq: Sequence, accepted: Accepted) -> None:
        """Called after verification, once `accepted.tokens` have been appended to `seq`."""

    def release(self, seq: Sequence) -> None:
        """The sequence finished or was aborted: free whatever the drafter holds for it."""

    def state_bytes(self, seq: Sequence) -> int:
        """Memory the drafter holds for this sequence."""


def requested_depth(seq: Sequence, want: DraftRequest, gamma: int, capacity: int) -> int:
    """How deep to draft for `seq`: the drafter's own `gamma`, the controller's hint and the room left in the cache."""
    return max(0, min(gamma, want.depth or gamma, capacity - seq.num_tokens))


# For a drafter with `traits.hidden_layers`: after every target forward that commits tokens of a sequence (prefill
# chunks and verify passes) the engine calls `observe_hidden(seq, start, hidden, kept)`: `hidden[layer]` holds one
# row per token of that forward and rows `kept[j]` are now committed at position `start + j` (verify: the accepted
# path, root first). It is called before `commit` (verify) and before `start` (prefill).


class StatelessDrafter:
    """Defaults for drafters that keep no per-sequence state."""

    name = "stateless"
    traits = DrafterTraits()

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
    traits = DrafterTraits(free="all", token_matched=True)

    def propose(self, batch: list[Sequence], wants: list[DraftRequest]) -> list[DraftTree]:
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
