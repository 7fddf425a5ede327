"""Engine benchmark on the real default model (SmolLM2-135M-Instruct), ratios measured side by side.

Figures (bench/results/engine.json):
- runner_vs_hf_512 / _4096: our plain decoding vs HF `generate()` (SDPA), 128 new tokens, decode tokens/s.
- overhead_ratio: the speculative engine with a drafter that proposes nothing vs the bare decoding loop.
- pld_speedup_code_edit / pld_tau_code_edit: n-gram drafting vs plain decoding on real code-editing
  tasks (a whole stdlib source file of 2,000+ tokens in context), T=0, and whether outputs are identical.
- batch4_vs_1: aggregate decode tokens/s of 4 concurrent sequences vs 1.

Decode rates are (N - 1) / (t(N new tokens) - t(1 new token)) so prefill cancels out, with the
contenders interleaved per repeat so load drift hits all alike.

    python bench/engine.py [--quick] [--dtype float32]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS_DIR, load_model, median, plot_panels, wait_for_quiet, write_results  # noqa: E402
from spyglass.demo import code_edit_task  # noqa: E402
from spyglass.drafters.base import NullDrafter  # noqa: E402
from spyglass.drafters.ngram import NgramDrafter  # noqa: E402
from spyglass.engine import EngineConfig, SpecEngine, plain_generate  # noqa: E402
from spyglass.sampling import SamplingParams  # noqa: E402

CODE_EDIT_MODULES = ["textwrap.py", "shlex.py", "fnmatch.py"]


def real_ids(tokenizer, n: int) -> list[int]:
    """n tokens of real text (stdlib source), for context-length sweeps."""
    text = Path(code_edit_task("argparse.py").source).read_text()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return (ids * (n // len(ids) + 1))[:n]


def chat_ids(tokenizer, text: str) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def decode_rates(fns: dict, n: int, repeats: int) -> dict[str, dict]:
    """Decode tokens/s of each contender fn(max_new_tokens), interleaved, prefill cancelled out."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():  # warm-up
        fn(2)
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn(1)
            t1 = time.perf_counter()
            fn(n)
            t2 = time.perf_counter()
            samples[name].append((n - 1) / max((t2 - t1) - (t1 - t0), 1e-9))
    return {k: {"median_tok_s": median(v), "samples_tok_s": [round(x, 3) for x in v]} for k, v in samples.items()}


def bench_runner_vs_hf(model, hf, ids: list[int], n: int, repeats: int) -> dict:
    prompt = torch.tensor([ids])

    def ours(k: int) -> None:
        plain_generate(model, ids, SamplingParams(max_new_tokens=k, ignore_eos=True))

    def theirs(k: int) -> None:
        with torch.no_grad():
            hf.generate(prompt, max_new_tokens=k, min_new_tokens=k, do_sample=False)

    return decode_rates({"spyglass": ours, "hf_generate": theirs}, n, repeats)


def bench_overhead(model, ids: list[int], n: int, repeats: int) -> dict:
    def bare(k: int) -> None:
        plain_generate(model, ids, SamplingParams(max_new_tokens=k, ignore_eos=True))

    def engine(k: int) -> None:
        eng = SpecEngine(model, NullDrafter(), EngineConfig(max_batch=1, max_context=len(ids) + k + 8))
        eng.run([ids], SamplingParams(max_new_tokens=k, ignore_eos=True))

    return decode_rates({"bare_loop": bare, "engine_null_drafter": engine}, n, repeats)


def bench_code_edit(model, tokenizer, n: int, repeats: int, modules: list[str]) -> dict:
    out = {}
    params = SamplingParams(max_new_tokens=n)
    for module in modules:
        ids = chat_ids(tokenizer, code_edit_task(module).prompt)
        runs: dict[str, list[dict]] = {"ar": [], "ngram": []}
        outputs: dict[str, list[int]] = {}
        for _ in range(repeats):
            for method in ("ar", "ngram"):
                drafter = NgramDrafter() if method == "ngram" else None
                eng = SpecEngine(model, drafter, EngineConfig(max_batch=1, max_context=len(ids) + n + 64))
                t0 = time.perf_counter()
                (seq,) = eng.run([ids], params)
                stats = seq.stats.summary(seq.num_generated)
                stats["wall_s"] = time.perf_counter() - t0
                runs[method].append(stats)
                outputs[method] = seq.output_ids
        ar_tps = median([r["tokens_per_s"] for r in runs["ar"]])
        ng_tps = median([r["tokens_per_s"] for r in runs["ngram"]])
        out[module] = {
            "prompt_tokens": len(ids),
            "generated_tokens": len(outputs["ngram"]),
            "ar_tok_s": ar_tps,
            "ngram_tok_s": ng_tps,
            "decode_speedup": ng_tps / ar_tps,
            "e2e_speedup": median([r["wall_s"] for r in runs["ar"]]) / median([r["wall_s"] for r in runs["ngram"]]),
            "tau": median([r["tau"] for r in runs["ngram"]]),
            "identical": outputs["ar"] == outputs["ngram"],
            "runs": runs,
        }
    return out


