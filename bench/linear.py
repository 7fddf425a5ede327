"""The CPU matmul kernels behind the target's linear layers: ATen/MKL `F.linear`, oneDNN's inner product, the
weights-first product `(W @ x^T)^T`, and the per-row-count plan `load_transformer` measured at start-up.

A verify-shaped forward of SmolLM2-135M (fp32 and bf16, 1-32 new tokens over a 256- and a 2,048-token committed
prefix) on each, interleaved per repeat, medians (oneDNN only where it has a kernel for the dtype). The forward
time of n tokens over the 1-token time of the *same* kernel is the verify-cost curve the speculation controller
sizes trees from, so its shape matters as much as the decode step itself.
Writes bench/results/linear.json (+ .png).

    python bench/linear.py [--repeats 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import (  # noqa: E402
    RESULTS_DIR,
    load_model,
    machine_load,
    plot_panels,
    time_interleaved,
    wait_for_quiet,
    write_results,
)
from spyglass.models.linear import onednn_supported, set_linear_backend  # noqa: E402
from spyglass.models.llama import Segment  # noqa: E402

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 32)
CONTEXTS = (256, 2048)


def forward_fn(model, cache, slot: int, ctx: int, n: int, backend: str):
    toks = torch.randint(0, model.args.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
    seg = Segment(slot, ctx, toks, torch.arange(ctx, ctx + n), None, "all")

    def run() -> None:
        set_linear_backend(model, backend)
        cache.lengths[slot] = ctx
        model([seg], cache)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="linear", help="results name: bench/results/NAME.json (+ .png)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    quiet = wait_for_quiet(max_load=1.0, timeout_s=180)
    load_before = machine_load()
    figures: dict = {}
    raw: dict = {}
    panels = []
    for dtype in ("float32", "bfloat16"):
        model, _, _ = load_model(dtype=dtype)
        plan = model.linear_backend
        figures[f"chosen_{dtype}"] = plan
        backends = {"plan": plan, "aten": "aten", "wfirst": "wfirst"}
        if onednn_supported(model.lm_head.weight):
            backends["onednn"] = "onednn"
        cache = model.new_cache(max(CONTEXTS) + max(SIZES), 1)
        slot = cache.allocate()  # K/V left at zeros: attention cost does not depend on the values
        for ctx in CONTEXTS:
            ms: dict[str, dict[int, float]] = {b: {} for b in backends}
            for n in SIZES:
                timed = time_interleaved(
                    {b: forward_fn(model, cache, slot, ctx, n, backends[b]) for b in ms}, repeats=args.repeats, warmup=1
                )
                for b in ms:
                    ms[b][n] = timed[b]["median_ms"]
                raw[f"{dtype}_{ctx}_{n}"] = timed
            tag = f"{dtype}_{ctx}"
            figures[f"decode_step_ms_{tag}"] = {b: round(ms[b][1], 2) for b in ms}
            figures[f"plan_vs_aten_decode_{tag}"] = round(ms["aten"][1] / ms["plan"][1], 3)
            # what the controller pays for a tree: n tokens in one forward, in decode steps of the plan
            figures[f"plan_vs_aten_2tokens_{tag}"] = round(ms["aten"][2] / ms["plan"][2], 3)
            figures[f"verify_cost_curve_{tag}"] = {b: {n: round(ms[b][n] / ms[b][1], 3) for n in SIZES} for b in ms}
            panels.append(
                {
                    "title": f"SmolLM2 {dtype}, {ctx}-token prefix",
                    "xlabel": "tokens in one forward",
                    "ylabel": "ms",
                    "series": {b: (list(SIZES), [ms[b][n] for n in SIZES]) for b in ms},
                }
            )
        set_linear_backend(model, plan)
    meta = {
        "what": "SmolLM2-135M forward time by linear kernel, n new tokens over a committed prefix",
        "threads": args.threads,
        "repeats": args.repeats,
        "quiet_before": quiet,
        "load_before": load_before,
        "load_after": machine_load(),
    }
    out = write_results(args.name, figures, raw, meta)
    title = "Linear kernels: ATen/MKL, oneDNN, weights-first, measured plan (forward ms)"
    plot_panels(RESULTS_DIR / f"{args.name}.png", panels, title=title)
    print(out)
    for k, v in figures.items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
