"""A draft's reduced vocabulary (FR-Spec): the rows of the target's LM head it scores."""

from __future__ import annotations

import torch

from spyglass.models.linear import planned_linear
from spyglass.weights import load_weights


class VocabSubset:
    """The tokens a draft proposes (FR-Spec: the most frequent ones it was trained on): logits for those rows of the
    target's LM head only, -inf elsewhere, so a draft step reads a fraction of the head and never proposes the
    other tokens (the output is still the target's). A new subset is a new object: no stale rows."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids.long()
        self._rows: torch.Tensor | None = None  # the head's rows for `ids`, gathered once per weight dtype

    @staticmethod
    def checked(ids: torch.Tensor, vocab_size: int, where: str) -> torch.Tensor:
        """`ids` read from a checkpoint, or ValueError naming `where`."""
        if ids.ndim != 1 or ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            raise ValueError(f"{where}: vocab_ids do not index the target's vocabulary")
        return ids.long()

    def logits(self, hidden: torch.Tensor, head: torch.nn.Linear) -> torch.Tensor:
        """`hidden [N, H]` through `head` (weight `[V, H]`) -> fp32 `[N, V]`, on the head's measured kernel plan
        (MKL's GEMM reads these rows at a fifth of oneDNN's speed on Zen 4: 3 ms instead of ~0.8 for 8K rows)."""
        weight = head.weight
        if self._rows is None or self._rows.dtype != weight.dtype:
            self._rows = weight.detach()[self.ids].contiguous()
        full = hidden.new_full((hidden.shape[0], weight.shape[0]), float("-inf"), dtype=torch.float32)
        rows = planned_linear(hidden.to(weight.dtype), self._rows, None, getattr(head, "plan", None))
        full[:, self.ids] = rows.float()
        return full


class ProposesSubset:
    """A mixin for a draft module: `vocab_ids` (None = the whole vocabulary) backed by a `VocabSubset`."""

    _subset: VocabSubset | None = None

    @property
    def vocab_ids(self) -> torch.Tensor | None:
        return None if self._subset is None else self._subset.ids

    @vocab_ids.setter
    def vocab_ids(self, ids: torch.Tensor | None) -> None:
        self._subset = None if ids is None else VocabSubset(ids)

    def head_logits(self, hidden: torch.Tensor, lm_head: torch.nn.Linear) -> torch.Tensor:
        """`hidden [N, H]` through the target's LM head, over `vocab_ids` when set -> fp32 `[N, V]`."""
        if self._subset is not None:
            return self._subset.logits(hidden, lm_head)
        return lm_head(hidden.to(lm_head.weight.dtype)).float()


def load_draft_state(module: torch.nn.Module, weights, dtype: torch.dtype, what: str, vocab_size: int) -> None:
    """A checkpoint's weights into `module` (ValueError naming `what` if a tensor does not fit), with its proposal
    vocabulary (`vocab_ids`) checked against the target's when it has one."""
    state = load_weights(weights, dtype)
    vocab_ids = state.pop("vocab_ids", None)
    try:
        module.load_state_dict(state)
    except RuntimeError as e:
        raise ValueError(f"{what}: {e}") from e
    if vocab_ids is not None:
        module.vocab_ids = VocabSubset.checked(vocab_ids, vocab_size, what)
