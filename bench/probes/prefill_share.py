"""Where a prefill-bound load's time goes in the engine at 1 and at 4 streams: prefill forwards against verify rounds.

The engine alone (no server, no client), the bench's held-out prompts (2K-7K tokens, `per_kind` of code, edit and
summary), all queued at once, `max_batch` slots (1 or 4: a closed loop of that many streams), greedy. Each
configuration runs the same prompts; the run records its wall time, the seconds spent in `_prefill_step` and in the
verify rounds (`_spec_round`), the rounds, their mean batch and the steps, and the per-token cost of one prefill
forward by chunk size at two contexts (what a step's time budget buys). Configurations: streams:prefill_step_s, and
optionally :method (default `suffix`; `ar` is plain decoding), so two methods can alternate on the same prompts.

    python bench/probes/prefill_share.py [--dtype bfloat16] [--per-kind 2] [--configs 1:0.25,4:0.25,4:0.5]
    python bench/probes/prefill_share.py --per-kind 1 --configs 1:0.1:ar,1:0.1:suffix,1:0.1:ar,1:0.1:suffix
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import load_model, machine_load, wait_for_quiet, write_results  # noqa: E402
from bench.tasks import heldout_tasks  # noqa: E402
from spyglass.cost import cpu_model, measure_prefill_rate  # noqa: E402
from spyglass.drafters import build_drafter  # noqa: E402
from spyglass.engine import EngineConfig, SpecEngine  # noqa: E402
from spyglass.sampling import SamplingParams  # noqa: E402

CHUNKS = (16, 48, 96, 192, 256, 512, 1024)


def chunk_costs(model, contexts=(2048, 5120), repeats: int = 3) -> dict[str, dict[int, float]]:
    """Milliseconds per prompt token of one prefill forward of each chunk size after `context` (zeroed) tokens."""
    cache = model.new_cache(2 * (max(contexts) + max(CHUNKS)), 1)  # measure_prefill_rate keeps chunks to half of it
    return {
        str(ctx): {n: round(1e3 / measure_prefill_rate(model, cache, n, ctx, repeats), 3) for n in CHUNKS}
        for ctx in contexts
    }


def budget(step_s: float | None) -> str:
    """A configuration's prefill budget as written: its seconds, or auto (the engine's default)."""
    return "auto" if step_s is None else f"{step_s:g}"


def run(
    model, prompts: list[list[int]], streams: int, step_s: float | None, method: str, params: SamplingParams
) -> dict:
    engine = SpecEngine(
        model,
        build_drafter(method, model, max_batch=streams),
        EngineConfig(max_batch=streams, max_context=8192, prefill_step_s=step_s),
    )
    acc = {"prefill_s": 0.0, "rounds_s": 0.0, "rounds": 0, "round_seqs": 0, "drafted": 0}
    prefill_step, spec_round = engine._prefill_step, engine._spec_round

    def timed_prefill():
        t0 = time.perf_counter()
        events = prefill_step()
        acc["prefill_s"] += time.perf_counter() - t0
        return events

    def timed_round(batch):
        t0 = time.perf_counter()
        events = spec_round(batch)
        acc["rounds_s"] += time.perf_counter() - t0
        acc["rounds"] += 1
        acc["round_seqs"] += len(batch)
        acc["drafted"] += sum(e.drafted for e in events)
        return events

    engine._prefill_step, engine._spec_round = timed_prefill, timed_round
    seqs = [engine.add_request(list(p), params) for p in prompts]
    steps, t0 = 0, time.perf_counter()
    while engine.has_work:
        engine.step()
        steps += 1
    wall = time.perf_counter() - t0
    return {
        "streams": streams,
        "prefill_step_s": step_s,
        "method": method,
        "wall_s": round(wall, 2),
        "prefill_s": round(acc["prefill_s"], 2),
        "rounds_s": round(acc["rounds_s"], 2),
        "rounds": acc["rounds"],
        "mean_round_batch": round(acc["round_seqs"] / max(1, acc["rounds"]), 2),
        "drafted": acc["drafted"],
        "steps": steps,
        "output_tokens": sum(s.num_generated for s in seqs),
        "outputs": [s.output_ids for s in seqs],
    }


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--per-kind", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument(
        "--configs",
        default="1:0.25,4:0.25,4:0.5",
        help="streams:prefill_step_s[:method], comma-separated (auto: the engine's default budget)",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="prefill_share")
    args = ap.parse_args(argv)
    configs = []
    for c in args.configs.split(","):
        streams, step_s, *method = c.split(":")
        configs.append((int(streams), None if step_s == "auto" else float(step_s), method[0] if method else "suffix"))
    torch.set_num_threads(args.threads)
    model, tok, _ = load_model(None, dtype=args.dtype)
    prompts = [t.prompt_ids for t in heldout_tasks(tok, per_kind=args.per_kind)]
    quiet = wait_for_quiet(max_load=1.0, timeout_s=300)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    runs = []
    for streams, step_s, method in configs:
        runs.append(run(model, prompts, streams, step_s, method, params))
        r = runs[-1]
        what = f"wall {r['wall_s']} s, prefill {r['prefill_s']} s, rounds {r['rounds_s']} s"
        how = f"{r['rounds']} rounds, batch {r['mean_round_batch']}"
        print(f"{method}, {streams} streams, budget {budget(step_s)}: {what} ({how})")
    costs = chunk_costs(model)
    print("prefill ms/token by chunk:", costs, flush=True)
    same = all(r["outputs"] == runs[0]["outputs"] for r in runs)
    base = runs[0]
    figures = {"outputs_equal_across_configs": same}
    ratios: dict[str, list[float]] = {}  # each configuration's time against the first one's (repeats: a list)
    for key in ("prefill_s", "rounds_s"):
        for r in runs[1:]:
            step = budget(r["prefill_step_s"])
            name = f"{key}_c{r['streams']}_{step}_vs_c{base['streams']}"
            if r["method"] != base["method"]:
                name = f"{key}_{r['method']}_vs_{base['method']}_c{r['streams']}_{step}"
            ratios.setdefault(name, []).append(round(r[key] / base[key], 3))
    figures.update({k: v[0] if len(v) == 1 else v for k, v in ratios.items()})
    raw = {"runs": [{k: v for k, v in r.items() if k != "outputs"} for r in runs], "prefill_ms_per_token": costs}
    meta = {
        "what": "the engine's prefill and verify-round time at 1 and 4 streams on a prefill-bound load",
        "cpu": cpu_model(),
        "dtype": args.dtype,
        "threads": args.threads,
        "prompts": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "max_new_tokens": args.max_new_tokens,
        "linear_backend": model.linear_backend,
        "quiet_before": quiet,
        "load_after": machine_load(),
    }
    path = write_results(args.name, figures, raw, meta)
    print(path, figures)
    return path


if __name__ == "__main__":
    main()
