"""TokenSwift's multi-token heads (trained by `spyglass.training.tokenswift_train`, served by
`spyglass.drafters.tokenswift`): gamma residual linear layers on the target's last hidden state.

h_0 is the output of the target's last layer (before the final norm); head i computes
h_i = h_{i-1} + W_i rmsnorm_i(h_{i-1}) and its logits go through the target's own frozen final norm and LM
head, so one pass over the target gives gamma + 1 next-token distributions (positions t+1 .. t+1+gamma).
The heads are chained, not independent (Medusa): each refines the previous one's residual stream.
W_i starts at zero, so an untrained head repeats the base distribution (a usable, honest default).

A checkpoint is `heads.safetensors` + `heads_config.json`; the config records the target's shape and a
numeric signature of its final norm and LM head, so heads trained for another model are refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from spyglass.models.drafts.vocab import ProposesSubset, load_draft_state
from spyglass.weights import save_weights, weights_path

CONFIG_FILE, WEIGHTS_FILE = "heads_config.json", "heads.safetensors"


def target_signature(target) -> dict:
    """Shape plus a few statistics of the frozen parts the heads were trained through (dtype-robust)."""
    a = target.args
    w = target.lm_head.weight.detach().float()
    return {
        "hidden_size": a.hidden_size,
        "vocab_size": a.vocab_size,
        "n_layers": a.n_layers,
        "norm_weight_mean": float(target.norm.weight.detach().float().mean()),
        "lm_head_abs_mean": float(w.abs().mean()),
        "lm_head_row0_sum": float(w[0].sum()),
    }


def signature_mismatch(saved: dict, target) -> list[str]:
    """Names of the signature entries that differ (statistics compared with a 2% tolerance)."""
    now = target_signature(target)
    bad = []
    for key, value in now.items():
        old = saved.get(key)
        if isinstance(value, int):
            if old != value:
                bad.append(f"{key} {old} != {value}")
        elif old is None or abs(old - value) > 0.02 * max(abs(value), 1e-3):
            bad.append(f"{key} {old} != {value:.6g}")
    return bad


class TokenSwiftHeads(ProposesSubset, nn.Module):
    """Heads trained on a reduced vocabulary ship its ids (`vocab_ids`) and score only those tokens."""

    def __init__(self, hidden_size: int, gamma: int = 3, eps: float = 1e-6) -> None:
        super().__init__()
        self.gamma, self.eps = gamma, eps
        self.norm_weight = nn.Parameter(torch.ones(gamma, hidden_size))
        self.proj = nn.Parameter(torch.zeros(gamma, hidden_size, hidden_size))  # [i, out, in]

    def forward(self, h0: torch.Tensor) -> list[torch.Tensor]:
        """`h0` `[..., d]` -> [h_0, h_1, ..., h_gamma] (residual streams, not normalised)."""
        hs = [h0]
        h = h0
        for i in range(self.gamma):
            hf = h.float()
            normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight[i].float()
            h = h + (normed.to(self.proj.dtype) @ self.proj[i].T).to(h.dtype)  # in the heads' dtype (the target's)
            hs.append(h)
        return hs

    def logits(self, target, h0: torch.Tensor, streams: slice = slice(None)) -> torch.Tensor:
        """`[k, ..., V]` fp32 logits of `streams` (default: all gamma + 1) through the target's final norm and LM
        head, in one matmul: the head's weights are read once for every stream (on a CPU, most of the cost)."""
        h = torch.stack(self(h0)[streams])
        flat = target.norm(h.reshape(-1, h.shape[-1]))
        return self.head_logits(flat, target.lm_head).view(*h.shape[:-1], -1)

    def save(self, out_dir: str | Path, target, extra: dict | None = None) -> None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        cfg = {"kind": "tokenswift-heads", "gamma": self.gamma, "eps": self.eps, "target": target_signature(target)}
        cfg.update(extra or {})
        state = dict(self.state_dict())
        if self.vocab_ids is not None:
            state["vocab_ids"] = self.vocab_ids
        save_weights(state, out / WEIGHTS_FILE)
        (out / CONFIG_FILE).write_text(json.dumps(cfg, indent=1))


def load_heads(checkpoint: str | Path, target) -> TokenSwiftHeads:
    """Heads from a checkpoint directory, checked against `target`; ValueError says what does not fit."""
    root = Path(checkpoint)
    if not (root / CONFIG_FILE).is_file() or not weights_path(root / WEIGHTS_FILE).is_file():
        raise ValueError(f"{root} is not a TokenSwift heads checkpoint (needs {CONFIG_FILE} and {WEIGHTS_FILE}[.xz])")
    cfg = json.loads((root / CONFIG_FILE).read_text())
    if cfg.get("kind") != "tokenswift-heads":
        raise ValueError(f"{root} holds a {cfg.get('kind')!r} checkpoint, not TokenSwift heads")
    bad = signature_mismatch(cfg.get("target", {}), target)
    if bad:
        raise ValueError(f"TokenSwift heads {root} were trained for another model ({'; '.join(bad)})")
    heads = TokenSwiftHeads(target.args.hidden_size, int(cfg["gamma"]), float(cfg.get("eps", 1e-6)))
    # the heads run in fp32 whatever the target
    load_draft_state(heads, root / WEIGHTS_FILE, torch.float32, f"TokenSwift heads {root}", target.args.vocab_size)
    return heads.eval()
