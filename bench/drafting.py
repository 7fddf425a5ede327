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

import torch  # noqa: E402

from bench.common import RESULTS_DIR, machine_load, median, plot_panels, wait_for_quiet, write_results  # noqa: E402
from bench.tasks import STDLIB, HeldOutTask, _chat, _fit, heldout_tasks  # noqa: E402
from spyglass.context_cache import ContextCache  # noqa: E402
from spyglass.controller import ControllerConfig  # noqa: E402
from spyglass.cost import measured_curve, measured_curves  # noqa: E402
from spyglass.drafters.base import StatelessDrafter  # noqa: E402
from spyglass.drafters.ngram import NgramDrafter  # noqa: E402
from spyglass.drafters.suffix import SuffixDrafter  # noqa: E402
from spyglass.engine import EngineConfig, SpecEngine  # noqa: E402
from spyglass.models.llama import load_transformer  # noqa: E402
from spyglass.models.loader import load_tokenizer, resolve_model  # noqa: E402
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


def run_task(engine: SpecEngine, task: HeldOutTask, params: SamplingParams) -> dict:
    (seq,) = engine.run([task.prompt_ids], params)
    st = seq.stats.summary(seq.num_generated)
    return {
        "tokens": seq.output_ids,
        "tau": st["tau"],
        "tok_s": st["tokens_per_s"],
        "acceptance_by_depth": [round(a, 3) for a in st["acceptance_by_depth"][:8]],
        "controller": st["controller"],
        "draft_s": round(st["draft_time_s"], 3),
        "verify_s": round(st["verify_time_s"], 3),
        "state_bytes": None,
    }


def median_runs(
    target,
    task: HeldOutTask,
    drafters: dict[str, Callable[[], object]],
    params: SamplingParams,
    repeats: int,
    cache: ContextCache | None = None,
    controller_off: tuple[str, ...] = (),
    run: Callable[[SpecEngine, HeldOutTask, SamplingParams], dict] = run_task,
    controls: dict[str, ControllerConfig] | None = None,
) -> dict[str, dict]:
    """`task` through plain decoding (`ar`) and each drafter, `repeats` times, interleaved so that a change in the
    machine's speed hits every method alike. Per method: the run with the median decode speed (tokens kept), every
    run's speed (`tok_s_runs`) and `identical` (every run's output equal to ar's first). `controls`: a method's
    controller constants, where not the defaults."""
    runs: dict[str, list[dict]] = {}
    for _ in range(repeats):
        for name, make in {"ar": lambda: None, **drafters}.items():
            controller = "off" if name in controller_off else "measure"
            control = (controls or {}).get(name, ControllerConfig())
            conf = EngineConfig(max_batch=1, max_context=8192, controller=controller, control=control)
            runs.setdefault(name, []).append(run(SpecEngine(target, make(), conf, context_cache=cache), task, params))
    row = {}
    for name, rs in runs.items():
        rs = sorted(rs, key=lambda r: r["tok_s"])
        identical = all(r["tokens"] == runs["ar"][0]["tokens"] for r in rs)
        row[name] = {**rs[len(rs) // 2], "tok_s_runs": [round(r["tok_s"], 3) for r in rs], "identical": identical}
    return row


def compare(
    target,
    tasks: list[HeldOutTask],
    drafters: dict[str, Callable[[], object]],
    params: SamplingParams,
    cache: ContextCache | None,
    controller_off: tuple[str, ...] = (),
    log=print,
    repeats: int = 1,
    controls: dict[str, ControllerConfig] | None = None,
) -> dict[str, dict[str, dict]]:
    """Every task through plain decoding (`ar`) and each drafter, side by side, `repeats` times; returns
    results[task][method] (the median run) with `speedup` (median decode tok/s over ar's on the same prompt) and
    `identical` (greedy output equal to plain decoding's in every run). `controls`: as median_runs'."""
    results: dict[str, dict[str, dict]] = {}
    for task in tasks:
        row = median_runs(target, task, drafters, params, repeats, cache, controller_off, controls=controls)
        base = row["ar"]["tok_s"]
        for r in row.values():
            r["speedup"] = r["tok_s"] / base if base else None
        log(
            f"{task.name} ({len(task.prompt_ids)} tok): "
            + "  ".join(
                f"{n} {r['speedup']:.2f}x tau {r['tau']:.2f}{'' if r['identical'] else ' DIFF'}" for n, r in row.items()
            )
        )
        for r in row.values():
            r.pop("tokens")
        results[task.name] = row
    return results


def speed_panels(results: dict, tasks: list[HeldOutTask], methods: list[str], label: str) -> list[dict]:
    """Two plot panels: decode speedup and tau per prompt, one line per method."""
    xs = list(range(len(tasks)))
    names = [f"{t.kind}:{t.name.split(':', 1)[1].rsplit('/', 1)[-1][:16]}" for t in tasks]

    def series(key: str) -> dict:
        return {m: (xs, [results[t.name][m][key] for t in tasks]) for m in methods}

    return [
        {
            "title": f"decode speedup vs plain decoding, {label}",
            "ylabel": "x",
            "hline": 1.0,
            "series": series("speedup"),
            "xticklabels": names,
        },
        {"title": f"tau (tokens per step), {label}", "ylabel": "tau", "series": series("tau"), "xticklabels": names},
    ]


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


def by_kind(results: dict, tasks: list[HeldOutTask], method: str, key: str) -> dict[str, float]:
    out = {}
    for kind in ("code", "edit", "summary"):
        vals = [results[t.name][method][key] for t in tasks if t.kind == kind]
        if vals:
            out[kind] = median(vals)
    return out


def bench_setup(cache_name: str, threads: int):
    """What every drafting bench does first: wait for a quiet machine, start a local Redis (keep the returned
    handle alive), load SmolLM2 fp32 and its tokenizer, and open a context cache under `cache_name`."""
    from services.local_redis import LocalRedis

    torch.set_num_threads(threads)
    quiet = wait_for_quiet(max_load=1.0, timeout_s=120)
    redis = LocalRedis()
    path = resolve_model(None, dtype="float32").path
    target = load_transformer(path, dtype=torch.float32)
    cache = ContextCache(redis.url, f"{cache_name}:{target.model_id}", block_size=128)
    return quiet, redis, target, load_tokenizer(path), cache


def run_meta(
    what: str, tasks: list[HeldOutTask], quiet: dict, load_before: dict, threads: int, target, **extra
) -> dict:
    """The meta every drafting bench writes beside its figures: what ran, on which prompts, the machine's load, and
    the machine-dependent choices the run made (the matmul kernel, the controller's verify-cost curves)."""
    return {
        "what": what,
        "tasks": {t.name: len(t.prompt_ids) for t in tasks},
        "quiet_before": quiet,
        "load_before": load_before,
        "load_after": machine_load(),
        "threads": threads,
        "linear_backend": target.linear_backend,
        "cost_curves": [c.to_dict() for c in measured_curves(target)],
        **extra,
    }


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
