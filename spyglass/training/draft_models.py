"""Draft models trained by the pipeline.

`LongSpecDraft` is the LongSpec one-block drafter: sliding-window self-attention over its own tokens,
cross-attention into the target's last-layer post-RoPE K/V (GLIDE reads the top layers the same way),
a SwiGLU MLP, and the target's frozen embedding and LM head (no final norm, as in LongSpec); optionally
(`feed_hidden`, not in the paper) a projection of the target's last hidden state added before the cross-attention,
the way EAGLE feeds the target's features to its draft. Only the
block is trained and checkpointed; the frozen parts are re-read from the target. `draft_logits` runs the
same block at inference over a window cache and the target's KVCache, through the hybrid tree attention
(`spyglass.attention`), for the serving drafter to wrap.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from spyglass.attention import cross_attention, tree_attention
from spyglass.models.llama import ModelArgs, RMSNorm, Transformer, apply_rope


@dataclass
class LongSpecDraftConfig:
    """Shapes follow the target (hidden size, heads, head dim must match its K/V); the MLP may be narrower."""

    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_eps: float = 1e-6
    window: int = 512
    qkv_bias: bool = True
    init_std: float = 0.02
    draft_vocab: int = 0  # > 0: the head scores only this many frequency-ranked tokens (FR-Spec); 0 = all
    init_layer: int | None = None  # copy the self-attention and MLP of this target layer instead of random init
    feed_hidden: bool = False  # also read the target's last hidden state (EAGLE-style), as stale as its K/V
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_target(cls, a: ModelArgs, **overrides) -> LongSpecDraftConfig:
        base = dict(
            hidden_size=a.hidden_size,
            n_heads=a.n_heads,
            n_kv_heads=a.n_kv_heads,
            head_dim=a.head_dim,
            intermediate_size=a.intermediate_size,
            vocab_size=a.vocab_size,
            rms_eps=a.rms_eps,
        )
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)

    def to_dict(self) -> dict:
        return asdict(self)


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """`[B, kvh, S, D]` -> `[B, kvh*n_rep, S, D]` (GQA)."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def sliding_window_mask(length: int, window: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive `[L, L]` mask: query i sees keys i-window < j <= i."""
    i = torch.arange(length).unsqueeze(1)
    j = torch.arange(length).unsqueeze(0)
    ok = (j <= i) & (j > i - window)
    return torch.zeros(length, length, dtype=dtype).masked_fill(~ok, float("-inf"))


