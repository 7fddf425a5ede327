"""The context capacity: the model's own window by default, a cap when asked, and a KV cache that must fit in memory;
a tiny model served at its full 32K-token window decodes losslessly."""

from __future__ import annotations

import re

import pytest
import torch

from spyglass.drafters import build_drafter
from spyglass.engine import EngineConfig, SpecEngine, plain_generate
from spyglass.kv_cache import (
    GIB,
    ContextCapacityError,
    KVCache,
    available_memory,
    context_capacity,
    kv_bytes_per_token,
)
from spyglass.models.llama import ModelArgs, load_transformer
from spyglass.sampling import SamplingParams
from tests.test_kv_cache import faults_writing
from tests.tiny import free_tokens_curve, make_tiny_model

WINDOW = 32768


def qwen_like_args(window: int = WINDOW) -> ModelArgs:
    """Qwen2.5-Coder-0.5B's shape (24 layers, 2 KV heads of 64) with the given window."""
    return ModelArgs.from_hf_config(
        {
            "architectures": ["Qwen2ForCausalLM"],
            "vocab_size": 151936,
            "hidden_size": 896,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "intermediate_size": 4864,
            "max_position_embeddings": window,
        }
    )


def test_bytes_per_token_counts_k_and_v_of_every_layer():
    args = qwen_like_args()
    assert kv_bytes_per_token(args, torch.float32) == 2 * 24 * 2 * 64 * 4 == 24576
    assert kv_bytes_per_token(args, torch.bfloat16) == 12288


def test_default_is_the_model_window_and_a_cap_is_honoured():
    assert context_capacity(qwen_like_args(), max_batch=1, dtype=torch.float32) == WINDOW
    assert context_capacity(qwen_like_args(8192), max_batch=1, dtype=torch.float32) == 8192
    assert context_capacity(qwen_like_args(), 1000, max_batch=1, dtype=torch.float32) == 1000
    assert context_capacity(qwen_like_args(), WINDOW, max_batch=1, dtype=torch.float32) == WINDOW


@pytest.mark.parametrize("requested", [0, 1, -5, WINDOW + 1, 10**9, "8192", 8192.0, True])
def test_a_cap_outside_the_window_is_refused(requested):
    with pytest.raises(ContextCapacityError, match=re.escape(f"in [2, {WINDOW}]")):
        context_capacity(qwen_like_args(), requested, max_batch=1, dtype=torch.float32)


def test_a_kv_cache_that_does_not_fit_is_one_clear_error():
    """Enough sequence slots that the K/V cannot fit in this machine's memory: the error names the numbers."""
    args = qwen_like_args()
    slots = available_memory() // (kv_bytes_per_token(args, torch.float32) * WINDOW) + 1
    with pytest.raises(ContextCapacityError) as err:
        context_capacity(args, max_batch=slots, dtype=torch.float32)
    msg = str(err.value)
    assert "24576 bytes per token" in msg
    needed, free = (float(x) for x in re.findall(r"([\d.]+) GiB", msg))
    assert needed == pytest.approx(24576 * WINDOW * slots / GIB, abs=0.01)
    assert 0 < free < needed
    assert f"{slots} sequence slot(s) x {WINDOW} tokens" in msg
    assert context_capacity(args, 1024, max_batch=1, dtype=torch.float32) == 1024


@pytest.fixture(scope="module")
def long_target(tmp_path_factory):
    """A tiny random Qwen2-family model whose window is 32K positions (one narrow layer: 32K-token prefills in
    seconds)."""
    path = tmp_path_factory.mktemp("long") / "qwen2"
    make_tiny_model(path, "qwen2", seed=3, layers=1, hidden=32, heads=2, kv_heads=1, tie=True, max_position=WINDOW)
    return load_transformer(path)


def allocated_bytes(cache: KVCache) -> int:
    """Bytes of the K and V tensors a cache holds, summed over its layers' views of every slot."""
    return sum(t.nbytes for layer in range(cache.n_layers) for t in cache.all_slots(layer))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_estimate_is_what_the_kv_cache_allocates(dtype):
    args = qwen_like_args()
    capacity = context_capacity(args, 300, max_batch=3, dtype=dtype)
    cache = KVCache(args.n_layers, args.n_kv_heads, args.head_dim, capacity, 3, dtype)
    assert allocated_bytes(cache) == kv_bytes_per_token(args, dtype) * capacity * 3 == cache.nbytes


def test_the_engine_takes_the_window_by_default_and_checks_a_cap(long_target):
    engine = SpecEngine(long_target, None, EngineConfig(max_batch=2, controller="off"))
    assert engine.capacity == WINDOW and engine.cache.capacity == WINDOW
    assert allocated_bytes(engine.cache) == kv_bytes_per_token(long_target.args, long_target.dtype) * WINDOW * 2
    assert SpecEngine(long_target, None, EngineConfig(max_batch=1, max_context=4096)).capacity == 4096
    with pytest.raises(ContextCapacityError, match="context window"):
        SpecEngine(long_target, None, EngineConfig(max_batch=1, max_context=WINDOW + 1))


def test_greedy_output_at_32k_positions_is_plain_decoding(long_target):
    """A prompt that fills the window up to its last 100 positions (random text with a span repeated at the end,
    so drafting fires): `suffix` and `ngram` at the default capacity give plain decoding's tokens."""
    g = torch.Generator().manual_seed(0)
    vocab = long_target.args.vocab_size
    head = torch.randint(3, vocab, (WINDOW - 100 - 1500,), generator=g).tolist()
    prompt = head + head[-20000:-18500]  # the repeated span: 1,500 tokens
    assert len(prompt) == WINDOW - 100
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    ref = plain_generate(long_target, prompt, params)
    for method in ("suffix", "ngram"):
        drafter = build_drafter(method, long_target, max_batch=1)
        engine = SpecEngine(long_target, drafter, EngineConfig(max_batch=1, controller=free_tokens_curve()))
        assert engine.capacity == WINDOW
        (seq,) = engine.run([prompt], params)
        assert seq.output_ids == ref, method
        assert seq.stats.depth_hits and seq.stats.depth_hits[0] > 0, f"{method} never had a drafted token accepted"


@pytest.mark.slow
def test_the_verifier_reports_one_kv_pool_whatever_the_methods():
    """SmolLM2 served with no max_context: its 8,192-token window; the reserved K/V is reported, resident once built,
    and does not grow with the served methods (one pool of max_batch slots); the memory check counts that pool's
    slots."""
    from services.verifier import VerifierConfig, build_engine

    per_token = 2 * 30 * 3 * 64 * 2  # 30 layers, 3 KV heads of 64, bf16 (as `spyglass generate` here: one cost curve)
    for methods in (["ar"], ["ar", "ngram", "suffix", "streaming"]):
        engine, _, info = build_engine(VerifierConfig(dtype="bfloat16", methods=methods, max_batch=2, threads=1))
        assert engine.methods == methods and info["context_length"] == 8192
        assert info["kv_bytes_per_token"] == per_token
        assert info["kv_bytes"] == allocated_bytes(engine.cache) == per_token * 8192 * 2
        # made resident when built (`KVCache.reserve`): writing the whole pool now faults no page in
        assert faults_writing(engine.cache) < info["kv_bytes"] // 4096 // 10
        assert info["kv_reserve_s"] >= 0

    twice = 2 * (available_memory() // (per_token * 8192) + 1)  # a pool twice what is free
    with pytest.raises(ContextCapacityError, match=f"{twice} sequence slot\\(s\\) x 8192 tokens"):
        build_engine(VerifierConfig(dtype="bfloat16", methods=["ar"], max_batch=twice, threads=1))
