"""Long context: held-out prompts of about 4K, 8K, 16K and 32K tokens on Qwen2.5-Coder-0.5B-Instruct (its 32K window,
the engine's default capacity), fp32 (and/or bf16: --dtype), T=0; plain decoding (`ar`), `suffix` (the default
method), `ngram`, the LongSpec draft shipped for the model and the best composite whose parts ship for it, side by side
on every prompt, each output checked identical to plain decoding's in the same dtype. Writes
bench/results/long_context.json (+ .png).

    python bench/long_context.py [--lengths 4k,8k,16k,32k] [--kinds repo,edit,quote,qa] [--per-kind 1]
                                 [--max-new-tokens 128] [--methods ar,suffix,ngram,longspec,best-composite]
                                 [--dtype float32|bfloat16|float32,bfloat16]
    python bench/long_context.py --smoke     # SmolLM2, 256- and 512-token prompts, 8 tokens (the tests run it)

Prompts (bench/tasks.py `long_tasks`, every source in the eval split): `repo` (files of a package, then the first
part of another file of it: repository-level completion), `edit` (files of a package and a request to rewrite a
function), `quote` (documentation pages and a request to quote a paragraph deep inside word for word), `qa` (the same
kind of text and a question on one of its sections).

Per prompt, with a real redis-server as the context cache (block size and memory limit of
infra/serve_config_qwen.yaml, emptied before each prompt):
1. a cache miss: plain decoding's prefill alone (one token), timed per chunk; its K/V blocks go to the cache as a
   server stores them (in the background), and the time until they are stored is kept;
2. every method in turn on a cache hit (the prefix loaded from Redis, the last partial block computed): the prefill
   is shared through the cache, so a prompt costs one prefill, not one per method.

Figures, per length label L (medians over the prompts of that length):
- speedup_L_default: decode speedup of the default method (suffix) over plain decoding (tokens after the first /
  time after the first token, the same prompt in the same run); speedup_L_<method>, tau_L_<method>;
- e2e_speedup_L_<method>: a cold request's wall time, plain over the method: the prefill measured on the miss plus
  the method's own start-up (its time to first token on a hit, over plain decoding's) plus its decode time;
- ttft_miss_s_L, ttft_hit_s_L (plain decoding) and cache_hit_ttft_speedup_L (miss over hit, per prompt);
- prefill_tok_s_L (prompt tokens / prefill time on the miss) and prefill_tok_s_<longest>_vs_<shortest>;
  prefill_chunk_tok_s_<longest>_vs_<shortest>: within the longest prompts' prefills, the throughput of the chunks in
  their last tenth over that of the chunks just below the shortest length (the attention over the cached prefix is
  the part that grows);
- peak_rss_mib_L (the process's peak resident memory over every run of that length), kv_bytes_L (K/V held for the
  sequence: bytes per token x tokens), kv_slot_bytes (one slot at the engine's capacity), draft_state_bytes_L_<m>;
- longspec_<model>_speedup_<longest> and longspec_<model>_tau_<longest>_vs_<shortest> where a LongSpec draft ships
  for the model; `skipped` names the methods that could not run and why (no draft for this model);
- identical_all: every output of every method equal to plain decoding's (in the same dtype).
- with --dtype bfloat16 every figure above is reported for bf16 with `_bf16` appended; with both dtypes, each prompt
  runs in fp32 then in bf16 (one target per dtype, its own cost curve and cache namespace), and
  ar_tok_s_L_bf16_vs_fp32 (plain decode tok/s, bf16 over fp32), kv_bytes_per_token(_bf16) and
  kv_bytes_per_token_bf16_vs_fp32 are added; raw rows of bf16 runs are keyed `<task> [bf16]`.
- output_copied_L: the share of plain decoding's output tokens that end a 4-gram found in the prompt (what a drafter
  reading the prompt could propose at all; each prompt's `output_start` shows what the model wrote).

Each finished prompt is kept in .cache/bench/<name>/ with the CPU model, the arguments and a hash of the code and
shipped weights: a rerun resumes after the prompts already measured (--fresh starts over). The full run (4 lengths x
4 kinds, one prompt each; `make bench-long`) takes about an hour on 2 cores, most of it the 32K prefills.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import sys
import time
import weakref
from collections.abc import Callable
from contextlib import contextmanager
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import (  # noqa: E402
    RESULTS_DIR,
    CpuWatch,
    code_fingerprint,
    load_model,
    machine_load,
    median,
    median_of,
    plot_panels,
    ratio,
    reset_peak_rss,
    vm_status,
    wait_for_quiet,
    write_results,
)
from bench.tasks import LONG_KINDS, HeldOutTask, long_tasks  # noqa: E402
from spyglass.context_cache import ContextCache, kv_namespace  # noqa: E402
from spyglass.cost import CostCurve, cpu_model  # noqa: E402
from spyglass.drafters import METHODS, build_drafter  # noqa: E402
from spyglass.engine import EngineConfig, SpecEngine  # noqa: E402
from spyglass.kv_cache import kv_bytes_per_token  # noqa: E402
from spyglass.sampling import SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QWEN = "qwen2.5-coder-0.5b"
DEFAULT_METHOD = "suffix"  # the CLI's default, first in infra/serve_config_qwen.yaml
DEFAULT_METHODS = "ar,suffix,ngram,longspec,best-composite"
# `best-composite`: the first of these whose learned part ships for the model (composite-span read 2.89x on the
# SmolLM2 drafting prompts, composite 2.5x, composite-dflash below; BENCHMARKS.md).
COMPOSITE_ORDER = ("composite-span", "composite", "composite-dflash")
DTYPE_SUFFIX = {"float32": "", "bfloat16": "_bf16"}  # a figure's suffix per dtype
SMOKE = {"lengths": "256,512", "per_kind": 1, "max_new_tokens": 8, "threads": 1, "model": None, "block_size": 32}


def parse_lengths(spec: str, window: int, max_new_tokens: int) -> list[tuple[str, int]]:
    """`4k,8k,16k,32k` (k = 1024) or token counts, each capped so that the prompt and its generation fit the
    window; (label, tokens) sorted by tokens."""
    out = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(k?)\s*", part.lower())
        if not m:
            raise SystemExit(f"--lengths: {part!r} is not a length (e.g. 8k or 3000)")
        n = int(m.group(1)) * (1024 if m.group(2) else 1)
        cap = window - max_new_tokens - 16
        if min(n, cap) < 64:
            raise SystemExit(f"--lengths: {part!r} leaves no room in the model's {window}-token window")
        out.append((part.strip().lower(), min(n, cap)))
    return sorted(out, key=lambda x: x[1])


def model_tag(model_id: str) -> str:
    """The model's short name in figure names (`longspec_qwen_...`)."""
    low = model_id.lower()
    return "qwen" if "qwen" in low else "smollm2" if "smollm2" in low else re.sub(r"\W+", "_", low)


