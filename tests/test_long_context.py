"""Qwen2.5-Coder-0.5B at 16K and 32K tokens (`make test-long`; skipped by `make test`: each prompt costs minutes of
prefill on 2 cores). Held-out prompts (bench/tasks.py `long_tasks`) through the engine at the model's default, full
window: greedy output of `suffix`, `ngram` and the LongSpec draft shipped for Qwen (when one ships) equal to plain
decoding's; the prompt's K/V go through a real Redis context cache, stored and loaded back bitwise."""

from __future__ import annotations

import math
import os

import pytest
import torch

from bench.long_context import QWEN, longspec_draft_for
from bench.tasks import long_tasks
from spyglass.context_cache import ContextCache
from spyglass.drafters import build_drafter
from spyglass.engine import EngineConfig, SpecEngine, plain_generate
from spyglass.models.llama import PREFILL_CHUNK, load_transformer
from spyglass.sampling import SamplingParams
from tests.tiny import free_tokens_curve

pytestmark = pytest.mark.long
WINDOW = 32768
BLOCK = 128  # the context cache block of infra/serve_config_qwen.yaml


@pytest.fixture(scope="module")
def qwen():
    """Qwen2.5-Coder-0.5B-Instruct fp32 with its tokenizer, on SPYGLASS_TEST_THREADS threads (`make test-long`: 2; else
    the suite's one: threads that share busy cores with other work spin and slow everything down)."""
    from spyglass.models.loader import ModelLoadError, load_tokenizer, resolve_model

    try:
        resolved = resolve_model(QWEN, dtype="float32")
    except ModelLoadError as e:
        pytest.fail(f"{QWEN} is not installed (make model-qwen): {e}")
    threads = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("SPYGLASS_TEST_THREADS", threads)))
    yield load_transformer(resolved.path), load_tokenizer(resolved.path), resolved.model_id
    torch.set_num_threads(threads)


def blocks_in_slot(engine: SpecEngine, slot: int, n_blocks: int) -> list[torch.Tensor]:
    return [engine.cache.read_span(slot, b * BLOCK, (b + 1) * BLOCK) for b in range(n_blocks)]


@pytest.mark.parametrize(("label", "length", "kind"), [("16k", 16384, "repo"), ("32k", WINDOW - 64, "quote")])
def test_long_prompt_greedy_is_plain_decoding(qwen, redis_server, label, length, kind):
    """The first method prefills (a cache miss) and stores the prompt's K/V blocks; they read back bitwise equal to
    the engine's own. Every later method loads them (a hit) into a fresh engine, bitwise equal again. Every method's
    output equals plain decoding's, and drafting did fire."""
    target, tokenizer, model_id = qwen
    (task,) = long_tasks(tokenizer, [(label, length)], (kind,), 1)
    prompt = task.prompt_ids
    assert 0.85 * length <= len(prompt) <= length
    params = SamplingParams(max_new_tokens=24)
    reference = plain_generate(target, prompt, params)

    draft = longspec_draft_for(target)
    methods = {"suffix": {}, "ngram": {}}
    if draft is not None:
        methods["longspec"] = {"draft_checkpoint": str(draft)}
    cache = ContextCache(redis_server.url, f"test-long:{model_id}:{label}", block_size=BLOCK, max_bytes=2 << 30)
    n_blocks = len(prompt) // BLOCK
    stored: list[torch.Tensor] = []
    accepted = 0
    for i, (method, options) in enumerate(methods.items()):
        drafter = build_drafter(method, target, max_batch=1, max_context=WINDOW, **options)
        config = EngineConfig(max_batch=1, controller=free_tokens_curve())  # every drafted node verified
        engine = SpecEngine(target, drafter, config, context_cache=cache)
        assert engine.capacity == WINDOW  # the model's window by default
        seq = engine.add_request(prompt, params)
        while seq.num_generated == 0:  # the prefill in chunks (or the cached prefix's load), then the first round
            engine.step()
        if i == 0:
            assert seq.stats.cached_prefix_tokens == 0
            cache.flush(timeout=600)
            stored = cache.lookup(prompt)
            assert len(stored) == n_blocks
            own = blocks_in_slot(engine, seq.slot, n_blocks)
            assert all(torch.equal(a, b) for a, b in zip(stored, own, strict=True)), "stored K/V differ"
        else:
            grain = math.lcm(BLOCK, PREFILL_CHUNK)  # whole blocks of whole prefill chunks
            loaded = (len(prompt) - 1) // grain * grain // BLOCK
            assert seq.stats.cached_prefix_tokens == loaded * BLOCK
            own = blocks_in_slot(engine, seq.slot, loaded)
            assert all(torch.equal(a, b) for a, b in zip(stored, own, strict=False)), "loaded K/V differ"
        while not seq.finished:
            engine.step()
        assert seq.output_ids == reference, method
        accepted += sum(seq.stats.depth_hits[:1])
        del engine, drafter, seq
    assert accepted > 0, "no drafted token was ever accepted: the identity check would be vacuous"
