"""What the context cache's writer costs the engine: the same prompts one after another through one engine with a
context cache on a real redis-server (every prompt new: a miss, then its blocks stored) and through one without,
alternating, greedy, `suffix` drafting. Records each run's wall time, the prompts' times to first token, the
writer's own seconds (`write_s`) and the engine loop's copies of blocks the writer had not reached when their slot
was released (`copy_s`).

    python bench/probes/cache_writer.py [--dtype bfloat16] [--prompts 4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import load_model, machine_load, wait_for_quiet, write_results  # noqa: E402
from bench.tasks import heldout_tasks  # noqa: E402
from services.local_redis import LocalRedis  # noqa: E402
from spyglass.context_cache import ContextCache, kv_namespace  # noqa: E402
from spyglass.cost import cpu_model  # noqa: E402
from spyglass.drafters import build_drafter  # noqa: E402
from spyglass.engine import EngineConfig, SpecEngine  # noqa: E402
from spyglass.sampling import SamplingParams  # noqa: E402


def run(model, tok, prompts: list[list[int]], redis_url: str | None, params: SamplingParams) -> dict:
    cache = None
    if redis_url:  # a fresh namespace: every prompt misses and is stored
        cache = ContextCache(redis_url, kv_namespace(f"writer-{uuid.uuid4().hex[:8]}", model.dtype), block_size=128)
    engine = SpecEngine(
        model,
        config=EngineConfig(max_batch=4, max_context=8192),
        tokenizer=tok,
        context_cache=cache,
        drafters={"suffix": build_drafter("suffix", model, max_batch=4)},
    )
    t0 = time.perf_counter()
    seqs = [engine.run([prompt], params)[0] for prompt in prompts]  # one after another
    wall = time.perf_counter() - t0
    out = {
        "cache": cache is not None,
        "wall_s": round(wall, 2),
        "ttft_s": [round(s.stats.prefill_time, 3) for s in seqs],  # admitted at once: admission to first token
        "outputs": [s.output_ids for s in seqs],
    }
    if cache is not None:
        cache.flush()
        st = cache.stats
        out.update(stored_blocks=st.stored_blocks, errors=st.errors)
        out.update(write_s=round(st.write_s, 2), copy_s=round(st.copy_s, 3))
    return out


def main() -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompts", type=int, default=4, help="held-out prompts (2K-7K tokens)")
    ap.add_argument("--rounds", type=int, default=2, help="pairs of runs (with, without), the order alternating")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="cache_writer")
    args = ap.parse_args()
    model, tok, _ = load_model(None, dtype=args.dtype, threads=args.threads)
    prompts = [list(t.prompt_ids) for t in heldout_tasks(tok, per_kind=6)][: args.prompts]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    redis = LocalRedis()
    try:
        quiet = wait_for_quiet(max_load=1.0, timeout_s=300)
        runs = []
        for r in range(args.rounds):
            for url in (redis.url, None) if r % 2 == 0 else (None, redis.url):
                runs.append(run(model, tok, prompts, url, params))
                print({k: v for k, v in runs[-1].items() if k != "outputs"}, flush=True)
    finally:
        redis.stop()
    on = [r for r in runs if r["cache"]]
    off = [r for r in runs if not r["cache"]]
    figures = {
        "wall_with_vs_without_cache": round(statistics.median(r["wall_s"] for r in on)
                                            / statistics.median(r["wall_s"] for r in off), 3),
        "ttft_sum_with_vs_without_cache": round(statistics.median(sum(r["ttft_s"]) for r in on)
                                                / statistics.median(sum(r["ttft_s"]) for r in off), 3),
        "outputs_equal": all(r["outputs"] == runs[0]["outputs"] for r in runs),
    }  # fmt: skip
    meta = {
        "what": "the context cache writer's cost to the engine: the same prompts with and without a cache",
        "cpu": cpu_model(),
        "dtype": args.dtype,
        "threads": args.threads,
        "prompt_tokens": [len(p) for p in prompts],
        "max_new_tokens": args.max_new_tokens,
        "quiet_before": quiet,
        "load_after": machine_load(),
    }
    raw = {"runs": [{k: v for k, v in r.items() if k != "outputs"} for r in runs]}
    path = write_results(args.name, figures, raw, meta)
    print(path, figures)
    return path


if __name__ == "__main__":
    main()
