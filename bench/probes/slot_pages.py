"""What a prefill into a fresh KV slot costs over one into a slot used before: its pages fault in as the prefill
writes its K/V.

The engine's prefill alone (`Transformer.prefill`), the default model, the first held-out prompts (5-7K tokens): per
round and prompt, the prompt into a slot never allocated, then into that slot again (its pages resident). Wall time is
at this VM's mercy (a 20 s prefill moves by seconds between runs); the kernel's CPU time (`ru_stime`) and the minor
page faults of each prefill tell the faults' cost apart. Writes bench/results/<name>.json.

    python bench/probes/slot_pages.py [--rounds 2] [--prompts 2] [--dtype float32]
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import load_model, median, wait_for_quiet, write_results  # noqa: E402
from bench.tasks import heldout_tasks  # noqa: E402


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="slot_pages")
    args = ap.parse_args(argv)
    model, tok, _ = load_model(None, args.dtype, args.threads)
    prompts = [torch.tensor(t.prompt_ids) for t in heldout_tasks(tok, per_kind=1)[: args.prompts]]
    quiet = wait_for_quiet(max_load=1.0, timeout_s=300)
    cache = model.new_cache(8192, args.rounds * len(prompts))
    runs: dict[str, list[dict]] = {"fresh": [], "used": []}
    for r in range(args.rounds):
        for tokens in prompts:
            slot = cache.allocate()  # a slot never used (the earlier ones stay allocated)
            for kind in ("fresh", "used"):
                cache.lengths[slot] = 0
                t0, u0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
                model.prefill(cache, slot, tokens)
                u1 = resource.getrusage(resource.RUSAGE_SELF)
                run = {"wall_s": time.perf_counter() - t0, "system_s": u1.ru_stime - u0.ru_stime,
                       "faults": u1.ru_minflt - u0.ru_minflt, "tokens": len(tokens)}  # fmt: skip
                runs[kind].append(run)
                print(f"round {r} slot {slot} {kind}: {run}", flush=True)
    figures = {
        f"{kind}_{m}": round(median([x[m] for x in runs[kind]]), 3)
        for kind in runs
        for m in ("wall_s", "system_s", "faults")
    }
    figures["prompt_tokens"] = [len(p) for p in prompts]
    path = write_results(args.name, figures, {"runs": runs, "quiet": quiet}, {"args": vars(args)})
    print(figures)
    return path


if __name__ == "__main__":
    main()
