"""The shipped LongSpec and GLIDE drafts (and the composites: suffix + LongSpec, suffix + DFlash) against n-gram and
suffix drafting on held-out long-context prompts (code completion, code editing, summarisation; SmolLM2, fp32),
every method on the same prompts in one run, at T=0 and T=1.
Writes bench/results/longspec.json (+ .png).

    python bench/longspec.py [--max-new-tokens 96] [--per-kind 2] [--t1-kinds code]

Also: the draft's memory at 1K and 8K tokens of context (LongSpec, GLIDE: fixed windows; small-lm: its own KV
cache, which grows), and the training figures from the shipped model cards' metrics (GLIDE's prefixed `glide_`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import (  # noqa: E402
    RESULTS_DIR,
    bench_setup,
    by_kind,
    compare,
    machine_load,
    median,
    plot_panels,
    run_meta,
    speed_panels,
    write_results,
)
from bench.tasks import heldout_tasks  # noqa: E402
from spyglass.drafters import build_drafter  # noqa: E402
from spyglass.drafters.longspec import SHIPPED, SHIPPED_GLIDE  # noqa: E402
from spyglass.engine import EngineConfig, SpecEngine  # noqa: E402
from spyglass.sampling import SamplingParams  # noqa: E402
from spyglass.training import repo_relative  # noqa: E402

METHODS = (
    "ngram", "suffix", "longspec", "longspec-span", "longspec-beam", "longspec-cape", "glide", "glide-cape",
    "composite", "composite-span", "composite-dflash",
)  # fmt: skip
HEADLINE = "longspec-span"


def state_bytes(target, method: str, context: int) -> int:
    """What the drafter holds for one sequence after a `context`-token prompt (small-lm: the KV it has filled)."""
    kw = {}
    if method == "small-lm":
        from spyglass.drafters.small_lm import truncated_draft

        kw["draft_model"] = truncated_draft(target, 8)
    drafter = build_drafter(method, target, max_batch=1, max_context=8192, **kw)
    engine = SpecEngine(target, drafter, EngineConfig(max_batch=1, max_context=8192, controller="off"))
    ids = [int(t) for t in torch.randint(100, 20000, (context,), generator=torch.Generator().manual_seed(0))]
    seq = engine.add_request(ids, SamplingParams(max_new_tokens=64, ignore_eos=True))  # alive after one step
    engine.step()
    if method == "small-lm":
        per_token = drafter.cache.slot_bytes() // drafter.cache.capacity
        used = drafter.cache.lengths[seq.drafter_state.slot] * per_token
    else:
        used = drafter.state_bytes(seq)
    while engine.has_work:
        engine.step()
    return int(used)


def training_figures(draft_dir: Path) -> dict:
    card = draft_dir / "training.json"
    if not card.exists():
        return {}
    t = json.loads(card.read_text())
    return {k: t.get(k) for k in ("train_tokens", "train_wall_s", "steps", "eval_agree_by_lag")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--per-kind", type=int, default=2)
    ap.add_argument("--t1-kinds", default="code", help="kinds also run at T=1 (comma list, '' = none)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="runs per method and prompt (median decode speed)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--draft", default=None, help="a LongSpec checkpoint dir (default: the shipped draft)")
    ap.add_argument("--glide-draft", default=None, help="a GLIDE checkpoint dir (default: the shipped draft)")
    ap.add_argument("--name", default="longspec", help="results name: bench/results/NAME.json")
    args = ap.parse_args()
    draft_dir = Path(args.draft).resolve() if args.draft else SHIPPED
    glide_dir = Path(args.glide_draft).resolve() if args.glide_draft else SHIPPED_GLIDE
    quiet, redis, target, tok, cache = bench_setup("bench-longspec", args.threads)
    methods = [m for m in args.methods.split(",") if m]

    def maker(m: str):
        ckpt = glide_dir if m.startswith("glide") else None if "dflash" in m else draft_dir  # DFlash: its shipped
        return lambda: build_drafter(m, target, max_batch=1, max_context=8192, draft_checkpoint=ckpt)

    makers = {m: maker(m) for m in methods}
    tasks = heldout_tasks(tok, per_kind=args.per_kind)
    load_before = machine_load()
    t0_params = SamplingParams(max_new_tokens=args.max_new_tokens)
    t0_results = compare(target, tasks, makers, t0_params, cache, repeats=args.repeats)
    t1_kinds = tuple(k for k in args.t1_kinds.split(",") if k)
    t1_tasks = [t for t in tasks if t.kind in t1_kinds]
    t1_params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=7)
    t1_results = compare(target, t1_tasks, makers, t1_params, cache, repeats=args.repeats) if t1_tasks else {}

    figures: dict = {}
    for m in methods:  # the headline figures are LongSpec's best mode, with copy spans; the chain's `_chain`
        tag = {HEADLINE: "", "longspec": "_chain"}.get(m, "_" + m.replace("-", "_"))
        for kind in ("code", "edit", "summary"):
            figures[f"tau_{kind}_t0{tag}"] = by_kind(t0_results, tasks, m, "tau").get(kind)
            figures[f"speedup_{kind}_t0{tag}"] = by_kind(t0_results, tasks, m, "speedup").get(kind)
        for kind in t1_kinds:
            figures[f"tau_{kind}_t1{tag}"] = by_kind(t1_results, t1_tasks, m, "tau").get(kind)
            figures[f"speedup_{kind}_t1{tag}"] = by_kind(t1_results, t1_tasks, m, "speedup").get(kind)
    figures["identical_t0_all"] = all(r["identical"] for row in t0_results.values() for r in row.values())
    for m in ("longspec", "longspec-span", "glide"):
        if m in methods:
            rows = [t0_results[t.name][m]["acceptance_by_depth"] for t in tasks]
            figures[f"acceptance_by_depth_{m.replace('-', '_')}"] = [
                round(median([r[d] for r in rows]), 3) for d in range(min(len(r) for r in rows))
            ]
    for ctx in (1024, 8000):
        label = "1k" if ctx == 1024 else "8k"
        figures[f"state_bytes_{label}"] = state_bytes(target, "longspec", ctx)
        figures[f"state_bytes_{label}_small_lm"] = state_bytes(target, "small-lm", ctx)
    figures.update(training_figures(draft_dir))
    if any(m.startswith("glide") for m in methods):
        figures["state_bytes_8k_glide"] = state_bytes(target, "glide", 8000)
        figures.update({f"glide_{k}": v for k, v in training_figures(glide_dir).items()})
    meta = run_meta(
        "decode speedup over plain decoding, held-out prompts (eval-split sources), SmolLM2 fp32",
        tasks,
        quiet,
        load_before,
        args.threads,
        target,
        draft=repo_relative(draft_dir),  # a --draft outside the repo is named, not a crash after the whole run
        glide_draft=repo_relative(glide_dir),
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
    )
    out = write_results(args.name, figures, {"t0": t0_results, "t1": t1_results}, meta)
    plot_panels(
        RESULTS_DIR / f"{args.name}.png",
        speed_panels(t0_results, tasks, methods, "T=0"),
        title="LongSpec vs model-free drafting, held-out long-context prompts (SmolLM2 fp32)",
    )
    redis.stop()
    print(out)
    for k, v in figures.items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
