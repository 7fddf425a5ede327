"""The controller's two answers to a drafted step that did not pay, side by side on held-out prompts: keep
drafting while drafted steps pay on average (`persist`) or back off to plain decoding until a probe (the
default). Matters for drafters that are neither free nor useless: LongSpec (per depth),
DFlash (per block), and the composite (suffix + LongSpec), whose LongSpec part makes it too costly for the
free-drafter rule. SmolLM2 fp32, T=0, every variant on the same prompts in one run.
Writes bench/results/controller_persist.json (+ .png).

    python bench/controller_persist.py [--max-new-tokens 256] [--per-kind 2] [--kinds code,edit]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS_DIR, machine_load, plot_panels, write_results  # noqa: E402
from bench.drafting import bench_setup, by_kind, compare, run_meta, speed_panels  # noqa: E402
from bench.tasks import heldout_tasks  # noqa: E402
from spyglass.controller import SpeculationController  # noqa: E402
from spyglass.drafters import build_drafter  # noqa: E402
from spyglass.sampling import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--per-kind", type=int, default=2)
    ap.add_argument("--kinds", default="code,edit")
    ap.add_argument("--methods", default="longspec,composite,dflash")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    quiet, redis, target, tok, cache = bench_setup("bench-controller", args.threads)

    def maker(method: str, persist: bool):
        def make():  # the engine built next (compare runs one at a time) reads the rule from the class
            SpeculationController.persist = persist
            return build_drafter(method, target, max_batch=1, max_context=8192)

        return make

    makers = {}
    for m in (m for m in args.methods.split(",") if m):
        makers[m] = maker(m, True)
        makers[f"{m}-backoff"] = maker(m, False)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    tasks = heldout_tasks(tok, kinds=kinds, per_kind=args.per_kind)
    load_before = machine_load()
    default = SpeculationController.persist
    results = compare(target, tasks, makers, SamplingParams(max_new_tokens=args.max_new_tokens), cache)
    SpeculationController.persist = default
    figures: dict = {"identical_all": all(r["identical"] for row in results.values() for r in row.values())}
    for m in makers:
        tag = m.replace("-", "_")
        for kind in kinds:
            figures[f"speedup_{kind}_{tag}"] = by_kind(results, tasks, m, "speedup").get(kind)
            figures[f"tau_{kind}_{tag}"] = by_kind(results, tasks, m, "tau").get(kind)
    what = "decode speedup over plain decoding with the controller persisting or backing off, SmolLM2 fp32"
    meta = run_meta(what, tasks, quiet, load_before, args.threads, target, max_new_tokens=args.max_new_tokens)
    out = write_results("controller_persist", figures, {"t0": results}, meta)
    plot_panels(
        RESULTS_DIR / "controller_persist.png",
        speed_panels(results, tasks, list(makers), "T=0"),
        title="Controller: keep drafting while it pays on average vs back off (SmolLM2 fp32)",
    )
    print(out)


if __name__ == "__main__":
    main()
