"""Does a LongSpec draft's acceptance hold as the context grows (the LongSpec paper's claim)? The same held-out long
prompts (`bench/tasks.py` `long_tasks`, Qwen2.5-Coder-0.5B by default) cut to their last N tokens and whole, drafted
with the model's shipped LongSpec chain and the controller off (every drafted node verified, so tau is the draft's
accuracy, not a speed, and does not depend on the machine's load). Also the drafter's per-sequence state bytes at each
length. Writes bench/results/<name>.json.

    python bench/probes/longspec_context_acceptance.py [--length 32k] [--tails 4096,0] [--kinds repo,quote]
                                                       [--draft-checkpoint DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from bench.common import load_model, median, write_results  # noqa: E402
from bench.long_context import QWEN  # noqa: E402
from bench.tasks import long_tasks  # noqa: E402
from spyglass.drafters import build_drafter  # noqa: E402
from spyglass.engine import EngineConfig, SpecEngine  # noqa: E402
from spyglass.sampling import SamplingParams  # noqa: E402


def state_bytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in vars(state).values() if isinstance(t, torch.Tensor))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=QWEN)
    ap.add_argument("--length", default="32k", help="the prompts' length (8k = x1024)")
    ap.add_argument("--tails", default="4096,0", help="prompt tails to keep, in tokens (0 = the whole prompt)")
    ap.add_argument("--kinds", default="repo,quote")
    ap.add_argument("--method", default="longspec")
    ap.add_argument("--draft-checkpoint", help="a draft directory (default: the one shipped for the model)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="longspec_context_acceptance")
    args = ap.parse_args()
    target, tok, resolved = load_model(args.model, threads=args.threads)
    n = int(args.length[:-1]) * 1024 if args.length.endswith("k") else int(args.length)
    tasks = long_tasks(tok, [(args.length, n)], tuple(args.kinds.split(",")), 1)
    tails = [int(t) for t in args.tails.split(",")]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    rows: dict[str, dict] = {}
    for task in tasks:
        for tail in tails:
            prompt = task.prompt_ids[-tail:] if tail else task.prompt_ids
            options = {"draft_checkpoint": args.draft_checkpoint} if args.draft_checkpoint else {}
            drafter = build_drafter(args.method, target, max_batch=1, **options)
            engine = SpecEngine(target, drafter, EngineConfig(max_batch=1, controller="off"))
            seq = engine.add_request(prompt, params)
            engine.step()
            held = state_bytes(seq.drafter_state)
            while not seq.finished:
                engine.step()
            st = seq.stats.summary(seq.num_generated)
            depth = [h / t for h, t in zip(seq.stats.depth_hits, seq.stats.depth_trials, strict=True) if t]
            rows[f"{task.name}/{len(prompt)}"] = {
                "task": task.name,
                "tail": tail,
                "prompt_tokens": len(prompt),
                "tau": st["tau"],
                "accept_by_depth": depth,
                "state_bytes": held,
            }
            print(
                f"{task.name} last {len(prompt)} tokens: tau {st['tau']:.2f}, by depth {[round(x, 2) for x in depth]}"
            )
    by_tail = {t: [r for r in rows.values() if r["tail"] == t] for t in tails}
    short, whole = tails[0], tails[-1]
    tau = {t: median([r["tau"] for r in rs]) for t, rs in by_tail.items()}
    figures = {
        f"tau_last_{short}": tau[short],
        "tau_whole": tau[whole],
        "tau_whole_vs_short": tau[whole] / tau[short],
        "state_bytes_whole_vs_short": median([r["state_bytes"] for r in by_tail[whole]])
        / median([r["state_bytes"] for r in by_tail[short]]),
    }
    print(figures)
    write_results(args.name, figures, {"rows": rows}, {"args": vars(args), "model": resolved.model_id})


if __name__ == "__main__":
    main()