def longspec_draft_for(target) -> Path | None:
    """The shipped LongSpec draft that fits `target` (spyglass/drafts/*-longspec), None if none does."""
    from spyglass.drafters.longspec import shipped_draft

    try:
        return shipped_draft(target)
    except ValueError:
        return None


def method_builders(methods: list[str], target, capacity: int) -> tuple[dict[str, Callable], dict[str, str]]:
    """Per method that can run for `target`, a builder of a fresh drafter (None: plain decoding); the ones that cannot
    (no draft ships for this model), with the reason. `best-composite` becomes the first of COMPOSITE_ORDER that
    builds. Unknown names are an error."""
    draft = longspec_draft_for(target)
    shipped = sorted(p.name for p in (ROOT / "spyglass" / "drafts").glob("*-longspec*"))
    no_draft = f"no LongSpec draft ships for this model (spyglass/drafts has {', '.join(shipped) or 'none'})"
    builders: dict[str, Callable] = {}
    skipped: dict[str, str] = {}

    def builder(m: str) -> Callable | str:
        """A builder, or why `m` cannot run here."""
        options = {}
        if m.startswith("longspec") or any(p.startswith("longspec") for p in METHODS[m].options.get("parts", ())):
            if draft is None:
                return no_draft
            options["draft_checkpoint"] = str(draft)  # (other learned drafts fit SmolLM2 only: ValueError below)
        make = partial(build_drafter, m, target, max_batch=1, max_context=capacity, **options)
        try:
            make()  # a learned part that does not fit this model raises ValueError
        except ValueError as e:
            return str(e).replace(f"{ROOT}/", "")  # the results name repository paths, not this machine's
        return make

    for m in methods:
        if m == "best-composite":
            reasons = []
            for c in COMPOSITE_ORDER:
                got = builder(c)
                if callable(got):
                    builders[c] = got
                    break
                reasons.append(f"{c}: {got}")
            else:
                skipped[m] = "; ".join(reasons)
            continue
        if m not in METHODS:
            raise SystemExit(f"--methods: unknown method {m!r}; available: {', '.join(METHODS)}, best-composite")
        got = builder(m)
        if callable(got):
            builders[m] = got
        else:
            skipped[m] = got
    if "ar" not in builders:
        raise SystemExit("--methods must include ar (plain decoding: every speedup and identity check is against it)")
    return {"ar": builders.pop("ar"), **builders}, skipped


