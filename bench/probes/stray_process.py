"""What a stray process costs the engine's prefill: the same held-out prompts prefilled one after another on a quiet
machine and beside a process that takes a core for `--burst-ms` in every `--period-ms` (by default ~0.08 of a core:
what an idle `spyglass serve`'s Ray, Serve and Redis processes take here), alternating. On 2 cores the engine's two
threads meet at the end of every kernel, so the one the stray process holds up keeps the other waiting: the cost
can exceed the CPU taken.

    python bench/probes/stray_process.py [--dtype bfloat16] [--prompts 2] [--rounds 2] [--policy nice|idle]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import load_model, machine_load, wait_for_quiet, write_results  # noqa: E402
from bench.tasks import heldout_tasks  # noqa: E402
from spyglass.cost import cpu_model  # noqa: E402
from spyglass.drafters import build_drafter  # noqa: E402
from spyglass.engine import EngineConfig, SpecEngine  # noqa: E402
from spyglass.sampling import SamplingParams  # noqa: E402


def stray(ready, stop, burst_s: float, period_s: float, policy: str) -> None:
    if policy == "nice":
        os.nice(19)
    elif policy == "idle":
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    ready.set()
    while not stop.is_set():
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < burst_s:
            pass
        time.sleep(period_s - burst_s)


def main() -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompts", type=int, default=2, help="held-out prompts (2K-7K tokens)")
    ap.add_argument("--rounds", type=int, default=2, help="pairs of runs (quiet, stray), the order alternating")
    ap.add_argument("--burst-ms", type=float, default=2.5)
    ap.add_argument("--period-ms", type=float, default=30.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--policy", default="normal", choices=["normal", "nice", "idle"], help="nice: 19; idle: SCHED_IDLE")
    ap.add_argument("--name", default="stray_process")
    args = ap.parse_args()
    if not 0 < args.burst_ms < args.period_ms:
        ap.error("--burst-ms must be > 0 and below --period-ms")
    model, tok, _ = load_model(None, dtype=args.dtype, threads=args.threads)
    prompts = [list(t.prompt_ids) for t in heldout_tasks(tok, per_kind=6)][: args.prompts]
    engine = SpecEngine(
        model,
        config=EngineConfig(max_batch=4, max_context=8192),
        tokenizer=tok,
        drafters={"suffix": build_drafter("suffix", model, max_batch=4)},
    )
    params = SamplingParams(max_new_tokens=1)
    engine.run([prompts[0][:1024]], params)  # warm: kernels built and loaded
    quiet = wait_for_quiet(max_load=1.0, timeout_s=300)
    runs = []
    ctx = mp.get_context("spawn")  # a forked child would make every page this process then writes a copy-on-write fault
    for r in range(args.rounds):
        for with_stray in (False, True) if r % 2 == 0 else (True, False):
            stop, ready = ctx.Event(), ctx.Event()
            if with_stray:  # a daemon: it ends with this process if a run fails
                timing = (args.burst_ms / 1e3, args.period_ms / 1e3)
                proc = ctx.Process(target=stray, args=(ready, stop, *timing, args.policy), daemon=True)
                proc.start()
                ready.wait()  # its start-up (imports) done before the timing starts
            seqs = []
            for p in prompts:
                engine.cache.kept.clear()  # else a released slot hands the prompt's K/V back: no prefill to time
                seqs.append(engine.run([p], params)[0])
            stop.set()
            if with_stray:
                proc.join()
            runs.append({"stray": with_stray, "prefill_s": [round(s.stats.prefill_time, 3) for s in seqs]})
            print(runs[-1], flush=True)

    def total(with_stray: bool) -> float:
        return statistics.median(sum(r["prefill_s"]) for r in runs if r["stray"] == with_stray)

    quiet_s = total(False)
    figures = {"prefill_stray_vs_quiet": round(total(True) / quiet_s, 3), "prefill_quiet_s": round(quiet_s, 2)}
    meta = {
        "what": "engine prefill of the same prompts, quiet and beside a process taking a core in bursts",
        "cpu": cpu_model(),
        "dtype": args.dtype,
        "threads": args.threads,
        "stray_core_share": round(args.burst_ms / args.period_ms, 3),
        "burst_ms": args.burst_ms,
        "stray_policy": args.policy,
        "prompt_tokens": [len(p) for p in prompts],
        "quiet_before": quiet,
        "load_after": machine_load(),
    }
    path = write_results(args.name, figures, {"runs": runs}, meta)
    print(path, figures)
    return path


if __name__ == "__main__":
    main()
