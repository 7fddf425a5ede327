"""TokenSwift benchmark: long generation from a long prefix on SmolLM2, vs plain decoding with the same penalty.

One run, every contender on the same prompt, sampling parameters and seed (T=1, contextual penalty theta=1.2 over
W=1024 tokens, min-p 0.1), generation to a fixed length (EOS ignored, as the paper does):
- `ar`: plain decoding through the same engine (the reference);
- `tokenswift`: partial KV (importance updates + rebuilds) + trained heads + [1,3,3,3] tree + n-gram reuse (the
  table's n-grams chained, and the context lookup: what followed the text's longest repeated suffix);
- `sampled-chain`: the same drafter drawing a chain from p_0..p_3, verified by rejection sampling (`sampled_chain`);
- ablations: `table-ngrams` (no context lookup: the n-gram table alone), `short-ngrams` (the paper's n-grams: the
  table alone, not chained on past n tokens), `no-ngram` (neither), `static-kv`
  (no dynamic KV updates), `heads-only` (no partial-cache pass: the heads
  read the verify pass's exact hidden state, Medusa-style, so drafting costs no target forward), and the
  `streaming` baseline (StreamingLLM/MagicDec self-speculation, sinks + recent window);
- `ngram`: model-free n-gram drafting on the same prompt, the bar every drafter must clear; `suffix`: suffix drafting
  alone (TokenSwift's context lookup without the heads: what the heads add);
- `ar-no-penalty`: plain decoding without the penalty, only for Distinct-4;
- `ar-again`: plain decoding with the penalty once more, last: the machine's drift over the run
  (`baseline_drift`); every speedup is taken against plain decoding's time interpolated to when the variant ran.
Token matching draws one target sample per emitted token, so with one seed the token-matching contenders emit the
same text as `ar` (up to floating-point differences between batched verification and single steps); rejection
sampling (`sampled-chain`, `streaming`) draws differently: same distribution, other text.

Figures (bench/results/tokenswift.json): speedup_long_t1 (decode time of ar / of tokenswift, prefill excluded),
acceptance_rate (the paper's alpha: accepted drafted tokens / (4 x steps); above 1 where lookups draft deeper
than 4), tau, speedup by generated length (plotted), distinct4_with_penalty / distinct4_without_penalty, ablation
speedups; with `--model qwen2.5-coder-0.5b` and 12K+ generated tokens, `speedup_12k_t1` (the issue's long-context
figure; `make bench-tokenswift-qwen`).

Each finished variant is kept in .cache/bench/<name>/ (with the machine's CPU model, the run's arguments and a hash of
the code and shipped weights): a rerun with the same --name resumes after the last finished variant on the same CPU
with the same code instead of starting over.

    python bench/tokenswift.py [--model M] [--prefix 2048] [--gen 6144] [--budget 1024] [--variants ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    RESULTS_DIR,
    CpuWatch,
    code_fingerprint,
    load_model,
    machine_load,
    plot_panels,
    wait_for_quiet,
    write_results,
)
from spyglass.cost import CostCurve, cpu_model  # noqa: E402
from spyglass.drafters.ngram import NgramDrafter  # noqa: E402
from spyglass.drafters.streaming import StreamingDrafter  # noqa: E402
from spyglass.drafters.suffix import SuffixDrafter  # noqa: E402
from spyglass.drafters.tokenswift import build_tokenswift  # noqa: E402
from spyglass.engine import EngineConfig, SpecEngine  # noqa: E402
from spyglass.sampling import SamplingParams  # noqa: E402

VARIANTS = (
    "ar", "tokenswift", "sampled-chain", "table-ngrams", "short-ngrams", "no-ngram", "static-kv", "heads-only",
    "streaming", "ngram", "suffix", "ar-no-penalty", "ar-again",
)  # fmt: skip
PLAIN = ("ar", "ar-no-penalty", "ar-again")


def eval_prose_prompt(tokenizer, n: int) -> tuple[list[int], str]:
    """The first `n` tokens of the first eval-split prose document that long (never trained on)."""
    from spyglass.training.data import CorpusConfig, prose_documents, split_of

    cfg = CorpusConfig()
    for doc in sorted(prose_documents(cfg), key=lambda d: d.path):
        if split_of(doc.group, cfg) != "eval":
            continue
        ids = tokenizer.encode(Path(doc.path).read_text(errors="replace"), add_special_tokens=False)
        if len(ids) >= n:
            return ids[:n], doc.path
    raise SystemExit(f"no eval-split prose document has {n} tokens")


def distinct_n(ids: list[int], n: int = 4) -> float:
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def drafter_for(variant: str, target, budget: int):
    if variant in PLAIN:
        return None
    if variant == "streaming":
        return StreamingDrafter(budget=budget, sinks=4, gamma=4)
    if variant == "ngram":
        return NgramDrafter()
    if variant == "suffix":
        return SuffixDrafter()
    options = {
        "tokenswift": {},
        "sampled-chain": {"sampled_chain": True},
        "table-ngrams": {"context_lookup": False},
        "short-ngrams": {"ngram_depth": 0, "context_lookup": False},
        "no-ngram": {"ngram_k": 0, "context_lookup": False},
        "static-kv": {"policy": "static"},
        "heads-only": {"draft_pass": False},
    }[variant]
    return build_tokenswift(target, ARGS.heads, budget=budget, **options)


def run_one(target, tokenizer, variant: str, prompt: list[int], params: SamplingParams, curve, capacity: int):
    engine = SpecEngine(target, drafter_for(variant, target, ARGS.budget), EngineConfig(1, capacity, controller=curve))
    t0 = time.perf_counter()
    seq = engine.add_request(prompt, params)
    marks = []  # (seconds since the first token, tokens generated)
    with CpuWatch() as watch:
        while not seq.finished:
            for ev in engine.step():
                if ev.seq is seq and ev.new_tokens:
                    marks.append((time.perf_counter(), seq.num_generated))
    t_first = seq.stats.t_first_token
    stats = seq.stats.summary(seq.num_generated)
    accepted = sum(seq.stats.new_tokens_per_step) - seq.stats.steps
    out = {
        "variant": variant,
        "tokens": seq.output_ids,
        "wall_s": time.perf_counter() - t0,
        "decode_s": marks[-1][0] - t_first,
        "curve_s": [round(t - t_first, 4) for t, _ in marks],
        "curve_n": [n for _, n in marks],
        "tau": stats["tau"],
        "steps": stats["steps"],
        "acceptance_rate": accepted / (4 * seq.stats.steps) if seq.stats.steps else 0.0,
        "acceptance_by_depth": stats["acceptance_by_depth"],
        "draft_s": stats["draft_time_s"],
        "verify_s": stats["verify_time_s"],
        "prefill_s": stats["prefill_time_s"],
        "controller": stats["controller"],
        "distinct4": distinct_n(seq.output_ids),
        "other_cores_busy": watch.other_cores,  # other processes' CPU use during the run (the machine's load)
    }
    drafter = engine.drafter
    if hasattr(drafter, "pkv") and drafter.pkv is not None:
        out["partial_kv_bytes"] = drafter.pkv.slot_bytes()
    if hasattr(drafter, "drafted"):
        out["heads_steps"] = drafter.drafted  # steps that ran TokenSwift's heads (the rest: lookups alone)
    print(
        f"{variant:14s} decode {out['decode_s']:.1f}s tau {out['tau']:.2f} alpha {out['acceptance_rate']:.2f} "
        f"distinct4 {out['distinct4']:.3f}",
        flush=True,
    )
    return out


def time_at(run: dict, n: int) -> float | None:
    """Decode seconds until `n` tokens had been generated."""
    for t, k in zip(run["curve_s"], run["curve_n"], strict=True):
        if k >= n:
            return t
    return None


def main() -> None:
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model source (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--gen", type=int, default=6144)
    ap.add_argument("--budget", type=int, default=1024, help="partial KV budget |B| (the paper: the prefix length)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument(
        "--heads", default=None, help="heads checkpoint (default: the ones shipped for the model; 'untrained' = zero)"
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="tokenswift")
    ap.add_argument("--note", default="", help="recorded in the results (what was run and why)")
    ARGS = ap.parse_args()
    target, tokenizer, resolved = load_model(ARGS.model, ARGS.dtype, ARGS.threads)
    prompt, source = eval_prose_prompt(tokenizer, ARGS.prefix)
    capacity = ARGS.prefix + ARGS.gen + 128
    quiet = wait_for_quiet(max_load=1.0, timeout_s=120)
    load_before = machine_load()
    t0 = time.perf_counter()
    curve = CostCurve.measure(target, target.new_cache(capacity, 1), contexts=(ARGS.prefix, ARGS.prefix + ARGS.gen))
    print(f"cost curve measured in {time.perf_counter() - t0:.0f}s", flush=True)
    base = dict(temperature=1.0, min_p=0.1, seed=ARGS.seed, max_new_tokens=ARGS.gen, ignore_eos=True)
    penalised = SamplingParams(contextual_penalty=1.2, penalty_window=1024, **base)
    runs = {}
    for variant in ARGS.variants.split(","):  # warm-up (one-time costs: oneDNN primitives, page faults)
        warm = SamplingParams(**{**base, "max_new_tokens": 16}, contextual_penalty=1.2, penalty_window=1024)
        run_one(target, tokenizer, variant, prompt, warm, curve, capacity)
    kept = Path(".cache/bench") / ARGS.name
    kept.mkdir(parents=True, exist_ok=True)
    same_run = {
        "cpu": cpu_model(),
        "code": code_fingerprint(),
        "args": {k: v for k, v in vars(ARGS).items() if k not in ("note", "variants", "name")},
    }
    kept_runs = []  # variants measured by an earlier, interrupted run with the same arguments on this CPU
    for variant in ARGS.variants.split(","):
        done = kept / f"{variant}.json"
        if done.is_file() and (saved := json.loads(done.read_text()))["same_run"] == same_run:
            runs[variant] = saved["run"]
            kept_runs.append(variant)
            print(f"{variant:14s} kept from an earlier run ({done})", flush=True)
            continue
        params = SamplingParams(**base) if variant == "ar-no-penalty" else penalised
        runs[variant] = run_one(target, tokenizer, variant, prompt, params, curve, capacity)
        done.write_text(json.dumps({"same_run": same_run, "run": runs[variant]}))
    ar = runs["ar"]
    order = list(runs)

    def drift(name: str) -> float:
        """Plain decoding's time when `name` ran, relative to its first run: interpolated in run order between
        its runs at both ends (`ar-again`), since an hour-long run on a shared VM drifts by several percent."""
        if "ar-again" not in runs:
            return 1.0
        i, a, b = order.index(name), order.index("ar"), order.index("ar-again")
        return 1.0 + (i - a) / (b - a) * (runs["ar-again"]["decode_s"] / ar["decode_s"] - 1.0)

    def speedup(name: str) -> float | None:
        return ar["decode_s"] * drift(name) / runs[name]["decode_s"] if name in runs else None

    checkpoints = [n for n in range(128, ARGS.gen + 1, 128)] or [ARGS.gen]
    by_length = {}
    for name, run in runs.items():
        if name in PLAIN:
            continue
        by_length[name] = [
            (n, time_at(ar, n) * drift(name) / time_at(run, n))
            for n in checkpoints
            if time_at(ar, n) and time_at(run, n)
        ]
    figures = {
        "speedup_long_t1": speedup("tokenswift"),
        "speedup_long_t1_ngram": speedup("ngram"),
        "baseline_drift": runs["ar-again"]["decode_s"] / ar["decode_s"] if "ar-again" in runs else None,
        "acceptance_rate": runs.get("tokenswift", {}).get("acceptance_rate"),
        "tau": runs.get("tokenswift", {}).get("tau"),
        "identical_to_ar": {
            k: r["tokens"] == ar["tokens"] for k, r in runs.items() if k not in ("ar", "ar-no-penalty")
        },
        "distinct4_with_penalty": ar["distinct4"],
        "distinct4_without_penalty": runs.get("ar-no-penalty", {}).get("distinct4"),
        "ablation_speedup": {k: speedup(k) for k in runs if k not in (*PLAIN, "tokenswift")},
        "ablation_tau": {k: r["tau"] for k, r in runs.items() if k not in PLAIN},
        "speedup_by_generated_length": {k: [[n, round(s, 3)] for n, s in v] for k, v in by_length.items()},
        "ar_decode_tokens_per_s": (ARGS.gen - 1) / ar["decode_s"],
        # the long-context figure: Qwen2.5-Coder-0.5B (32K context), 2K prefix, 12K+ generated tokens
        "speedup_12k_t1": speedup("tokenswift") if ARGS.model and ARGS.gen >= 12_000 else None,
    }
    meta = {
        "what_was_run": {
            "model": resolved.model_id,
            "dtype": ARGS.dtype,
            "threads": ARGS.threads,
            "prefix_tokens": ARGS.prefix,
            "generated_tokens": ARGS.gen,
            "prompt_source": source,
            "partial_budget": ARGS.budget,
            "heads": ARGS.heads or "shipped for the model (spyglass/drafts/*-tokenswift)",
            "sampling": {"temperature": 1.0, "min_p": 0.1, "contextual_penalty": 1.2, "penalty_window": 1024},
            "seed": ARGS.seed,
            "variants": list(runs),
            "kept_from_earlier_run": kept_runs,
            "note": ARGS.note,
        },
        "cost_curve": curve.to_dict(),
        "quiet_before": quiet,
        "load_before": load_before,
        "load_after": machine_load(),
    }
    raw = {k: {kk: vv for kk, vv in r.items() if kk != "tokens"} for k, r in runs.items()}
    path = write_results(ARGS.name, figures, raw, meta)
    panels = [
        {
            "title": f"speedup vs plain decoding (same penalty), prefix {ARGS.prefix}",
            "xlabel": "generated tokens",
            "ylabel": "cumulative decode-time speedup",
            "series": {k: ([n for n, _ in v], [s for _, s in v]) for k, v in by_length.items()},
            "hline": 1.0,
        },
        {
            "title": "decode progress",
            "xlabel": "seconds after the first token",
            "ylabel": "generated tokens",
            "series": {k: (r["curve_s"], r["curve_n"]) for k, r in runs.items()},
        },
    ]
    plot_panels(RESULTS_DIR / f"{ARGS.name}.png", panels, title=f"TokenSwift on {resolved.model_id}")
    print(path)


if __name__ == "__main__":
    main()
