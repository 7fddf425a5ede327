"""A copy head (a pointer network over the target's KV cache), shared by the LongSpec and DFlash drafts: per
target KV head, a query from the draft's final hidden state attends over the target's last-layer keys, and
position j proposes the token after it; a gate mixes that with the draft's LM head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from spyglass.models.llama import apply_rope


def init_copy_gate(gate: nn.Linear) -> None:
    """A fifth of the mass copied, spread evenly over the copy heads: the ranking barely moves at first."""
    nn.init.zeros_(gate.weight)
    with torch.no_grad():
        gate.bias.copy_(torch.tensor([0.0] + [-2.5] * (gate.out_features - 1)))


def read_copies(
    head: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor, visible
) -> tuple[torch.Tensor, torch.Tensor]:
    """A copy head (`head.copy_norm`, `copy_q`, `copy_gate`: LongSpec's and DFlash's) over final hidden states `x`
    `[..., L, H]` at RoPE `cos`/`sin` and the target's last-layer post-RoPE keys `[..., kvh, S, D]` (`visible`
    `[L, S]` bool, None = all): the LM head's log-weight `[..., L]` and the copy mass per key position `[..., L, S]`
    (rows sum to 1 - exp(log-weight)). A row that sees no key keeps all its mass on the LM head."""
    kvh, dim = keys.shape[-3], keys.shape[-1]
    h = head.copy_norm(x)
    q = apply_rope(head.copy_q(h).view(*h.shape[:-1], kvh, dim), cos, sin).transpose(-3, -2)
    scores = q.float() @ keys.float().transpose(-1, -2) / math.sqrt(dim)  # [..., kvh, L, S]
    gate = torch.log_softmax(head.copy_gate(h).float(), dim=-1)  # [..., L, 1 + kvh]
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
        blind = ~visible.any(-1)  # [L]
        gate = torch.where(blind.unsqueeze(-1), gate.new_tensor([0.0] + [float("-inf")] * kvh), gate)
        scores = scores.masked_fill(blind.unsqueeze(-1), 0.0)
    per_head = torch.softmax(scores, dim=-1) * gate[..., 1:].exp().transpose(-1, -2).unsqueeze(-1)
    return gate[..., 0], per_head.sum(-3)


def add_copies_log(p: torch.Tensor, mass: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
    """Log of the head's probabilities `p` `[..., V]` (weighted already) plus each context position's copy `mass`
    `[..., S]` on the token after it, `next_tokens` `[S]`; in place on `p`. Most of a row stays 0 (outside the
    draft's rows and the copies), and log(0) costs ~10x log(x > 0) on a CPU: those entries are set to -inf."""
    p = p.scatter_add_(-1, next_tokens.to(p.device).expand(mass.shape), mass)
    return torch.where(p > 0, p.clamp_min(torch.finfo(p.dtype).tiny).log(), float("-inf"))


@dataclass
class CopyMix:
    """A `copy_head` draft's output: its LM head's logits `[..., Vd]`, the log-weight `keep` `[...]` the gate gives
    them, and the rest of the mass spread over the target's context positions, `attn` `[..., S]` (rows sum to
    1 - exp(keep)): position j proposes the token after it."""

    logits: torch.Tensor
    keep: torch.Tensor
    attn: torch.Tensor

    def select(self, index) -> CopyMix:
        """The same rows of each part (an index over the leading dimensions they share)."""
        return CopyMix(self.logits[index], self.keep[index], self.attn[index])

    @staticmethod
    def stack(outs: list[CopyMix]) -> CopyMix:
        return CopyMix(*(torch.stack([getattr(o, f) for o in outs]) for f in ("logits", "keep", "attn")))
