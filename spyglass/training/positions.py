"""Anchor-Offset position ids (LongSpec): keep the first `anchors` positions, shift the rest by an offset.

Short training sequences then exercise large RoPE indices, while the attention-sink positions stay put.
The offset is a deterministic function of (seed, the first `hash_tokens` tokens): a context always gets the
same positions, and any cached prefix block (whose key chains the tokens from position 0) implies them.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

import torch


def anchor_offset_positions(length: int, anchors: int, offset: int) -> torch.Tensor:
    """`[0, 1, .., anchors-1, anchors+offset, anchors+1+offset, ..]` of `length` entries."""
    pos = torch.arange(length, dtype=torch.int64)
    pos[anchors:] += offset
    return pos


@dataclass(frozen=True)
class PositionScheme:
    """How extraction (and training) numbers the tokens of a context.

    scheme: "plain" (0..L-1) or "anchor_offset"; max_offset bounds the random offset (inclusive);
    the model's max position further caps it so every index stays inside the trained RoPE range.
    """

    scheme: str = "plain"
    anchors: int = 4
    max_offset: int = 0
    seed: int = 0
    hash_tokens: int = 16

    def __post_init__(self) -> None:
        if self.scheme not in ("plain", "anchor_offset"):
            raise ValueError(f"unknown position scheme {self.scheme!r} (plain | anchor_offset)")
        if self.anchors < 0 or self.max_offset < 0 or self.hash_tokens < 1:
            raise ValueError("anchors and max_offset must be >= 0, hash_tokens >= 1")

    @classmethod
    def from_dict(cls, d: dict | None) -> PositionScheme:
        return cls(**(d or {}))

    def to_dict(self) -> dict:
        return asdict(self)

    def tag(self) -> str:
        """A short string naming the scheme, for cache namespaces and manifests."""
        if self.scheme == "plain":
            return "plain"
        return f"ao-a{self.anchors}-m{self.max_offset}-s{self.seed}-h{self.hash_tokens}"

    def offset(self, tokens: torch.Tensor, max_position: int | None = None) -> int:
        """The context's offset: a hash of (seed, its first tokens), uniform in [0, bound]."""
        if self.scheme == "plain":
            return 0
        length = int(tokens.shape[0])
        bound = self.max_offset
        if max_position is not None:
            bound = max(0, min(bound, max_position - length))
        head = tokens[: self.hash_tokens].to(torch.int64).numpy().tobytes()
        h = hashlib.sha256(f"{self.seed}:".encode() + head).digest()
        return int.from_bytes(h[:8], "little") % (bound + 1)

    def positions(self, tokens: torch.Tensor, max_position: int | None = None) -> torch.Tensor:
        """Position ids `[L]` for one context."""
        length = int(tokens.shape[0])
        if self.scheme == "plain":
            return torch.arange(length, dtype=torch.int64)
        return anchor_offset_positions(length, self.anchors, self.offset(tokens, max_position))
