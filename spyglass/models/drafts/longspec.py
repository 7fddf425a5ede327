"""The LongSpec / GLIDE draft network (trained by `actors/trainer.py`, served by `spyglass.drafters.longspec`).

`LongSpecDraft` is the LongSpec draft: one layer of sliding-window self-attention over its own tokens,
cross-attention into the target's last-layer post-RoPE K/V, a SwiGLU MLP, and the target's frozen embedding
and LM head (no final norm, as in LongSpec). With `n_layers` N > 1 it is GLIDE's draft: layer m reads target
layer L - N + m. Optionally (`feed_hidden`, not in either paper) a projection of the target's last hidden state
is added before the top layer's cross-attention, the way EAGLE feeds the target's features to its draft. Only
the layers are trained and checkpointed; the frozen parts are re-read from the target. `draft_step` runs the
same layers at inference over window caches and the target's KVCache, through the hybrid tree attention
(`spyglass.attention`), for the serving drafter to wrap.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from spyglass.attention import cross_attention, tree_attention
from spyglass.models.drafts import target_shape
from spyglass.models.drafts.copy_head import CopyMix, add_copies_log, init_copy_gate, read_copies
from spyglass.models.linear import Linear
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
    # feed_hidden: the target layers whose outputs are read (EAGLE-3 style low/mid/high), the last entry being the
    # one `hidden_proj` reads; None = the last layer only. The others go through `extra_hidden_proj` (zero-init).
    hidden_layers: list[int] | None = None
    feed_own_hidden: bool = False  # a node also reads its parent's final draft hidden state (EAGLE's recursion)
    # Each token's input also carries the token before it (a projection of its embedding, zero-init): keys that
    # know their predecessor let one attention layer copy ("what followed the last time this token came").
    prev_token: bool = False
    # A copy head (not in the LongSpec paper; a pointer network over the target's cache): per target KV head, a
    # query from the draft's final hidden state attends over the target's last-layer keys, and position j proposes
    # the token after it; a gate mixes that with the LM head. Copying is most of what the target does on long
    # prompts, and one attention layer over token-embedding keys cannot express it.
    copy_head: bool = False
    n_layers: int = 1  # GLIDE: N layers, layer m reading target layer L - N + m; LongSpec: one
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_target(cls, a: ModelArgs, **overrides) -> LongSpecDraftConfig:
        return cls(**target_shape(a, **overrides))

    def to_dict(self) -> dict:
        return asdict(self)


def feature_layers(hidden_layers: list[int] | None, n_target_layers: int) -> list[int]:
    """A `feed_hidden` draft's target layers (config `hidden_layers`, None = the last one), as indices from 0, in
    the draft's order (the main feature last)."""
    layers = hidden_layers or [-1]
    if not all(-n_target_layers <= i < n_target_layers for i in layers):
        raise ValueError(f"hidden_layers {layers} outside a {n_target_layers}-layer target")
    return [i % n_target_layers for i in layers]


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


LAYER_PARTS = ("attn_norm", "wqkv", "wo", "cross_norm", "cross_q", "cross_o", "mlp_norm", "w_gate_up", "w_down")


