"""Replica warm-up (services/verifier.py `warm_up`): one-time costs are paid at start-up, in-process, without
touching the context cache or leaving anything behind, and the first request after it is served normally.
Whether the first request is then as fast as a repeat is measured by `make run` (numbers in RELIABILITY.md),
never asserted in a timed test."""

from __future__ import annotations

import redis

from services.verifier import VerifierConfig, encode_prompt, warm_up
from spyglass.context_cache import ContextCache
from spyglass.cost import CostCurve
from spyglass.drafters import build_drafter
from spyglass.engine import EngineConfig, SpecEngine, plain_generate
from spyglass.sampling import SamplingParams


def test_warm_up_runs_every_method_and_leaves_no_trace(smollm2, redis_server):
    model, tok = smollm2
    r = redis.Redis.from_url(redis_server.url)
    r.flushdb()
    cache = ContextCache(redis_server.url, "warmup-test", block_size=64, async_writes=False)
    cfg = VerifierConfig(methods=["ngram", "ar"], max_batch=2, max_context=1024, prefill_chunk=128)
    econf = EngineConfig(max_batch=2, max_context=1024, prefill_chunk=128, controller=CostCurve.linear())
    drafters = {m: build_drafter(m, model, max_batch=2, max_context=1024) for m in cfg.methods}
    engine = SpecEngine(model, config=econf, tokenizer=tok, context_cache=cache, drafters=drafters)
    report = warm_up(engine, tok, cfg, prompt_tokens=200)
    assert set(report["methods"]) == {"ngram", "ar"} and report["seconds"] > 0
    for m, rep in report["methods"].items():  # the first method prefills the full prompt, later ones a quarter
        first = m == "ngram"
        assert rep["prompt_tokens"][0] == (200 if first else 50), (m, rep)
        assert rep["generated"] == ([24, 24] if first else [12, 12]), (m, rep)
    assert not engine.has_work and engine.cache.free_slots == engine.cache.max_slots
    assert engine.context_cache is cache  # re-attached after the warm-up
    assert r.dbsize() == 0  # the synthetic prompt never reached Redis
    # the first real request after warm-up: greedy output equals plain decoding
    ids = encode_prompt(tok, "List the days of the week, one per line.", raw=False)
    params = SamplingParams(max_new_tokens=12)
    (seq,) = engine.run([ids], params, method="ngram")
    assert seq.output_ids == plain_generate(model, ids, params)
