"""A compact decoder for the Llama family (Llama, Qwen2, Mistral-style) with packed variable-length
batches over a slotted KV cache.

One forward takes the new tokens of several sequences concatenated ("segments"): the matmuls run
over all of them at once, attention runs per segment over that sequence's committed prefix plus its
own new tokens (a prefill chunk is a causal chain; a verify pass is a draft tree with a tree mask).
HF transformers is used only to read the config (and the RoPE frequencies) and as a test oracle.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from kernels import cpu as cpu_kernels
from spyglass.attention import (
    batched_tree_attention,
    causal_mask,
    resolve_backend,
    single_token_attention,
    tree_attention,
)
from spyglass.kv_cache import CacheFullError, KVCache
from spyglass.models.linear import LANES, Linear, prefill_row_invariant, row_invariant, set_linear_backend


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float
    max_position: int
    tie_embeddings: bool
    qkv_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelArgs:
        arch = (cfg.get("architectures") or ["?"])[0]
        n_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
            intermediate_size=cfg["intermediate_size"],
            rms_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position=cfg.get("max_position_embeddings", 4096),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


@dataclass
class Segment:
    """New tokens of one sequence in a packed forward.

    `start` is the sequence's committed KV length: the tokens are written at start..start+n and see
    the whole committed prefix. `mask` is the `[n, n]` visibility among them (None = causal chain).
    `logits` chooses which rows get logits: "all", "last" or "none".
    """

    slot: int
    start: int
    tokens: torch.Tensor  # [n] int64
    positions: torch.Tensor  # [n] int64
    mask: torch.Tensor | None = None
    logits: str = "all"


def on_device(segments: list[Segment], device: torch.device) -> list[Segment]:
    """The segments with their tokens, positions and masks on `device` (the same objects where they are there)."""

    def there(s: Segment) -> bool:
        return s.tokens.device == s.positions.device == device and (s.mask is None or s.mask.device == device)

    if all(map(there, segments)):
        return segments
    return [
        replace(s, tokens=s.tokens.to(device), positions=s.positions.to(device),
                mask=None if s.mask is None else s.mask.to(device))
        for s in segments
    ]  # fmt: skip


def rope_frequencies(config_dir: Path | None, args: ModelArgs, cfg: dict) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for the model's RoPE type (default, linear, llama3, yarn...)."""
    # transformers, a heavy import: only a checkpoint's RoPE needs it, a model built from ModelArgs (tests,
    # bench/gpu_check.py) never does
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = AutoConfig.from_pretrained(config_dir) if config_dir else AutoConfig.for_model(**cfg)
    params = getattr(hf_cfg, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        inv = 1.0 / (theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim))
        return inv.float(), 1.0
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, "cpu")
    return inv.float(), float(scaling)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[T, heads, D]`, cos/sin `[T, 1, D]` (half-rotation layout, as HF Llama)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _tail_rows(segments: list[Segment], tails: list[int]) -> list[int]:
    """The packed rows that are each segment's last `tails[i]` rows, in order."""
    rows, offset = [], 0
    for seg, keep in zip(segments, tails, strict=True):
        offset += seg.tokens.shape[0]
        rows.extend(range(offset - keep, offset))
    return rows


def _rows_index(segments: list[Segment], tails: list[int], device) -> torch.Tensor:
    return torch.tensor(_tail_rows(segments, tails), dtype=torch.long, device=device)


class Block(nn.Module):
    native = True  # run the CPU kernels of kernels/cpu_ops.cpp where they are built (fp32 or bf16 on the CPU)

    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.a = a
        q_dim, kv_dim = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
        self.wqkv = Linear(a.hidden_size, q_dim + 2 * kv_dim, bias=a.qkv_bias)
        self.wo = Linear(q_dim, a.hidden_size, bias=False)
        self.w_gate_up = Linear(a.hidden_size, 2 * a.intermediate_size, bias=False)
        self.w_down = Linear(a.intermediate_size, a.hidden_size, bias=False)
        self.attn_norm = RMSNorm(a.hidden_size, a.rms_eps)
        self.mlp_norm = RMSNorm(a.hidden_size, a.rms_eps)

    def forward(self, x, cos, sin, segments: list[Segment], cache: KVCache, layer: int, backend: str, tails=None):
        """The layer over the packed new tokens, writing their K/V. `tails` (a prefill's last layer): per segment, how
        many of its last rows to return (the others only write their K/V, on the CPU kernels computing nothing
        more); None: every row."""
        on_cpu = backend == "cpu" or (backend == "auto" and x.device.type == "cpu")  # "auto" is "cpu" there
        native = x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)  # the kernels' dtypes
        if on_cpu and native and self.native and (ops := cpu_kernels.native()):
            return self._forward_native(ops, x, cos, sin, segments, cache, layer, tails)
        out = self._forward_torch(x, cos, sin, segments, cache, layer, backend)
        return out if tails is None else out[_rows_index(segments, tails, x.device)]

    def _forward_torch(self, x, cos, sin, segments: list[Segment], cache: KVCache, layer: int, backend: str):
        a = self.a
        t = x.shape[0]
        q_dim, kv_dim = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
        qkv = self.wqkv(self.attn_norm(x))
        q = apply_rope(qkv[:, :q_dim].view(t, a.n_heads, a.head_dim), cos, sin)
        k = apply_rope(qkv[:, q_dim : q_dim + kv_dim].view(t, a.n_kv_heads, a.head_dim), cos, sin)
        v = qkv[:, q_dim + kv_dim :].view(t, a.n_kv_heads, a.head_dim)
        if backend == "triton" and len(segments) > 1:
            o = attend_batched(q, k, v, segments, cache, layer)
        else:
            outs = []
            offset = 0
            for seg in segments:
                n = seg.tokens.shape[0]
                qs = q[offset : offset + n].transpose(0, 1)
                ks = k[offset : offset + n].transpose(0, 1)
                vs = v[offset : offset + n].transpose(0, 1)
                cache.write(seg.slot, layer, seg.start, ks, vs)
                # a decode step: prefix + itself in one call (its K/V written just above)
                if n == 1 and backend in ("cpu", "triton"):
                    k_all, v_all = cache.layer(seg.slot, layer)
                    o1 = single_token_attention(qs, k_all[:, : seg.start + 1], v_all[:, : seg.start + 1])
                else:
                    k_pre, v_pre = cache.prefix(seg.slot, layer)  # committed only: the write moves no length
                    o1 = tree_attention(qs, k_pre, v_pre, ks, vs, seg.mask, backend=backend)
                outs.append(o1.transpose(0, 1))
                offset += n
            o = torch.cat(outs) if len(outs) > 1 else outs[0]
        h = x + self.wo(o.reshape(t, q_dim))
        gate, up = self.w_gate_up(self.mlp_norm(h)).chunk(2, dim=-1)
        return h + self.w_down(F.silu(gate) * up)

    def _forward_native(self, ops, x, cos, sin, segments: list[Segment], cache: KVCache, layer: int, tails=None):
        """The same layer in a few fused CPU kernels: RMSNorm, RoPE + cache write, attention over the cache
        (tile_attention for every number of new tokens: a token's result depends only on its query and the keys it
        sees, so a verify pass equals the decode steps it replaces), SwiGLU. fp32 or bf16: each kernel rounds its
        output to the model's dtype as the torch ops do, the arithmetic in fp32."""
        a = self.a
        qkv = self.wqkv(ops.rms_norm(x, self.attn_norm.weight, self.attn_norm.eps))
        outs = []
        offset = 0
        for i, seg in enumerate(segments):
            n = seg.tokens.shape[0]
            _check_room(seg, cache)
            k_all, v_all = cache.layer(seg.slot, layer)
            q = ops.rope_write(qkv, cos, sin, k_all, v_all, offset, n, seg.start, a.n_heads)  # [H, n, D]
            keep = n if tails is None else tails[i]
            if keep:  # a row's attention depends only on its query and the keys it sees: the last rows alone
                q = q if keep == n else q[:, n - keep :].contiguous()
                outs.append(ops.tile_attention(q, k_all, v_all, seg.start + n - keep, seg.mask, a.head_dim**-0.5))
            offset += n
        if tails is not None:
            if not outs:
                return x[:0]
            x = x[_rows_index(segments, tails, x.device)]
        h = x + self.wo(torch.cat(outs) if len(outs) > 1 else outs[0])
        return h + self.w_down(ops.silu_mul(self.w_gate_up(ops.rms_norm(h, self.mlp_norm.weight, self.mlp_norm.eps))))


def attend_batched(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: list[Segment], cache: KVCache, layer: int
) -> torch.Tensor:
    """All segments in one batched hybrid call (GPU: one flash-attn kvcache launch over every committed
    prefix, read in place by slot, plus one Triton launch over the trees). q/k/v `[T, heads, D]` packed;
    trees are padded to the longest with hidden mask rows/columns. Returns `[T, H, D]`."""
    m = max(seg.tokens.shape[0] for seg in segments)
    b, h, hkv, d = len(segments), q.shape[1], k.shape[1], q.shape[2]
    qb = q.new_zeros(b, h, m, d)
    kb, vb = k.new_zeros(b, hkv, m, d), v.new_zeros(b, hkv, m, d)
    mask = torch.zeros(b, m, m, dtype=torch.bool, device=q.device)
    offset = 0
    for i, seg in enumerate(segments):
        n = seg.tokens.shape[0]
        qb[i, :, :n] = q[offset : offset + n].transpose(0, 1)
        kb[i, :, :n] = k[offset : offset + n].transpose(0, 1)
        vb[i, :, :n] = v[offset : offset + n].transpose(0, 1)
        mask[i, :n, :n] = seg.mask if seg.mask is not None else causal_mask(n, q.device)
        cache.write(seg.slot, layer, seg.start, kb[i, :, :n], vb[i, :, :n])  # read only past seqlens[i]
        offset += n
    seqlens = [cache.lengths[seg.slot] for seg in segments]
    k_cache, v_cache = cache.all_slots(layer)
    out = batched_tree_attention(
        qb, k_cache, v_cache, seqlens, kb, vb, mask, backend="triton", cache_batch_idx=[s.slot for s in segments]
    )
    return torch.cat([out[i, :, : seg.tokens.shape[0]].transpose(0, 1) for i, seg in enumerate(segments)])


# Prompt tokens per prefill forward, here and in the engine (EngineConfig.prefill_chunk): 256 prefills 4K tokens
# ~9% slower than 512 in bf16 on 2 Zen 4 cores, within 3% of it in fp32 on 2 Zen 3 cores (BENCHMARKS.md, "Engine
# step"), and a layer of it is the least prefill a step runs beside decoding streams (EngineConfig.prefill_step_s).
PREFILL_CHUNK = 256


def _check_room(seg: Segment, cache: KVCache) -> None:
    """A clear error where a segment's tokens would run past its slot's capacity."""
    if seg.start + seg.tokens.shape[0] > cache.capacity:
        raise CacheFullError(
            f"slot {seg.slot}: {seg.start + seg.tokens.shape[0]} tokens exceed the capacity {cache.capacity}"
        )


def _shared_prefixes(ops, segments: list[Segment], cache: KVCache) -> tuple[list[int], list[int]]:
    """`layer_stack`'s groups: each segment joins the first earlier group whose head's slot holds the same K/V as its
    own over at least a whole attention chunk below both starts (`KVCache.same_prefix`: a prompt copied from one slot
    to others), and the group shares the fewest keys any of its segments shares with the head; a segment of more new
    tokens than `group_attention` takes heads its own. Returns each segment's group head and the keys it shares."""
    groups, shared = [], []
    for i, s in enumerate(segments):
        groups.append(i)
        shared.append(0)
        if s.tokens.shape[0] > ops.split_tokens:
            continue
        for j in range(i):
            head = segments[j]
            if groups[j] != j or head.tokens.shape[0] > ops.split_tokens:
                continue
            n = min(cache.same_prefix(s.slot, head.slot), s.start, head.start)
            if n >= ops.chunk_keys:
                groups[i] = j
                shared[j] = n if shared[j] == 0 else min(shared[j], n)
                break
    return groups, [shared[g] for g in groups]


def _row_invariant(segments: list[Segment]) -> bool:
    """Whether a forward runs its linears row-invariant: it wants every row's logits or carries a tree (a decode
    step, a verify pass), unlike a prefill chunk."""
    return not all(s.logits != "all" and s.mask is None for s in segments)


class StagedForward:
    """One forward run a few layers at a time, so that a long prefill chunk can share several engine steps with
    other forwards (the decoding streams' rounds): its K/V and logits are those of the same forward run at once,
    as each layer runs the same kernels on the same rows, whatever runs in between."""

    def __init__(self, layers, invariant: bool, n_layers: int) -> None:
        self._layers = layers
        self._invariant = invariant  # the linears row-invariant (see Transformer.forward), set at every resumption
        self.n_layers = n_layers
        self.layers_run = 0
        self.logits: list[torch.Tensor | None] | None = None  # set once the last layer has run

    @property
    def layers_left(self) -> int:
        return self.n_layers - self.layers_run

    def run(self, layers: int | None = None) -> list[torch.Tensor | None] | None:
        """Run the next `layers` layers (None: all that are left); the logits once the last has run, else None."""
        n = self.layers_left if layers is None else min(layers, self.layers_left)
        with torch.inference_mode(), row_invariant(self._invariant):
            for _ in range(n):
                self.layers_run += 1
                try:
                    next(self._layers)
                except StopIteration as end:
                    self.logits = end.value
        return self.logits


class Transformer(nn.Module):
    """The target (or a draft) model: weights plus the packed forward over a KVCache."""

    def __init__(self, args: ModelArgs, inv_freq: torch.Tensor, rope_scaling: float = 1.0) -> None:
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_eps)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rope_scaling = rope_scaling
        self.attention_backend = "auto"  # GPU: flash-attn prefix + Triton tree kernel; CPU: ATen flash
        self.linear_backend = "aten"  # or "onednn" (CPU): see spyglass.models.linear; load_transformer measures
        self.draft_linear_backend = "aten"  # what a draft beside it runs (set_linear_backend)
        self._stack_cache: tuple | None = None  # (what decides it, _stack_weights' result)
        self.model_id = "unnamed"

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def prefill_row_invariant(self) -> bool:
        """Whether a prompt's K/V and logits do not depend on the chunks it is prefilled in: the layers on the CPU
        kernels (a token's attention depends only on its query and its keys) and the linears' prefill on one
        row-invariant kernel (spyglass.models.linear)."""
        on_kernels = (
            self.device.type == "cpu"
            and self.dtype in (torch.float32, torch.bfloat16)
            and resolve_backend(self.attention_backend, self.device) == "cpu"
            and all(layer.native for layer in self.layers)
            and cpu_kernels.native() is not None
        )
        return on_kernels and prefill_row_invariant(self)

    def new_cache(self, capacity: int, max_slots: int) -> KVCache:
        a = self.args
        return KVCache(a.n_layers, a.n_kv_heads, a.head_dim, capacity, max_slots, self.dtype, self.device)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        cos = (emb.cos() * self.rope_scaling).to(self.dtype).unsqueeze(1)
        sin = (emb.sin() * self.rope_scaling).to(self.dtype).unsqueeze(1)
        return cos, sin

    def forward(self, segments: list[Segment], cache: KVCache) -> list[torch.Tensor | None]:
        """Run the new tokens of every segment; returns fp32 logits per segment (rows as requested).

        The KV of the new tokens is written after each segment's committed length but not committed:
        the caller commits what it accepts. Tokens, positions and masks may be on the CPU whatever the model's
        device (the engine and the drafters build them there): they are moved to it here.

        A forward that wants every row's logits or carries a tree (a decode step, a verify pass) runs its linears
        row-invariant (spyglass.models.linear), so a verify pass equals the decode steps bit for bit; prefill chunks
        (only the last row's logits, or none) on the fastest kernels.
        """
        segments = on_device(segments, self.device)
        stack = self._stack_ops(segments)
        if stack is not None:
            return self._forward_stacked(stack, segments, cache)
        return self.staged(segments, cache).run()

    def staged(self, segments: list[Segment], cache: KVCache) -> StagedForward:
        """`forward` over these segments, to be run a few layers at a time (`StagedForward.run`)."""
        segments = on_device(segments, self.device)
        for s in segments:
            cache.overwrite(s.slot, s.start)
        return StagedForward(self._layer_by_layer(segments, cache), _row_invariant(segments), len(self.layers))

    def _inputs(self, segments: list[Segment]):
        """What every layer takes: the new tokens' embeddings and RoPE tables; per segment, how many of its last rows
        get logits (`tails`); whether a prefill's last layer may compute those rows alone (`cut`: every row writes
        its K/V, only those go on, unless a drafter reads that layer's hidden states)."""
        tokens = torch.cat([s.tokens for s in segments]) if len(segments) > 1 else segments[0].tokens
        positions = torch.cat([s.positions for s in segments]) if len(segments) > 1 else segments[0].positions
        cos, sin = self._rope(positions)
        tails = [{"all": s.tokens.shape[0], "last": 1}.get(s.logits, 0) for s in segments]
        cut = (
            len(self.layers) - 1 not in getattr(self, "capture_layers", ())
            and all(s.mask is None for s in segments)
            and sum(tails) < tokens.shape[0]
        )
        return self.embed(tokens), cos, sin, tails, cut

    def _stack_ops(self, segments: list[Segment]):
        """The kernels' module when this forward can run its layers in one `layer_stack` call (a row-invariant
        forward whose every layer would run on the CPU kernels with its linears on `rows`, or all on `lanes`), else
        None."""
        ops = cpu_kernels.native()
        if (
            ops is None
            or self.device.type != "cpu"
            or self.dtype not in (torch.float32, torch.bfloat16)
            or not _row_invariant(segments)
            or resolve_backend(self.attention_backend, self.device) != "cpu"
            # a prefill segment beside the others: the layer-by-layer path may compute its last layer's tail alone
            or (all(s.mask is None for s in segments) and any(s.logits != "all" for s in segments))
        ):
            return None
        return ops if self._stack_weights() is not None else None

    def _stack_weights(self) -> tuple[list[torch.Tensor | None], bool] | None:
        """The layers' weights in `layer_stack`'s order and whether its linears run on `lanes` (else `rows`), or None
        where a layer would not run on the kernels with its linears on one of them in row-invariant forwards.
        Gathered once per linear backend and per layer kernel switch (`set_linear_backend`, `Block.native`):
        gathering them through the modules took ~0.5 ms of a ~16 ms decode step, while the other thread waited. The
        target's parameters are updated in place, never reassigned, once it is loaded."""
        key = (self.linear_backend, id(self.layers), tuple(layer.native for layer in self.layers))
        if self._stack_cache is not None and self._stack_cache[0] == key:
            return self._stack_cache[1]
        weights: list[torch.Tensor | None] = []
        kinds = set()
        for layer in self.layers:
            for lin in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down):
                kinds.add("rows" if lin.invariant and lin.plan is not None else "lanes" if lin.plan == LANES else None)
            weights += [layer.attn_norm.weight, layer.wqkv.weight, layer.wqkv.bias, layer.wo.weight]
            weights += [layer.mlp_norm.weight, layer.w_gate_up.weight, layer.w_down.weight]
        ok = all(layer.native for layer in self.layers) and len(kinds) == 1 and None not in kinds
        self._stack_cache = (key, (weights, kinds == {"lanes"}) if ok else None)
        return self._stack_cache[1]

    def _forward_stacked(self, ops, segments: list[Segment], cache: KVCache) -> list[torch.Tensor | None]:
        """`forward` with every layer in one kernel call (`layer_stack`): the same kernels on the same rows as the
        layer-by-layer path, without the Python between them."""
        for s in segments:
            _check_room(s, cache)
            cache.overwrite(s.slot, s.start)
        groups, shared = _shared_prefixes(ops, segments, cache)
        with torch.inference_mode():
            x, cos, sin, tails, _ = self._inputs(segments)  # no cut: _stack_ops leaves those forwards out
            a = self.args
            weights, lanes = self._stack_weights()
            capture = sorted({i for i in getattr(self, "capture_layers", ()) if 0 <= i < len(self.layers)})
            k, v = cache.all_layers()
            out = ops.layer_stack(
                x, cos, sin, weights, a.rms_eps, k, v,
                [s.slot for s in segments], [s.start for s in segments], [s.tokens.shape[0] for s in segments],
                [s.mask for s in segments], a.n_heads, a.head_dim**-0.5, capture, lanes, groups, shared,
            )  # fmt: skip
            with row_invariant():
                return self._head(segments, out[0], tails, False, dict(zip(capture, out[1:], strict=True)))

    def _layer_by_layer(self, segments: list[Segment], cache: KVCache):
        """The forward as a generator: it stops after each layer but the last, whose step also runs the head and
        returns the logits."""
        x, cos, sin, tails, cut = self._inputs(segments)
        backend = resolve_backend(self.attention_backend, self.device)
        capture = getattr(self, "capture_layers", ())
        kept: dict[int, torch.Tensor] = {}
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, segments, cache, i, backend, tails if cut and i == last else None)
            if i in capture:
                kept[i] = x
            if i < last:
                yield
        return self._head(segments, x, tails, cut, kept)

    def _head(self, segments: list[Segment], x: torch.Tensor, tails: list[int], cut: bool, kept: dict):
        """The final norm and LM head over the rows that want logits (`x` holds only those when `cut`); the hidden
        states `kept` (layer -> every new token's output) go to `captured`, per segment."""
        if kept:  # hidden states (layer outputs) of every new token, per segment, for drafters that read them
            bounds = torch.tensor([0, *(s.tokens.shape[0] for s in segments)]).cumsum(0).tolist()
            self.captured = [{i: h[a:b] for i, h in kept.items()} for a, b in zip(bounds, bounds[1:], strict=False)]
        rows = _tail_rows(segments, tails)  # the rows whose logits are asked for
        if not rows:
            return [None] * len(segments)
        if cut:  # x holds those rows only, in order
            picked = x
        # consecutive rows (one segment, or every row of several) are a view: no index tensor to copy to the device
        elif rows[-1] - rows[0] + 1 == len(rows):
            picked = x[rows[0] : rows[-1] + 1]
        else:
            picked = x[torch.tensor(rows, device=x.device)]
        h = self.norm(picked)
        logits = self.lm_head(h).float()
        starts = itertools.accumulate(tails, initial=0)
        return [logits[a : a + k] if k else None for a, k in zip(starts, tails, strict=False)]

    def prefill(self, cache: KVCache, slot: int, tokens: torch.Tensor, chunk_size: int = PREFILL_CHUNK) -> torch.Tensor:
        """Chunked prefill of `tokens` into `slot` (committing them); returns the last token's logits."""
        start = cache.lengths[slot]
        logits = None
        for c in range(0, tokens.shape[0], chunk_size):
            chunk = tokens[c : c + chunk_size]
            pos = torch.arange(start, start + chunk.shape[0], device=tokens.device)
            logits = self.forward([Segment(slot, start, chunk, pos, None, "last")], cache)[0]
            cache.commit(slot, start, list(range(chunk.shape[0])))
            start += chunk.shape[0]
        return logits[-1]


_WEIGHT_MAP = {
    "self_attn.o_proj.weight": "wo.weight",
    "mlp.down_proj.weight": "w_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
}


def model_args(path: str | Path) -> ModelArgs:
    """The shapes of an HF-format model directory's model (its config.json), without loading its weights."""
    return ModelArgs.from_hf_config(json.loads((Path(path) / "config.json").read_text()))


def load_transformer(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu", linear_backend: str = "auto"
) -> Transformer:
    """Build a Transformer from an HF-format directory (config.json + *.safetensors); `linear_backend` "auto"
    times the CPU matmul kernels on its weights and keeps the fastest for prefill chunks, decode steps and verify
    passes running on the row-invariant one (spyglass.models.linear)."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    args = ModelArgs.from_hf_config(cfg)
    inv_freq, scaling = rope_frequencies(path, args, cfg)
    with torch.device("meta"):
        model = Transformer(args, torch.empty(0))
    raw: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        raw.update(load_file(str(f)))
    state = convert_hf_state_dict(raw, args)
    model.load_state_dict(state, strict=False, assign=True)
    if args.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"{path}: weights missing from the safetensors files: {missing[:5]}")
    model.inv_freq = inv_freq
    model.rope_scaling = scaling
    model.model_id = path.name
    model = model.to(device=device, dtype=dtype).eval()
    into_huge_pages(model)
    set_linear_backend(model, linear_backend)
    return model


MADV_HUGEPAGE = 14  # Linux <sys/mman.h>


def into_huge_pages(model: nn.Module) -> None:
    """Move every CPU parameter and buffer into one anonymous buffer marked for transparent huge pages (Linux).

    Why: `load_file` maps the safetensors file, so the weights not fused at load (the embedding / LM head, the
    output and down projections) stayed file-backed in the page cache's pages, whose size depends on the page
    cache's state. A 1-token step streams every weight once; from huge pages it ran 4-6% faster on a 2-core Zen 4 VM
    (processes alternated: SmolLM2-135M 24.8 -> 23.6 ms at 2K context, 31.3 -> 29.2 at 6K; Qwen2.5-Coder-0.5B 59.8
    -> 56.2 at 2K). Values are copied unchanged; tied weights stay one tensor."""
    tensors = [t for t in [*model.parameters(), *model.buffers()] if t.device.type == "cpu" and t.numel()]
    if not tensors:  # a model on an accelerator
        return
    align = 64
    sizes = [-(-t.numel() * t.element_size() // align) * align for t in tensors]
    buf = torch.empty(sum(sizes), dtype=torch.uint8)  # fresh, untouched pages: the advice applies as they fault in
    if sys.platform == "linux":
        page = 4096
        start = -(-buf.data_ptr() // page) * page
        length = (buf.data_ptr() + buf.numel() - start) // page * page
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), MADV_HUGEPAGE)  # best effort: 0 or EINVAL
    offset = 0
    with torch.no_grad():
        for t, size in zip(tensors, sizes, strict=True):
            view = buf[offset : offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            view.copy_(t)
            t.data = view
            offset += size


def convert_hf_state_dict(raw: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """HF Llama/Qwen2 names -> ours, fusing q/k/v and gate/up into one matmul each."""
    out: dict[str, torch.Tensor] = {
        "embed.weight": raw["model.embed_tokens.weight"],
        "norm.weight": raw["model.norm.weight"],
    }
    if not args.tie_embeddings:
        out["lm_head.weight"] = raw["lm_head.weight"]
    for i in range(args.n_layers):
        p = f"model.layers.{i}."
        out[f"layers.{i}.wqkv.weight"] = torch.cat([raw[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        if args.qkv_bias:
            out[f"layers.{i}.wqkv.bias"] = torch.cat([raw[p + f"self_attn.{n}_proj.bias"] for n in "qkv"])
        out[f"layers.{i}.w_gate_up.weight"] = torch.cat(
            [raw[p + "mlp.gate_proj.weight"], raw[p + "mlp.up_proj.weight"]]
        )
        for hf_name, name in _WEIGHT_MAP.items():
            out[f"layers.{i}.{name}"] = raw[p + hf_name]
    return out
