"""DFlash block drafter, optionally fused with the DeLS-Spec local head (`spyglass.drafters.dels`).

One draft forward proposes a whole block: the input is `[root, MASK x (b-1)]` at positions `P .. P+b-1`
(P = the root's position), attention inside the block is non-causal, and every draft layer also attends to
the *context stream*: hidden states of a few target layers, concatenated, projected (`fc`) and normalised
(`hidden_norm`), then turned into that layer's keys/values. Outputs at block positions 1..b-1 go through the
draft's final norm and the target's frozen LM head: b-1 draft distributions, each conditioned on the
context only (positions inside the block do not see each other's drafted tokens).

Per sequence the drafter keeps the context stream's keys/values per draft layer for every committed position
whose target hidden states it was handed (`observe_hidden`, called by the engine after prefill chunks and
verify passes with the committed rows only). Positions whose target forward never ran here (a prefix loaded
from the Redis context cache) have no hidden states: the stream then covers only the positions seen, which
costs acceptance, never correctness. Rows are kept by position and cropped to `start` before new rows are
appended, so the cache always equals what recomputing it from scratch over the committed tokens would give.

A draft with a copy head (`DFlashConfig.copy_head`) mixes every block row with copies: a pointer from the final
hidden state of the position before the row's (the root's, for the first) over the target's committed last-layer
keys (read in place from the engine's KV cache), each position proposing the token after it. `dflash-span` (greedy
requests) uses it as `longspec-span` does (`spyglass.spans`): the chain ends at its first copied token and
goes on with the context's text after that token's source, and while the target's tokens keep agreeing with that
text (verified, or its own on a step the controller kept plain) the next chain continues it with no block forward
at all, also between the controller's probes (its free part). A copied token whose preceding text agrees with its
source's is tagged COPY_SOURCE and priced like the span behind it.

Greedy requests get the block's top-1 chain plus, at low-confidence positions, a few alternative leaves; every
node carries P(accepted) as the product of the draft's probabilities along its path (`DraftTree.scores`), and
the engine's speculation controller prunes it by the measured verify-cost curve. Sampled requests get a chain
sampled position by position from the (fused) draft distribution under the request's sampling parameters, and
that distribution is handed to the verifier as the proposal `q` (rejection sampling: lossless, and it accepts
more than matching target samples against argmax drafts when the draft is close to the target).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from spyglass.attention import tree_attention
from spyglass.drafters.base import (
    DrafterTraits,
    DraftRequest,
    ProposesSubset,
    VocabSubset,
    choose_draft_token,
    draft_generator,
    load_once,
)
from spyglass.models.linear import Linear, set_linear_backend
from spyglass.models.llama import ModelArgs, RMSNorm, Transformer, apply_rope
from spyglass.sequence import Sequence
from spyglass.spans import continuation, copied_score, copy_source, next_pointer, pointer_continuation, text_before
from spyglass.training.draft_models import add_copies_log, init_copy_gate, read_copies
from spyglass.tree import COPY_SOURCE, DRAFT_SOURCE, SPAN_SOURCE, DraftTree
from spyglass.verify import Accepted
from spyglass.weights import STORED_DTYPE, load_weights, save_weights, weights_path

PACKAGED = Path(__file__).resolve().parents[1] / "drafts"
DEFAULT_DFLASH = PACKAGED / "smollm2-135m-dflash"
DEFAULT_DELS = PACKAGED / "smollm2-135m-dels"
# DFlash's copy head spreads its mass thinly (its largest single copy weight is ~0.012-0.016 along the dev prompts'
# outputs, against LongSpec's ~0.04-0.05), so a drafted token starts a span as soon as its top places hold this much
# (the span's source is then chosen among them by agreement with the text before). Swept on the 9 dev prompts (eval
# split, never benchmark prompts; 192 tokens, v9 + DeLS, two runs): mean speedup 1.28x at 0.1 (LongSpec's
# SPAN_MASS), 1.39x at 0.03, 1.45x at 0.01, 1.47x at 0.003, 1.54x at 0.0005; n-gram drafting 1.96-2.02x.
DFLASH_SPAN_MASS = 5e-4


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
    # A copy head (LongSpec's, `spyglass.training.draft_models`): per target KV head a query from the final hidden
    # state of the block position before a drafted token (the root's, for the first: it holds the token to be found
    # in the context, as a LongSpec node does) points over the target's last-layer keys, position j proposing the
    # token after it; a gate mixes that with the LM head. It lets `dflash-span` hang the context's text below a block.
    copy_head: bool = False
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_target(cls, a: ModelArgs, **overrides) -> DFlashConfig:
        base = dict(
            hidden_size=a.hidden_size,
            n_heads=a.n_heads,
            n_kv_heads=a.n_kv_heads,
            head_dim=a.head_dim,
            intermediate_size=a.intermediate_size,
            vocab_size=a.vocab_size,
            rms_eps=a.rms_eps,
            qkv_bias=a.qkv_bias,
            target_layers=default_target_layers(a.n_layers),
        )
        base.update({k: v for k, v in overrides.items() if v is not None})
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


def mix_copies(logits: torch.Tensor, keep: torch.Tensor, mass: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """Log-probs `[Q, V]` of the copy-head proposal: the head's softmax (`logits` `[Q, V]`, -inf outside the draft's
    rows) weighted by exp(`keep`) plus each key position's `mass` `[Q, S]` on the token after it, `after` `[S]`."""
    return add_copies_log(torch.softmax(logits, -1) * keep.exp().unsqueeze(-1), mass, after)