@contextmanager
def prefill_chunks(engine: SpecEngine):
    """Collects (start position, tokens, seconds) of every prefill forward the engine runs inside the block."""
    chunks: list[dict] = []
    forward = engine._forward

    def timed(segments):
        t0 = time.perf_counter()
        out = forward(segments)
        if all(s.mask is None and s.logits == "last" for s in segments):  # a prefill chunk, not a verify step
            n = sum(len(s.tokens) for s in segments)
            chunks.append({"start": segments[0].start, "tokens": n, "s": round(time.perf_counter() - t0, 5)})
        return out

    engine._forward = timed
    try:
        yield chunks
    finally:
        del engine._forward  # the class's method again


def run_one(target, drafter, task: HeldOutTask, params: SamplingParams, curve, cache: ContextCache) -> dict:
    """One request through a fresh engine at the model's full window; what it did and what it cost."""
    engine = SpecEngine(target, drafter, EngineConfig(max_batch=1, controller=curve), context_cache=cache)
    reset_peak_rss()
    state_bytes = 0
    with CpuWatch() as watch, prefill_chunks(engine) as chunks:
        seq = engine.add_request(task.prompt_ids, params)
        while not seq.finished:
            engine.step()
            if not seq.finished:  # a finished sequence's drafter state is already released
                state_bytes = max(state_bytes, engine.drafter.state_bytes(seq))
    st = seq.stats.summary(seq.num_generated)
    out = {
        "tokens": seq.output_ids,
        "generated": seq.num_generated,
        "ttft_s": st["ttft_s"],
        "prefill_s": st["prefill_time_s"],
        "cached_prefix_tokens": st["cached_prefix_tokens"],
        "decode_s": st["decode_time_s"],
        "tok_s": st["tokens_per_s"],
        "tau": st["tau"],
        "steps": st["steps"],
        "acceptance_by_depth": [round(a, 3) for a in st["acceptance_by_depth"][:8]],
        "controller": st["controller"],
        "draft_s": round(st["draft_time_s"], 3),
        "verify_s": round(st["verify_time_s"], 3),
        "draft_state_bytes": int(state_bytes),
        "kv_bytes": kv_bytes_per_token(target.args, target.dtype) * seq.committed,
        "kv_slot_bytes": engine.cache.nbytes // engine.cache.max_slots,
        "peak_rss_mib": vm_status()["hwm_mib"],
        "chunks": chunks,
        "other_cores_busy": watch.other_cores,
        "t_first_token": seq.stats.t_first_token,
    }
    kv = weakref.ref(engine.cache._k)
    del engine, seq
    if kv() is not None:  # held in a reference cycle: its K/V (0.75 GiB at 32K for Qwen) goes before the next engine
        gc.collect()
    return out


