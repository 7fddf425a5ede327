"""How sharply a copy head points, along greedy outputs of the dev prompts (eval split, never benchmark prompts).

    python bench/copy_probe.py [--prompts 1] [--max-new-tokens 64]

For the shipped DFlash draft (every block's first drafted position) and the shipped LongSpec draft (every drafted
node of `longspec-span`), controller off: the share of mass the gate keeps on the LM head, the largest single copy
weight, the copy mass on the drafted token's places, and how often that reaches the drafter's `span_mass` (a span
starts). Writes bench/results/copy_probe.json. Not timed: no speed figure comes from here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import write_results  # noqa: E402
from bench.replay import dev_setup  # noqa: E402
from spyglass.drafters import build_drafter  # noqa: E402
from spyglass.engine import EngineConfig, SpecEngine  # noqa: E402
from spyglass.sampling import SamplingParams  # noqa: E402


def probe(
    target, method: str, prompt: list[int], max_new_tokens: int
) -> tuple[list[tuple[float, float, float]], float]:
    """(head weight, largest copy weight, copy mass on the drafted token's places) per drafted position probed, and
    the drafter's `span_mass`."""
    drafter = build_drafter(method, target)
    rows: list[tuple[float, float, float]] = []
    if method.startswith("dflash"):
        span_tree = drafter._span_tree

        def first_position(seq, logits, mass, cap):  # the block's first drafted token (its row's argmax)
            copies, first = mass[0], int(logits[0].argmax())  # (the LM head keeps what the copies do not take)
            on_first = float(copies[seq.tokens[1 : seq.committed + 1] == first].sum())
            rows.append((1 - float(copies.sum()), float(copies.max()), on_first))
            return span_tree(seq, logits, mass, cap)

        drafter._span_tree = first_position
    else:
        add_span = drafter._add_span

        def recording(seq, g, node, mass, after, room):
            copied = float(mass.sum())
            rows.append((1 - copied, float(mass.max()), float(torch.where(after == g.tokens[node], mass, 0.0).sum())))
            return add_span(seq, g, node, mass, after, room)

        drafter._add_span = recording
    engine = SpecEngine(target, drafter, EngineConfig(max_batch=1, max_context=8192, controller="off"))
    engine.run([prompt], SamplingParams(max_new_tokens=max_new_tokens))
    return rows, drafter.span_mass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=1, help="the first N dev prompts")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    target, tasks = dev_setup(2)
    figures, raw = {}, {}
    for method in ("dflash-span", "longspec-span"):
        rows, span_mass = [], 0.0
        for t in tasks[: args.prompts]:
            probed, span_mass = probe(target, method, t.prompt_ids, args.max_new_tokens)
            rows += probed
        raw[method] = rows
        figures[method] = {
            "positions": len(rows),
            "head_weight_median": statistics.median(r[0] for r in rows),
            "largest_copy_weight_median": statistics.median(r[1] for r in rows),
            "copy_mass_on_drafted_token_median": statistics.median(r[2] for r in rows),
            "span_mass": span_mass,
            "span_rate": sum(r[2] >= span_mass for r in rows) / max(1, len(rows)),
        }
        print(method, figures[method], flush=True)
    print(write_results("copy_probe", figures, raw, {"prompts": [t.name for t in tasks[: args.prompts]], **vars(args)}))


if __name__ == "__main__":
    main()