def training_mask(anchors: torch.Tensor, ctx_len: int, block: int) -> torch.Tensor:
    """`[A*block, ctx_len + A*block]` bool: a block anchored at position a sees context positions < a (what the
    target's hidden states cover when the root at a is drafted from) and every token of its own block."""
    a = anchors.shape[0]
    q_anchor = anchors.repeat_interleave(block).unsqueeze(1)
    ctx_ok = torch.arange(ctx_len).unsqueeze(0) < q_anchor
    blk = torch.arange(a).repeat_interleave(block)
    blk_ok = blk.unsqueeze(1) == blk.unsqueeze(0)
    return torch.cat([ctx_ok, blk_ok], dim=1)


def dflash_loss(
    draft: DFlashDraft,
    feats: torch.Tensor,
    tokens: torch.Tensor,
    anchors: torch.Tensor,
    gamma: float = 7.0,
    vocab_ids: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    keys: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """Block loss on one context: `feats [L, layers*H]` target hidden states, `tokens [L]`, `anchors [A]` with
    a + block <= L. Block position k >= 1 predicts tokens[a+k] with weight exp(-(k-1)/gamma) (DFlash's decay:
    early positions matter most, as acceptance stops at the first miss). `vocab_ids` (frequency-ranked token
    ids) restricts the softmax to those rows of the shared head, a CPU saving: targets outside are skipped (unless
    the copy head can copy them); serving always uses the full head. `labels [L]` (the target's greedy next token
    at each position) replace the text as targets: position k then learns the target's choice after the true
    prefix a+k-1 (distillation). A copy-head draft needs `keys`, the target's last-layer keys `[kvh, L, D]`: the
    loss is then the mixture's, its pointer seeing the positions before the anchor."""
    b = draft.cfg.block_size
    length = tokens.shape[0]
    ctx = draft.context_kv(feats, torch.arange(length))
    x = draft.block_input(tokens[anchors], b)
    pos = (anchors.unsqueeze(1) + torch.arange(b)).reshape(-1)
    mask = training_mask(anchors, length, b)
    out = draft.blocks_hidden(x, pos, ctx, mask).view(anchors.shape[0], b, -1)
    hid = out[:, 1:].reshape(-1, out.shape[-1])
    if labels is None:
        targets = tokens[(anchors.unsqueeze(1) + torch.arange(1, b)).reshape(-1)]
    else:
        targets = labels[(anchors.unsqueeze(1) + torch.arange(0, b - 1)).reshape(-1)]
    if vocab_ids is None:
        logits = draft.logits(hid)
    else:
        logits = F.linear(hid.to(draft.lm_head.weight.dtype), draft.lm_head.weight[vocab_ids]).float()
    if draft.cfg.copy_head:
        if keys is None:
            raise ValueError("a copy-head draft's loss needs the target's last-layer keys")
        row_anchor = anchors.repeat_interleave(b - 1)
        visible = torch.arange(length).unsqueeze(0) < row_anchor.unsqueeze(1)
        queries = out[:, :-1].reshape(-1, out.shape[-1])  # each token's copy is pointed from the position before it
        keep, mass = draft.copy_read(queries, (anchors.unsqueeze(1) + torch.arange(b - 1)).reshape(-1), keys, visible)
        head_p = torch.softmax(logits, -1) * keep.exp().unsqueeze(-1)
        p = head_p.new_zeros(head_p.shape[0], draft.cfg.vocab_size)
        p = p.index_copy(1, vocab_ids, head_p) if vocab_ids is not None else head_p
        after = torch.cat([tokens[1:], tokens[-1:]])
        p = p.scatter_add(-1, after.expand(mass.shape), mass)
        picked = p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        ok = picked > 0
        ce = -picked.clamp_min(1e-30).log() * ok
        hit_rows = p.detach().argmax(-1) == targets
    else:
        if vocab_ids is not None:
            remap = torch.full((draft.cfg.vocab_size,), -100, dtype=torch.long)
            remap[vocab_ids] = torch.arange(vocab_ids.shape[0])
            targets = remap[targets]
        ok = targets != -100
        ce = F.cross_entropy(logits, targets, reduction="none", ignore_index=-100)
        hit_rows = logits.detach().argmax(-1) == targets
    ce = ce.view(anchors.shape[0], b - 1)
    w = torch.exp(-torch.arange(b - 1, dtype=torch.float32) / gamma) * ok.view(ce.shape).float()
    loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
    with torch.no_grad():
        hit = hit_rows.view(anchors.shape[0], b - 1).float()
        run = hit.cumprod(dim=1).sum(dim=1).mean()  # accepted drafted tokens if verified greedily as a chain
    return loss, {"acc_first": float(hit[:, 0].mean()), "accepted_chain": float(run)}


# --------------------------------------------------------------------------- checkpoints


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
    state = load_weights(weights, target.dtype)
    vocab_ids = state.pop("vocab_ids", None)
    try:
        draft.load_state_dict(state)
    except RuntimeError as e:
        raise ValueError(f"DFlash checkpoint {root}: {e}") from e
    if vocab_ids is not None:
        draft.vocab_ids = VocabSubset.checked(vocab_ids, a.vocab_size, f"DFlash checkpoint {root}")
    return draft.to(device=target.device, dtype=target.dtype).eval()


# --------------------------------------------------------------------------- the serving drafter


@dataclass
class _Context:
    """The context stream of one sequence: per draft layer K/V rows at ascending positions."""

    k: list[torch.Tensor]  # per layer [kv_heads, cap, D]
    v: list[torch.Tensor]
    pos: torch.Tensor  # [cap] int64
    generator: torch.Generator | None  # the drafter's random stream for a sampled sequence
    n: int = 0
    pointer: int = -1  # spans: the context position whose token should be the root, where the last copy ended
    chain: list[int] | None = None  # spans: the last chain proposed (root first) and each node's context position
    origins: list[int] | None = None

    def crop(self, start: int) -> None:
        """Drop rows at positions >= start (a verify pass re-commits from `start`)."""
        self.n = int(torch.searchsorted(self.pos[: self.n], start))

    def append(self, kv: list[tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor) -> None:
        m = positions.shape[0]
        if self.n + m > self.pos.shape[0]:
            cap = max(2 * self.pos.shape[0], self.n + m)
            self.k = [_grow(t, cap) for t in self.k]
            self.v = [_grow(t, cap) for t in self.v]
            self.pos = torch.cat([self.pos, self.pos.new_zeros(cap - self.pos.shape[0])])
        for i, (k, v) in enumerate(kv):
            self.k[i][:, self.n : self.n + m] = k
            self.v[i][:, self.n : self.n + m] = v
        self.pos[self.n : self.n + m] = positions
        self.n += m

    def view(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(k[:, : self.n], v[:, : self.n]) for k, v in zip(self.k, self.v, strict=True)]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v)) + self.pos.numel() * 8