def copied_share(prompt: list[int], output: list[int], n: int = 4) -> float:
    """The share of `output`'s tokens that end an n-gram (with the tokens before it) found in `prompt`: how much of
    what the model wrote a drafter reading the prompt could have proposed at all."""
    grams = {tuple(prompt[i : i + n]) for i in range(len(prompt) - n + 1)}
    text = prompt[-(n - 1) :] + output
    return sum(tuple(text[i : i + n]) in grams for i in range(len(output))) / max(1, len(output))


def run_prompt(
    target, task: HeldOutTask, builders: dict, params: SamplingParams, curve, cache: ContextCache, client, decode
):
    """A cache miss (plain decoding's prefill alone), then every method on a hit; speedups against plain decoding.
    `client`: a connection to the cache's Redis (emptied first); `decode`: token ids -> text (the output's start is
    kept, to show what the model did with the task)."""
    client.flushdb()
    miss = run_one(target, None, task, SamplingParams(max_new_tokens=1), curve, cache)
    cache.flush(timeout=3600)  # the K/V blocks are written in the background, as a server writes them
    miss["stored_s"] = round(time.perf_counter() - miss.pop("t_first_token"), 3)  # after the first token
    miss["cache_bytes"] = int(client.get("spyglass:ctx-bytes") or 0)
    miss["redis_used_memory"] = int(client.info("memory")["used_memory"])
    miss["prefill_tok_s"] = len(task.prompt_ids) / miss["prefill_s"]
    print(
        f"{task.name} ({len(task.prompt_ids)} tok): prefill {miss['prefill_s']:.1f}s "
        f"({miss['prefill_tok_s']:.0f} tok/s), stored {miss['cache_bytes'] / 2**20:.0f} MiB "
        f"{miss['stored_s']:.1f}s after the first token",
        flush=True,
    )
    runs = {}
    for name, make in builders.items():
        runs[name] = run_one(target, make(), task, params, curve, cache)
        del runs[name]["chunks"], runs[name]["t_first_token"]  # (a hit computes the last partial block only)
    ar = runs["ar"]
    for r in runs.values():
        r["identical"] = r["tokens"] == ar["tokens"]
        r["speedup"] = r["tok_s"] / ar["tok_s"] if ar["tok_s"] and r["tok_s"] else None
        start_up = max(0.0, r["ttft_s"] - ar["ttft_s"])  # the method's own set-up (e.g. its index of the prompt)
        r["e2e_speedup"] = (miss["ttft_s"] + ar["decode_s"]) / (miss["ttft_s"] + start_up + r["decode_s"])
        r["e2e_speedup_hit"] = (ar["ttft_s"] + ar["decode_s"]) / (r["ttft_s"] + r["decode_s"])
    identical_first = miss["tokens"] == ar["tokens"][:1]
    print(
        f"  miss TTFT {miss['ttft_s']:.1f}s, hit {ar['ttft_s']:.2f}s; "
        + "  ".join(
            f"{n} {r['speedup'] or 0:.2f}x tau {r['tau']:.2f}{'' if r['identical'] else ' DIFF'}"
            for n, r in runs.items()
        ),
        flush=True,
    )
    output = ar["tokens"]
    for r in (miss, *runs.values()):
        r.pop("tokens")
    return {
        "prompt_tokens": len(task.prompt_ids),
        "kind": task.kind,
        "group": task.group,
        "output_start": decode(output)[:160],
        "output_copied": copied_share(task.prompt_ids, output),
        "miss": miss,
        "first_token_identical": identical_first,
        "methods": runs,
    }


def chunk_rate(chunks: list[dict], lo: float, hi: float) -> float | None:
    """Prefill tokens per second over the chunks that start in [lo, hi)."""
    sel = [c for c in chunks if lo <= c["start"] < hi]
    return sum(c["tokens"] for c in sel) / sum(c["s"] for c in sel) if sel else None