def lagged_cross_mask(q_len: int, kv_len: int, lag: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Additive `[Lq, Lkv]` mask where query t sees target positions <= t - lag, and the rows with no key.

    The lag mimics inference, where the target's cache trails the draft by the tokens not yet verified.
    """
    t = torch.arange(q_len).unsqueeze(1)
    j = torch.arange(kv_len).unsqueeze(0)
    ok = j <= t - lag
    empty = ~ok.any(dim=1)
    ok = ok | empty.unsqueeze(1)  # keep softmax finite; those rows are zeroed afterwards
    return torch.zeros(q_len, kv_len, dtype=dtype).masked_fill(~ok, float("-inf")), empty


class LongSpecDraft(nn.Module):
    """One draft block over frozen target embeddings; `forward` returns logits `[B, L, vocab]`."""

    def __init__(
        self,
        cfg: LongSpecDraftConfig,
        embed: nn.Embedding,
        lm_head: nn.Linear,
        inv_freq: torch.Tensor,
        rope_scaling: float = 1.0,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        h, q_dim, kv_dim = cfg.hidden_size, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.attn_norm = RMSNorm(h, cfg.rms_eps)
        self.wqkv = nn.Linear(h, q_dim + 2 * kv_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(q_dim, h, bias=False)
        self.cross_norm = RMSNorm(h, cfg.rms_eps)
        self.cross_q = nn.Linear(h, q_dim, bias=cfg.qkv_bias)
        self.cross_o = nn.Linear(q_dim, h, bias=False)
        self.mlp_norm = RMSNorm(h, cfg.rms_eps)
        self.w_gate_up = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.w_down = nn.Linear(cfg.intermediate_size, h, bias=False)
        if cfg.feed_hidden:
            self.hidden_norm = RMSNorm(h, cfg.rms_eps)
            self.hidden_proj = nn.Linear(h, h, bias=False)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=cfg.init_std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        if cfg.feed_hidden:  # starts as the K/V-only draft (and can warm-start from one)
            nn.init.zeros_(self.hidden_proj.weight)
        # Frozen, shared with the target (not part of checkpoints).
        self.embed = embed
        self.full_head = lm_head
        for p in (*embed.parameters(), *lm_head.parameters()):
            p.requires_grad_(False)
        # The reduced head: rows `vocab_ids` of the shared head (set_vocab); the ids ship in the checkpoint.
        self.register_buffer("vocab_ids", torch.arange(cfg.draft_vocab or cfg.vocab_size), persistent=True)
        self.lm_head = lm_head if not cfg.draft_vocab else nn.Linear(cfg.hidden_size, cfg.draft_vocab, bias=False)
        if cfg.draft_vocab:
            self.set_vocab(self.vocab_ids)
        self.register_buffer("inv_freq", inv_freq.clone().float(), persistent=False)
        self.rope_scaling = rope_scaling

    @classmethod
    def from_target(cls, target: Transformer, **overrides) -> LongSpecDraft:
        cfg = LongSpecDraftConfig.from_target(target.args, **overrides)
        embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        embed.weight = nn.Parameter(target.embed.weight.detach().clone().float(), requires_grad=False)
        head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if target.args.tie_embeddings:
            head.weight = embed.weight
        else:
            head.weight = nn.Parameter(target.lm_head.weight.detach().clone().float(), requires_grad=False)
        draft = cls(cfg, embed, head, target.inv_freq, target.rope_scaling)
        if cfg.init_layer is not None:
            layer = target.layers[cfg.init_layer]
            with torch.no_grad():
                for name in ("attn_norm", "wqkv", "wo", "mlp_norm", "w_gate_up", "w_down"):
                    src = getattr(layer, name).state_dict()
                    if all(src[k].shape == v.shape for k, v in getattr(draft, name).state_dict().items() if k in src):
                        getattr(draft, name).load_state_dict(src, strict=False)
        return draft

    def set_vocab(self, ids: torch.Tensor) -> None:
        """Score only the target tokens `ids` (most frequent first): the head becomes those rows of the shared
        head. Tokens outside are never proposed, which costs acceptance only when the target picks one."""
        if not self.cfg.draft_vocab or ids.shape != (self.cfg.draft_vocab,):
            raise ValueError(f"vocab ids must have shape ({self.cfg.draft_vocab},) for this draft")
        self.vocab_ids.copy_(ids)
        w = self.full_head.weight.detach()[ids.to(self.full_head.weight.device)].clone()
        self.lm_head.weight = nn.Parameter(w, requires_grad=False)

    def full_to_draft_ids(self) -> torch.Tensor:
        """`[vocab]` map from a target token id to its row in the draft head, -1 when not scored."""
        table = torch.full((self.cfg.vocab_size,), -1, dtype=torch.long)
        table[self.vocab_ids] = torch.arange(self.vocab_ids.shape[0])
        return table

    def to_full_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-head logits `[..., Vd]` as target-vocab logits (unscored tokens at -inf)."""
        if not self.cfg.draft_vocab:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.cfg.vocab_size), float("-inf"))
        full[..., self.vocab_ids] = logits
        return full

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Only the draft block (and the reduced head's token ids): what checkpoints hold."""
        names = {n for n, p in self.named_parameters() if p.requires_grad}
        if self.cfg.draft_vocab:
            names.add("vocab_ids")
        return {k: v for k, v in self.state_dict().items() if k in names}

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin `[B, L, 1, D]` for position ids `[B, L]`, same frequencies as the target."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.rope_scaling).to(dtype).unsqueeze(2), (emb.sin() * self.rope_scaling).to(
            dtype
        ).unsqueeze(2)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        target_k: torch.Tensor,
        target_v: torch.Tensor,
        lag: int | tuple[int, ...] = 1,
        logits_from: int = 0,
        target_h: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens/positions `[B, L]`; target_k/v `[B, kvh, L, D]` (post-RoPE); returns fp32 draft-head logits
        `[B, L, Vd]`, or `[len(lag), B, L, Vd]` for a tuple of lags (the self-attention is shared between them);
        with `logits_from`, only positions from there on get logits (the LM head is most of the cost).
        `target_h` `[B, L, H]`: the target's last hidden states, for a `feed_hidden` draft; query t reads row
        t - lag (the newest one serving has), nothing before the first."""
        c = self.cfg
        b, length = tokens.shape
        dtype = self.wqkv.weight.dtype
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        n_rep = c.n_heads // c.n_kv_heads
        cos, sin = self.rope(positions, dtype)
        x = self.embed(tokens).to(dtype)

        qkv = self.wqkv(self.attn_norm(x))
        q = apply_rope(qkv[..., :q_dim].view(b, length, c.n_heads, c.head_dim), cos, sin).transpose(1, 2)
        k = apply_rope(qkv[..., q_dim : q_dim + kv_dim].view(b, length, c.n_kv_heads, c.head_dim), cos, sin)
        v = qkv[..., q_dim + kv_dim :].view(b, length, c.n_kv_heads, c.head_dim)
        k, v = _repeat_kv(k.transpose(1, 2), n_rep), _repeat_kv(v.transpose(1, 2), n_rep)
        mask = sliding_window_mask(length, c.window, dtype).to(x.device)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(c.head_dim))
        x = x_self = x + self.wo(a.transpose(1, 2).reshape(b, length, q_dim))

        if c.feed_hidden and target_h is None:
            raise ValueError("this draft reads the target's hidden states: pass target_h")
        tk, tv = _repeat_kv(target_k.to(dtype), n_rep), _repeat_kv(target_v.to(dtype), n_rep)

        def cross_query(y: torch.Tensor) -> torch.Tensor:
            qc = self.cross_q(self.cross_norm(y)).view(b, length, c.n_heads, c.head_dim)
            return apply_rope(qc, cos, sin).transpose(1, 2)

        qc = None if c.feed_hidden else cross_query(x)  # without the hidden state, the same for every lag
        outs = []
        for one_lag in lag if isinstance(lag, tuple) else (lag,):
            if c.feed_hidden:  # the hidden state read at this lag changes the query
                x = x_self + self.read_hidden(F.pad(target_h, (0, 0, one_lag, 0))[:, :length])
                qc = cross_query(x)
            cmask, empty = lagged_cross_mask(length, tk.shape[2], one_lag, dtype)
            scale = 1.0 / math.sqrt(c.head_dim)
            o = F.scaled_dot_product_attention(qc, tk, tv, attn_mask=cmask.to(x.device), scale=scale)
            o = o.masked_fill(empty.to(x.device).view(1, 1, length, 1), 0.0)
            y = x + self.cross_o(o.transpose(1, 2).reshape(b, length, q_dim))
            outs.append(self.mlp_logits(y[:, logits_from:]))
        return torch.stack(outs) if isinstance(lag, tuple) else outs[0]

    def read_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The residual update from the target's hidden state (zero rows stay zero: RMSNorm of 0 is 0)."""
        return self.hidden_proj(self.hidden_norm(hidden.to(self.hidden_proj.weight.dtype)))

    def mlp_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The block's last sub-layer and the shared LM head: fp32 logits."""
        gate, up = self.w_gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        x = x + self.w_down(F.silu(gate) * up)
        return self.lm_head(x.to(self.lm_head.weight.dtype)).float()

    # --- inference: the same block over caches, through the hybrid tree attention ----------------------

    @torch.inference_mode()
    def window_kv(self, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Post-RoPE self-attention K/V `[kvh, n, D]` of committed tokens `[n]`. The block's first sub-layer
        makes them a function of token and position only, so the draft's window cache needs nothing else."""
        c = self.cfg
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        n = tokens.shape[0]
        x = self.attn_norm(self.embed(tokens).to(self.wqkv.weight.dtype))
        bias = self.wqkv.bias[q_dim:] if self.wqkv.bias is not None else None
        kv = F.linear(x, self.wqkv.weight[q_dim:], bias)
        cos, sin = self.rope(positions.unsqueeze(0), x.dtype)
        k = apply_rope(kv[:, :kv_dim].view(n, c.n_kv_heads, c.head_dim), cos[0], sin[0])
        return k.transpose(0, 1), kv[:, kv_dim:].view(n, c.n_kv_heads, c.head_dim).transpose(0, 1)

    @torch.inference_mode()
    def draft_logits(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        tree_mask: torch.Tensor | None,
        window_k: torch.Tensor,
        window_v: torch.Tensor,
        target_k: torch.Tensor,
        target_v: torch.Tensor,
        backend: str = "auto",
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """fp32 target-vocab logits `[n, vocab]` for n draft-tree tokens (tree_mask `[n, n]`, None = chain).

        Self-attention: hybrid tree attention over the window cache (`window_kv` of the last committed tokens,
        all visible) plus the tree under its mask. Cross-attention: every node sees the target's whole
        committed last-layer K/V `[kvh, C, D]` (post-RoPE, e.g. a KVCache prefix view), so it is the hybrid's
        unmasked prefix part alone. As in training, a node at depth d sees the target up to d + 1 tokens back,
        and (`feed_hidden`) every node reads `hidden` `[H]`, the target's hidden state of the last committed token.
        """
        c = self.cfg
        n = tokens.shape[0]
        dtype = self.wqkv.weight.dtype
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        cos, sin = self.rope(positions.unsqueeze(0), dtype)
        cos, sin = cos[0], sin[0]
        x = self.embed(tokens).to(dtype)
        qkv = self.wqkv(self.attn_norm(x))
        q = apply_rope(qkv[:, :q_dim].view(n, c.n_heads, c.head_dim), cos, sin).transpose(0, 1)
        k = apply_rope(qkv[:, q_dim : q_dim + kv_dim].view(n, c.n_kv_heads, c.head_dim), cos, sin).transpose(0, 1)
        v = qkv[:, q_dim + kv_dim :].view(n, c.n_kv_heads, c.head_dim).transpose(0, 1)
        a = tree_attention(q, window_k.to(dtype), window_v.to(dtype), k, v, tree_mask, backend=backend)
        x = x + self.wo(a.transpose(0, 1).reshape(n, q_dim))
        if c.feed_hidden:
            x = x + self.read_hidden(hidden)

        qc = self.cross_q(self.cross_norm(x)).view(n, c.n_heads, c.head_dim)
        qc = apply_rope(qc, cos, sin).transpose(0, 1)
        o = cross_attention(qc, target_k.to(dtype), target_v.to(dtype), backend=backend)
        x = x + self.cross_o(o.transpose(0, 1).reshape(n, q_dim))

        return self.to_full_vocab(self.mlp_logits(x))

    @torch.inference_mode()
    def draft_step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        self_groups: list[tuple[list[int], torch.Tensor, torch.Tensor]],
        cross_groups: list[tuple[list[int], torch.Tensor, torch.Tensor]],
        backend: str = "auto",
        hidden: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One incremental drafting step for M new tree nodes of several sequences at once: the matmuls run over
        all of them; attention runs per group. A self group `(rows, prefix_k, prefix_v)` is sibling nodes that
        see `prefix` (window + their ancestors' K/V `[kvh, P, D]`) and each itself; a cross group is the nodes
        of one sequence and the target's committed last-layer K/V; `hidden` `[M, H]` (`feed_hidden`) the target's
        hidden state of each node's sequence's last committed token. Returns draft-head logits `[M, Vd]` and the
        nodes' own self-attention K/V `[kvh, M, D]` (their descendants' prefix)."""
        c = self.cfg
        m = tokens.shape[0]
        dtype = self.wqkv.weight.dtype
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        cos, sin = self.rope(positions.unsqueeze(0), dtype)
        cos, sin = cos[0], sin[0]
        x = self.embed(tokens).to(dtype)
        qkv = self.wqkv(self.attn_norm(x))
        q = apply_rope(qkv[:, :q_dim].view(m, c.n_heads, c.head_dim), cos, sin).transpose(0, 1)
        k = apply_rope(qkv[:, q_dim : q_dim + kv_dim].view(m, c.n_kv_heads, c.head_dim), cos, sin).transpose(0, 1)
        v = qkv[:, q_dim + kv_dim :].view(m, c.n_kv_heads, c.head_dim).transpose(0, 1)
        a = torch.empty_like(q)
        for rows, pk, pv in self_groups:
            idx = torch.tensor(rows)
            n = len(rows)
            mask = None if n == 1 else torch.eye(n, dtype=torch.bool)
            a[:, idx] = tree_attention(
                q[:, idx], pk.to(dtype), pv.to(dtype), k[:, idx], v[:, idx], mask, backend=backend
            )
        x = x + self.wo(a.transpose(0, 1).reshape(m, q_dim))
        if c.feed_hidden:
            x = x + self.read_hidden(hidden)
        qc = apply_rope(self.cross_q(self.cross_norm(x)).view(m, c.n_heads, c.head_dim), cos, sin).transpose(0, 1)
        o = torch.empty_like(qc)
        for rows, tk, tv in cross_groups:
            idx = torch.tensor(rows)
            o[:, idx] = cross_attention(qc[:, idx], tk.to(dtype), tv.to(dtype), backend=backend)
        x = x + self.cross_o(o.transpose(0, 1).reshape(m, q_dim))
        return self.mlp_logits(x), k, v


DRAFT_MODELS = {"longspec": LongSpecDraft}
