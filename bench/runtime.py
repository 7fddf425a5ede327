"""The allocator and OpenMP runtime under spyglass's engine: torch's defaults (glibc malloc, GNU OpenMP) against
tcmalloc, jemalloc, Intel OpenMP (libiomp5, as vLLM's CPU guide preloads it) and tcmalloc + libiomp5, each preloaded
(LD_PRELOAD) into its own spyglass worker (bench/peer_worker.py, the process bench/peers.py measures).

The workers load one after another (each times its kernels at load), then every round runs each variant on the same
held-out prompt (`bench/tasks.py`, SmolLM2 fp32, 2 threads) with plain decoding and `suffix`, variants interleaved;
medians over rounds. Greedy outputs are checked equal across variants. Figures (`bench/results/runtime.json` + plot):
`<variant>_ttft_vs_default` (time to first token, < 1 is faster), `<variant>_plain_tok_s_vs_default` and
`<variant>_suffix_tok_s_vs_default` (> 1 is faster), `outputs_identical`.

    python bench/runtime.py [--rounds 3] [--max-new-tokens 128]   (make bench-runtime)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import median, plot_panels, wait_for_quiet, write_results  # noqa: E402
from bench.peers import Peer, find_libiomp5, find_tcmalloc  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
JEMALLOC = ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "/usr/lib64/libjemalloc.so.2", "/usr/lib/libjemalloc.so.2")


def libiomp5() -> Path | None:
    """Intel OpenMP from the project's venv (pip `intel-openmp`) or vLLM's under .cache/peers."""
    for venv in (Path(sys.prefix), ROOT / ".cache" / "peers" / "vllm" / "venv"):
        found = find_libiomp5(venv)
        if found:
            return found
    return None


def shown(path: Path) -> str:
    """A library's path as the results record it: relative to the repository when inside it (its .cache)."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def variants() -> tuple[dict[str, list[Path]], dict[str, str]]:
    """Each runtime variant's preloads, and the ones this machine lacks (with what is missing)."""
    libs = {
        "tcmalloc": find_tcmalloc(),
        "jemalloc": next((Path(p) for p in JEMALLOC if Path(p).exists()), None),
        "iomp5": libiomp5(),
    }
    have, missing = {}, {}
    for name in ("default", "tcmalloc", "jemalloc", "iomp5", "tcmalloc+iomp5"):
        parts = [] if name == "default" else name.split("+")
        absent = [p for p in parts if libs[p] is None]
        if absent:
            missing[name] = "not found: " + ", ".join(absent)
        else:
            have[name] = [libs[p] for p in parts]
    return have, missing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--task", default="code", help="the kind of bench/tasks.py's held-out prompt (its first)")
    ap.add_argument("--name", default="runtime")
    args = ap.parse_args()

    from bench.tasks import heldout_tasks
    from spyglass.models.loader import load_tokenizer, resolve_model

    model = resolve_model(None)
    (task,) = heldout_tasks(load_tokenizer(model.path), kinds=(args.task,), per_kind=1)
    have, missing = variants()
    for name, why in missing.items():
        print(f"{name}: skipped ({why})")
    quiet = wait_for_quiet(timeout_s=300)
    threads = str(args.threads)
    logs = ROOT / ".cache" / "bench-logs" / args.name  # each worker's stderr
    workers: dict[str, Peer] = {}
    try:
        for name, libs in have.items():  # one at a time: each worker times its kernels at load
            env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "LD_PRELOAD": ":".join(map(str, libs))}
            cfg = {"engine": "spyglass", "model": str(model.path), "methods": ["ar", "suffix"], "threads": args.threads}
            workers[name] = Peer(name, Path(sys.executable), {**cfg, "max_context": 8192}, env, logs / f"{name}.log")
            workers[name].wait_ready(600)
            print(f"{name}: loaded in {workers[name].load_s:.1f} s, preloading {[p.name for p in libs]}")
        runs: dict[str, dict[str, list[dict]]] = {n: {"ar": [], "suffix": []} for n in workers}
        for r in range(args.rounds):
            order = list(workers) if r % 2 == 0 else list(reversed(workers))  # no variant always first
            for name in order:
                for method in ("ar", "suffix"):
                    req = {"cmd": "generate", "method": method, "prompt_ids": task.prompt_ids}
                    req |= {"max_new_tokens": args.max_new_tokens, "ignore_eos": True}
                    res = workers[name].request(req, 1200)
                    runs[name][method].append(res)
                    print(f"round {r} {name:15s} {method:6s} ttft {res['ttft_s']:.2f} s  {res['tok_s']:.1f} tok/s")
    finally:
        for w in workers.values():
            w.close()

    def med(name: str, method: str, key: str) -> float:
        return median([x[key] for x in runs[name][method]])

    outputs = {tuple(x["output_ids"]) for n in runs for m in ("ar", "suffix") for x in runs[n][m]}
    figures: dict = {"outputs_identical": len(outputs) == 1, "skipped": missing}
    for name in runs:
        figures[f"{name}_ttft_s"] = med(name, "ar", "ttft_s")
        figures[f"{name}_plain_tok_s"] = med(name, "ar", "tok_s")
        figures[f"{name}_suffix_tok_s"] = med(name, "suffix", "tok_s")
    for name in runs:
        if name != "default":
            figures[f"{name}_ttft_vs_default"] = figures[f"{name}_ttft_s"] / figures["default_ttft_s"]
            for m in ("plain", "suffix"):
                figures[f"{name}_{m}_tok_s_vs_default"] = figures[f"{name}_{m}_tok_s"] / figures[f"default_{m}_tok_s"]
    meta = {
        "task": task.name,
        "prompt_tokens": len(task.prompt_ids),
        "preloads": {n: [shown(p) for p in libs] for n, libs in have.items()},
        "quiet": quiet,
        "args": vars(args),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    path = write_results(args.name, figures, {"runs": runs}, meta)
    names = list(runs)
    xs = list(range(len(names)))
    plot_panels(
        path.with_suffix(".png"),
        [
            {
                "title": "relative to torch's defaults (glibc malloc, GNU OpenMP)",
                "ylabel": "ratio",
                "xticklabels": names,
                "hline": 1.0,
                "series": {
                    "time to first token": (xs, [figures[f"{n}_ttft_s"] / figures["default_ttft_s"] for n in names]),
                    "plain tok/s": (xs, [figures[f"{n}_plain_tok_s"] / figures["default_plain_tok_s"] for n in names]),
                    "suffix tok/s": (
                        xs,
                        [figures[f"{n}_suffix_tok_s"] / figures["default_suffix_tok_s"] for n in names],
                    ),
                },
            }
        ],
        title=f"{task.name} ({len(task.prompt_ids)} tokens), {args.threads} threads",
        ncols=1,
    )
    print({k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()})


if __name__ == "__main__":
    main()