def by_length(rows: dict, tasks: list[HeldOutTask], lengths: list[tuple[str, int]]) -> dict[str, list[dict]]:
    return {label: [rows[t.name] for t in tasks if t.name.endswith(f"@{label}")] for label, _ in lengths}


def summarise(rows: dict, tasks: list[HeldOutTask], lengths: list[tuple[str, int]], tag: str) -> dict:
    figures: dict = {}
    at = by_length(rows, tasks, lengths)
    methods = list(next(iter(rows.values()))["methods"])
    for label, rs in at.items():
        if DEFAULT_METHOD in methods:
            figures[f"speedup_{label}_default"] = median_of([r["methods"][DEFAULT_METHOD]["speedup"] for r in rs])
        for m in methods[1:]:  # every method but plain decoding
            for key in ("speedup", "e2e_speedup", "tau", "draft_state_bytes"):
                figures[f"{key}_{label}_{m}"] = median_of([r["methods"][m][key] for r in rs])
        figures[f"ar_tok_s_{label}"] = median_of([r["methods"]["ar"]["tok_s"] for r in rs])
        figures[f"output_copied_{label}"] = median_of([r.get("output_copied") for r in rs])
        figures[f"ttft_miss_s_{label}"] = median_of([r["miss"]["ttft_s"] for r in rs])
        figures[f"ttft_hit_s_{label}"] = median_of([r["methods"]["ar"]["ttft_s"] for r in rs])
        figures[f"cache_hit_ttft_speedup_{label}"] = median_of(
            [ratio(r["miss"]["ttft_s"], r["methods"]["ar"]["ttft_s"]) for r in rs]
        )
        figures[f"cache_store_s_{label}"] = median_of([r["miss"]["stored_s"] for r in rs])
        figures[f"prefill_tok_s_{label}"] = median_of([r["miss"]["prefill_tok_s"] for r in rs])
        figures[f"peak_rss_mib_{label}"] = max(
            max([r["miss"]["peak_rss_mib"]] + [x["peak_rss_mib"] for x in r["methods"].values()]) for r in rs
        )
        figures[f"kv_bytes_{label}"] = median_of([r["methods"]["ar"]["kv_bytes"] for r in rs])
    figures["kv_slot_bytes"] = next(iter(rows.values()))["methods"]["ar"]["kv_slot_bytes"]
    (lo, lo_n), (hi, _) = lengths[0], lengths[-1]
    if hi != lo:
        figures[f"prefill_tok_s_{hi}_vs_{lo}"] = ratio(figures[f"prefill_tok_s_{hi}"], figures[f"prefill_tok_s_{lo}"])
        figures[f"prefill_chunk_tok_s_{hi}_vs_{lo}"] = median_of(
            [
                ratio(
                    chunk_rate(r["miss"]["chunks"], 0.9 * r["prompt_tokens"], float("inf")),
                    chunk_rate(r["miss"]["chunks"], max(0, lo_n - 1024), lo_n),
                )
                for r in at[hi]
            ]
        )
        if "longspec" in methods:
            figures[f"longspec_{tag}_speedup_{hi}"] = figures[f"speedup_{hi}_longspec"]
            figures[f"longspec_{tag}_tau_{hi}_vs_{lo}"] = ratio(
                figures[f"tau_{hi}_longspec"], figures[f"tau_{lo}_longspec"]
            )
            figures[f"longspec_{tag}_draft_state_bytes_{hi}_vs_{lo}"] = ratio(
                figures[f"draft_state_bytes_{hi}_longspec"], figures[f"draft_state_bytes_{lo}_longspec"]
            )
    figures["identical_all"] = all(
        r["first_token_identical"] and all(x["identical"] for x in r["methods"].values()) for r in rows.values()
    )
    return figures


