"""The DFlash draft network and its checkpoints (trained by `spyglass.training.dflash`, served by
`spyglass.drafters.dflash`).

One draft forward proposes a whole block: the input is `[root, MASK x (b-1)]` at positions `P .. P+b-1`
(P = the root's position), attention inside the block is non-causal, and every draft layer also attends to
the *context stream*: hidden states of a few target layers, concatenated, projected (`fc`) and normalised
(`hidden_norm`), then turned into that layer's keys/values. Outputs at block positions 1..b-1 go through the
draft's final norm and the target's frozen LM head: b-1 draft distributions, each conditioned on the
context only (positions inside the block do not see each other's drafted tokens).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from spyglass.attention import tree_attention
from spyglass.models.drafts import target_shape
from spyglass.models.drafts.copy_head import init_copy_gate, read_copies
from spyglass.models.drafts.vocab import ProposesSubset, load_draft_state
from spyglass.models.linear import Linear
from spyglass.models.llama import ModelArgs, RMSNorm, Transformer, apply_rope
from spyglass.weights import STORED_DTYPE, save_weights, weights_path


def default_target_layers(n_target_layers: int, n: int = 3) -> tuple[int, ...]:
    """`n` target layers evenly spaced from layer 1 to layer L-3 (DFlash's rule), as layer-output indices."""
    lo, hi = 1, max(1, n_target_layers - 3)
    if n == 1:
        return (hi,)
    return tuple(sorted({round(lo + i * (hi - lo) / (n - 1)) for i in range(n)}))


@dataclass
class DFlashConfig:
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    target_layers: tuple[int, ...]
    n_layers: int = 2
    block_size: int = 16
    rms_eps: float = 1e-6
    qkv_bias: bool = False
    init_std: float = 0.02
    # A copy head (LongSpec's, `spyglass.models.drafts.copy_head`): per target KV head a query from the final hidden
    # state of the block position before a drafted token (the root's, for the first: it holds the token to be found
    # in the context, as a LongSpec node does) points over the target's last-layer keys, position j proposing the
    # token after it; a gate mixes that with the LM head. It lets `dflash-span` hang the context's text below a block.
    copy_head: bool = False
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_target(cls, a: ModelArgs, **overrides) -> DFlashConfig:
        base = target_shape(a, qkv_bias=a.qkv_bias, target_layers=default_target_layers(a.n_layers)) | {
            k: v for k, v in overrides.items() if v is not None
        }
        base["target_layers"] = tuple(int(i) % a.n_layers for i in base["target_layers"])
        return cls(**base)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["target_layers"] = list(self.target_layers)
        return d


class DFlashLayer(nn.Module):
    """A Llama block whose keys/values are [context stream; block] and whose attention has no causal mask."""

    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.c = c
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_eps)
        self.wqkv = Linear(c.hidden_size, q_dim + 2 * kv_dim, bias=c.qkv_bias)
        self.wo = Linear(q_dim, c.hidden_size, bias=False)
        self.mlp_norm = RMSNorm(c.hidden_size, c.rms_eps)
        self.w_gate_up = Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.w_down = Linear(c.intermediate_size, c.hidden_size, bias=False)

    def kv(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Context keys/values `[kv_heads, n, D]` (keys roped at their positions) from the projected stream."""
        c = self.c
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        w = self.wqkv.weight[q_dim:]
        b = self.wqkv.bias[q_dim:] if self.wqkv.bias is not None else None
        kv = F.linear(ctx, w, b)
        n = ctx.shape[0]
        k = apply_rope(kv[:, :kv_dim].view(n, c.n_kv_heads, c.head_dim), cos, sin)
        v = kv[:, kv_dim:].view(n, c.n_kv_heads, c.head_dim)
        return k.transpose(0, 1), v.transpose(0, 1)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask: torch.Tensor | None) -> torch.Tensor:
        """x `[Q, H]` block tokens; ctx_k/v `[kv_heads, S, D]`; mask `[Q, S+Q]` bool (None = all visible)."""
        c = self.c
        n = x.shape[0]
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        qkv = self.wqkv(self.attn_norm(x))
        q = apply_rope(qkv[:, :q_dim].view(n, c.n_heads, c.head_dim), cos, sin).transpose(0, 1)
        k = apply_rope(qkv[:, q_dim : q_dim + kv_dim].view(n, c.n_kv_heads, c.head_dim), cos, sin).transpose(0, 1)
        v = qkv[:, q_dim + kv_dim :].view(n, c.n_kv_heads, c.head_dim).transpose(0, 1)
        if mask is None:  # serving: one block over the whole context, read in place by the hybrid tree attention
            o = tree_attention(q, ctx_k, ctx_v, k, v, torch.ones(n, n, dtype=torch.bool), backend="auto")
        else:  # training: many blocks, each masked to its own anchor
            k, v = torch.cat([ctx_k, k], dim=1), torch.cat([ctx_v, v], dim=1)
            g = c.n_heads // c.n_kv_heads
            if g > 1:
                k, v = k.repeat_interleave(g, dim=0), v.repeat_interleave(g, dim=0)
            o = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask)[0]
        h = x + self.wo(o.transpose(0, 1).reshape(n, q_dim))
        gate, up = self.w_gate_up(self.mlp_norm(h)).chunk(2, dim=-1)
        return h + self.w_down(F.silu(gate) * up)


class DFlashDraft(ProposesSubset, nn.Module):
    """The trained part of DFlash (`fc`, `hidden_norm`, the mask embedding, the layers, a final norm) on top of
    the target's frozen embedding and LM head, which are referenced, not owned (not in the state dict). It proposes
    `vocab_ids` only (its training softmax's rows) when they are set."""

    def __init__(self, cfg: DFlashConfig, embed: nn.Embedding, lm_head: nn.Linear, inv_freq, rope_scaling=1.0):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = Linear(len(cfg.target_layers) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_eps)
        self.mask_embed = nn.Parameter(torch.zeros(h))
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(h, cfg.rms_eps)
        if cfg.copy_head:
            self.copy_norm = RMSNorm(h, cfg.rms_eps)
            self.copy_q = Linear(h, cfg.n_kv_heads * cfg.head_dim, bias=False)
            self.copy_gate = Linear(h, 1 + cfg.n_kv_heads)  # log-weights: the LM head, then each copy head
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=cfg.init_std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        nn.init.normal_(self.mask_embed, std=cfg.init_std)
        if cfg.copy_head:
            init_copy_gate(self.copy_gate)
        self._io = (embed, lm_head)  # a tuple: shared with the target, frozen, never checkpointed
        self.register_buffer("inv_freq", inv_freq.clone().float(), persistent=False)
        self.rope_scaling = rope_scaling

    @classmethod
    def from_target(cls, target: Transformer, init_from_target: bool = False, **overrides) -> DFlashDraft:
        """A draft sharing `target`'s embedding and head; `init_from_target` copies the target's last layers
        and final norm where shapes match (a better start than random for a short training budget)."""
        cfg = DFlashConfig.from_target(target.args, **overrides)
        draft = cls(cfg, target.embed, target.lm_head, target.inv_freq, target.rope_scaling)
        if init_from_target:
            src_layers = target.layers[-cfg.n_layers :]
            with torch.no_grad():
                for dst, src in zip(draft.layers, src_layers, strict=True):
                    for name in ("attn_norm", "wqkv", "wo", "mlp_norm", "w_gate_up", "w_down"):
                        s, d = getattr(src, name).state_dict(), getattr(dst, name).state_dict()
                        if all(k in s and s[k].shape == v.shape for k, v in d.items()):
                            getattr(dst, name).load_state_dict(s)
                draft.norm.weight.copy_(target.norm.weight)
                # the context stream starts as the deepest tapped layer's output, normed as the first copied layer
                # norms its input: where that tap feeds that layer (the default taps, 2 layers), its context
                # keys/values start as the target's own
                h = cfg.hidden_size
                deepest = cfg.target_layers.index(max(cfg.target_layers))
                draft.fc.weight.zero_()
                draft.fc.weight[:, deepest * h : (deepest + 1) * h].copy_(torch.eye(h))
                draft.hidden_norm.weight.copy_(src_layers[0].attn_norm.weight)
        return draft.to(device=target.device, dtype=target.dtype)

    @property
    def embed(self) -> nn.Embedding:
        return self._io[0]

    @property
    def lm_head(self) -> nn.Linear:
        return self._io[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(self.inv_freq.device).float().unsqueeze(-1) * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        cos = (emb.cos() * self.rope_scaling).to(self.dtype).unsqueeze(1)
        sin = (emb.sin() * self.rope_scaling).to(self.dtype).unsqueeze(1)
        return cos, sin

    def context_kv(self, feats: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Concatenated target hidden states `[n, layers*H]` -> per draft layer (k, v) `[kv_heads, n, D]`."""
        ctx = self.hidden_norm(self.fc(feats.to(self.dtype)))
        cos, sin = self.rope(positions)
        return [layer.kv(ctx, cos, sin) for layer in self.layers]

    def block_input(self, first: torch.Tensor, block: int) -> torch.Tensor:
        """`[A]` first tokens -> `[A*block, H]` embeddings of `[first, MASK x (block-1)]` per block."""
        x = self.mask_embed.expand(first.shape[0], block, -1).clone()
        x[:, 0] = self.embed(first.to(x.device)).to(x.dtype)
        return x.reshape(-1, x.shape[-1])

    def blocks_hidden(self, x, positions, ctx: list[tuple[torch.Tensor, torch.Tensor]], mask=None) -> torch.Tensor:
        """Run the block tokens `x [Q, H]` through the layers; returns the final-normed hidden states."""
        cos, sin = self.rope(positions)
        for layer, (k, v) in zip(self.layers, ctx, strict=True):
            x = layer(x, cos, sin, k, v, mask)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head_logits(hidden, self.lm_head)

    def copy_read(
        self, hidden: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The copy head (`read_copies`) over final hidden states `[Q, H]` queried at `positions` and the target's
        last-layer keys `[kvh, S, D]`: the LM head's log-weight `[Q]` and the copy mass per key position `[Q, S]`."""
        return read_copies(self, hidden, *self.rope(positions), keys, visible)


def save_dflash(draft: DFlashDraft, out: str | Path, dtype: torch.dtype = STORED_DTYPE, card: dict | None = None):
    """`draft_config.json` + `draft.safetensors` (trained tensors only, in `dtype`; token ids as integers)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"kind": "dflash", **draft.cfg.to_dict(), **({"card": card} if card else {})}
    (out / "draft_config.json").write_text(json.dumps(cfg, indent=1))
    state = dict(draft.state_dict())
    if draft.vocab_ids is not None:
        state["vocab_ids"] = draft.vocab_ids
    save_weights(state, out / "draft.safetensors", dtype)


def load_dflash(checkpoint: str | Path, target: Transformer) -> DFlashDraft:
    """A DFlash checkpoint on top of `target`'s frozen embedding and head. ValueError if it does not fit."""
    root = Path(checkpoint)
    cfg_file, weights = root / "draft_config.json", weights_path(root / "draft.safetensors")
    if not cfg_file.is_file() or not weights.is_file():
        raise ValueError(f"{root} is not a DFlash checkpoint (needs draft_config.json and draft.safetensors[.xz])")
    cfg = json.loads(cfg_file.read_text())
    kind = cfg.pop("kind", None)
    cfg.pop("card", None)
    if kind != "dflash":
        raise ValueError(f"{root} holds a {kind!r} draft, not a DFlash one")
    a = target.args
    shape = {"hidden_size": a.hidden_size, "vocab_size": a.vocab_size}
    wrong = {k: (cfg.get(k), v) for k, v in shape.items() if cfg.get(k) != v}
    if wrong or max(cfg["target_layers"]) >= a.n_layers:
        raise ValueError(f"DFlash checkpoint {root} does not fit the target (draft, target): {wrong or 'layers'}")
    draft = DFlashDraft.from_target(target, **cfg)
    load_draft_state(draft, weights, target.dtype, f"DFlash checkpoint {root}", a.vocab_size)
    return draft.to(device=target.device, dtype=target.dtype).eval()


__all__ = ["DFlashConfig", "DFlashDraft", "DFlashLayer", "default_target_layers", "load_dflash", "save_dflash"]