class DraftLayer(nn.Module):
    """Self-attention over the draft's own tokens, cross-attention into one target layer's post-RoPE K/V (only
    queries are projected: the keys and values are the target's), SwiGLU MLP. Shapes `[..., L, H]`."""

    def __init__(self, cfg: LongSpecDraftConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, q_dim, kv_dim = cfg.hidden_size, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.q_dim, self.kv_dim = q_dim, kv_dim
        self.attn_norm = RMSNorm(h, cfg.rms_eps)
        self.wqkv = Linear(h, q_dim + 2 * kv_dim, bias=cfg.qkv_bias)
        self.wo = Linear(q_dim, h, bias=False)
        self.cross_norm = RMSNorm(h, cfg.rms_eps)
        self.cross_q = Linear(h, q_dim, bias=cfg.qkv_bias)
        self.cross_o = Linear(q_dim, h, bias=False)
        self.mlp_norm = RMSNorm(h, cfg.rms_eps)
        self.w_gate_up = Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.w_down = Linear(cfg.intermediate_size, h, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Post-RoPE q `[..., L, nh, D]`, k and v `[..., L, kvh, D]`."""
        c, shape = self.cfg, x.shape[:-1]
        qkv = self.wqkv(self.attn_norm(x))
        q = apply_rope(qkv[..., : self.q_dim].view(*shape, c.n_heads, c.head_dim), cos, sin)
        k, v = self._split_kv(qkv[..., self.q_dim :], cos, sin)
        return q, k, v

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Only the keys and values (what a window cache keeps): skips the query rows of the projection."""
        bias = self.wqkv.bias[self.q_dim :] if self.wqkv.bias is not None else None
        return self._split_kv(F.linear(self.attn_norm(x), self.wqkv.weight[self.q_dim :], bias), cos, sin)

    def _split_kv(self, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c, shape = self.cfg, kv.shape[:-1]
        k = apply_rope(kv[..., : self.kv_dim].view(*shape, c.n_kv_heads, c.head_dim), cos, sin)
        return k, kv[..., self.kv_dim :].view(*shape, c.n_kv_heads, c.head_dim)

    def cross_query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        return apply_rope(self.cross_q(self.cross_norm(x)).view(*x.shape[:-1], c.n_heads, c.head_dim), cos, sin)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.w_down(F.silu(gate) * up)


def _align_layers(module: LongSpecDraft, state: dict, prefix: str, *_) -> None:
    """Load-time key map: a draft with fewer layers fills the top ones (a smaller draft warm-starts a larger
    GLIDE one), and one-block checkpoints, which name the block's parts at the top level, still load."""
    layer_keys: dict[str, tuple[int, str]] = {}  # key -> (layer index, name inside the layer)
    for key in state:
        if not key.startswith(prefix):
            continue
        head, _, rest = key[len(prefix) :].partition(".")
        if head in LAYER_PARTS:
            layer_keys[key] = (0, key[len(prefix) :])
        elif head == "layers":
            index, _, name = rest.partition(".")
            layer_keys[key] = (int(index), name)
    shift = max(0, module.cfg.n_layers - 1 - max((i for i, _ in layer_keys.values()), default=-1))
    moved = {f"{prefix}layers.{i + shift}.{name}": state.pop(key) for key, (i, name) in layer_keys.items()}
    state.update(moved)


class LongSpecDraft(nn.Module):
    """The draft's layers over frozen target embeddings; `forward` returns logits `[B, L, vocab]`. One layer is
    LongSpec's draft; N layers are GLIDE's, layer m reading target layer L - N + m (the top N)."""

    def __init__(
        self,
        cfg: LongSpecDraftConfig,
        embed: nn.Embedding,
        lm_head: nn.Linear,
        inv_freq: torch.Tensor,
        rope_scaling: float = 1.0,
    ) -> None:
        super().__init__()
        if cfg.n_layers < 1:
            raise ValueError(f"a draft needs at least one layer, got n_layers={cfg.n_layers}")
        self.cfg = cfg
        h = cfg.hidden_size
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.n_layers))
        if cfg.feed_hidden:  # read by the top layer, before its cross-attention
            self.hidden_norm = RMSNorm(h, cfg.rms_eps)
            self.hidden_proj = Linear(h, h, bias=False)
            n_extra = len(cfg.hidden_layers or [None]) - 1
            if n_extra:  # the lower target layers, each normed, concatenated, projected
                self.extra_hidden_norms = nn.ModuleList(RMSNorm(h, cfg.rms_eps) for _ in range(n_extra))
                self.extra_hidden_proj = Linear(n_extra * h, h, bias=False)
        if cfg.feed_own_hidden:  # read by the top layer beside the target's hidden state
            self.own_norm = RMSNorm(h, cfg.rms_eps)
            self.own_proj = Linear(h, h, bias=False)
        if cfg.prev_token:
            self.prev_proj = Linear(h, h, bias=False)
        if cfg.copy_head:
            self.copy_norm = RMSNorm(h, cfg.rms_eps)
            self.copy_q = Linear(h, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
            self.copy_gate = Linear(h, 1 + cfg.n_kv_heads)  # log-weights: the LM head, then each copy head
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=cfg.init_std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        # Zero projections: a new input starts as a no-op, so a draft without it warm-starts exactly.
        if cfg.feed_hidden:
            nn.init.zeros_(self.hidden_proj.weight)
            if hasattr(self, "extra_hidden_proj"):
                nn.init.zeros_(self.extra_hidden_proj.weight)
        if cfg.feed_own_hidden:
            nn.init.zeros_(self.own_proj.weight)
        if cfg.prev_token:
            nn.init.zeros_(self.prev_proj.weight)
        if cfg.copy_head:
            init_copy_gate(self.copy_gate)
        # Frozen, shared with the target (not part of checkpoints).
        self.embed = embed
        self.full_head = lm_head
        for p in (*embed.parameters(), *lm_head.parameters()):
            p.requires_grad_(False)
        # The reduced head: rows `vocab_ids` of the shared head (set_vocab); the ids ship in the checkpoint.
        self.register_buffer("vocab_ids", torch.arange(cfg.draft_vocab or cfg.vocab_size), persistent=True)
        self.lm_head = lm_head if not cfg.draft_vocab else Linear(cfg.hidden_size, cfg.draft_vocab, bias=False)
        if cfg.draft_vocab:
            self.set_vocab(self.vocab_ids)
        self.register_buffer("inv_freq", inv_freq.clone().float(), persistent=False)
        self.rope_scaling = rope_scaling
        self.register_load_state_dict_pre_hook(_align_layers)

    @classmethod
    def from_target(cls, target: Transformer, share_io: bool = False, **overrides) -> LongSpecDraft:
        """A draft over `target`'s frozen embedding and LM head: fp32 copies of them (training, where the target
        is dropped once the draft exists), or with `share_io` the target's own tensors (serving: no copy; the draft
        is cast to the target's dtype anyway, so it reads the same values)."""
        cfg = LongSpecDraftConfig.from_target(target.args, **overrides)
        tied = target.args.tie_embeddings
        if share_io:  # no throwaway initialisation either: the modules wrap the target's tensors
            embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=target.embed.weight.detach(), _freeze=True)
            head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device="meta")
            head.weight = embed.weight if tied else nn.Parameter(target.lm_head.weight.detach(), requires_grad=False)
        else:
            embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            embed.weight = nn.Parameter(target.embed.weight.detach().clone().float(), requires_grad=False)
            head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            if tied:
                head.weight = embed.weight
            else:
                head.weight = nn.Parameter(target.lm_head.weight.detach().clone().float(), requires_grad=False)
        draft = cls(cfg, embed, head, target.inv_freq, target.rope_scaling)
        if cfg.init_layer is not None:  # every draft layer starts as that target layer's self-attention and MLP
            src = target.layers[cfg.init_layer]
            with torch.no_grad():
                for layer in draft.layers:
                    for name in ("attn_norm", "wqkv", "wo", "mlp_norm", "w_gate_up", "w_down"):
                        sd = getattr(src, name).state_dict()
                        if all(sd[k].shape == v.shape for k, v in getattr(layer, name).state_dict().items() if k in sd):
                            getattr(layer, name).load_state_dict(sd, strict=False)
        return draft

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].wqkv.weight.dtype

    def target_layers(self, n_target_layers: int) -> list[int]:
        """The target layers the draft's layers read, lowest first (GLIDE: the top N)."""
        return list(range(n_target_layers - self.cfg.n_layers, n_target_layers))

    def feature_layers(self, n_target_layers: int) -> list[int]:
        """The target layers whose outputs a `feed_hidden` draft reads, concatenated in this order (the last one
        is the main feature); [] without `feed_hidden`."""
        return feature_layers(self.cfg.hidden_layers, n_target_layers) if self.cfg.feed_hidden else []

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
        """Only the draft layers (and the reduced head's token ids): what checkpoints hold."""
        names = {n for n, p in self.named_parameters() if p.requires_grad}
        if self.cfg.draft_vocab:
            names.add("vocab_ids")
        return {k: v for k, v in self.state_dict().items() if k in names}

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin `[..., L, 1, D]` for position ids `[..., L]` (on any device), same frequencies as the target."""
        freqs = positions.to(self.inv_freq.device).float().unsqueeze(-1) * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos() * self.rope_scaling, emb.sin() * self.rope_scaling
        return cos.to(dtype).unsqueeze(-2), sin.to(dtype).unsqueeze(-2)

    def _per_layer(self, kv: torch.Tensor | list | tuple) -> list:
        """One target layer's K or V per draft layer: a tensor for a one-layer draft, else a list, lowest first."""
        kvs = [kv] if isinstance(kv, torch.Tensor) else list(kv)
        if len(kvs) != self.cfg.n_layers:
            raise ValueError(
                f"this draft has {self.cfg.n_layers} layer(s), each reading one target layer; got {len(kvs)}"
            )
        return kvs

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The shared (or reduced) LM head, no final norm: fp32 logits."""
        return self.lm_head(x.to(self.lm_head.weight.dtype)).float()

    def read_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The residual update from the target's hidden states `[..., n*H]` (the `hidden_layers`' outputs side by
        side, the main one last); zero rows stay zero: RMSNorm of 0 is 0."""
        parts = hidden.to(self.hidden_proj.weight.dtype).split(self.cfg.hidden_size, dim=-1)
        out = self.hidden_proj(self.hidden_norm(parts[-1]))
        if len(parts) > 1:
            normed = [norm(p) for norm, p in zip(self.extra_hidden_norms, parts[:-1], strict=True)]
            out = out + self.extra_hidden_proj(torch.cat(normed, dim=-1))
        return out

    def copy_read(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The copy head over final hidden states `x` `[..., L, H]` (`read_copies`)."""
        return read_copies(self, x, cos, sin, keys, visible)

    def mix(self, out: CopyMix | torch.Tensor, next_tokens: torch.Tensor | None) -> torch.Tensor:
        """Target-vocab log-probs (`copy_head`) or logits (otherwise) `[..., V]` of the draft's proposal;
        `next_tokens` `[..., S]` (broadcast over rows): the token after each context position."""
        if not isinstance(out, CopyMix):
            return self.to_full_vocab(out)
        if next_tokens is None:
            raise ValueError("a copy-head draft proposes context tokens: pass next_tokens")
        p = out.logits.new_zeros(*out.logits.shape[:-1], self.cfg.vocab_size)
        p[..., self.vocab_ids] = torch.softmax(out.logits, -1) * out.keep.exp().unsqueeze(-1)  # the head's rows only
        return add_copies_log(p, out.attn, next_tokens)

    def inputs(self, tokens: torch.Tensor, prev: torch.Tensor | None) -> torch.Tensor:
        """The first layer's input: each token's embedding, plus (`prev_token`) the projected embedding of the
        token before it, `prev` (same shape; -1: none, as for position 0). Token ids may be on any device."""
        device = self.embed.weight.device
        tokens, prev = tokens.to(device), None if prev is None else prev.to(device)
        x = self.embed(tokens).to(self.dtype)
        if not self.cfg.prev_token:
            return x
        if prev is None:
            raise ValueError("this draft reads each token's predecessor: pass prev")
        before = self.embed(prev.clamp(min=0)).to(self.dtype) * (prev >= 0).unsqueeze(-1).to(self.dtype)
        return x + self.prev_proj(before)

    def read_own(self, own: torch.Tensor) -> torch.Tensor:
        """The residual update from the parent's final draft hidden state (zero rows, the root's, stay zero)."""
        return self.own_proj(self.own_norm(own.to(self.own_proj.weight.dtype)))

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        target_k: torch.Tensor | list[torch.Tensor],
        target_v: torch.Tensor | list[torch.Tensor],
        lag: int | tuple[int, ...] = 1,
        logits_from: int = 0,
        target_h: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens/positions `[B, L]`; target_k/v `[B, kvh, L, D]` (post-RoPE; a list, lowest first, for several
        layers); returns fp32 draft-head logits `[B, L, Vd]`, or `[len(lag), B, L, Vd]` for a tuple of lags (the
        first self-attention is shared between them); with `logits_from`, only positions from there on get
        logits (the LM head is most of the cost); a `copy_head` draft returns a `CopyMix` of such shapes.
        `target_h` `[B, L, n*H]`: the target's hidden states of the `hidden_layers` side by side, for a `feed_hidden`
        draft; query t reads row t - lag (the newest one serving has), nothing before the first. A `feed_own_hidden`
        draft's query t at lag l also reads its own final hidden state at t - 1, lag l - 1. Every layer sees the target
        with the same lag (serving computes the lower layers of committed tokens, which later queries attend to, at lag
        1: GLIDE's approximation; exact for one layer)."""
        c = self.cfg
        if c.feed_hidden and target_h is None:
            raise ValueError("this draft reads the target's hidden states: pass target_h")
        b, length = tokens.shape
        dtype = self.dtype
        n_rep = c.n_heads // c.n_kv_heads
        tks = [_repeat_kv(k.to(dtype), n_rep) for k in self._per_layer(target_k)]
        tvs = [_repeat_kv(v.to(dtype), n_rep) for v in self._per_layer(target_v)]
        top_keys = self._per_layer(target_k)[-1]  # the copy head's
        cos, sin = self.rope(positions, dtype)
        mask = sliding_window_mask(length, c.window, dtype).to(tokens.device)
        scale = 1.0 / math.sqrt(c.head_dim)

        def self_attention(layer: DraftLayer, x: torch.Tensor) -> torch.Tensor:
            q, k, v = (t.transpose(1, 2) for t in layer.qkv(x, cos, sin))
            a = F.scaled_dot_product_attention(
                q, _repeat_kv(k, n_rep), _repeat_kv(v, n_rep), attn_mask=mask, scale=scale
            )
            return layer.wo(a.transpose(1, 2).reshape(b, length, -1))

        x0 = self.inputs(tokens, F.pad(tokens, (1, 0), value=-1)[:, :-1])
        first = x0 + self_attention(self.layers[0], x0)  # no target read yet: the same for every lag
        lags = lag if isinstance(lag, tuple) else (lag,)
        # feed_own_hidden: lag l reads lag l - 1's final hidden state one position back (a chain node's parent), so
        # every lag below the largest runs too, over every position (detached: each lag is trained for its own use)
        runs = range(1, max(lags) + 1) if c.feed_own_hidden else lags
        outs, own = {}, None
        for one_lag in runs:
            cmask, empty = lagged_cross_mask(length, tks[0].shape[2], one_lag, dtype)
            cmask, empty = cmask.to(tokens.device), empty.to(tokens.device).view(1, 1, length, 1)
            x = first
            for m, layer in enumerate(self.layers):
                top = m == c.n_layers - 1
                if m:
                    x = x + self_attention(layer, x)
                # the top layer's rows before logits_from feed nothing (no logits; a feed_own_hidden draft's next
                # lag reads every row): its cross-attention, the part that grows with the context, skips them
                lo = logits_from if top and not c.feed_own_hidden else 0
                x, rows = x[:, lo:], slice(lo, length)
                if top and c.feed_hidden:
                    x = x + self.read_hidden(F.pad(target_h, (0, 0, one_lag, 0))[:, rows])
                if top and own is not None:
                    x = x + self.read_own(F.pad(own, (0, 0, 1, 0))[:, rows])
                qc = layer.cross_query(x, cos[:, rows], sin[:, rows]).transpose(1, 2)
                o = F.scaled_dot_product_attention(qc, tks[m], tvs[m], attn_mask=cmask[rows], scale=scale)
                x = x + layer.cross_o(o.masked_fill(empty[:, :, rows], 0.0).transpose(1, 2).reshape(b, length - lo, -1))
                x = layer.mlp(x)
            if c.feed_own_hidden:
                own, x = x.detach(), x[:, logits_from:]
            if one_lag in lags:
                outs[one_lag] = self.head(x)
                if c.copy_head:
                    rows = torch.arange(logits_from, length, device=tokens.device).unsqueeze(1)
                    visible = torch.arange(length, device=tokens.device).unsqueeze(0) <= rows - one_lag
                    read = self.copy_read(x, cos[:, logits_from:], sin[:, logits_from:], top_keys, visible)
                    outs[one_lag] = CopyMix(outs[one_lag], *read)
        if not isinstance(lag, tuple):
            return outs[lag]
        stack = CopyMix.stack if c.copy_head else torch.stack
        return stack([outs[lg] for lg in lags])

    # --- inference: the same layers over caches, through the hybrid tree attention ---------------------

    @torch.inference_mode()
    def window_kv(
        self, tokens: torch.Tensor, positions: torch.Tensor, prev: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first layer's post-RoPE self-attention K/V `[kvh, n, D]` of committed tokens `[n]` (`prev`: the
        token before each, for a `prev_token` draft): a function of tokens and position only (the other layers'
        need `sync_kv`)."""
        cos, sin = self.rope(positions, self.dtype)
        k, v = self.layers[0].kv(self.inputs(tokens, prev), cos, sin)
        return k.transpose(0, 1), v.transpose(0, 1)

    @torch.inference_mode()
    def sync_kv(
        self,
        tokens: torch.Tensor,
        start: int,
        ring: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        targets: list[tuple[torch.Tensor, torch.Tensor]],
        keep: int,
        backend: str = "auto",
        before: int = -1,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's self-attention K/V `[N, kvh, n', D]` of newly committed tokens `[n]` (positions
        `start`..), for a window cache that keeps the last `keep` positions: n' = min(n, keep) newest ones.

        The first layer's depend on token and position only; a higher layer's on the layers below, run over
        the new tokens: self-attention within the training window over the cache `ring` (K/V `[N, kvh, R, D]`,
        positions `[R]`, -1 empty) and the new tokens, cross-attention into `targets` (the target's committed
        K/V per layer, `[kvh, >= start + n, D]`) up to the token before each (lag 1; position 0 reads nothing).
        `before`: the committed token at `start - 1` (-1 at the start), a `prev_token` draft's first predecessor."""
        c, n, dtype = self.cfg, tokens.shape[0], self.dtype
        end = start + n
        need = [max(start, end - keep)]  # first position whose K/V layer m must give, from the top down
        for _ in range(c.n_layers - 1):
            need.insert(0, max(start, need[0] - c.window + 1))
        pos = torch.arange(need[0], end)
        cos, sin = self.rope(pos, dtype)
        prev = torch.cat([torch.tensor([before], dtype=tokens.dtype), tokens[:-1]])
        x = self.inputs(tokens[need[0] - start :], prev[need[0] - start :])
        ks, vs = [], []
        ring_k, ring_v, ring_pos = ring
        for m, layer in enumerate(self.layers):
            lo = need[m] - need[0]  # x, cos, sin cover positions need[0]..end; layer m works from need[m]
            if m == c.n_layers - 1:
                k, v = layer.kv(x, cos[lo:], sin[lo:])
                ks.append(k)
                vs.append(v)
                break
            q, k, v = layer.qkv(x, cos[lo:], sin[lo:])
            ks.append(k)
            vs.append(v)
            nxt = need[m + 1] - need[m]  # queries: the positions the next layer needs
            old = (ring_pos >= 0) & (ring_pos < need[m])
            keys_pos = torch.cat([ring_pos[old], pos[lo:]])
            qpos = pos[lo + nxt :].unsqueeze(1)
            visible = (keys_pos <= qpos) & (keys_pos > qpos - c.window)
            keys_k = torch.cat([ring_k[m][:, old], k.transpose(0, 1)], dim=1)
            keys_v = torch.cat([ring_v[m][:, old], v.transpose(0, 1)], dim=1)
            a = _masked_attention(q[nxt:].transpose(0, 1), keys_k, keys_v, visible)
            x = x[nxt:] + layer.wo(a.transpose(0, 1).reshape(x.shape[0] - nxt, -1))
            qc = layer.cross_query(x, cos[lo + nxt :], sin[lo + nxt :]).transpose(0, 1)
            tk, tv = targets[m]
            q0 = need[m + 1]  # query j sees target keys < j: all of 0..q0-1, then a strictly lower triangle
            tail = torch.ones(end - q0, end - q0, dtype=torch.bool).tril(-1)
            tk, tv = tk.to(dtype), tv.to(dtype)
            o = tree_attention(qc, tk[:, :q0], tv[:, :q0], tk[:, q0:end], tv[:, q0:end], tail, backend=backend)
            if q0 == 0:
                o[:, 0] = 0.0  # position 0 has nothing to read (training zeroes it the same way)
            x = layer.mlp(x + layer.cross_o(o.transpose(0, 1).reshape(x.shape[0], -1)))
        out_k = torch.stack([k[need[-1] - p0 :].transpose(0, 1) for k, p0 in zip(ks, need, strict=True)])
        out_v = torch.stack([v[need[-1] - p0 :].transpose(0, 1) for v, p0 in zip(vs, need, strict=True)])
        return out_k, out_v

    @torch.inference_mode()
    def draft_logits(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        tree_mask: torch.Tensor | None,
        window_k: torch.Tensor | list[torch.Tensor],
        window_v: torch.Tensor | list[torch.Tensor],
        target_k: torch.Tensor | list[torch.Tensor],
        target_v: torch.Tensor | list[torch.Tensor],
        backend: str = "auto",
        hidden: torch.Tensor | None = None,
        prev: torch.Tensor | None = None,
        next_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """fp32 target-vocab logits `[n, vocab]` for n draft-tree tokens (tree_mask `[n, n]`, None = chain;
        `prev`: each token's parent, the root's the last committed token, for a `prev_token` draft; `next_tokens`
        `[C]`: the token after each committed one, for a `copy_head` draft, whose rows are log-probs).

        Self-attention: hybrid tree attention over the window cache (per layer: `window_kv` / `sync_kv` of the
        last committed tokens, all visible) plus the tree under its mask. Cross-attention: every node sees the
        target's whole committed K/V `[kvh, C, D]` of its layer (post-RoPE, e.g. a KVCache prefix view), so it is
        the hybrid's unmasked prefix part alone. As in training, a node at depth d sees the target up to d + 1
        tokens back, and (`feed_hidden`) every node reads `hidden` `[H]`, the target's hidden state of the last
        committed token. Lists of K/V, lowest layer first, for a draft of several layers."""
        c, n, dtype = self.cfg, tokens.shape[0], self.dtype
        if c.feed_own_hidden:
            raise ValueError("a feed_own_hidden draft reads each node's parent's output: draft it depth by depth")
        wks, wvs = self._per_layer(window_k), self._per_layer(window_v)
        tks, tvs = self._per_layer(target_k), self._per_layer(target_v)
        cos, sin = self.rope(positions, dtype)
        x = self.inputs(tokens, prev)
        for m, layer in enumerate(self.layers):
            q, k, v = (t.transpose(0, 1) for t in layer.qkv(x, cos, sin))
            a = tree_attention(q, wks[m].to(dtype), wvs[m].to(dtype), k, v, tree_mask, backend=backend)
            x = x + layer.wo(a.transpose(0, 1).reshape(n, -1))
            if m == c.n_layers - 1 and c.feed_hidden:
                x = x + self.read_hidden(hidden)
            qc = layer.cross_query(x, cos, sin).transpose(0, 1)
            o = cross_attention(qc, tks[m].to(dtype), tvs[m].to(dtype), backend=backend)
            x = layer.mlp(x + layer.cross_o(o.transpose(0, 1).reshape(n, -1)))
        out = self.head(x)
        if c.copy_head:
            out = CopyMix(out, *self.copy_read(x, cos, sin, tks[-1], None))
        return self.mix(out, next_tokens)

    @torch.inference_mode()
    def draft_step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        self_groups: list[tuple[list[int], torch.Tensor, torch.Tensor]],
        cross_groups: list[tuple[list[int], list[torch.Tensor], list[torch.Tensor]]],
        backend: str = "auto",
        hidden: torch.Tensor | None = None,
        own: torch.Tensor | None = None,
        prev: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor | None] | None]:
        """One incremental drafting step for M new tree nodes of several sequences at once: the matmuls run over
        all of them; attention runs per group. A self group `(rows, prefix_k, prefix_v)` is sibling nodes that
        see `prefix` (per layer: window + their ancestors' K/V, `[N, kvh, P, D]`) and each itself; a cross group
        is the nodes of one sequence, the target's committed K/V of each draft layer's target layer (lists) and,
        for a `copy_head` draft, the token after each committed one `[C]` (else None);
        `hidden` `[M, H]` (`feed_hidden`) the target's hidden state of each node's sequence's last committed
        token; `own` `[M, H]` (`feed_own_hidden`) each node's parent's final hidden state (zero for the root);
        `prev` `[M]` (`prev_token`) each node's parent token (the root's: the last committed token).
        Returns target-vocab logits `[M, V]` (log-probs for a `copy_head` draft), the nodes' own K/V
        `[N, kvh, M, D]` (their descendants' prefix), their final hidden states `[M, H]` (their children's
        `own`) and, for a `copy_head` draft, each node's copy mass per committed position (`[C]` per row; else
        None): where its pointer reads, for drafting the context's continuation."""
        c, m_rows, dtype = self.cfg, tokens.shape[0], self.dtype
        cos, sin = self.rope(positions, dtype)
        selfs = [
            (torch.tensor(rows), pk, pv, None if len(rows) == 1 else torch.eye(len(rows), dtype=torch.bool))
            for rows, pk, pv in self_groups
        ]
        crosses = [(torch.tensor(rows), tks, tvs, after) for rows, tks, tvs, after in cross_groups]
        x = self.inputs(tokens, prev)
        ks, vs = [], []
        for m, layer in enumerate(self.layers):
            q, k, v = (t.transpose(0, 1) for t in layer.qkv(x, cos, sin))
            a = torch.empty_like(q)
            for idx, pk, pv, mask in selfs:
                a[:, idx] = tree_attention(
                    q[:, idx], pk[m].to(dtype), pv[m].to(dtype), k[:, idx], v[:, idx], mask, backend=backend
                )
            x = x + layer.wo(a.transpose(0, 1).reshape(m_rows, -1))
            if m == c.n_layers - 1 and c.feed_hidden:
                x = x + self.read_hidden(hidden)
            if m == c.n_layers - 1 and c.feed_own_hidden:
                x = x + self.read_own(own)
            qc = layer.cross_query(x, cos, sin).transpose(0, 1)
            o = torch.empty_like(qc)
            for idx, tks, tvs, _ in crosses:
                o[:, idx] = cross_attention(qc[:, idx], tks[m].to(dtype), tvs[m].to(dtype), backend=backend)
            x = layer.mlp(x + layer.cross_o(o.transpose(0, 1).reshape(m_rows, -1)))
            ks.append(k)
            vs.append(v)
        head = self.head(x)
        if not c.copy_head:
            return self.to_full_vocab(head), torch.stack(ks), torch.stack(vs), x, None
        logits = head.new_empty(m_rows, c.vocab_size)
        mass: list[torch.Tensor | None] = [None] * m_rows  # every row is filled below
        for idx, tks, _, after in crosses:
            read = CopyMix(head[idx], *self.copy_read(x[idx], cos[idx], sin[idx], tks[-1], None))
            logits[idx] = self.mix(read, after)
            for r, row in zip(idx.tolist(), read.attn, strict=True):
                mass[r] = row
        return logits, torch.stack(ks), torch.stack(vs), x, mass


def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """q `[H, n, D]` over k/v `[Hkv, S, D]` under a bool mask `[n, S]` (each row sees a key) -> `[H, n, D]`."""
    n_rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(n_rep, dim=0), v.repeat_interleave(n_rep, dim=0)
    mask = visible.to(q.device)  # (built from positions on the CPU)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(q.shape[-1]))


DRAFT_MODELS = {"longspec": LongSpecDraft}