def panels(rows: dict, tasks: list[HeldOutTask], lengths: list[tuple[str, int]]) -> list[dict]:
    at = by_length(rows, tasks, lengths)
    xs = [median([r["prompt_tokens"] for r in rs]) for rs in at.values()]
    methods = [m for m in next(iter(rows.values()))["methods"] if m != "ar"]

    def per_length(get) -> list[float]:
        return [median_of([get(r) for r in rs]) for rs in at.values()]

    chunk_series = {}
    for label, rs in at.items():
        starts = sorted({c["start"] for r in rs for c in r["miss"]["chunks"]})
        rates = [median_of([chunk_rate(r["miss"]["chunks"], s, s + 1) for r in rs]) for s in starts]
        chunk_series[label] = (starts, rates)
    return [
        {
            "title": "decode speedup over plain decoding vs prompt length",
            "xlabel": "prompt tokens",
            "ylabel": "x (median over prompts)",
            "logx": True,
            "hline": 1.0,
            "series": {m: (xs, per_length(lambda r, m=m: r["methods"][m]["speedup"])) for m in methods},
        },
        {
            "title": "end-to-end speedup (cold request: prefill + start-up + decode)",
            "xlabel": "prompt tokens",
            "ylabel": "x",
            "logx": True,
            "hline": 1.0,
            "series": {m: (xs, per_length(lambda r, m=m: r["methods"][m]["e2e_speedup"])) for m in methods},
        },
        {
            "title": "time to first token: context cache miss vs hit (plain decoding)",
            "xlabel": "prompt tokens",
            "ylabel": "s",
            "logx": True,
            "logy": True,
            "series": {
                "miss": (xs, per_length(lambda r: r["miss"]["ttft_s"])),
                "hit": (xs, per_length(lambda r: r["methods"]["ar"]["ttft_s"])),
            },
        },
        {
            "title": "prefill throughput per chunk (cache miss)",
            "xlabel": "chunk start position",
            "ylabel": "tokens / s",
            "series": chunk_series,
        },
        {
            "title": "tau (tokens per verify step) vs prompt length",
            "xlabel": "prompt tokens",
            "ylabel": "tau",
            "logx": True,
            "series": {m: (xs, per_length(lambda r, m=m: r["methods"][m]["tau"])) for m in methods},
        },
    ]


def serve_cache_config() -> tuple[int, int]:
    """The context cache's block size and memory limit as infra/serve_config_qwen.yaml serves them."""
    import yaml

    doc = yaml.safe_load((ROOT / "infra" / "serve_config_qwen.yaml").read_text())
    verifier = doc["applications"][0]["args"]["verifier"]
    return int(verifier["cache_block_size"]), int(verifier["cache_max_bytes"])


