"""Tiny random Llama / Qwen2 checkpoints in HF format, for fast unit tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# A test parametrized over the engine's dtypes: `@pytest.mark.parametrize("dtype", DTYPES)`; its bf16 cases carry
# the `bf16` marker and id (`pytest -m bf16`, `-k bf16`).
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.bf16),
]


def make_tiny_model(
    path: Path,
    family: str = "llama",
    vocab: int = 128,
    seed: int = 0,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    init_range: float = 0.2,
    tie: bool = False,
    max_position: int = 1024,
) -> Path:
    """Save a random model with `transformers` (the oracle) and return its directory."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position,
        initializer_range=init_range,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        rms_norm_eps=1e-6,
    )
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(rope_theta=10000.0, **common))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(rope_theta=1000000.0, **common))
        with torch.no_grad():  # make the q/k/v biases matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, init_range)
    else:
        raise ValueError(family)
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_tiny_tokenizer(vocab: int = 128):
    """A real byte-level BPE-style tokenizer (HF `tokenizers`, decoded like GPT-2's) for the tiny models' `vocab`
    ids: 0-2 are the special <unk>, <s>, </s> (the tiny models' EOS is 2), the rest single characters, words, and
    whole and partial UTF-8 characters (a character's bytes split over tokens decode to U+FFFD until complete)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    # GPT-2's printable stand-ins for the 256 byte values (what a byte-level vocabulary spells its tokens with)
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    char = {**{b: chr(b) for b in kept}, **{b: chr(256 + i) for i, b in enumerate(moved)}}
    pieces = [c.encode() for c in "abcdefghijklmnopqrstuvwxyz .,\n"]
    pieces += [w.encode() for w in (" the", " quick", " brown", " fox", " jumps", " over", " lazy", " dog", "ing")]
    pieces += [c.encode() for c in "é中😀"]
    pieces += [b"\xc3", b"\xa9", b"\xe4", b"\xb8", b"\xad", b"\xe4\xb8", b"\xf0\x9f", b"\x98\x80", b"\xf0", b"\x9f\x98"]
    pieces += [c.encode() for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"]
    letters = "etaoinshrd"
    pieces += [(a + b).encode() for a in letters for b in letters][: vocab - 3 - len(pieces)]
    table = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for p in pieces:
        table["".join(char[b] for b in p)] = len(table)
    assert len(table) == vocab, len(table)
    tk = Tokenizer(models.WordLevel(table, unk_token="<unk>"))
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def layer_copy_draft(
    target,
    window: int = 512,
    cross_std: float = 0.01,
    feed_hidden: bool = False,
    n_layers: int = 1,
    feed_own_hidden: bool = False,
    prev_token: bool = False,
    copy_head: bool = False,
):
    """A LongSpec draft whose block is the target's first layer (a GLIDE one, `n_layers`: the target's first layers),
    with a small random cross-attention (and, with `feed_hidden` / `feed_own_hidden`, a small random read of the
    target's hidden state / of the parent node's output; with `copy_head`, a random copy gate): untrained, yet it agrees
    with the target often (HF's random init leaves RMSNorm weights at 1, so skipping the final norm keeps the argmax),
    so lossless tests exercise acceptance."""
    from torch import nn

    from spyglass.models.drafts.longspec import LongSpecDraft

    a = target.args
    draft = LongSpecDraft.from_target(
        target,
        window=window,
        qkv_bias=a.qkv_bias,
        intermediate_size=a.intermediate_size,
        feed_hidden=feed_hidden,
        n_layers=n_layers,
        feed_own_hidden=feed_own_hidden,
        prev_token=prev_token,
        copy_head=copy_head,
    )
    with torch.no_grad():
        for layer, source in zip(draft.layers, target.layers, strict=False):
            for name in ("attn_norm", "wqkv", "wo", "mlp_norm", "w_gate_up", "w_down"):
                getattr(layer, name).load_state_dict(getattr(source, name).state_dict())
            nn.init.normal_(layer.cross_o.weight, std=cross_std)
        if feed_hidden:
            nn.init.normal_(draft.hidden_proj.weight, std=cross_std)
        if feed_own_hidden:
            nn.init.normal_(draft.own_proj.weight, std=cross_std)
        if prev_token:
            nn.init.normal_(draft.prev_proj.weight, std=cross_std)
        if copy_head:
            nn.init.normal_(draft.copy_gate.weight, std=0.1)
    return draft.to(target.dtype).eval()  # in the target's dtype, as a served draft runs


def free_tokens_curve():
    """A verify-cost curve where extra tree tokens cost nothing and a step is so long that the drafter's own time
    is negligible beside it: the engine's controller then keeps every node a drafter proposes, so lossless tests
    exercise drafting whatever the machine's load does to measured times (a slow draft on a loaded CI machine
    would otherwise, rightly, be switched off and leave the identity check vacuous)."""
    from spyglass.cost import CostCurve

    return CostCurve.linear(1.0e4, 0.0)


def make_prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    """Random prompts of mixed lengths, half of them with repeated spans so n-gram drafting fires."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(n):
        length = int(torch.randint(4, 90, (), generator=g))
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        if i % 2:
            ids = ids + ids[: length // 2] + ids
        prompts.append(ids)
    return prompts


_TRAINED: dict[tuple, tuple] = {}


def full_features(target, tokens: torch.Tensor, layers) -> torch.Tensor:
    """Concatenated hidden states of `tokens` from one fresh target forward (no cache reuse)."""
    from spyglass.models.llama import Segment

    cache = target.new_cache(tokens.shape[0] + 1, 1)
    slot = cache.allocate()
    target.capture_layers = tuple(layers)
    try:
        target([Segment(slot, 0, tokens, torch.arange(tokens.shape[0]), None, "none")], cache)
        return torch.cat([target.captured[0][i] for i in layers], dim=-1).clone()
    finally:
        target.capture_layers = ()


def trained_tiny(target, block: int = 6, steps: int = 120, prefix: list[int] | None = None):
    """A DFlash draft and a local head trained for a few seconds on the target's own text (greedy continuations
    of random prompts, plus sampled continuations of `prefix` if given), so the lossless suites exercise
    acceptance: random weights would almost never be accepted. Cached per target and prompt."""
    from spyglass.engine import plain_generate
    from spyglass.models.drafts.dels import LocalHead, LocalHeadConfig, token_counts, unigram_log_prior
    from spyglass.models.drafts.dflash import DFlashDraft
    from spyglass.sampling import SamplingParams
    from spyglass.training.losses import dflash_loss

    key = (id(target), tuple(prefix or ()))
    if key in _TRAINED:
        return _TRAINED[key][:2]
    torch.manual_seed(0)
    vocab = target.args.vocab_size
    texts = []
    for p in make_prompts(vocab, 12, seed=99):
        out = plain_generate(target, p, SamplingParams(max_new_tokens=40, ignore_eos=True))
        texts.append(torch.tensor(p + out))
    if prefix is not None:  # distillation on the very distribution the fidelity test samples
        for i in range(48):
            sp = SamplingParams(temperature=1.0, seed=i, max_new_tokens=block + 2, ignore_eos=True)
            texts.append(torch.tensor(prefix + plain_generate(target, prefix, sp)))
    layers = tuple(range(target.args.n_layers))
    draft = DFlashDraft.from_target(target, target_layers=layers, n_layers=1, block_size=block).float().train()
    feats = [full_features(target, t, layers) for t in texts]
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    for step in range(steps):
        i = step % len(texts)
        t = texts[i]
        anchors = torch.arange(1, t.shape[0] - block - 1)
        loss, _ = dflash_loss(draft, feats[i], t, anchors)
        opt.zero_grad()
        loss.backward()
        opt.step()
    head = LocalHead(LocalHeadConfig(target.args.hidden_size, vocab, 32, 16, window=6), target.embed.weight,
                     target.lm_head.weight)  # fmt: skip
    flat = torch.cat(texts)
    fit_local_head(head, flat, steps=60, window=6, batch=32)
    head.log_unigram.copy_(unigram_log_prior(token_counts(flat, vocab)))
    # the draft in the target's dtype, as a served one runs (trained in fp32); the local head runs in fp32 always
    _TRAINED[key] = (draft.to(target.dtype).eval(), head.eval(), target)  # (the target keeps its id from being reused)
    return _TRAINED[key][:2]


def fit_local_head(head, data: torch.Tensor, steps: int, window: int, batch: int, lr: float = 1e-2) -> list[float]:
    """A DeLS local head trained on random windows of `data`; returns the loss per step."""
    from spyglass.training.losses import local_head_loss

    opt = torch.optim.AdamW(head.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, data.shape[0] - window, (batch,))
        loss = local_head_loss(head, data[starts.unsqueeze(1) + torch.arange(window)])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def with_copy_head(draft):
    """A DFlash `draft` plus a fresh copy head (its pointer random, about a fifth of the mass copied)."""
    from dataclasses import replace

    from spyglass.models.drafts.dflash import DFlashDraft

    torch.manual_seed(1)
    out = DFlashDraft(replace(draft.cfg, copy_head=True), draft.embed, draft.lm_head, draft.inv_freq,
                      draft.rope_scaling)  # fmt: skip
    missing, _ = out.load_state_dict(draft.state_dict(), strict=False)
    assert all(k.startswith("copy_") for k in missing)
    return out.to(draft.dtype).eval()
