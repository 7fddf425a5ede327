"""Serving benchmark: the Ray Serve stack (gRPC gateway + one verifier replica) on the real SmolLM2.

Figures (bench/results/serving.json):
- grpc_vs_inprocess: single-stream decode tokens/s through the SDK + gRPC proxy + gateway + verifier vs
  the same SpecEngine in process (n-gram drafting, a real code-editing prompt). Goal >= 0.95.
- concurrency4_vs_1 (and 2, 8): aggregate decode tokens/s of N concurrent streams vs 1 (short chat prompts,
  n-gram drafting). Goal >= 2.5.
- cache_hit_ttft_speedup: client-side time to first token of a repeated 4K-token prompt, Redis context
  cache hit vs miss (each repeat uses a fresh prompt so its first request is a real miss). Goal >= 10.
- served_speedup_ngram, served_speedup_longspec_span (and served_tau_*): one stream's decode tokens/s through
  the gateway with that drafting method over plain decoding (`ar`) in the same replica, greedy, on a held-out
  code-completion prompt (5.6K tokens, 128 new): the LongSpec draft runs colocated with the target, reading
  its KV cache in the verifier; served_outputs_identical: every method's tokens equal plain decoding's.
- mixed_methods_c4_vs_per_method_engines: aggregate decode tokens/s of 4 concurrent streams with 4 different
  methods (ar, suffix, longspec-span, dflash-dels-span) on held-out prompts of 2K-6K tokens, in process on one
  target: the replica's one SpecEngine (every method in one batch, one KV pool) vs one SpecEngine per method
  (each its own pool of max_batch slots) stepped round-robin by one loop, as the replica ran them before. Decode
  time runs from the step where every stream has its first token to the last one's end. Goal >= 1.5. The same mix
  through the gRPC stack is kept for the record (mixed_grpc_*).
- spec_vs_plain_c{1,2,4,8,16} and `sweep`: 1-16 concurrent streams on the held-out prompts through the gRPC stack
  (streamed), the default method (suffix) and plain decoding (`ar`) interleaved: aggregate tokens/s, client-side
  p50/p99 time to first token (the prompts' prefixes come from the Redis context cache: the time is admission,
  the cache load and the prompt's uncached tail, not a full prefill) and p50 per-token latency (per stream,
  (last token - first token) / (tokens - 1)).
- replica_rss_all_methods_vs_one: resident memory (VmRSS) of a process that builds the replica's engine
  (services.verifier.build_engine + warm_up) with every method of spyglass.drafters.METHODS vs with `suffix`
  alone, each in its own subprocess, after one short request of each method (small-lm, which has no default
  draft, drafts with the target's first 8 layers). Goal <= 1.3.

Every greedy output of the mixed and sweep runs is checked against plain decoding (`plain_generate`) of its prompt.
The bench's replica drafts with `suffix_global: False`: the suffix drafter's replica-wide index of earlier outputs
would otherwise hand every repeat of a prompt its whole previous output as the draft.

Decode rates through gRPC are (N - 1) / (t(N new tokens) - t(1 new token)) so prefill cancels out; contenders are
interleaved per repeat and the medians reported, with the machine load recorded.

    python bench/serving.py             # the full run (~30 min on 2 idle cores): bench/results/serving.json (+ .png)
    python bench/serving.py --quick     # plumbing check, ~3 min: .cache/bench/serving_quick.json (+ .png)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    RESULTS_DIR,
    load_model,
    machine_load,
    median,
    median_of,
    percentile,
    plot_panels,
    ratio,
    wait_for_quiet,
    write_results,
)
from bench.common import vm_status as _vm_status  # noqa: E402
from bench.tasks import code_completion, heldout_tasks  # noqa: E402

CHAT_PROMPTS = [
    "Explain how a hash table handles collisions.",
    "Write a short story about a lighthouse keeper.",
    "Describe the water cycle for a ten-year-old.",
    "What are the trade-offs between TCP and UDP?",
    "Give three tips for writing clear documentation.",
    "How does a compiler differ from an interpreter?",
    "Summarise the rules of chess in a paragraph.",
    "Why is the sky blue? Answer briefly.",
]


SERVED_DRAFTERS = ["ngram", "longspec-span"]  # served side by side against plain decoding (`ar`)
MIXED_METHODS = ["ar", "suffix", "longspec-span", "dflash-dels-span"]  # one per stream of the 4-stream mix
DEFAULT_METHOD = "suffix"  # the replica's first method: what a request without `method` gets
SWEEP_LEVELS, QUICK_LEVELS = [1, 2, 4, 8, 16], [1, 2, 4]
MAX_PROMPT_TOKENS, QUICK_PROMPT_TOKENS = 6000, 320
RSS_SMALL_LM_LAYERS = 8  # small-lm has no default draft: the target's first 8 layers (weights shared)
DRAFTER_OPTIONS = {"suffix_global": False}  # no cross-request index: repeated prompts would be drafted from memory


def rate(t1: float, tn: float, n: int, streams: int = 1) -> float:
    return streams * (n - 1) / max(tn - t1, 1e-9)


def decode_rate(t1: float, tn: float, n: int, streams: int) -> float | None:
    """`rate`, or None (a void sample, left out of the median) where the 1-token wave took as long as the n-token
    one: other work on the machine swamped the decode."""
    return round(rate(t1, tn, n, streams), 3) if tn > t1 else None


def bench_grpc_vs_inprocess(client, engine_run, prompt: str, n: int, repeats: int) -> dict:
    """Decode tok/s of one stream with n-gram drafting: gRPC (client-side wall time) vs in process."""

    def grpc_call(k: int) -> None:
        client.generate_text(prompt, max_new_tokens=k, ignore_eos=True, method="ngram")

    def local_call(k: int) -> None:
        engine_run(prompt, k)

    samples: dict[str, list[float]] = {"grpc": [], "inprocess": []}
    grpc_call(2)
    local_call(2)
    for _ in range(repeats):
        for name, fn in (("grpc", grpc_call), ("inprocess", local_call)):
            t0 = time.perf_counter()
            fn(1)
            t1 = time.perf_counter()
            fn(n)
            t2 = time.perf_counter()
            samples[name].append(rate(t1 - t0, t2 - t1, n))
            print(f"  {name}: {samples[name][-1]:.2f} tok/s", flush=True)
    return {k: {"median_tok_s": median(v), "samples_tok_s": [round(x, 3) for x in v]} for k, v in samples.items()}


def bench_methods(client, prompt_ids: list[int], drafters: list[str], n: int, repeats: int) -> dict:
    """Decode tok/s and tau of one stream per drafting method and of plain decoding (`ar`) through the gateway
    (the drafts run colocated with the target in the verifier replica), greedy, on a held-out code prompt."""
    methods = ["ar", *drafters]

    def call(method: str, k: int):
        return client.generate_text(prompt_token_ids=prompt_ids, max_new_tokens=k, ignore_eos=True, method=method)

    samples: dict[str, list[float]] = {m: [] for m in methods}
    outs: dict[str, list] = {m: [] for m in methods}
    for m in methods:
        call(m, 2)  # the prompt's prefix into the context cache, the draft warmed
    for _ in range(repeats):
        for m in methods:  # interleaved, so drift hits every method alike
            t0 = time.perf_counter()
            call(m, 1)
            t1 = time.perf_counter()
            done = call(m, n)
            samples[m].append(rate(t1 - t0, time.perf_counter() - t1, n))
            outs[m].append(done)
            print(f"  {m}: {samples[m][-1]:.2f} tok/s, tau {done.stats.get('tau', 1.0):.2f}", flush=True)
    ref = outs["ar"][0].token_ids
    return {
        m: {
            "median_tok_s": median(samples[m]),
            "samples_tok_s": [round(x, 3) for x in samples[m]],
            "tau": median([o.stats.get("tau", 1.0) for o in outs[m]]),
            "method_served": outs[m][0].stats.get("method"),
            "identical": all(o.token_ids == ref for o in outs[m]),
        }
        for m in methods
    }


def bench_concurrency(address: str, n: int, repeats: int, levels: list[int]) -> dict:
    """Aggregate decode tok/s of c concurrent streams (distinct short prompts, n-gram drafting), c in `levels`."""
    from spyglass.client import AsyncClient

    async def wave(c: int, k: int) -> tuple[float, list[float]]:
        async with AsyncClient(address, timeout=600) as client:
            t0 = time.perf_counter()
            outs = await asyncio.gather(
                *(
                    client.generate_text(
                        CHAT_PROMPTS[i % len(CHAT_PROMPTS)], max_new_tokens=k, ignore_eos=True, method="ngram"
                    )
                    for i in range(c)
                )
            )
            return time.perf_counter() - t0, [o.stats["mean_batch_size"] for o in outs]

    asyncio.run(wave(1, 2))
    out: dict = {}
    samples: dict[int, list[float]] = {c: [] for c in levels}
    batch: dict[int, list[float]] = {c: [] for c in levels}
    for _ in range(repeats):
        for c in levels:
            t1, _ = asyncio.run(wave(c, 1))
            tn, mb = asyncio.run(wave(c, n))
            samples[c].append(rate(t1, tn, n, c))
            batch[c].append(median(mb))
            print(f"  concurrency {c}: {samples[c][-1]:.2f} tok/s aggregate, mean batch {batch[c][-1]:.2f}", flush=True)
    for c in levels:
        out[f"c{c}"] = {
            "median_agg_tok_s": median(samples[c]),
            "samples_agg_tok_s": [round(x, 3) for x in samples[c]],
            "mean_batch_size": median(batch[c]),
        }
    return out


def bench_cache(client, tokenizer, target_tokens: int, repeats: int) -> dict:
    """Client-side TTFT of a fresh ~4K-token prompt (miss) and of the same prompt again (hit)."""
    from spyglass.demo import code_edit_task

    source = Path(code_edit_task("argparse.py").source).read_text()
    ids = tokenizer.encode(source, add_special_tokens=False)[: target_tokens - 64]
    body = tokenizer.decode(ids)

    def ttft(prompt: str) -> tuple[float, dict]:
        t0 = time.perf_counter()
        first = None
        stats: dict = {"token_ids": []}
        for chunk in client.generate(prompt, max_new_tokens=4):
            if first is None and chunk.token_ids:
                first = time.perf_counter() - t0
            stats["token_ids"] += chunk.token_ids
            if chunk.final:
                stats.update(chunk.stats)
        return first, stats

    rows = []
    for _ in range(repeats):
        prompt = f"# session {uuid.uuid4().hex}\n{body}\n\nSummarise what this file does."
        miss, s_miss = ttft(prompt)
        time.sleep(1.0)  # blocks are written asynchronously after prefill
        hit, s_hit = ttft(prompt)
        rows.append(
            {
                "miss_ttft_s": miss,
                "hit_ttft_s": hit,
                "speedup": miss / hit,
                "prompt_tokens": s_miss["prompt_tokens"],
                "cached_prefix_tokens": s_hit["cached_prefix_tokens"],
                "identical": s_hit["token_ids"] == s_miss["token_ids"],
            }
        )
        print(f"  cache: miss {miss:.2f} s, hit {hit:.2f} s ({s_hit['cached_prefix_tokens']} cached)", flush=True)
    return {
        "runs": rows,
        "miss_ttft_s": median([r["miss_ttft_s"] for r in rows]),
        "hit_ttft_s": median([r["hit_ttft_s"] for r in rows]),
        "prompt_tokens": rows[0]["prompt_tokens"],
        "cached_prefix_tokens": rows[0]["cached_prefix_tokens"],
    }


def heldout_prompts(tokenizer, quick: bool) -> list[tuple[str, list[int]]]:
    """The held-out prompts of 2K-6K tokens (bench/tasks.py), kinds alternating (code, summary, code, ...);
    --quick cuts each to its first QUICK_PROMPT_TOKENS tokens."""
    by_kind: dict[str, list] = {}
    for t in heldout_tasks(tokenizer, per_kind=4):
        if len(t.prompt_ids) <= MAX_PROMPT_TOKENS:
            by_kind.setdefault(t.kind, []).append(t)
    order = [t for group in zip(*by_kind.values(), strict=False) for t in group]
    order += [t for group in by_kind.values() for t in group if t not in order]
    return [(t.name, t.prompt_ids[:QUICK_PROMPT_TOKENS] if quick else t.prompt_ids) for t in order]


def plain_references(model, prompts: list[tuple[str, list[int]]], n: int) -> list[list[int]]:
    """Plain decoding (the tests' oracle) of every prompt, greedy, `n` tokens."""
    from spyglass.engine import plain_generate
    from spyglass.sampling import SamplingParams

    return [plain_generate(model, ids, SamplingParams(max_new_tokens=n, ignore_eos=True)) for _, ids in prompts]


def bench_mixed_inprocess(
    model,
    tokenizer,
    prompts: list[list[int]],
    refs: list[list[int]],
    n: int,
    repeats: int,
    max_batch: int,
    capacity: int,
) -> dict:
    """Aggregate decode tok/s of 4 streams with 4 methods (MIXED_METHODS, one prompt each), in process on one target:
    the replica's one engine (one batch, one KV pool) vs one engine per method, each with its own pool of
    `max_batch` slots, stepped round-robin (a loop turn steps every engine with work: the replica's loop before
    it held one engine). Decode time: from the loop turn after which every stream has its first token to the end
    of the last stream; the pairs run back to back, their order alternating per repeat."""
    import torch

    from spyglass.drafters import build_drafter
    from spyglass.engine import EngineConfig, SpecEngine
    from spyglass.sampling import SamplingParams

    def drafter(method: str):
        return build_drafter(method, model, max_batch=max_batch, max_context=capacity, **DRAFTER_OPTIONS)

    conf = EngineConfig(max_batch=max_batch, max_context=capacity)
    one = SpecEngine(model, config=conf, tokenizer=tokenizer, drafters={m: drafter(m) for m in MIXED_METHODS})
    per_method = {
        m: SpecEngine(model, config=conf, tokenizer=tokenizer, drafters={m: drafter(m)}) for m in MIXED_METHODS
    }

    def one_engine(ids: list[list[int]], params):
        return [one.add_request(p, params, method=m) for p, m in zip(ids, MIXED_METHODS, strict=True)], one.step

    def per_method_engines(ids: list[list[int]], params):
        seqs = [per_method[m].add_request(p, params) for p, m in zip(ids, MIXED_METHODS, strict=True)]

        def turn() -> None:
            for engine in per_method.values():
                if engine.has_work:
                    engine.step()

        return seqs, turn

    contenders = {"one_engine": one_engine, "per_method_engines": per_method_engines}

    def decode(start, ids: list[list[int]], k: int) -> dict:
        seqs, turn = start(ids, SamplingParams(max_new_tokens=k, ignore_eos=True))
        with torch.inference_mode():
            while not all(s.num_generated or s.finished for s in seqs):
                turn()
            t0, before = time.perf_counter(), sum(s.num_generated for s in seqs)
            while not all(s.finished for s in seqs):
                turn()
            seconds = time.perf_counter() - t0
        tokens = sum(s.num_generated for s in seqs) - before
        return {
            "tok_s": tokens / max(seconds, 1e-9),
            "decode_s": seconds,
            "tokens": tokens,
            "mean_batch_size": median([s.stats.summary(s.num_generated)["mean_batch_size"] for s in seqs]),
            "identical": [s.output_ids == ref[:k] for s, ref in zip(seqs, refs, strict=True)],
        }

    for start in contenders.values():  # every drafter's and shape's first use, on the prompts' heads
        decode(start, [p[:256] for p in prompts], 8)
    samples: dict[str, list[dict]] = {k: [] for k in contenders}
    for r in range(repeats):
        names = list(contenders) if r % 2 == 0 else list(contenders)[::-1]
        for name in names:
            samples[name].append(decode(contenders[name], prompts, n))
            s = samples[name][-1]
            print(f"  {name}: {s['tok_s']:.2f} tok/s ({s['tokens']} tokens in {s['decode_s']:.1f} s)", flush=True)
    out = {
        name: {
            "median_tok_s": median([s["tok_s"] for s in rows]),
            "samples_tok_s": [round(s["tok_s"], 3) for s in rows],
            "samples_decode_s": [round(s["decode_s"], 3) for s in rows],
            "mean_batch_size": median([s["mean_batch_size"] for s in rows]),
            "identical": all(all(s["identical"]) for s in rows),
            "identical_by_method": dict(
                zip(MIXED_METHODS, [all(s["identical"][i] for s in rows) for i in range(4)], strict=True)
            ),
        }
        for name, rows in samples.items()
    }
    out["pair_ratios"] = [
        round(a["tok_s"] / b["tok_s"], 4)
        for a, b in zip(samples["one_engine"], samples["per_method_engines"], strict=True)
    ]
    out["max_batch"], out["capacity"], out["new_tokens"] = max_batch, capacity, n
    return out


async def _stream(client, ids: list[int], method: str, k: int, t0: float) -> dict:
    """One streamed request: its tokens, client-side time to first token and per-token latency, final stats."""
    first = last = None
    tokens: list[int] = []
    stats: dict = {}
    async for chunk in client.generate(prompt_token_ids=ids, max_new_tokens=k, ignore_eos=True, method=method):
        if chunk.token_ids:
            last = time.perf_counter()
            first = first or last
            tokens += chunk.token_ids
        if chunk.final:
            stats = chunk.stats or {}
    return {
        "token_ids": tokens,
        "ttft_s": (first or time.perf_counter()) - t0,
        "tpot_s": (last - first) / (len(tokens) - 1) if len(tokens) > 1 else None,
        "stats": stats,
    }


def stream_wave(address: str, jobs: list[tuple[list[int], str]], k: int) -> tuple[float, list[dict]]:
    """All `jobs` (prompt ids, method) streamed at once; the wave's wall time and each stream's record."""
    from spyglass.client import AsyncClient

    async def wave() -> tuple[float, list[dict]]:
        async with AsyncClient(address, timeout=1800) as client:
            t0 = time.perf_counter()
            outs = await asyncio.gather(*(_stream(client, ids, m, k, t0) for ids, m in jobs))
            return time.perf_counter() - t0, outs

    return asyncio.run(wave())


def fill_context_cache(address: str, prompts: list[list[int]]) -> None:
    """Every prompt's prefix into the Redis context cache, so the 1-token and the n-token waves both load it (a
    first wave that prefilled would make t(1) too long and the decode rate too high)."""
    stream_wave(address, [(ids, "ar") for ids in prompts], 1)
    time.sleep(1.0)  # blocks are written asynchronously after prefill


def bench_mixed_grpc(address: str, prompts: list[list[int]], refs: list[list[int]], n: int, repeats: int) -> dict:
    """The 4-method mix of bench_mixed_inprocess through the gRPC stack (the served replica's one engine)."""
    jobs = list(zip(prompts, MIXED_METHODS, strict=True))
    fill_context_cache(address, prompts)
    samples, batch, identical = [], [], []
    for _ in range(repeats):
        t1, _ = stream_wave(address, jobs, 1)
        tn, outs = stream_wave(address, jobs, n)
        samples.append(decode_rate(t1, tn, n, len(jobs)))
        batch.append(median([o["stats"].get("mean_batch_size", 0.0) for o in outs]))
        identical.append([o["token_ids"] == ref[:n] for o, ref in zip(outs, refs, strict=True)])
        print(f"  gRPC one engine: {samples[-1]} tok/s aggregate, mean batch {batch[-1]:.2f}", flush=True)
    return {
        "median_agg_tok_s": median_of(samples),
        "samples_agg_tok_s": samples,
        "mean_batch_size": median(batch),
        "identical": all(all(row) for row in identical),
        "identical_by_method": dict(
            zip(MIXED_METHODS, [all(row[i] for row in identical) for i in range(len(jobs))], strict=True)
        ),
        "new_tokens": n,
    }


def bench_sweep(
    address: str, prompts: list[list[int]], refs: list[list[int]], n: int, repeats: int, levels: list[int]
) -> dict:
    """c concurrent streams (c in `levels`, prompt i % len(prompts) each) with the default method and with plain
    decoding, interleaved per level: aggregate decode tok/s, client-side TTFT and per-token latency."""
    methods = [DEFAULT_METHOD, "ar"]
    fill_context_cache(address, prompts)
    rows: dict[tuple[int, str], dict[str, list]] = {
        (c, m): {"agg": [], "ttft": [], "tpot": [], "batch": [], "tau": [], "identical": []}
        for c in levels
        for m in methods
    }
    for _ in range(repeats):
        for c in levels:
            jobs = [(prompts[i % len(prompts)], i % len(prompts)) for i in range(c)]
            for m in methods:
                t1, _ = stream_wave(address, [(ids, m) for ids, _ in jobs], 1)
                tn, outs = stream_wave(address, [(ids, m) for ids, _ in jobs], n)
                row = rows[(c, m)]
                row["agg"].append(decode_rate(t1, tn, n, c))
                row["ttft"] += [o["ttft_s"] for o in outs]
                row["tpot"] += [o["tpot_s"] for o in outs if o["tpot_s"] is not None]
                row["batch"].append(median([o["stats"].get("mean_batch_size", 0.0) for o in outs]))
                row["tau"].append(median([o["stats"].get("tau", 1.0) for o in outs]))
                row["identical"] += [o["token_ids"] == refs[i][:n] for o, (_, i) in zip(outs, jobs, strict=True)]
                print(
                    f"  {c} x {m}: {row['agg'][-1]} tok/s aggregate, TTFT p50 "
                    f"{percentile([o['ttft_s'] for o in outs], 50):.2f} s, mean batch {row['batch'][-1]:.2f}",
                    flush=True,
                )
    out: dict = {}
    for (c, m), row in rows.items():
        out.setdefault(f"c{c}", {})[m] = {
            "median_agg_tok_s": median_of(row["agg"]),
            "samples_agg_tok_s": row["agg"],
            "ttft_p50_s": percentile(row["ttft"], 50),
            "ttft_p99_s": percentile(row["ttft"], 99),
            "tpot_p50_ms": percentile(row["tpot"], 50) * 1e3 if row["tpot"] else None,
            "mean_batch_size": median(row["batch"]),
            "tau": median(row["tau"]),
            "identical": all(row["identical"]),
            "streams_measured": len(row["ttft"]),
        }
    return out


def rss_child(spec: dict) -> dict:
    """In a fresh process: build the replica's engine (build_engine + warm_up) for `spec` (a VerifierConfig dict),
    serve one short greedy request of each method (each checked against plain decoding), report the memory."""
    import torch

    from services.verifier import VerifierConfig, build_engine, encode_prompt, warm_up
    from spyglass.engine import plain_generate
    from spyglass.sampling import SamplingParams

    cfg = VerifierConfig.from_dict(spec)
    torch.set_num_threads(cfg.threads or 1)
    marks = {"imported": _vm_status()}
    engine, tokenizer, info = build_engine(cfg)
    marks["built"] = _vm_status()
    warm = warm_up(engine, tokenizer, cfg, cfg.warmup_prompt_tokens) if cfg.warmup_prompt_tokens > 0 else {}
    marks["warmed_up"] = _vm_status()
    ids = encode_prompt(tokenizer, CHAT_PROMPTS[0], raw=False)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    ref = plain_generate(engine.target, ids, params)
    identical = {}
    with torch.inference_mode():
        for m in engine.methods:
            (seq,) = engine.run([ids], params, method=m)
            identical[m] = seq.output_ids == ref
    marks["served"] = _vm_status()
    return {
        "methods": engine.methods,
        "rss_mib": marks["served"]["rss_mib"],
        "hwm_mib": marks["served"]["hwm_mib"],
        "marks": marks,
        "kv_bytes": info["kv_bytes"],
        "warmup_s": warm.get("seconds"),
        "identical": all(identical.values()),
        "identical_by_method": identical,
    }


def bench_rss(verifier: dict) -> dict:
    """rss_child with every method of METHODS and with DEFAULT_METHOD alone, each in its own subprocess."""
    from spyglass.drafters import METHODS

    out = {}
    for label, methods in (("all_methods", list(METHODS)), ("one_method", [DEFAULT_METHOD])):
        spec = {**verifier, "methods": methods}
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--rss-child", json.dumps(spec)],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"the {label} replica process failed:\n{proc.stderr[-4000:]}")
        out[label] = json.loads(proc.stdout.strip().splitlines()[-1])
        out[label]["process_s"] = round(time.perf_counter() - t0, 1)
        print(f"  {label} ({len(methods)}): {out[label]['rss_mib']:.0f} MiB resident", flush=True)
    out["config"] = {k: v for k, v in verifier.items() if k != "methods"}
    return out


def _rounded(value):
    if isinstance(value, float):
        return round(value, 3)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


def compute_figures(raw: dict) -> dict:
    """Headline ratios. The cache speedup is the median of per-repeat miss/hit ratios: each pair is measured
    back to back, so load drift on the shared machine cancels (the ratio of medians is kept alongside); the same
    for the mixed-methods A/B."""
    g = raw["grpc_vs_inprocess"]
    c = raw["concurrency"]
    cache = raw["cache"]
    figures = {
        "grpc_vs_inprocess": g["grpc"]["median_tok_s"] / g["inprocess"]["median_tok_s"],
        **{
            f"concurrency{k}_vs_1": c[f"c{k}"]["median_agg_tok_s"] / c["c1"]["median_agg_tok_s"]
            for k in (2, 4, 8)
            if f"c{k}" in c
        },
        "cache_hit_ttft_speedup": median([r["miss_ttft_s"] / r["hit_ttft_s"] for r in cache["runs"]]),
        "cache_hit_ttft_speedup_of_medians": cache["miss_ttft_s"] / cache["hit_ttft_s"],
        "cache_miss_ttft_s": cache["miss_ttft_s"],
        "cache_hit_ttft_s": cache["hit_ttft_s"],
        "cache_prompt_tokens": cache["prompt_tokens"],
        "cache_outputs_identical": all(r["identical"] for r in cache["runs"]),
        "single_stream_grpc_tok_s": g["grpc"]["median_tok_s"],
        "single_stream_inprocess_tok_s": g["inprocess"]["median_tok_s"],
        "mean_batch_size_c4": c["c4"]["mean_batch_size"],
    }
    served = raw["methods"]
    for m in SERVED_DRAFTERS:
        key = m.replace("-", "_")
        figures[f"served_speedup_{key}"] = served[m]["median_tok_s"] / served["ar"]["median_tok_s"]
        figures[f"served_tau_{key}"] = served[m]["tau"]
    figures["served_outputs_identical"] = all(r["identical"] for r in served.values())

    mixed, mixed_grpc = raw["mixed_inprocess"], raw["mixed_grpc"]
    one, per = mixed["one_engine"], mixed["per_method_engines"]
    figures["mixed_methods_c4_vs_per_method_engines"] = median(mixed["pair_ratios"])
    figures["mixed_methods_c4_vs_per_method_engines_of_medians"] = one["median_tok_s"] / per["median_tok_s"]
    figures["mixed_one_engine_tok_s"] = one["median_tok_s"]
    figures["mixed_per_method_engines_tok_s"] = per["median_tok_s"]
    figures["mixed_one_engine_mean_batch_size"] = one["mean_batch_size"]
    figures["mixed_grpc_one_engine_tok_s"] = mixed_grpc["median_agg_tok_s"]
    figures["mixed_grpc_mean_batch_size"] = mixed_grpc["mean_batch_size"]
    figures["mixed_outputs_identical"] = one["identical"] and per["identical"] and mixed_grpc["identical"]

    sweep = raw["sweep"]
    for level, row in sweep.items():
        figures[f"spec_vs_plain_{level}"] = ratio(
            row[DEFAULT_METHOD]["median_agg_tok_s"], row["ar"]["median_agg_tok_s"]
        )
    figures["sweep"] = {
        level: {
            m: {k: row[m][k] for k in ("median_agg_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_ms")}
            for m in (DEFAULT_METHOD, "ar")
        }
        for level, row in sweep.items()
    }
    figures["sweep_outputs_identical"] = all(r[m]["identical"] for r in sweep.values() for m in (DEFAULT_METHOD, "ar"))

    rss = raw["rss"]
    figures["replica_rss_all_methods_vs_one"] = rss["all_methods"]["rss_mib"] / rss["one_method"]["rss_mib"]
    figures["replica_rss_all_methods_mib"] = rss["all_methods"]["rss_mib"]
    figures["replica_rss_one_method_mib"] = rss["one_method"]["rss_mib"]
    figures["replica_rss_methods"] = len(rss["all_methods"]["methods"])
    figures["replica_rss_outputs_identical"] = rss["all_methods"]["identical"] and rss["one_method"]["identical"]
    return _rounded(figures)


def plot(path: Path, raw: dict, figures: dict, repeats: int) -> Path:
    c, sweep = raw["concurrency"], raw["sweep"]
    old_levels = sorted(int(k[1:]) for k in c)
    levels = sorted(int(k[1:]) for k in sweep)
    methods = (DEFAULT_METHOD, "ar")

    def nan(v: float | None) -> float:  # a void sample: a gap in the line
        return float("nan") if v is None else v

    def per_level(m: str, key: str) -> tuple[list[int], list[float]]:
        return levels, [nan(sweep[f"c{k}"][m][key]) for k in levels]

    def per_repeat(samples: list[float | None]) -> tuple[list[int], list[float]]:
        return list(range(len(samples))), [nan(v) for v in samples]

    mixed, mixed_grpc = raw["mixed_inprocess"], raw["mixed_grpc"]
    return plot_panels(
        path,
        [
            {
                "title": "aggregate decode tok/s vs concurrent streams (held-out 2K-6K prompts)",
                "xlabel": "streams",
                "ylabel": "tok/s",
                "series": {
                    **{f"{m} (gRPC)": per_level(m, "median_agg_tok_s") for m in methods},
                    "ngram, short chat prompts (gRPC)": (
                        old_levels,
                        [c[f"c{k}"]["median_agg_tok_s"] for k in old_levels],
                    ),
                },
                "logx": True,
                "logy": True,
            },
            {
                "title": f"{DEFAULT_METHOD} / plain decoding, aggregate tok/s",
                "xlabel": "streams",
                "ylabel": "speedup",
                "series": {
                    DEFAULT_METHOD: (levels, [nan(figures[f"spec_vs_plain_c{k}"]) for k in levels]),
                },
                "hline": 1.0,
                "logx": True,
            },
            {
                "title": "client-side time to first token (context-cache hits)",
                "xlabel": "streams",
                "ylabel": "seconds",
                "series": {f"{m} {q}": per_level(m, f"ttft_{q}_s") for m in methods for q in ("p50", "p99")},
                "logx": True,
                "logy": True,
            },
            {
                "title": "per-token latency p50 (per stream)",
                "xlabel": "streams",
                "ylabel": "ms",
                "series": {m: per_level(m, "tpot_p50_ms") for m in methods},
                "logx": True,
            },
            {
                "title": "4 streams, 4 methods: aggregate decode tok/s per repeat",
                "xlabel": "repeat",
                "ylabel": "tok/s",
                "series": {
                    "one engine (in process)": per_repeat(mixed["one_engine"]["samples_tok_s"]),
                    "per-method engines (in process)": per_repeat(mixed["per_method_engines"]["samples_tok_s"]),
                    "one engine (gRPC)": per_repeat(mixed_grpc["samples_agg_tok_s"]),
                },
            },
            {
                "title": "TTFT of a repeated prompt: Redis miss vs hit",
                "xlabel": "repeat",
                "ylabel": "seconds",
                "series": {
                    "miss": (list(range(repeats)), [r["miss_ttft_s"] for r in raw["cache"]["runs"]]),
                    "hit": (list(range(repeats)), [r["hit_ttft_s"] for r in raw["cache"]["runs"]]),
                },
                "logy": True,
            },
        ],
        title="spyglass serving (SmolLM2-135M, CPU)",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="plumbing check: few tokens, short prompts, 1 repeat")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--results-dir", type=Path, help="default: bench/results (--quick: .cache/bench)")
    ap.add_argument("--rss-child", metavar="JSON", help=argparse.SUPPRESS)  # bench_rss's subprocess
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.rss_child:
        print(json.dumps(rss_child(json.loads(args.rss_child))))
        return
    results_dir = args.results_dir or (ROOT / ".cache" / "bench" if args.quick else RESULTS_DIR)
    quiet = wait_for_quiet(max_load=1.0, timeout_s=0 if args.quick else 300)
    q = args.quick
    n, repeats = (12, 1) if q else (48, 3)
    mixed_n, mixed_repeats = (12, 1) if q else (128, 5)
    sweep_n, levels = (12, QUICK_LEVELS) if q else (64, SWEEP_LEVELS)
    max_context = 4096 if q else 8192

    import torch
    from ray import serve

    from services.app import LocalRedis, deploy, start_local_ray, wait_ready
    from services.local_redis import free_port
    from services.verifier import encode_prompt
    from spyglass.client import Client
    from spyglass.demo import code_edit_task
    from spyglass.drafters import build_drafter
    from spyglass.engine import EngineConfig, SpecEngine
    from spyglass.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    verifier = {
        # the default first; n-gram for grpc_vs_inprocess and the short-prompt concurrency figures
        "methods": list(dict.fromkeys([DEFAULT_METHOD, "ar", "ngram", *SERVED_DRAFTERS, *MIXED_METHODS])),
        "max_batch": max(SWEEP_LEVELS),  # 16 streams run in one batch
        "max_context": max_context,
        "threads": args.threads,
        "cache_block_size": 128,
        "cache_max_bytes": 4 << 30,  # every held-out prompt's blocks stay cached through the sweep
        "drafter_options": DRAFTER_OPTIONS,
    }
    if q:
        verifier["warmup_prompt_tokens"] = 200
    raw: dict = {}
    phase_s: dict[str, float] = {}
    t_phase = time.perf_counter()

    def phase(name: str) -> None:
        nonlocal t_phase
        phase_s[name] = round(time.perf_counter() - t_phase, 1)
        t_phase = time.perf_counter()

    print("replica resident memory, all methods vs one (subprocesses):", flush=True)
    rss_verifier = {
        "max_batch": verifier["max_batch"],
        "max_context": max_context,
        "threads": args.threads,
        "drafter_options": {"draft_layers": RSS_SMALL_LM_LAYERS},
    }
    if q:
        rss_verifier["warmup_prompt_tokens"] = 0  # the quick run skips the replica's warm-up (minutes for 19 methods)
    raw["rss"] = bench_rss(rss_verifier)
    phase("rss")

    model, tok, _ = load_model()
    prompts = heldout_prompts(tok, q)
    print(f"plain-decoding references of {len(prompts)} held-out prompts:", flush=True)
    refs = plain_references(model, prompts, max(mixed_n, sweep_n))
    prompt_ids = [ids for _, ids in prompts]
    meta_prompts = [{"name": name, "tokens": len(ids)} for name, ids in prompts]
    phase("references")
    print("4 streams, 4 methods, in process: one engine vs per-method engines:", flush=True)
    raw["mixed_inprocess"] = bench_mixed_inprocess(
        model, tok, prompt_ids[:4], refs[:4], mixed_n, mixed_repeats, max_batch=4, capacity=max_context
    )
    raw["mixed_inprocess"]["prompts"] = meta_prompts[:4]
    gc.collect()  # the A/B engines' KV pages go back before the replica starts
    phase("mixed_inprocess")

    # Ray's workers (the replica, the gateway) import this tree's code, also where another checkout is installed
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    redis = LocalRedis()
    start_local_ray(4)
    doc = {
        "applications": [
            {"name": "spyglass", "args": {"redis_url": redis.url, "gateway": {"max_queued": 16}, "verifier": verifier}}
        ]
    }
    try:
        address, _ = deploy(doc, grpc_port=free_port(), http_port=free_port())
        wait_ready(address)
        phase("deploy")

        def engine_run(prompt: str, k: int) -> None:
            eng = SpecEngine(model, build_drafter("ngram", model, max_batch=1), EngineConfig(1, 8192), tok)
            eng.run([encode_prompt(tok, prompt, raw=False)], SamplingParams(max_new_tokens=k, ignore_eos=True))

        prompt = code_edit_task("textwrap.py", max_chars=6000).prompt
        with Client(address, timeout=900) as client:
            print("grpc vs in-process (single stream):", flush=True)
            # 7 pairs: with 3 the ratio spread 0.82-1.04 over five runs, the machine drifting between the two sides
            raw["grpc_vs_inprocess"] = bench_grpc_vs_inprocess(client, engine_run, prompt, n, 1 if q else 7)
            print("concurrency (short chat prompts, n-gram):", flush=True)
            raw["concurrency"] = bench_concurrency(address, n, repeats, QUICK_LEVELS if q else [1, 2, 4, 8])
            print("context cache:", flush=True)
            raw["cache"] = bench_cache(client, tok, 1024 if q else 4096, repeats)
            print("drafting methods through the gateway (held-out code completion):", flush=True)
            task = code_completion(tok, "calendar.py")
            method_ids = task.prompt_ids[-QUICK_PROMPT_TOKENS:] if q else task.prompt_ids
            raw["methods"] = bench_methods(client, method_ids, SERVED_DRAFTERS, 32 if q else 128, repeats)
            phase("grpc_single_stream")
            print("4 streams, 4 methods, through gRPC (the replica's one engine):", flush=True)
            raw["mixed_grpc"] = bench_mixed_grpc(address, prompt_ids[:4], refs[:4], mixed_n, repeats)
            phase("mixed_grpc")
            print(f"concurrency sweep (held-out prompts, {DEFAULT_METHOD} and plain decoding):", flush=True)
            raw["sweep"] = bench_sweep(address, prompt_ids, refs, sweep_n, repeats, levels)
            phase("sweep")
            raw["health"] = client.health()
    finally:
        serve.shutdown()
        import ray

        ray.shutdown()
        redis.stop()

    figures = compute_figures(raw)
    name = "serving_quick" if q else "serving"
    meta = {
        "threads": args.threads,
        "new_tokens": n,
        "mixed_new_tokens": mixed_n,
        "sweep_new_tokens": sweep_n,
        "repeats": repeats,
        "mixed_repeats": mixed_repeats,
        "quiet_check": quiet,
        "load_at_end": machine_load(),
        "verifier": verifier,
        "heldout_prompts": meta_prompts,
        "mixed_methods": MIXED_METHODS,
        "phase_s": phase_s,
    }
    path = write_results(name, figures, raw, meta, results_dir=results_dir)
    plot(results_dir / f"{name}.png", raw, figures, repeats)
    print(json.dumps(figures, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
