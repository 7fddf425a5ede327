"""Where a stream's long waits between two tokens come from: the engine alone as a replica builds it
(`services.verifier.build_engine`: its KV pool, context cache on a local redis-server, `suffix` and `ar`, 16 slots),
a load of `bench/load.py` (`shared` by default) in a closed loop of N streams, greedy. Every step is timed by part
(admission and its prefix copies, prefill, the verify round) and every gap between two events of one stream is kept;
the run records the gaps' median, P99 and maximum, the steps behind the longest ones and the context cache's writer
statistics.

    python bench/probes/step_gaps.py [--streams 4] [--workload shared] [--cache-min-uses 2] [--write-share 0.5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import machine_load, median, percentile, wait_for_quiet, write_results  # noqa: E402
from bench.load import workloads  # noqa: E402
from services.local_redis import LocalRedis  # noqa: E402
from services.verifier import VerifierConfig, build_engine  # noqa: E402
from spyglass.cost import cpu_model  # noqa: E402
from spyglass.sampling import SamplingParams  # noqa: E402

PARTS = ("_admit", "_prefill_step", "_spec_round")


def timed_parts(engine, spent: dict[str, float]) -> None:
    """Wrap the engine's step parts and its prefix copies so each adds its seconds to `spent`."""

    def wrap(owner, name: str, label: str) -> None:
        fn = getattr(owner, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - t0

        setattr(owner, name, timed)

    for part in PARTS:
        wrap(engine, part, part.lstrip("_"))
    wrap(engine.cache, "copy_prefix", "copy_prefix")


def by_running(steps: list[dict]) -> dict[int, dict]:
    """Steps, their rounds' and their prefills' seconds per number of decoding sequences."""
    out: dict[int, dict] = {}
    for st in steps:
        b = out.setdefault(st["running"], {"steps": 0, "round_s": 0.0, "prefill_s": 0.0})
        b["steps"] += 1
        b["round_s"] += st.get("spec_round", 0.0)
        b["prefill_s"] += st.get("prefill_step", 0.0)
    return {n: {k: round(v, 2) for k, v in b.items()} for n, b in sorted(out.items())}


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--workload", default="shared", choices=["long", "shared", "copy"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--cache-min-uses", type=int, default=2)
    ap.add_argument("--write-share", type=float, default=0.5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="step_gaps")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    quiet = wait_for_quiet(max_load=1.0, timeout_s=300)
    redis = LocalRedis()
    try:
        cfg = VerifierConfig(
            dtype=args.dtype, methods=["suffix", "ar"], max_batch=16, redis_url=redis.url, threads=args.threads,
            cache_min_uses=args.cache_min_uses, cache_write_share=args.write_share,
        )  # fmt: skip
        engine, tok, info = build_engine(cfg)
        prompts = [tok.encode(t) for t in workloads(tok, False, 4)[args.workload]]
        spent: dict[str, float] = {}
        timed_parts(engine, spent)
        params = SamplingParams(max_new_tokens=args.max_new_tokens)
        todo, live, last, gaps, steps = list(prompts), [], {}, [], []
        t_start = time.perf_counter()
        with torch.inference_mode():
            while todo or engine.has_work:
                while todo and len(live) < args.streams:
                    live.append(engine.add_request(todo.pop(0), params))
                spent.clear()
                t0 = time.perf_counter()
                events = engine.step()
                t1 = time.perf_counter()
                steps.append({**{k: round(v, 3) for k, v in spent.items()}, "step": round(t1 - t0, 3),
                              "running": len(engine.running), "prefilling": len(engine.prefilling)})  # fmt: skip
                for ev in events:
                    sid = ev.seq.seq_id
                    if sid in last:
                        gaps.append((t1 - last[sid], len(steps) - 1))
                    last[sid] = t1
                live = [s for s in live if not s.finished]
        wall = time.perf_counter() - t_start
        stats = engine.context_cache.stats
    finally:
        redis.stop()
    seconds = [g for g, _ in gaps]
    figures = {
        "wall_s": round(wall, 2),
        "gap_p50_s": round(median(seconds), 3),
        "gap_p99_s": round(percentile(seconds, 99), 3),
        "gap_max_s": round(max(seconds), 3),
    }
    longest = sorted(gaps, reverse=True)[:8]
    raw = {
        "longest": [
            {"gap_s": round(g, 3), "step": steps[i], "step_before": steps[i - 1] if i else None} for g, i in longest
        ],  # fmt: skip
        "cache": {
            "stored_blocks": stats.stored_blocks,
            "write_s": round(stats.write_s, 2),
            "copy_s": round(stats.copy_s, 3),
        },  # fmt: skip
        "steps": len(steps),
        # seconds per part over the run, and per number of decoding sequences: the rounds' and the prefills' shares
        "totals_s": {
            k: round(sum(st.get(k, 0.0) for st in steps), 2) for k in (*(p.lstrip("_") for p in PARTS), "step")
        },
        "by_running": by_running(steps),
        "kv_reserve_s": info["kv_reserve_s"],
    }
    print(figures, raw["cache"], raw["totals_s"], raw["by_running"], flush=True)
    meta = {
        "what": "gaps between a stream's tokens in the engine alone, by step part",
        "cpu": cpu_model(),
        "args": vars(args),
        "prompts": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "quiet_before": quiet,
        "load_after": machine_load(),
    }
    return write_results(args.name, figures, raw, meta)


if __name__ == "__main__":
    main()