def bench_batch(model, tokenizer, n: int, repeats: int) -> dict:
    texts = [
        "Explain how a hash table handles collisions.",
        "Write a short story about a lighthouse keeper.",
        "Describe the water cycle for a ten-year-old.",
        "What are the trade-offs between TCP and UDP?",
    ]
    prompts = [chat_ids(tokenizer, t) for t in texts]
    result = {}
    for batch in (1, 4):

        def run(k: int, batch: int = batch) -> None:
            eng = SpecEngine(model, None, EngineConfig(max_batch=batch, max_context=512))
            eng.run(prompts[:batch], SamplingParams(max_new_tokens=k, ignore_eos=True))

        rate = decode_rates({f"b{batch}": run}, n, repeats)[f"b{batch}"]
        result[f"batch{batch}_agg_tok_s"] = rate["median_tok_s"] * batch
        result[f"batch{batch}_samples"] = rate["samples_tok_s"]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: fewer tokens and repeats")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    quiet = wait_for_quiet(timeout_s=0 if args.quick else 300)
    n, repeats = (16, 1) if args.quick else (128, 3)
    dtype = getattr(torch, args.dtype)
    model, tokenizer, resolved = load_model(dtype=args.dtype)

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(resolved.path, dtype=dtype).eval()
    raw: dict = {}
    for ctx in (512, 4096):
        raw[f"runner_vs_hf_{ctx}"] = bench_runner_vs_hf(model, hf, real_ids(tokenizer, ctx), n, repeats)
        print(f"runner vs hf @{ctx}:", {k: round(v["median_tok_s"], 2) for k, v in raw[f"runner_vs_hf_{ctx}"].items()})
    del hf
    raw["overhead"] = bench_overhead(model, real_ids(tokenizer, 512), n, repeats)
    print("overhead:", {k: round(v["median_tok_s"], 2) for k, v in raw["overhead"].items()})
    modules = CODE_EDIT_MODULES[:1] if args.quick else CODE_EDIT_MODULES
    raw["code_edit"] = bench_code_edit(model, tokenizer, 2 * n, repeats, modules)
    for m, r in raw["code_edit"].items():
        print(f"code edit {m}: speedup {r['decode_speedup']:.2f} tau {r['tau']:.2f} identical {r['identical']}")
    raw["batch"] = bench_batch(model, tokenizer, n // 2, repeats)
    print("batch:", {k: v for k, v in raw["batch"].items() if "samples" not in k})

    def ratio(key: str) -> float:
        r = raw[key]
        names = list(r)
        return r[names[0]]["median_tok_s"] / r[names[1]]["median_tok_s"]

    edits = raw["code_edit"].values()
    figures = {
        "runner_vs_hf_512": ratio("runner_vs_hf_512"),
        "runner_vs_hf_4096": ratio("runner_vs_hf_4096"),
        "overhead_ratio": 1.0 / ratio("overhead"),
        "pld_speedup_code_edit": median([e["decode_speedup"] for e in edits]),
        "pld_e2e_speedup_code_edit": median([e["e2e_speedup"] for e in edits]),
        "pld_tau_code_edit": median([e["tau"] for e in edits]),
        "pld_identical_code_edit": f"{sum(e['identical'] for e in edits)}/{len(edits)}",
        "batch4_vs_1": raw["batch"]["batch4_agg_tok_s"] / raw["batch"]["batch1_agg_tok_s"],
    }
    figures = {k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}
    name = "engine_quick" if args.quick else "engine"
    meta = {"dtype": args.dtype, "threads": args.threads, "new_tokens": n, "repeats": repeats, "quiet_check": quiet}
    path = write_results(name, figures, raw, meta)
    plot_panels(
        RESULTS_DIR / f"{name}.png",
        [
            {
                "title": "speedup vs plain decoding (code edit, T=0)",
                "xlabel": "task",
                "ylabel": "x",
                "series": {
                    "decode": (list(range(len(edits))), [e["decode_speedup"] for e in edits]),
                    "end to end": (list(range(len(edits))), [e["e2e_speedup"] for e in edits]),
                },
                "hline": 1.0,
            },
            {
                "title": "ratios",
                "xlabel": "figure",
                "ylabel": "x",
                "series": {
                    "ratio": (
                        list(range(4)),
                        [
                            figures[k]
                            for k in ("runner_vs_hf_512", "runner_vs_hf_4096", "overhead_ratio", "batch4_vs_1")
                        ],
                    )
                },
                "hline": 1.0,
            },
        ],
        title=f"spyglass engine, SmolLM2-135M {args.dtype}",
    )
    print(path)
    print(figures)


if __name__ == "__main__":
    main()
