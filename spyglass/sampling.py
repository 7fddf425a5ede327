"""Sampling parameters and the one logits pipeline applied identically to draft and target rows.

Order (as HF generate): repetition penalty, temperature, top-k, top-p, min-p. Temperature 0 means
greedy: the argmax of the penalised logits. Each row of a tree is processed with its own context:
the sequence's tokens plus the drafted ancestors of that node.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 128
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def presence_rows(history: torch.Tensor, vocab: int, n_rows: int, tree_tokens=None, ancestors=None):
    """`[n_rows, vocab]` bool: tokens each row has already seen (history + its drafted ancestors)."""
    base = torch.zeros(vocab, dtype=torch.bool)
    base[history] = True
    rows = base.expand(n_rows, vocab).clone()
    if tree_tokens is not None and ancestors is not None:
        r, c = ancestors.nonzero(as_tuple=True)
        rows[r, tree_tokens[c]] = True
    return rows


def apply_repetition_penalty(logits: torch.Tensor, presence: torch.Tensor, penalty: float) -> torch.Tensor:
    scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(presence, scaled, logits)


def warp(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on fp32 logits `[n, V]` -> probabilities `[n, V]`."""
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= (1.0 - p.top_p)
        drop_sorted[..., -1] = False  # always keep the most likely token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.min_p > 0.0:
        floor = p.min_p * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def process(logits: torch.Tensor, p: SamplingParams, presence: torch.Tensor | None) -> torch.Tensor:
    """Greedy: penalised logits (take the argmax). Sampling: the probabilities to sample from."""
    if p.repetition_penalty != 1.0 and presence is not None:
        logits = apply_repetition_penalty(logits, presence, p.repetition_penalty)
    return logits if p.greedy else warp(logits, p)


def needs_presence(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))
