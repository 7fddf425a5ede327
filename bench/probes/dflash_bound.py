"""How good a block drafter would have to be to pass n-gram drafting on this machine: a bound from measured costs.

A DFlash step costs the block's forward (`draft_s` per step, as served) plus a verification of the root and d
drafted tokens, t(d + 1, c) on the verify-cost curve the run measured at start-up, and emits 1 + a_1 + ... + a_d
tokens on average, where a_i is the chance that the first i drafted tokens are all right. Against plain decoding
(t(1, c) a token) the modeled speedup is

    S = (1 + a_1 + ... + a_d) * t(1, c) / (block + t(d + 1, c)),   best d <= b - 1 for a block of b.

Per prompt of a `bench/dflash.py` results file (c = its prompt plus half its output), this reports the ceiling
(every drafted token right) for the shipped block of 4 and for a block of 16, the per-position acceptance q
(a_i = q^i) needed to equal n-gram drafting's measured speedup on the same prompt in the same run, and S for
the acceptance profile the run measured along the greedy output. The model leaves out the engine's own per-step
work and prices a block of 16 as the served block of 4, so it flatters the drafter: the q it reports is the least
that could do.

    python bench/probes/dflash_bound.py [--results bench/results/dflash.json] [--name dflash_bound]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import RESULTS_DIR, median, plot_panels, write_results  # noqa: E402
from spyglass.cost import CostCurve  # noqa: E402
from spyglass.training import repo_relative  # noqa: E402

BLOCKS = (4, 16)


def modeled_speedup(reach: list[float], block_s: float, curve: CostCurve, context: int) -> float:
    """Best S over chain depths d <= len(reach): `reach[i]` = chance the first i + 1 drafted tokens are right."""
    t1 = curve.time(1, context)
    best = 1.0  # d = 0: plain decoding, no block
    for d in range(1, len(reach) + 1):
        best = max(best, (1 + sum(reach[:d])) * t1 / (block_s + curve.time(d + 1, context)))
    return best


def geometric(q: float, block: int) -> list[float]:
    """The reach of a block whose every drafted token is right with chance q given the ones before."""
    return [q ** (i + 1) for i in range(block - 1)]


def needed_q(goal: float, block: int, block_s: float, curve: CostCurve, context: int) -> float | None:
    """Least per-position acceptance q with modeled speedup >= `goal` (None: not even with every token right)."""

    def speed(q: float) -> float:
        return modeled_speedup(geometric(q, block), block_s, curve, context)

    if speed(1.0) < goal:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if speed(mid) < goal else (lo, mid)
    return hi


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(RESULTS_DIR / "dflash.json"), help="a bench/dflash.py results file")
    ap.add_argument("--name", default="dflash_bound")
    args = ap.parse_args()
    doc = json.loads(Path(args.results).read_text())
    meta, per_task = doc["meta"], doc["raw"]["per_task"]
    curve_doc = meta["cost_curve"]
    curve = CostCurve(**curve_doc)
    new_tokens = meta["run"]["max_new_tokens"]
    profile = doc["figures"]["acceptance_by_block_position"]["dflash"]  # unconditional: first i + 1 all right
    rows = {}
    for name, prompt_tokens in meta["tasks"].items():
        runs = per_task[name]
        context = prompt_tokens + new_tokens // 2
        dflash = runs["dflash"]
        control = dflash["controller"]  # plain steps do not run the block; probes (counted as plain) do
        drafting_steps = new_tokens / dflash["tau"] - control["plain_steps"] + control["probe_steps"]
        block_s = dflash["draft_s"] / drafting_steps  # per step that runs it, as served
        goal = runs["ngram"]["speedup"]
        rows[name] = {
            "context": context,
            "t1_ms": 1e3 * curve.time(1, context),
            "block_ms": 1e3 * block_s,
            "ngram_speedup": goal,
            "dflash_speedup": dflash["speedup"],
            "dflash_modeled": modeled_speedup(profile, block_s, curve, context),
            **{f"ceiling_block{b}": modeled_speedup(geometric(1.0, b), block_s, curve, context) for b in BLOCKS},
            **{f"q_needed_block{b}": needed_q(goal, b, block_s, curve, context) for b in BLOCKS},
        }

    def med(key: str) -> float | None:
        """Median over prompts, an unreachable q (None) counting as above every reachable one."""
        m = median([math.inf if r[key] is None else r[key] for r in rows.values()])
        return None if m == math.inf else m

    conditional = [profile[0]] + [b / a for a, b in zip(profile, profile[1:], strict=False) if a > 0]
    figures = {
        "ngram_speedup": med("ngram_speedup"),
        "dflash_speedup": med("dflash_speedup"),
        "dflash_modeled": med("dflash_modeled"),
        **{f"ceiling_block{b}": med(f"ceiling_block{b}") for b in BLOCKS},
        **{f"q_needed_block{b}": med(f"q_needed_block{b}") for b in BLOCKS},
        "prompts_unreachable_block4": sum(r["q_needed_block4"] is None for r in rows.values()),
        "measured_acceptance_conditional": conditional,
    }
    names = list(rows)
    ceilings = [f"ceiling_block{b}" for b in BLOCKS]
    mid = sorted(names, key=lambda n: rows[n]["context"])[len(names) // 2]
    r = rows[mid]
    qs = [i / 20 for i in range(21)]
    by_q = {
        f"block {b}": (qs, [modeled_speedup(geometric(q, b), r["block_ms"] / 1e3, curve, r["context"]) for q in qs])
        for b in BLOCKS
    }
    plot_panels(
        RESULTS_DIR / f"{args.name}.png",
        [
            {
                "title": "per prompt: measured (n-gram, DFlash) and modeled ceilings",
                "ylabel": "decode speedup over plain",
                "xticklabels": names,
                "series": {
                    key: (list(range(len(names))), [rows[n][key] for n in names])
                    for key in ("ngram_speedup", "dflash_speedup", "dflash_modeled", *ceilings)
                },
            },
            {
                "title": f"modeled speedup vs per-position acceptance ({mid}, {r['context']} tokens)",
                "xlabel": "q (each drafted token right given the ones before)",
                "ylabel": "modeled decode speedup",
                "series": by_q,
                "hline": r["ngram_speedup"],
            },
        ],
        title=f"DFlash bound from {Path(args.results).name} ({curve.cpu})",
    )
    path = write_results(
        args.name,
        figures,
        {"per_task": rows, "by_q_middle_prompt": {"prompt": mid, **by_q}},
        {"source": repo_relative(args.results), "source_run": meta["run"], "cost_curve": curve_doc},
    )
    print(json.dumps(figures, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
