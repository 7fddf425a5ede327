"""Tiny random Llama / Qwen2 checkpoints in HF format, for fast unit tests."""

from __future__ import annotations

from pathlib import Path

import torch


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
        max_position_embeddings=1024,
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


def layer_copy_draft(target, window: int = 512, cross_std: float = 0.01):
    """A LongSpec draft whose block is the target's first layer, with a small random cross-attention: untrained,
    yet it agrees with the target often (HF's random init leaves RMSNorm weights at 1, so skipping the final norm
    keeps the argmax), so lossless tests exercise acceptance."""
    from torch import nn

    from spyglass.training.draft_models import LongSpecDraft

    a = target.args
    draft = LongSpecDraft.from_target(target, window=window, qkv_bias=a.qkv_bias, intermediate_size=a.intermediate_size)
    with torch.no_grad():
        for name in ("attn_norm", "wqkv", "wo", "mlp_norm", "w_gate_up", "w_down"):
            getattr(draft, name).load_state_dict(getattr(target.layers[0], name).state_dict())
        nn.init.normal_(draft.cross_o.weight, std=cross_std)
    return draft.eval()


def free_tokens_curve():
    """A verify-cost curve where extra tree tokens cost nothing: the engine's controller then keeps every node a
    drafter proposes, so lossless tests exercise drafting whatever the machine's load does to a measured curve."""
    from spyglass.controller import CostCurve

    return CostCurve.linear(1.0, 0.0)