def _grow(t: torch.Tensor, cap: int) -> torch.Tensor:
    out = t.new_empty(t.shape[0], cap, t.shape[2])
    out[:, : t.shape[1]] = t
    return out


class DFlashDrafter:
    """DFlash block drafting (`local_head` None) or DFlash + DeLS-Spec fusion (a `LocalHead`)."""

    traits: DrafterTraits  # set in __init__: they follow the draft's layers, the tree shape and the spans

    def __init__(
        self,
        draft: DFlashDraft,
        local_head=None,
        alpha: float = 0.3,
        beta: float = 0.3,
        block_size: int | None = None,
        alt_threshold: float = 0.6,
        max_alternatives: int = 0,
        max_alt_positions: int = 4,
        span: int = 0,
        span_mass: float = DFLASH_SPAN_MASS,
        token_matched: bool = False,
    ) -> None:
        """`max_alternatives` > 0 adds up to that many runner-up tokens at block positions whose top token has
        less than `alt_threshold` probability, making a tree the controller sizes step by step from its scores.
        The default, a chain, is sized by its acceptance profile instead: replayed over v6's drafts on the dev
        prompts (bench/probes/replay.py policies) the two make the same mean, but the per-step sizing stalls where the
        first drafts miss (median 1.18x vs 1.26x, worst prompt 1.03x vs 1.09x).
        `span` > 0 (a copy-head draft, greedy requests): the chain ends at its first copied token and goes on with
        up to `span` tokens of the context that followed that token's source.
        `token_matched` (a composite's part, whose merged tree is verified by token matching): sampled requests get
        the chain of the processed rows' argmaxes (what token matching accepts most often), drawn from no random
        stream."""
        self.draft = draft.eval()
        self.local = local_head.eval() if local_head is not None else None
        self.alpha, self.beta = alpha, beta
        self.block = block_size or draft.cfg.block_size
        if self.block < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block}")
        self.alt_threshold = alt_threshold
        self.max_alternatives = max_alternatives
        self.max_alt_positions = max_alt_positions
        if span < 0 or not 0 < span_mass <= 1:
            raise ValueError(f"span must be >= 0 and span_mass in (0, 1], got {span}, {span_mass}")
        if span and not draft.cfg.copy_head:
            raise ValueError("spans follow the copy head's pointer: this DFlash draft has no copy head")
        if span and max_alternatives:
            raise ValueError("spans continue a chain: max_alternatives must be 0")
        self.span, self.span_mass = span, span_mass
        self.traits = DrafterTraits(
            free="part" if span else "none",  # a copy that goes on costs no draft step: proposed between probes too
            token_matched=token_matched,
            drafts_chain=max_alternatives == 0,  # one token per block position: sized by its acceptance profile
            hidden_layers=tuple(draft.cfg.target_layers),
        )
        self.name = ("dflash-dels" if local_head is not None else "dflash") + ("-span" if span else "")
        self.capacity: int | None = None
        self.cache = None
        self.keys_layer = -1

    def bind(self, target: Transformer, cache) -> None:
        self.capacity, self.cache = cache.capacity, cache
        self.keys_layer = target.args.n_layers - 1  # a copy head points over the target's last-layer keys
        set_linear_backend(self.draft, target.linear_backend)  # the kernel measured faster for the target
        if self.local is not None:
            self.local.prepare(self.draft.vocab_ids)

    def _state(self, seq: Sequence) -> _Context:
        if seq.drafter_state is None:
            c = self.draft.cfg
            cap = 256
            dtype, device = self.draft.dtype, self.draft.fc.weight.device
            k = [torch.empty(c.n_kv_heads, cap, c.head_dim, dtype=dtype, device=device) for _ in range(c.n_layers)]
            v = [torch.empty_like(t) for t in k]
            gen = None if self.traits.token_matched else draft_generator(seq)  # no draw: plain sampling's kept
            seq.drafter_state = _Context(k, v, torch.zeros(cap, dtype=torch.long), gen)
        return seq.drafter_state

    @torch.inference_mode()
    def observe_hidden(self, seq: Sequence, start: int, hidden: dict[int, torch.Tensor], kept: list[int]) -> None:
        st = self._state(seq)
        st.crop(start)
        idx = torch.tensor(kept, dtype=torch.long)
        feats = torch.cat([hidden[i][idx] for i in self.traits.hidden_layers], dim=-1)
        positions = torch.arange(start, start + len(kept))
        st.append(self.draft.context_kv(feats, positions), positions)

    def start(self, seq: Sequence) -> None:
        self._state(seq)

    @torch.inference_mode()
    def propose(self, batch: list[Sequence], wants: list[DraftRequest]) -> list[DraftTree]:
        cap = self.capacity or 1 << 30
        trees: list[DraftTree | None] = [None] * len(batch)
        drafted, hiddens = [], []  # (index, block size) of the sequences the block runs for
        for i, (seq, want) in enumerate(zip(batch, wants, strict=True)):
            b = max(1, min(self.block, cap - seq.num_tokens + 1))
            if b < 2:
                trees[i] = DraftTree.root_only(seq.root)
                continue
            if self.span and seq.params.greedy and (tree := self._follow_pointer(seq, cap)) is not None:
                trees[i] = tree  # the last accepted copy goes on: its continuation, no draft step
                continue
            if want.free_only:  # between the controller's probes: only a copy that goes on, for free
                trees[i] = DraftTree.root_only(seq.root)
                continue
            p = seq.committed
            x = self.draft.block_input(torch.tensor([seq.root]), b)
            hiddens.append(self.draft.blocks_hidden(x, torch.arange(p, p + b), self._state(seq).view()))
            drafted.append((i, b))
        if not drafted:
            return trees
        long_logits = self.draft.logits(torch.cat([h[1:] for h in hiddens]))
        offset = 0
        for (i, b), hidden in zip(drafted, hiddens, strict=True):
            seq, rows, mass = batch[i], long_logits[offset : offset + b - 1], None
            if self.draft.cfg.copy_head:
                rows, mass = self._with_copies(seq, hidden[:-1], rows)
            if not seq.params.greedy:
                trees[i] = self._sampled_chain(seq, rows)
            elif self.span:
                trees[i] = self._span_tree(seq, rows, mass, cap)
            else:
                trees[i] = self._tree(seq.root, rows)
            offset += b - 1
        return trees

    def _with_copies(self, seq: Sequence, hidden: torch.Tensor, logits: torch.Tensor):
        """A copy-head draft's rows: log-probs of the mixture of its LM head and its pointer (queried from the block
        positions before the drafted ones, `hidden`) over the target's committed last-layer keys (position j
        proposing the token after it), and the pointer's mass `[b-1, c]`."""
        keys = self.cache.prefix(seq.slot, self.keys_layer)[0]
        c = keys.shape[1]
        if c == 0:  # nothing to copy from
            return logits, logits.new_zeros(logits.shape[0], 0)
        keep, mass = self.draft.copy_read(hidden, torch.arange(c, c + hidden.shape[0]), keys)
        return mix_copies(logits, keep, mass, seq.tokens[1 : c + 1]), mass

    def _span_tree(self, seq: Sequence, rows: torch.Tensor, mass: torch.Tensor, cap: int) -> DraftTree:
        """The block's chain up to its first copied token (`spans.copy_source` on that position's pointer), then the
        context's continuation from that token's source; the whole chain if no position copies."""
        c, after = seq.committed, seq.tokens[1 : seq.committed + 1]
        chain, scores, h, found = [], [1.0], None, None
        for k in range(rows.shape[0]):
            logits, h = self._position_logits(rows, chain, h)
            p = torch.softmax(logits, -1)
            chain.append(int(p.argmax()))
            scores.append(scores[-1] * float(p[chain[-1]]))
            found = copy_source(seq, text_before(seq, chain, c), chain[-1], mass[k], after, self.span_mass)
            if found is not None:
                break
        if found is None:
            self._state(seq).chain = None
            return DraftTree.chain(seq.root, chain, scores=scores)
        at, match = found
        vouched = copied_score(scores[-2], match)  # priced as a span's, still evidence of the drafted profile
        if vouched is not None:
            scores[-1] = vouched
        span = continuation(seq, at, c, min(self.span, cap - seq.num_tokens - len(chain)), scores[-1], match)
        return self._spanned(seq, chain, scores, at, span, copied=vouched is not None)

    def _follow_pointer(self, seq: Sequence, cap: int) -> DraftTree | None:
        """Where the root is the context's token at the pointer (the last accepted copy goes on), the chain of what
        followed it there; None otherwise."""
        at = self._state(seq).pointer
        span = pointer_continuation(seq, at, seq.committed, min(self.span, cap - seq.num_tokens))
        return self._spanned(seq, [], [1.0], at, span) if span else None

    def _spanned(
        self, seq: Sequence, chain: list[int], scores: list[float], at: int, span: list, copied: bool = False
    ) -> DraftTree:
        """The chain root, `chain` (drafted; `scores` from the root's on), then `span`, the context's text after
        position `at`, which holds the chain's last token (the root's, for an empty chain; `copied`: that token
        is sized as a span's); remembered for `commit`'s pointer."""
        st = self._state(seq)
        st.chain = [seq.root, *chain, *(t for t, _ in span)]
        st.origins = [-1] * len(chain) + list(range(at, at + len(span) + 1))
        drafted = [DRAFT_SOURCE] * (len(chain) - copied) + [COPY_SOURCE] * copied
        sources = [0] + drafted + [SPAN_SOURCE] * len(span)
        n = len(st.chain)
        return DraftTree(torch.tensor(st.chain), list(range(-1, n - 1)), None, scores + [sc for _, sc in span], sources)

    def _position_logits(self, long_logits: torch.Tensor, chain: list[int], h):
        """Block position len(chain)'s logits: DFlash's alone first, then fused with the local head stepped on
        the chain so far. Returns the logits and the local head's new state."""
        logits = long_logits[len(chain)]
        if self.local is None or not chain:
            return logits, h
        h = self.local.step(chain[-1], h)
        ids = self.draft.vocab_ids
        if ids is None:
            return fuse(logits, self.local.logits(h), self.local.log_unigram, self.alpha, self.beta), h
        fused = logits.clone()  # -inf outside the draft's vocabulary stays -inf
        fused[ids] = fuse(logits[ids], self.local.logits(h, ids), self.local.log_unigram[ids], self.alpha, self.beta)
        return fused, h

    def _sampled_chain(self, seq: Sequence, long_logits: torch.Tensor) -> DraftTree:
        """A chain sampled from the processed (fused) draft rows, which are the verifier's proposal q (their
        argmaxes when `traits.token_matched`)."""
        chain, rows, h = [], [], None
        gen = self._state(seq).generator
        for _ in range(long_logits.shape[0]):
            logits, h = self._position_logits(long_logits, chain, h)
            tok, row = choose_draft_token(seq, chain, logits[None], gen, top=self.traits.token_matched)
            chain.append(tok)
            rows.append(row)
        # no per-node scores: the controller sizes a rejection-sampled chain from its shape and history only
        # (its own sampled tokens' probabilities would bias which of them get verified)
        return DraftTree.sampled_chain(seq.root, chain, rows)

    def _tree(self, root: int, long_logits: torch.Tensor) -> DraftTree:
        """Chain of argmaxes (fused with the local head after the first position) + alternative leaves."""
        chain, probs, h = [], [], None
        for _ in range(long_logits.shape[0]):
            logits, h = self._position_logits(long_logits, chain, h)
            p = torch.softmax(logits, dim=-1)
            chain.append(int(p.argmax()))
            probs.append(p)
        tokens, parents, scores = [root, *chain], list(range(-1, len(chain))), [1.0]
        for p, tok in zip(probs, chain, strict=True):
            scores.append(scores[-1] * float(p[tok]))
        alt_positions = 0
        for j, p in enumerate(probs):
            if alt_positions >= self.max_alt_positions or self.max_alternatives == 0:
                break
            if float(p[chain[j]]) >= self.alt_threshold:
                continue
            alt_positions += 1
            top = torch.topk(p, self.max_alternatives + 1)
            for prob, tok in zip(top.values.tolist()[1:], top.indices.tolist()[1:], strict=True):
                tokens.append(tok)
                parents.append(j)  # the chain node before position j (node j), root for j = 0
                scores.append(scores[j] * prob)
        return DraftTree(torch.tensor(tokens), parents, None, scores)

    def commit(self, seq: Sequence, accepted: Accepted) -> None:
        """`observe_hidden` already appended the accepted rows (and cropped before them). With spans, the pointer
        follows the committed tokens along the copy (`spans.next_pointer`; compared by tokens: in a composite the
        verified tree is a merged one)."""
        st: _Context | None = seq.drafter_state
        if st is None or not self.span:
            return
        st.pointer = next_pointer(seq, st.pointer, st.chain, st.origins, accepted.tokens)
        st.chain = None

    def release(self, seq: Sequence) -> None:
        seq.drafter_state = None

    def state_bytes(self, seq: Sequence) -> int:
        st: _Context | None = seq.drafter_state
        return 0 if st is None else st.nbytes()


