"""TokenSwift's multi-token heads: gamma residual linear layers on the target's last hidden state.

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

from spyglass.drafters.base import ProposesSubset, VocabSubset
from spyglass.sampling import SamplingParams, apply_repetition_penalty, process
from spyglass.weights import load_weights, save_weights, weights_path

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
            normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight[i]
            h = h + (normed @ self.proj[i].T).to(h.dtype)
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
    state = load_weights(root / WEIGHTS_FILE, torch.float32)  # the heads run in fp32 whatever the target
    vocab_ids = state.pop("vocab_ids", None)
    try:
        heads.load_state_dict(state)
    except RuntimeError as e:
        raise ValueError(f"TokenSwift heads {root}: {e}") from e
    if vocab_ids is not None:
        heads.vocab_ids = VocabSubset.checked(vocab_ids, target.args.vocab_size, f"TokenSwift heads {root}")
    return heads.eval()


def window_mask(
    tokens: torch.Tensor, ctx: torch.Tensor, end: torch.Tensor, window: int, vocab: torch.Tensor | None, n_cols: int
) -> torch.Tensor:
    """`[m, n_cols]` bool: the tokens among `tokens[ctx, end - window : end]` (row by row), as columns of the
    reduced vocabulary `vocab` (sorted ids; tokens outside it are dropped) or of the full one."""
    idx = end[:, None] - window + torch.arange(window)
    toks = tokens[ctx[:, None], idx.clamp(min=0)]
    valid = idx >= 0
    if vocab is not None:
        col = torch.searchsorted(vocab, toks).clamp(max=len(vocab) - 1)
        valid &= vocab[col] == toks
        toks = col
    mask = torch.zeros(len(ctx), n_cols + 1, dtype=torch.bool)
    mask.scatter_(1, torch.where(valid, toks, n_cols), True)  # invalid entries land in the spare last column
    return mask[:, :n_cols]


def heads_loss(
    heads: TokenSwiftHeads,
    target,
    h0: torch.Tensor,
    tokens: torch.Tensor,
    pos: torch.Tensor,
    vocab: torch.Tensor | None = None,
    distill: float = 0.0,
    sampling: SamplingParams | None = None,
):
    """Sum over heads i = 1..gamma of the loss of head i at position t on token t + 1 + i, through the frozen norm
    and head: (1 - distill) x CE against the corpus token + distill x CE against the target's own distribution
    there (its logits at t + i, computed from the stored hidden state: acceptance means matching the target, not
    the corpus, and the soft label carries what a sampled continuation would make of it).

    `sampling` (a sampled request's parameters) trains for serving under them: the teacher is the distribution
    the target samples from there (contextual penalty over the window before token t + 1 + i, temperature,
    min-p...), and the head's logits get the penalty the drafter applies, over the window ending at token t + 1
    (the step's root: a drafter processes every depth with the start-of-step context).

    `h0` `[n, L, d]` last-layer hidden states, `tokens` `[n, L]`, `pos` `[m, 2]` (context, t) rows with
    t + 1 + gamma < L. `vocab` (sorted token ids): a cheaper training loss over only those rows of the LM head,
    positions whose corpus token lies outside dropped (the head is most of the cost on a CPU). Returns (loss,
    per-head corpus CE list, per-head metrics: top-1 vs the corpus, top-1 vs the target's argmax, and the target's
    probability of the head's top-1 token, i.e. its acceptance rate at T=1)."""
    ctx, t = pos[:, 0], pos[:, 1]
    h = h0[ctx, t].float()
    ces, losses = [], []
    metrics = {"top1": [], "target_top1": [], "target_prob": []}
    streams = heads(h)
    weight = target.lm_head.weight if vocab is None else target.lm_head.weight[vocab]
    penalised = sampling is not None and sampling.contextual_penalty != 1.0
    if penalised:
        draft_window = window_mask(tokens, ctx, t + 2, sampling.penalty_window, vocab, weight.shape[0])
    for i in range(1, heads.gamma + 1):
        logits = (target.norm(streams[i]) @ weight.T).float()
        with torch.no_grad():
            teacher = (target.norm(h0[ctx, t + i].float()) @ weight.T).float()
            if sampling is None:
                teacher = teacher.softmax(-1)
            else:
                window = (
                    window_mask(tokens, ctx, t + i + 1, sampling.penalty_window, vocab, weight.shape[0])
                    if penalised
                    else None
                )
                teacher = process(teacher, sampling, None, window)
                if sampling.greedy:  # process gives the penalised logits: the teacher is their softmax
                    teacher = teacher.softmax(-1)
        if penalised:
            logits = apply_repetition_penalty(logits, draft_window, sampling.contextual_penalty)
        want = tokens[ctx, t + 1 + i]
        if vocab is not None:
            idx = torch.searchsorted(vocab, want).clamp(max=len(vocab) - 1)
            keep = vocab[idx] == want
            logits, want, teacher = logits[keep], idx[keep], teacher[keep]
        ce = nn.functional.cross_entropy(logits, want)
        ces.append(ce)
        soft = -(teacher * logits.log_softmax(-1)).sum(-1).mean() if distill else 0.0
        losses.append((1 - distill) * ce + distill * soft)
        pick = logits.argmax(-1)
        metrics["top1"].append(float((pick == want).float().mean()))
        metrics["target_top1"].append(float((pick == teacher.argmax(-1)).float().mean()))
        metrics["target_prob"].append(float(teacher.gather(1, pick[:, None]).mean()))
    return sum(losses), [float(c.detach()) for c in ces], metrics
