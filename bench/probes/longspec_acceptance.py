"""What a LongSpec draft gets accepted in serving, by depth and by context length, with the controller off (every
drafted node verified), next to the held-out agreement by lag its training reported. Several drafts side by side
on the same held-out prompts (code completion unless `--kinds` says more), cut to their last N tokens. Writes
bench/results/longspec_acceptance.json (or NAME.json with `--name`).

    python bench/probes/longspec_acceptance.py [--drafts shipped,DIR...] [--lengths 512,2048,0] [--max-new-tokens 64]

Accuracy, not speed: tau here is what the controller could work with, not a speedup. Acceptance at depth d is
the share of steps that accepted at least d drafted tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


from bench.common import load_model, median, write_results  # noqa: E402
from bench.tasks import heldout_tasks  # noqa: E402
from spyglass.drafters.longspec import SHIPPED, LongSpecDrafter, load_longspec_draft  # noqa: E402
from spyglass.engine import EngineConfig, SpecEngine  # noqa: E402
from spyglass.sampling import SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafts", default="shipped", help="comma list of checkpoint dirs ('shipped' = the package's)")
    ap.add_argument("--lengths", default="512,2048,0", help="prompt tails to keep, in tokens (0 = the whole prompt)")
    ap.add_argument("--per-kind", type=int, default=2)
    ap.add_argument("--kinds", default="code", help="comma list of held-out prompt kinds: code, edit, summary")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="longspec_acceptance", help="results name: bench/results/NAME.json")
    args = ap.parse_args()
    target, tok, _ = load_model(threads=args.threads)
    kinds = tuple(args.kinds.split(","))
    tasks = heldout_tasks(tok, kinds=kinds, per_kind=args.per_kind)
    lengths = [int(n) for n in args.lengths.split(",")]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    figures: dict = {}
    rows: dict = {}
    for spec in args.drafts.split(","):
        ckpt = SHIPPED if spec == "shipped" else Path(spec).resolve()
        draft = load_longspec_draft(ckpt, target)
        label = str(ckpt.relative_to(ROOT)) if ckpt.is_relative_to(ROOT) else str(ckpt)
        training = json.loads((ckpt / "training.json").read_text()) if (ckpt / "training.json").exists() else {}
        for n in lengths:
            per_task = []
            for task in tasks:
                ids = task.prompt_ids[-n:] if n else task.prompt_ids
                engine = SpecEngine(
                    target, LongSpecDrafter(draft, gamma=args.gamma), EngineConfig(1, 8192, controller="off")
                )
                (seq,) = engine.run([ids], params)
                st = seq.stats.summary(seq.num_generated)
                per_task.append({"task": task.name, "prompt_tokens": len(ids), "tau": st["tau"],
                                 "acceptance_by_depth": [round(a, 3) for a in st["acceptance_by_depth"]]})  # fmt: skip
            name = ckpt.name if not ckpt.name.startswith("step-") else f"{ckpt.parent.parent.name}/{ckpt.name}"
            key = f"{name}@{n or 'full'}"  # a training checkpoint is named by its run: step-N alone repeats
            by_depth = [r["acceptance_by_depth"] + [0.0] * args.gamma for r in per_task]  # depths never reached: 0
            depth = [round(median([a[d] for a in by_depth]), 3) for d in range(args.gamma)]
            figures[f"tau_{key}"] = round(median([r["tau"] for r in per_task]), 3)
            figures[f"tau_mean_{key}"] = round(sum(r["tau"] for r in per_task) / len(per_task), 3)
            figures[f"acceptance_by_depth_{key}"] = depth
            rows[key] = {"draft": label, "tail_tokens": n, "tasks": per_task,
                         "eval_agree_by_lag": training.get("eval_agree_by_lag")}  # fmt: skip
            tau, mean = figures[f"tau_{key}"], figures[f"tau_mean_{key}"]
            print(f"{key}: tau {tau} (mean {mean})  acceptance by depth {depth}", flush=True)
    meta = {"what": __doc__.splitlines()[0], "kinds": kinds, "max_new_tokens": args.max_new_tokens, "gamma": args.gamma,
            "controller": "off", "threads": args.threads}  # fmt: skip
    print(write_results(args.name, figures, rows, meta))


if __name__ == "__main__":
    main()