def fuse(long_logits, short_logits, log_prior, alpha: float = 0.3, beta: float = 0.3) -> torch.Tensor:
    """DeLS-Spec's product of experts in logit space: l = l_L + alpha * l_S - beta * log p_unigram."""
    return long_logits + alpha * short_logits.to(long_logits.dtype) - beta * log_prior.to(long_logits.dtype)


def build_dflash_drafter(
    target: Transformer, checkpoint=None, dels_checkpoint=None, dels: bool = False, loaded: dict | None = None, **kw
):
    """The packaged SmolLM2 drafts when no checkpoint is given (ValueError if they do not fit the target).
    `loaded`: a replica's memo (`load_once`): its dflash variants share one draft and one local head."""
    draft = load_once(loaded, "dflash", checkpoint or DEFAULT_DFLASH, lambda path: load_dflash(path, target))
    head = None
    if dels:
        from spyglass.drafters.dels import load_local_head

        head = load_once(loaded, "dels", dels_checkpoint or DEFAULT_DELS, lambda path: load_local_head(path, target))
    return DFlashDrafter(draft, head, **{k: v for k, v in kw.items() if v is not None})


__all__ = [
    "DFlashConfig",
    "DFlashDraft",
    "DFlashDrafter",
    "build_dflash_drafter",
    "default_target_layers",
    "dflash_loss",
    "fuse",
    "load_dflash",
    "save_dflash",
    "training_mask",
]
