"""Model-free drafting on held-out long-context prompts: plain decoding vs `ngram`, an HF-style prompt lookup
(re-implemented here as a drafter, for comparison only) and `suffix`, every prompt side by side in one run;
plus a multi-request workload where later requests resemble earlier ones (suffix with vs without its global
index). SmolLM2, fp32, T=0. Writes bench/results/drafting.json (+ .png).

    python bench/drafting.py [--max-new-tokens 128] [--per-kind 3] [--small-lm]

Decode speed is the engine's own (tokens after the first / time after the first token), so prefill, which the
Redis context cache shares between the methods of one prompt, does not enter the ratio.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from bench.common import (  # noqa: E402
    RESULTS_DIR,
    bench_setup,
    by_kind,
    compare,
    machine_load,
    median,
    plot_panels,
    run_meta,
    run_task,
    speed_panels,
    write_results,
)
from bench.tasks import STDLIB, HeldOutTask, _chat, _fit, heldout_tasks  # noqa: E402
from spyglass.cost import measured_curve  # noqa: E402
from spyglass.drafters.base import StatelessDrafter  # noqa: E402
from spyglass.drafters.ngram import NgramDrafter  # noqa: E402
from spyglass.drafters.suffix import SuffixDrafter  # noqa: E402
from spyglass.engine import EngineConfig, SpecEngine  # noqa: E402
from spyglass.sampling import SamplingParams  # noqa: E402
from spyglass.tree import DraftTree  # noqa: E402


class PromptLookupDrafter(StatelessDrafter):
    """What Hugging Face's prompt lookup does (for comparison only): the earliest occurrence of the longest
    trailing n-gram (n <= 2) earlier in the text, its next 10 tokens as one candidate chain."""

    name = "hf-lookup"

    def __init__(self, max_ngram: int = 2, num_tokens: int = 10) -> None:
        self.max_ngram, self.num_tokens = max_ngram, num_tokens

    def propose(self, batch, wants):
        trees = []
        for seq in batch:
            toks = seq.tokens
            chain: list[int] = []
            for n in range(min(self.max_ngram, len(toks) - 1), 0, -1):
                windows = toks[:-1].unfold(0, n, 1)
                hits = (windows == toks[-n:]).all(dim=1).nonzero().flatten()
                if hits.numel():
                    s = int(hits[0]) + n
                    chain = toks[s : s + self.num_tokens].tolist()
                    break
            trees.append(DraftTree.chain(seq.root, chain))
        return trees


def repeat_workload(tokenizer) -> list[HeldOutTask]:
    """Requests that resemble earlier ones: the same held-out file edited several times (different functions),
    then the same document asked several questions."""
    import ast

    src = _fit(tokenizer, (STDLIB / "calendar.py").read_text(), 3500)
    funcs = [n.name for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef)][:12]
    out = []
    for fn in funcs[2:6]:
        ask = f"Rewrite `{fn}` with full type hints. Output only the code."
        text = f"Here is the file `calendar.py`:\n\n```python\n{src}\n```\n\n{ask}"
        out.append(HeldOutTask(f"repeat-edit:{fn}", "edit", _chat(tokenizer, text), "code:calendar"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--per-kind", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="runs per method and prompt (median decode speed)")
    ap.add_argument("--small-lm", action="store_true", help="also small-lm with the target's first 8 layers")
    ap.add_argument("--no-repeat", action="store_true", help="skip the multi-request workload")
    args = ap.parse_args()
    quiet, redis, target, tok, cache = bench_setup("bench-drafting", args.threads)
    t0 = time.perf_counter()
    curve = measured_curve(target, target.new_cache(8192, 1))
    curve_s = time.perf_counter() - t0
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    tasks = heldout_tasks(tok, per_kind=args.per_kind)
    drafters: dict[str, Callable[[], object]] = {
        "ngram": NgramDrafter,
        "hf_lookup": PromptLookupDrafter,
        "suffix": SuffixDrafter,
    }
    if args.small_lm:
        from spyglass.drafters.small_lm import SmallLMDrafter, truncated_draft

        drafters["small_lm_8layers"] = lambda: SmallLMDrafter(truncated_draft(target, 8), max_batch=1, max_context=8192)
    load_before = machine_load()
    results = compare(target, tasks, drafters, params, cache, controller_off=("hf_lookup",), repeats=args.repeats)

    repeat = {}
    if not args.no_repeat:
        work = repeat_workload(tok)
        for label, use_global in (("with_global", True), ("without_global", False)):
            drafter = SuffixDrafter(use_global=use_global)
            engine = SpecEngine(target, drafter, EngineConfig(max_batch=1, max_context=8192), context_cache=cache)
            runs = [run_task(engine, t, params) for t in work]  # one engine: the global index carries over
            repeat[label] = {"tok_s": [r["tok_s"] for r in runs], "tau": [r["tau"] for r in runs]}
        ar = SpecEngine(target, None, EngineConfig(max_batch=1, max_context=8192), context_cache=cache)
        repeat["ar"] = {"tok_s": [run_task(ar, t, params)["tok_s"] for t in work]}

    sp = {m: [results[t.name][m]["speedup"] for t in tasks] for m in drafters}
    best_other = [max(results[t.name]["ngram"]["speedup"], results[t.name]["hf_lookup"]["speedup"]) for t in tasks]
    figures = {}
    for kind, key in (("code", "code"), ("edit", "edit"), ("summary", "summary")):
        figures[f"suffix_tau_{key}"] = by_kind(results, tasks, "suffix", "tau").get(kind)
        figures[f"suffix_speedup_{key}"] = by_kind(results, tasks, "suffix", "speedup").get(kind)
        for m in ("ngram", "hf_lookup"):
            figures[f"{m}_speedup_{key}"] = by_kind(results, tasks, m, "speedup").get(kind)
    figures["suffix_vs_best_other_min"] = min(s / b for s, b in zip(sp["suffix"], best_other, strict=True))
    figures["suffix_speedup_min"] = min(sp["suffix"])
    figures["ngram_speedup_min"] = min(sp["ngram"])
    figures["identical_all"] = all(r["identical"] for row in results.values() for r in row.values())
    if args.small_lm:
        figures["small_lm_8layers_speedup_median"] = median(sp["small_lm_8layers"])
        figures["small_lm_8layers_speedup_min"] = min(sp["small_lm_8layers"])
    if repeat:
        g, ng, ar = (sum(repeat[k]["tok_s"][1:]) for k in ("with_global", "without_global", "ar"))
        figures["repeat_workload_speedup"] = g / ng  # later requests only: the first has nothing to reuse
        figures["repeat_workload_speedup_vs_ar"] = g / ar
    meta = run_meta(
        "decode speedup over plain decoding on held-out prompts (eval-split sources), SmolLM2 fp32 T=0",
        tasks,
        quiet,
        load_before,
        args.threads,
        target,
        max_new_tokens=args.max_new_tokens,
        cost_curve=curve.to_dict(),
        cost_curve_measure_s=round(curve_s, 2),
        repeats=args.repeats,
        pid=os.getpid(),
    )
    out = write_results("drafting", figures, {"per_task": results, "repeat_workload": repeat}, meta)
    plot_panels(
        RESULTS_DIR / "drafting.png",
        speed_panels(results, tasks, list(drafters), "T=0"),
        title="model-free drafting, held-out long-context prompts (SmolLM2 fp32, T=0)",
    )
    redis.stop()
    print(out)
    for k, v in figures.items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
