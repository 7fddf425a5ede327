"""Drafter-specific loss modules. The trainer loop is drafter-agnostic: it hands a batch (a dict of
tensors read from extraction shards) to a loss module, which runs the draft and returns the loss and
the metrics to log.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LongSpecLoss(nn.Module):
    """Next-token cross-entropy of the LongSpec draft over a context, cross-attending to the target's
    last-layer K/V with a lag (Flash Noisy Training); optionally distils the target's top-1.

    Metrics: `loss`, `ce` and `top1_agreement` (the draft's argmax equals the target's argmax, measured on
    the positions where the draft sees some target context).
    """

    def __init__(self, kv_layer: int, lag_min: int = 1, lag_max: int = 4, distill_weight: float = 0.0) -> None:
        super().__init__()
        self.kv_layer = kv_layer
        self.lag_min, self.lag_max = lag_min, lag_max
        self.distill_weight = distill_weight

    def required_keys(self) -> list[str]:
        return ["tokens", "positions", f"kv.{self.kv_layer}", "topk_ids"]

    def lag(self, step: int, seed: int) -> int:
        """Per step, identical on every rank and after a resume."""
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        return int(torch.randint(self.lag_min, self.lag_max + 1, (1,), generator=g))

    def forward(self, model: nn.Module, batch: dict[str, torch.Tensor], lag: int) -> tuple[torch.Tensor, dict]:
        tokens, positions = batch["tokens"], batch["positions"]
        kv = batch[f"kv.{self.kv_layer}"]  # [B, 2, kvh, L, D]
        logits = model(tokens, positions, kv[:, 0], kv[:, 1], lag=lag)  # [B, L, V]
        labels = tokens[:, 1:]
        pred = logits[:, :-1]
        valid = torch.zeros_like(labels, dtype=torch.bool)
        valid[:, lag:] = True  # queries t >= lag see target K/V; earlier ones still get a CE term
        ce = F.cross_entropy(pred.reshape(-1, pred.shape[-1]), labels.reshape(-1))
        loss = ce
        target_top1 = batch["topk_ids"][:, :-1, 0]
        if self.distill_weight > 0:
            kd = F.cross_entropy(pred.reshape(-1, pred.shape[-1]), target_top1.reshape(-1))
            loss = (1 - self.distill_weight) * ce + self.distill_weight * kd
        with torch.no_grad():
            agree = (pred.argmax(-1) == target_top1) & valid
            agreement = agree.sum().float() / valid.sum().clamp(min=1)
            token_acc = ((pred.argmax(-1) == labels) & valid).sum().float() / valid.sum().clamp(min=1)
        return loss, {"ce": ce.detach(), "top1_agreement": agreement, "token_accuracy": token_acc}


LOSSES = {"longspec": LongSpecLoss}
