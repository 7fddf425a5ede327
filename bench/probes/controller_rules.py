"""One of the speculation controller's tuned constants against its default, side by side on held-out prompts
(SmolLM2 fp32, T=0, every variant on the same prompts in one run). A rule is a change to `ControllerConfig`:
- `short_backoff`: at most 16 plain steps between probes, or up to the default `max_backoff` (64).
Writes bench/results/controller_RULE.json (+ .png), or NAME.json with `--name`.

    python bench/probes/controller_rules.py --rule short_backoff [--max-new-tokens 256] [--per-kind 2] \
        [--kinds code,edit] [--methods longspec] [--draft-checkpoint DIR --name NAME]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import (  # noqa: E402
    RESULTS_DIR,
    bench_setup,
    by_kind,
    compare,
    machine_load,
    plot_panels,
    run_meta,
    speed_panels,
    write_results,
)
from bench.tasks import heldout_tasks  # noqa: E402
from spyglass.controller import ControllerConfig  # noqa: E402
from spyglass.drafters import build_drafter  # noqa: E402
from spyglass.sampling import SamplingParams  # noqa: E402

# rule -> (the ControllerConfig fields it changes, the name of the variant on the defaults)
RULES = {"short_backoff": ({"max_backoff": 16}, "long-backoff")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rule", choices=sorted(RULES), required=True)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--per-kind", type=int, default=2)
    ap.add_argument("--kinds", default="code,edit")
    ap.add_argument("--methods", default="longspec,composite,dflash")
    ap.add_argument("--baselines", default="", help="methods run once, with the default constants (e.g. suffix)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft-checkpoint", default=None, help="a learned method's draft (default: the shipped one)")
    ap.add_argument("--name", default=None, help="results name (default: controller_RULE)")
    args = ap.parse_args()
    quiet, redis, target, tok, cache = bench_setup("bench-controller", args.threads)

    rule = args.rule
    changes, default_name = RULES[rule]
    with_rule = replace(ControllerConfig(), **changes)

    def maker(method: str):
        return lambda: build_drafter(
            method, target, max_batch=1, max_context=8192, draft_checkpoint=args.draft_checkpoint
        )

    makers, controls = {}, {}
    for m in (m for m in args.methods.split(",") if m):
        makers[m], controls[m] = maker(m), with_rule
        makers[f"{m}-{default_name}"] = maker(m)
    for m in (m for m in args.baselines.split(",") if m):
        makers[m] = maker(m)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    tasks = heldout_tasks(tok, kinds=kinds, per_kind=args.per_kind)
    load_before = machine_load()
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    results = compare(target, tasks, makers, params, cache, controls=controls)
    figures: dict = {"identical_all": all(r["identical"] for row in results.values() for r in row.values())}
    for m in makers:
        tag = m.replace("-", "_")
        for kind in kinds:
            figures[f"speedup_{kind}_{tag}"] = by_kind(results, tasks, m, "speedup").get(kind)
            figures[f"tau_{kind}_{tag}"] = by_kind(results, tasks, m, "tau").get(kind)
    what = f"decode speedup over plain decoding with the controller's {rule} rule ({changes}) and without, SmolLM2 fp32"
    meta = run_meta(what, tasks, quiet, load_before, args.threads, target, max_new_tokens=args.max_new_tokens,
                    draft_checkpoint=args.draft_checkpoint, rule=changes)  # fmt: skip
    name = args.name or f"controller_{rule}"
    out = write_results(name, figures, {"t0": results}, meta)
    plot_panels(
        RESULTS_DIR / f"{name}.png",
        speed_panels(results, tasks, list(makers), "T=0"),
        title=f"Controller: the {rule} rule on vs off (SmolLM2 fp32)",
    )
    print(out)


if __name__ == "__main__":
    main()
