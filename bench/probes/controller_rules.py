"""One of the controller's rules on and off, side by side on held-out prompts (SmolLM2 fp32, T=0, every variant
on the same prompts in one run):
- `persist`: after a drafted step that did not pay, keep drafting while drafted steps pay on average, or back off
  to plain decoding until a probe (the default). Matters for drafters that are neither free nor useless:
  LongSpec (per depth), DFlash (per block), the composite (suffix + LongSpec).
- `per_source`: calibrate a merged tree's sources (the composite's suffix lookups, its LongSpec draft, both)
  each on its own acceptance (the default), or all of them with one factor per depth (`pooled`).
- `short_backoff`: at most 16 plain steps between probes, or up to the controller's `max_backoff` (64, the default).
- `chain_profile`: chains drafted one token per depth (LongSpec, GLIDE, small-lm) sized by their acceptance
  profile (`ChainDepthController`, the default), or per step from the draft's scores like every other tree.
Writes bench/results/controller_RULE.json (+ .png), or NAME.json with `--name`.

    python bench/probes/controller_rules.py --rule persist [--max-new-tokens 256] [--per-kind 2] [--kinds code,edit]
    python bench/probes/controller_rules.py --rule per_source --methods composite --baselines suffix \
        --kinds code,edit,summary
    python bench/probes/controller_rules.py --rule chain_profile --methods longspec --draft-checkpoint DIR --name NAME
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import RESULTS_DIR, machine_load, plot_panels, write_results  # noqa: E402
from bench.drafting import bench_setup, by_kind, compare, run_meta, speed_panels  # noqa: E402
from bench.tasks import heldout_tasks  # noqa: E402
from spyglass.controller import SpeculationController  # noqa: E402
from spyglass.drafters import build_drafter  # noqa: E402
from spyglass.sampling import SamplingParams  # noqa: E402

# rule -> (the controller's class attribute, its value with the rule, without it, the variant without it)
RULES = {
    "persist": ("persist", True, False, "backoff"),
    "per_source": ("per_source", True, False, "pooled"),
    "short_backoff": ("max_backoff", 16, 64, "long-backoff"),
    "chain_profile": ("chain_profile", True, False, "per-step"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rule", choices=sorted(RULES), required=True)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--per-kind", type=int, default=2)
    ap.add_argument("--kinds", default="code,edit")
    ap.add_argument("--methods", default="longspec,composite,dflash")
    ap.add_argument("--baselines", default="", help="methods run once, with the default rules (e.g. suffix)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft-checkpoint", default=None, help="a learned method's draft (default: the shipped one)")
    ap.add_argument("--name", default=None, help="results name (default: controller_RULE)")
    args = ap.parse_args()
    quiet, redis, target, tok, cache = bench_setup("bench-controller", args.threads)

    rule = args.rule
    attr, on, off, off_name = RULES[rule]
    default = getattr(SpeculationController, attr)

    def maker(method: str, value):
        def make():  # the engine built next (compare runs one at a time) reads the rule from the class
            setattr(SpeculationController, attr, value)
            return build_drafter(method, target, max_batch=1, max_context=8192, draft_checkpoint=args.draft_checkpoint)

        return make

    makers = {}
    for m in (m for m in args.methods.split(",") if m):
        makers[m] = maker(m, on)
        makers[f"{m}-{off_name}"] = maker(m, off)
    for m in (m for m in args.baselines.split(",") if m):
        makers[m] = maker(m, default)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    tasks = heldout_tasks(tok, kinds=kinds, per_kind=args.per_kind)
    load_before = machine_load()
    results = compare(target, tasks, makers, SamplingParams(max_new_tokens=args.max_new_tokens), cache)
    setattr(SpeculationController, attr, default)
    figures: dict = {"identical_all": all(r["identical"] for row in results.values() for r in row.values())}
    for m in makers:
        tag = m.replace("-", "_")
        for kind in kinds:
            figures[f"speedup_{kind}_{tag}"] = by_kind(results, tasks, m, "speedup").get(kind)
            figures[f"tau_{kind}_{tag}"] = by_kind(results, tasks, m, "tau").get(kind)
    what = f"decode speedup over plain decoding with the controller's {rule} rule on and off, SmolLM2 fp32"
    meta = run_meta(what, tasks, quiet, load_before, args.threads, target, max_new_tokens=args.max_new_tokens,
                    draft_checkpoint=args.draft_checkpoint)  # fmt: skip
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