def main(argv: list[str] | None = None) -> Path:
    block_default, bytes_default = serve_cache_config()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=QWEN, help=f"model source (default {QWEN}: `make model-qwen` installs it)")
    ap.add_argument("--lengths", default="4k,8k,16k,32k", help="prompt lengths: 8k (x1024) or token counts")
    ap.add_argument("--kinds", default=",".join(LONG_KINDS), help=f"of {', '.join(LONG_KINDS)}")
    ap.add_argument("--per-kind", type=int, default=1, help="prompts per kind and length")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--methods", default=DEFAULT_METHODS, help="ar first; best-composite = the best that ships")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=block_default, help="context cache block (tokens)")
    ap.add_argument("--cache-max-bytes", type=int, default=bytes_default, help="context cache memory limit")
    ap.add_argument("--name", default="long_context", help="results file name")
    ap.add_argument("--out-dir", type=Path, default=None, help="where results go (default bench/results)")
    ap.add_argument("--fresh", action="store_true", help="do not resume from prompts an earlier run measured")
    ap.add_argument(
        "--dtype", default="float32", help="float32, bfloat16, or float32,bfloat16 (both, interleaved per prompt)"
    )
    ap.add_argument(
        "--smoke", action="store_true", help="a tiny run (SmolLM2, short prompts, 8 tokens) under .cache/bench"
    )
    args = ap.parse_args(argv)
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    if not dtypes or any(d not in DTYPE_SUFFIX for d in dtypes):
        raise SystemExit(f"--dtype takes float32, bfloat16 or both (comma-separated), not {args.dtype!r}")
    dtypes = [d for d in DTYPE_SUFFIX if d in dtypes]  # fp32 first
    if args.smoke:  # options not given on the command line take the smoke values
        given = {a.split("=")[0].lstrip("-").replace("-", "_") for a in (argv or sys.argv[1:]) if a.startswith("--")}
        for k, v in SMOKE.items():
            if k not in given:
                setattr(args, k, v)
        args.name = args.name if "name" in given else "long_context_smoke"
        args.out_dir = args.out_dir or ROOT / ".cache" / "bench"
        args.fresh = True
    if args.per_kind < 1 or args.max_new_tokens < 1:
        raise SystemExit("--per-kind and --max-new-tokens must be at least 1")
    out_dir = args.out_dir or RESULTS_DIR
    torch.set_num_threads(args.threads)

    import redis as redis_client

    from services.local_redis import LocalRedis

    loaded = {d: load_model(args.model, dtype=d) for d in dtypes}
    targets = {d: target for d, (target, _, _) in loaded.items()}
    _, tokenizer, resolved = loaded[dtypes[0]]
    model_id = resolved.model_id
    window = targets[dtypes[0]].args.max_position
    lengths = parse_lengths(args.lengths, window, args.max_new_tokens)
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    tasks = long_tasks(tokenizer, lengths, kinds, args.per_kind)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    builders = {}
    for d in dtypes:
        builders[d], skipped = method_builders(methods, targets[d], window)
    for m, why in skipped.items():
        print(f"{m}: skipped ({why})", flush=True)
    quiet = None if args.smoke else wait_for_quiet(max_load=1.0, timeout_s=300)
    load_before = machine_load()
    contexts = tuple(sorted({256, *(n for _, n in lengths)}))
    quick = {"repeats": 1, "sizes": (1, 2, 4, 8, 16)} if args.smoke else {}
    curves, curve_s = {}, {}
    for d in dtypes:
        t0 = time.perf_counter()
        curves[d] = CostCurve.measure(targets[d], targets[d].new_cache(window, 1), contexts=contexts, **quick)
        curve_s[d] = round(time.perf_counter() - t0, 1)
        print(f"{d} verify-cost curve at {contexts} measured in {curve_s[d]:.0f}s", flush=True)

    redis = LocalRedis()
    try:
        client = redis_client.Redis.from_url(redis.url)
        caches = {
            d: ContextCache(
                redis.url,
                kv_namespace(f"bench-long:{model_id}", d),
                block_size=args.block_size,
                max_bytes=args.cache_max_bytes,
            )
            for d in dtypes
        }
        params = SamplingParams(max_new_tokens=args.max_new_tokens)
        kept_dir = ROOT / ".cache" / "bench" / args.name
        rows: dict[str, dict] = {d: {} for d in dtypes}
        kept = []
        for task in tasks:
            for d in dtypes:  # interleaved per prompt
                same_run = {
                    "cpu": cpu_model(),
                    "code": code_fingerprint(),
                    "model": model_id,
                    "dtype": d,
                    "args": {
                        k: str(v) for k, v in vars(args).items() if k not in ("fresh", "out_dir", "name", "dtype")
                    },
                }
                key = task.name + DTYPE_SUFFIX[d].replace("_", "@")
                done = kept_dir / f"{re.sub(r'[^A-Za-z0-9_.@-]+', '_', key)}.json"
                if (
                    not args.fresh
                    and done.is_file()
                    and (saved := json.loads(done.read_text()))["same_run"] == same_run
                ):
                    rows[d][task.name] = saved["row"]
                    kept.append(key)
                    print(f"{key}: kept from an earlier run ({done})", flush=True)
                    continue
                rows[d][task.name] = run_prompt(
                    targets[d], task, builders[d], params, curves[d], caches[d], client, tokenizer.decode
                )
                if not args.smoke:
                    kept_dir.mkdir(parents=True, exist_ok=True)
                    done.write_text(json.dumps({"same_run": same_run, "row": rows[d][task.name]}))
    finally:
        redis.stop()

    figures = {}
    for d in dtypes:
        part = summarise(rows[d], tasks, lengths, model_tag(model_id))
        part["kv_bytes_per_token"] = kv_bytes_per_token(targets[d].args, targets[d].dtype)
        figures.update({k + DTYPE_SUFFIX[d]: v for k, v in part.items()})
    if len(dtypes) == 2:
        for label, _ in lengths:
            figures[f"ar_tok_s_{label}_bf16_vs_fp32"] = ratio(
                figures[f"ar_tok_s_{label}_bf16"], figures[f"ar_tok_s_{label}"]
            )
        figures["kv_bytes_per_token_bf16_vs_fp32"] = ratio(
            figures["kv_bytes_per_token_bf16"], figures["kv_bytes_per_token"]
        )
        figures["identical_all"] = figures["identical_all"] and figures["identical_all_bf16"]
    figures["skipped"] = skipped
    target, d0 = targets[dtypes[0]], dtypes[0]
    meta = {
        "what": "held-out long prompts at the model's full window: plain decoding vs drafting methods, "
        f"{' and '.join(dtypes)}, T=0",
        "model": model_id,
        "window": window,
        "dtype": " and ".join(dtypes),
        "dtypes": dtypes,
        "threads": args.threads,
        "lengths": dict(lengths),
        "kinds": list(kinds),
        "per_kind": args.per_kind,
        "max_new_tokens": args.max_new_tokens,
        "methods": list(builders[d0]),
        "default_method": DEFAULT_METHOD,
        "tasks": {t.name: {"tokens": len(t.prompt_ids), "sources": t.group} for t in tasks},
        "context_cache": {"block_size": args.block_size, "max_bytes": args.cache_max_bytes},
        "kv_bytes_per_token": kv_bytes_per_token(target.args, target.dtype),
        "linear_backend": target.linear_backend,
        "prefill_row_invariant": target.prefill_row_invariant,  # a cache hit then loads any whole blocks
        "cost_curve": curves[d0].to_dict(),
        "cost_curve_measure_s": curve_s[d0],
        **(
            {
                "linear_backend_bf16": targets["bfloat16"].linear_backend,
                "cost_curve_bf16": curves["bfloat16"].to_dict(),
                "kv_bytes_per_token_bf16": kv_bytes_per_token(targets["bfloat16"].args, torch.bfloat16),
            }
            if "bfloat16" in dtypes and d0 != "bfloat16"
            else {}
        ),
        "kept_from_earlier_run": kept,
        "quiet_before": quiet,
        "load_before": load_before,
        "load_after": machine_load(),
        "smoke": args.smoke,
    }
    raw = {name + ("" if d == "float32" else " [bf16]"): row for d in dtypes for name, row in rows[d].items()}
    path = write_results(args.name, figures, raw, meta, results_dir=out_dir)
    plot = panels(rows[d0], tasks, lengths)
    if len(dtypes) == 2:
        at = {d: by_length(rows[d], tasks, lengths) for d in dtypes}
        xs = [median([r["prompt_tokens"] for r in rs]) for rs in at[d0].values()]
        plain = {
            d: (xs, [median_of([r["methods"]["ar"]["tok_s"] for r in rs]) for rs in at[d].values()]) for d in dtypes
        }
        plot.insert(
            0,
            {"title": "plain decode tok/s, fp32 and bf16", "xlabel": "prompt tokens", "ylabel": "tok/s", "logx": True,
             "series": plain},
        )  # fmt: skip
    plot_panels(
        out_dir / f"{args.name}.png",
        plot,
        title=f"long context on {model_id} ({' and '.join(dtypes)}, T=0, {args.threads} threads; others: {d0})",
    )
    print(path)
    for k, v in figures.items():
        print(f"{k}: {v}")
    return path


if __name__ == "__main__":
    main()
