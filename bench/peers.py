"""spyglass against vLLM and llama.cpp on this machine: the same held-out long-context prompt ids (bench/tasks.py,
2K-7K tokens), greedy, in fp32 and in bf16 (vLLM's default on this CPU), 2 threads each, interleaved per prompt.
Writes bench/results/peers.json (+ .png).

    python bench/peers.py [--per-kind 2] [--kinds code,edit,summary] [--max-new-tokens 256] [--dtypes D] [--out PATH]
    python bench/peers.py --smoke [--out PATH]       (one short prompt, a few tokens; peers not installed are skipped)

Every engine runs in each of --dtypes (default float32,bfloat16) as a process of its own (spyglass's bf16 worker loads
the model's bf16 safetensors, vLLM's `LLM(dtype="bfloat16")` the same file); llama.cpp runs its F32 GGUF in the fp32
lanes only. A lane's label is `engine:method`, with `@bf16` for the bf16 ones; the bf16 figures end in `_bf16`.

Engines and methods (each engine a long-lived process of its own venv's python, bench/peer_worker.py, loaded once):
  spyglass  ar (plain decoding), suffix (its default), ngram, composite-dflash (the best learned method)
  vLLM      plain, ngram, suffix (Arctic Inference's suffix tree, its cross-request cache off); one process each
  llama.cpp plain, pld (llama-cpp-python's LlamaPromptLookupDecoding, logits_all=True), F32 GGUF
vLLM and llama.cpp are installed by `make peers` (bench/peers_setup.sh) under .cache/peers/; one that is missing is
skipped with a message, and its figures are null (named in `skipped`), never reported as passing.

For each prompt every engine's methods run in turn, each request after the CPU is free of other work (bench/common's
IdleGate), and the CPU time of every other engine process is read around it (idle engines must use none). Time to
first token and decode speed ((new tokens - 1) / time after the first token) come from the workers, measured the same
way. Every output is checked against its engine's plain decoding in the same dtype and against spyglass's plain
decoding in the same dtype (identical, or the first differing index). The physical-limit readout, measured before each
prompt's runs: memory read bandwidth (a sum over a 1 GiB tensor, the engines' thread count) and fp32 matmul peak; each
plain decoder's achieved bandwidth, (weight bytes + KV bytes at the context, both in its dtype) / step time, as a share
of it; prefill FLOP/s (model FLOPs / time to first token) against the peak.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    RESULTS_DIR,
    CpuWatch,
    IdleGate,
    environment,
    machine_load,
    median_of,
    plot_panels,
    ratio,
    wait_for_quiet,
    worst,
    write_results,
)
from bench.common import log as bench_log  # noqa: E402

WORKER = ROOT / "bench" / "peer_worker.py"
PEERS_DIR = ROOT / ".cache" / "peers"
SPYGLASS_METHODS = ("ar", "suffix", "ngram", "composite-dflash")
DEFAULT_METHOD = "suffix"  # spyglass's default (`spyglass --method`)
PLAIN = {"spyglass": "ar", "vllm": "plain", "llamacpp": "plain"}
# vLLM's speculative configs. n-gram: its prompt lookup; suffix: its defaults (tree depth 24 = the most tokens a step
# proposes) with the cross-request cache off (single-request comparisons).
VLLM_SPEC = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4},  # vLLM's documented example
    "suffix": {"method": "suffix", "num_speculative_tokens": 24, "suffix_decoding_max_cached_requests": 0},
}
LLAMACPP_METHODS = ("plain", "pld")
DTYPES = ("float32", "bfloat16")
DTYPE_TAG = {"float32": "", "bfloat16": "@bf16"}  # a lane label's dtype suffix

log = partial(bench_log, tag="peers")
med = partial(median_of, all_present=True)  # a figure over the prompts: None where any prompt lacks it


def no_machine_paths(value: Any) -> Any:
    """The results name no path of this machine: absolute paths become repo-relative (or their last part)."""
    from spyglass.training import repo_relative

    if isinstance(value, dict):
        return {k: no_machine_paths(v) for k, v in value.items()}
    if isinstance(value, list):
        return [no_machine_paths(v) for v in value]
    if isinstance(value, str) and value.startswith("/") and Path(value).is_absolute():
        return repo_relative(value)
    return value


# --- worker processes ------------------------------------------------------------------------------------------
class WorkerError(RuntimeError):
    pass


class Peer:
    """A bench/peer_worker.py process (its own session, so that it and its children end together)."""

    def __init__(self, name: str, python: Path, cfg: dict[str, Any], env: dict[str, str], log_path: Path) -> None:
        self.name, self.log_path = name, log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(
            [str(python), str(WORKER), json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env={**os.environ, **env},
            text=True,
            cwd=ROOT,
            start_new_session=True,
        )
        self.info: dict[str, Any] = {}
        self.load_s: float | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self, timeout_s: float) -> dict[str, Any]:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        ready = sel.select(timeout_s)
        sel.close()
        if not ready:
            raise WorkerError(f"{self.name}: no answer within {timeout_s:.0f} s (log: {self.log_path})")
        line = self.proc.stdout.readline()
        if not line:
            raise WorkerError(f"{self.name}: the worker exited (code {self.proc.poll()}); log: {self.log_path}")
        return json.loads(line)

    def wait_ready(self, timeout_s: float) -> None:
        msg = self._read(timeout_s)
        if not msg.get("ready"):
            raise WorkerError(f"{self.name}: failed to load: {msg.get('error')} (log: {self.log_path})")
        self.info, self.load_s = msg.get("info", {}), msg.get("load_s")

    def request(self, req: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        msg = self._read(timeout_s)
        if not msg.get("ok"):
            raise WorkerError(f"{self.name}: {req.get('cmd')} failed: {msg.get('error')} (log: {self.log_path})")
        return msg

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        else:  # the worker is gone; children it left in its session (vLLM's engine core) go too
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        self._log.close()


def tree_cpu_s(roots: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user + system) used so far by each root process and all its descendants, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        pid = int(entry.name)
        parent[pid] = int(fields[1])
        cpu[pid] = (int(fields[11]) + int(fields[12])) / tick
    out = {}
    for name, root in roots.items():
        total = 0.0
        for pid in cpu:
            p = pid
            while p > 1 and p != root:
                p = parent.get(p, 0)
            if p == root:
                total += cpu[pid]
        out[name] = total
    return out


# --- engines -------------------------------------------------------------------------------------------------
@dataclass
class Lane:
    engine: str  # spyglass | vllm | llamacpp
    method: str
    worker: str  # the Peer that serves it
    dtype: str = "float32"

    @property
    def label(self) -> str:
        return f"{self.engine}:{self.method}{DTYPE_TAG[self.dtype]}"

    @property
    def plain_label(self) -> str:
        """Its engine's plain decoding in the same dtype."""
        return f"{self.engine}:{PLAIN[self.engine]}{DTYPE_TAG[self.dtype]}"

    @property
    def spyglass_plain_label(self) -> str:
        return f"spyglass:ar{DTYPE_TAG[self.dtype]}"


@dataclass
class Setup:
    peers: dict[str, Peer] = field(default_factory=dict)
    lanes: list[Lane] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def find_libiomp5(venv: Path) -> Path | None:
    hits = sorted(venv.glob("lib/libiomp5.so")) + sorted(venv.glob("lib/python*/site-packages/**/libiomp5.so"))
    return hits[0] if hits else None


def find_tcmalloc() -> Path | None:
    for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/lib/aarch64-linux-gnu"):
        for name in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"):
            if (Path(d) / name).exists():
                return Path(d) / name
    return None


def worker_name(engine: str, dtype: str) -> str:
    return engine + ("" if dtype == "float32" else "-bf16")


def start_peers(args, model_dirs: dict[str, Path], gguf: Path | None, logs: Path) -> Setup:
    """Start every installed engine's workers, one per dtype (and per method for vLLM); say what is skipped.

    spyglass loads alone first, one dtype after the other: it times its kernels at load (linear and attention
    plans), which a peer compiling next to it would skew. The peers then load concurrently (nothing else is timed
    yet)."""
    s = Setup()
    threads = str(args.threads)
    base = {"threads": args.threads, "max_context": args.max_context}
    env_sg = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    for dtype in args.dtypes:
        name = worker_name("spyglass", dtype)
        s.peers[name] = Peer(
            name,
            Path(sys.executable),
            {
                **base,
                "engine": "spyglass",
                "model": str(model_dirs[dtype]),
                "dtype": dtype,
                "methods": list(args.spyglass_methods),
                "linear_backend": args.spyglass_linear,
            },
            env_sg,
            logs / f"{name}.log",
        )
        s.lanes += [Lane("spyglass", m, name, dtype) for m in args.spyglass_methods]
        s.peers[name].wait_ready(args.load_timeout)
        log(f"{name} ready (load {s.peers[name].load_s:.1f} s)")

    engines = set(args.engines)
    vllm_py = args.peers_dir / "vllm" / "venv" / "bin" / "python"
    if "vllm" not in engines:
        s.skipped["vllm"] = "not selected (--engines)"
    elif not vllm_py.exists():
        s.skipped["vllm"] = f"not installed (no {vllm_py}): run `make peers`"
    else:
        preload = [p for p in (find_tcmalloc(), find_libiomp5(args.peers_dir / "vllm" / "venv")) if p]
        env_v = {
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",  # else it keeps one of two cores for its scheduler
            "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib),
            "OMP_NUM_THREADS": threads,
            "LD_PRELOAD": ":".join(str(p) for p in preload),
            "VLLM_LOGGING_LEVEL": "INFO",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_CACHE_ROOT": str(args.peers_dir / "vllm" / "cache"),  # its compiled graphs stay under .cache/peers
            "DO_NOT_TRACK": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        if not preload or len(preload) < 2:
            log(f"vLLM: preloading only {[str(p) for p in preload]} (tcmalloc and/or libiomp5 not found)")
        for dtype in args.dtypes:
            for m in args.vllm_methods:
                cfg = {
                    **base,
                    "engine": "vllm",
                    "model": str(model_dirs[dtype]),
                    "dtype": dtype,
                    "methods": [m],
                    "speculative_config": VLLM_SPEC[m],
                }
                name = worker_name(f"vllm-{m}", dtype)
                s.peers[name] = Peer(name, vllm_py, cfg, env_v, logs / f"{name}.log")
                s.lanes.append(Lane("vllm", m, name, dtype))

    llama_py = args.peers_dir / "llamacpp" / "venv" / "bin" / "python"
    if "llamacpp" not in engines:
        s.skipped["llamacpp"] = "not selected (--engines)"
    elif "float32" not in args.dtypes:
        s.skipped["llamacpp"] = "runs its F32 GGUF only, and float32 is not in --dtypes"
    elif not llama_py.exists():
        s.skipped["llamacpp"] = f"not installed (no {llama_py}): run `make peers`"
    elif gguf is None or not gguf.exists():
        s.skipped["llamacpp"] = f"no F32 GGUF of the model ({gguf}): run `make peers`"
    else:
        env_l = {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": threads}
        cfg = {**base, "engine": "llamacpp", "model": str(gguf), "methods": list(LLAMACPP_METHODS)}
        s.peers["llamacpp"] = Peer("llamacpp", llama_py, cfg, env_l, logs / "llamacpp.log")
        s.lanes += [Lane("llamacpp", m, "llamacpp") for m in LLAMACPP_METHODS]
    for engine, why in s.skipped.items():
        log(f"SKIPPED {engine}: {why}")
    return s


def wait_all_ready(s: Setup, timeout_s: float) -> None:
    """Wait for every worker; one that fails to load takes its engine out (skipped, with the reason)."""
    for name, peer in list(s.peers.items()):
        if peer.load_s is not None:
            continue  # already waited for (spyglass)
        t0 = time.monotonic()
        try:
            peer.wait_ready(timeout_s)
        except WorkerError as e:
            engine = name.split("-")[0]
            if engine == "spyglass":
                raise
            log(f"SKIPPED {engine}: {e}")
            s.skipped[engine] = f"failed to start: {e}"
            for other in [n for n in s.peers if n.split("-")[0] == engine]:
                s.peers.pop(other).close()
            s.lanes = [lane for lane in s.lanes if lane.engine != engine]
            continue
        log(f"{name} ready (load {peer.load_s:.1f} s, waited {time.monotonic() - t0:.1f} s)")


# --- the model's sizes, for the physical-limit readout -----------------------------------------------------------
def model_facts(model_dir: Path) -> dict[str, Any]:
    """Parameter count (from the safetensors headers), and the shapes the KV bytes and FLOPs depend on."""
    cfg = json.loads((model_dir / "config.json").read_text())
    params = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, t in header.items():
            if name != "__metadata__":
                count = 1
                for d in t["shape"]:
                    count *= d
                params += count
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return {
        "params": params,
        "weight_bytes_f32": params * 4,  # tied embeddings: one matrix, read whole by the LM head each step
        "n_layers": cfg["num_hidden_layers"],
        "n_heads": heads,
        "n_kv_heads": cfg.get("num_key_value_heads", heads),
        "head_dim": head_dim,
        "hidden": cfg["hidden_size"],
        "vocab": cfg["vocab_size"],
    }


def kv_bytes(facts: dict[str, Any], context: float, elem_bytes: int) -> float:
    return facts["n_layers"] * 2 * facts["n_kv_heads"] * facts["head_dim"] * context * elem_bytes


def prefill_flops(facts: dict[str, Any], length: int) -> float:
    """Matmul FLOPs of a prefill of `length` tokens: the layers' weights for every token, causal attention (QK^T and
    AV over half the square), the LM head for the last token only."""
    embed = facts["vocab"] * facts["hidden"]
    dense = 2 * (facts["params"] - embed) * length
    attn = 2 * facts["n_layers"] * facts["n_heads"] * facts["head_dim"] * length * length
    return dense + attn + 2 * embed


KV_ELEM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}  # bytes per weight or K/V element


def kv_elem_bytes(info: dict[str, Any]) -> int:
    kv = str(info.get("kv_dtype", "float32")).replace("torch.", "")
    if kv == "auto":  # vLLM's "auto" is the model's dtype
        kv = str(info.get("dtype", "float32"))
    return KV_ELEM_BYTES.get(kv, 4)


# --- comparisons and figures ------------------------------------------------------------------------------------
def first_difference(a: list[int], b: list[int]) -> int | None:
    """None when equal, else the first index where they differ (the shorter one's length when one is a prefix)."""
    if a == b:
        return None
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def make_figures(rows: dict[str, dict], setup: Setup) -> dict[str, Any]:
    lanes = {lane.label for lane in setup.lanes}
    names = list(rows)

    def per_prompt(num: str, den: str, key: str) -> list[float | None] | None:
        if num not in lanes or den not in lanes:
            return None
        return [ratio(rows[n]["runs"][num][key], rows[n]["runs"][den][key]) for n in names]

    figures: dict[str, Any] = {}
    specs = {
        "plain_vs_vllm": ("spyglass:ar", "vllm:plain", "tok_s", True),
        "ttft_vs_vllm": ("spyglass:ar", "vllm:plain", "ttft_s", False),
        "default_vs_vllm_suffix": (f"spyglass:{DEFAULT_METHOD}", "vllm:suffix", "tok_s", True),
        "ngram_vs_vllm_ngram": ("spyglass:ngram", "vllm:ngram", "tok_s", True),
        "plain_vs_llamacpp_f32": ("spyglass:ar", "llamacpp:plain", "tok_s", True),
        "ttft_vs_llamacpp_f32": ("spyglass:ar", "llamacpp:plain", "ttft_s", False),
        "default_vs_llamacpp_pld": (f"spyglass:{DEFAULT_METHOD}", "llamacpp:pld", "tok_s", True),
    }
    bf16 = DTYPE_TAG["bfloat16"]
    for fig in ("plain_vs_vllm", "ttft_vs_vllm", "default_vs_vllm_suffix", "ngram_vs_vllm_ngram"):
        num, den, key, higher_is_better = specs[fig]
        specs[f"{fig}_bf16"] = (num + bf16, den + bf16, key, higher_is_better)
    specs["bf16_vs_fp32_plain"] = ("spyglass:ar" + bf16, "spyglass:ar", "tok_s", True)  # spyglass's own
    specs["bf16_vs_fp32_default"] = (f"spyglass:{DEFAULT_METHOD}{bf16}", f"spyglass:{DEFAULT_METHOD}", "tok_s", True)
    for fig, (num, den, key, higher_is_better) in specs.items():
        vals = per_prompt(num, den, key)
        figures[fig] = worst(vals, lowest=higher_is_better) if vals else None  # worst prompt
        figures[f"{fig}_median"] = med(vals) if vals else None
        figures[f"{fig}_per_prompt"] = vals
    for dtype in DTYPES:
        sg_default = f"spyglass:{DEFAULT_METHOD}{DTYPE_TAG[dtype]}"
        figures["default_identical_to_plain" + ("" if dtype == "float32" else "_bf16")] = (
            all(rows[n]["runs"][sg_default]["identical_to_own_plain"] for n in names) if sg_default in lanes else None
        )
    # bf16: every spyglass method's greedy output equals spyglass's plain bf16 decoding on every prompt; beside it,
    # on how many prompts each of vLLM's bf16 methods kept vLLM's plain bf16 output
    sg_bf16 = [lane.label for lane in setup.lanes if lane.engine == "spyglass" and lane.dtype == "bfloat16"]
    figures["bf16_identical_all"] = (
        all(rows[n]["runs"][lab]["identical_to_own_plain"] for n in names for lab in sg_bf16) if sg_bf16 else None
    )
    figures["prompts"] = len(names)
    figures["vllm_bf16_identical_prompts"] = {
        lane.label: sum(rows[n]["runs"][lane.label]["identical_to_own_plain"] for n in names)
        for lane in setup.lanes
        if lane.engine == "vllm" and lane.dtype == "bfloat16" and lane.method != PLAIN["vllm"]
    } or None
    for lane in setup.lanes:
        tag = lane.label.replace(":", "_").replace("-", "_").replace("@", "_")
        figures[f"tok_s_{tag}_median"] = med([rows[n]["runs"][lane.label]["tok_s"] for n in names])
        figures[f"ttft_s_{tag}_median"] = med([rows[n]["runs"][lane.label]["ttft_s"] for n in names])
    figures["identical_to_own_plain"] = {
        lane.label: all(rows[n]["runs"][lane.label]["identical_to_own_plain"] for n in names) for lane in setup.lanes
    }
    figures["identical_to_spyglass_plain"] = {
        lane.label: all(rows[n]["runs"][lane.label]["identical_to_spyglass_plain"] for n in names)
        for lane in setup.lanes
    }
    # The physical-limit readout at the prompt nearest 2K tokens of context.
    near = min(names, key=lambda n: abs(rows[n]["prompt_tokens"] - 2048))
    figures["bandwidth_context_tokens"] = rows[near]["prompt_tokens"]
    probe = rows[near]["probe"]  # the probe taken just before that prompt's runs
    figures["memory_read_bandwidth_gbs"] = probe["read_bandwidth_gbs"]
    figures["matmul_peak_gflops"] = probe["matmul_peak_gflops"]
    for engine, plain in PLAIN.items():
        for dtype in DTYPES if engine != "llamacpp" else ("float32",):  # llama.cpp: its F32 GGUF only
            lane = f"{engine}:{plain}{DTYPE_TAG[dtype]}"
            run = rows[near]["runs"].get(lane)
            suffix = ("" if engine == "spyglass" else f"_{engine}") + ("" if dtype == "float32" else "_bf16")
            figures[f"decode_bandwidth_fraction{suffix}"] = run.get("bandwidth_fraction") if run else None
            figures[f"prefill_peak_fraction{suffix}"] = (
                med([rows[n]["runs"][lane].get("prefill_peak_fraction") for n in names]) if run else None
            )
    figures["skipped"] = dict(setup.skipped)
    return figures


def physical(
    run: dict, prompt_tokens: int, facts: dict, info: dict, probe: dict | None, plain: bool, weight_bytes: int
) -> None:
    """Adds to `run` its achieved decode bandwidth (plain decoders: one token per step; `weight_bytes` per weight, the
    K/V's per its engine's info) and its prefill FLOP/s."""
    n = run["new_tokens"]
    if probe and plain and n > 1 and run["decode_s"] > 0:
        step_s = run["decode_s"] / (n - 1)
        context = prompt_tokens + n / 2  # the mean context over the decode
        nbytes = facts["params"] * weight_bytes + kv_bytes(facts, context, kv_elem_bytes(info))
        run["step_bytes"] = nbytes
        run["bandwidth_gbs"] = nbytes / step_s / 1e9
        run["bandwidth_fraction"] = run["bandwidth_gbs"] / probe["read_bandwidth_gbs"]
    if probe and run.get("ttft_s"):
        flops = prefill_flops(facts, prompt_tokens)
        run["prefill_gflops"] = flops / run["ttft_s"] / 1e9
        run["prefill_peak_fraction"] = run["prefill_gflops"] / probe["matmul_peak_gflops"]


def panels(rows: dict[str, dict], setup: Setup, figures: dict) -> list[dict]:
    names = list(rows)
    xs = list(range(len(names)))
    ticks = [f"{n.split(':', 1)[0]}:{n.split(':', 1)[1].rsplit('/', 1)[-1][:14]}" for n in names]

    def series(key: str, labels: list[str]) -> dict:
        nan = float("nan")
        return {
            lab: (
                xs,
                [rows[n]["runs"][lab].get(key) if rows[n]["runs"][lab].get(key) is not None else nan for n in names],
            )
            for lab in labels
        }

    plain = [lane.label for lane in setup.lanes if lane.method in ("ar", "plain")]
    spec = [lane.label for lane in setup.lanes]
    out = [
        {"title": "plain decode tok/s", "ylabel": "tok/s", "series": series("tok_s", plain), "xticklabels": ticks},
        {
            "title": "decode tok/s, every method",
            "ylabel": "tok/s",
            "series": series("tok_s", spec),
            "xticklabels": ticks,
        },
        {"title": "time to first token", "ylabel": "s", "series": series("ttft_s", plain), "xticklabels": ticks},
    ]
    ratios = {
        k: (xs, [v if v is not None else float("nan") for v in figures[f"{k}_per_prompt"]])
        for k in (
            "plain_vs_vllm",
            "ttft_vs_vllm",
            "default_vs_vllm_suffix",
            "plain_vs_vllm_bf16",
            "ttft_vs_vllm_bf16",
            "default_vs_vllm_suffix_bf16",
            "bf16_vs_fp32_plain",
            "plain_vs_llamacpp_f32",
            "default_vs_llamacpp_pld",
        )
        if figures.get(f"{k}_per_prompt")
    }
    if ratios:
        out.append(
            {
                "title": "spyglass / peer, per prompt",
                "ylabel": "ratio",
                "hline": 1.0,
                "series": ratios,
                "xticklabels": ticks,
            }
        )
    return out


# --- the run ---------------------------------------------------------------------------------------------------
def smoke_task(tok):
    """One short prompt: the first held-out code prompt's opening tokens."""
    from bench.tasks import CODE_FILES, HeldOutTask, code_completion

    task = code_completion(tok, CODE_FILES[0])
    return HeldOutTask(task.name + "[:160]", task.kind, task.prompt_ids[:160], task.group)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-kind", type=int, default=2, help="held-out prompts of each kind (bench/tasks.py)")
    ap.add_argument("--kinds", default="code,edit,summary", help="comma list of code, edit, summary")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default 256 (--smoke: 8)")
    ap.add_argument("--ignore-eos", action="store_true", help="generate max-new-tokens tokens even past an EOS")
    ap.add_argument("--repeats", type=int, default=1, help="runs of every method per prompt (the median kept)")
    ap.add_argument(
        "--retries",
        type=int,
        default=None,
        help="reruns of a request that other processes slowed (default 2; --smoke: 0)",
    )
    ap.add_argument(
        "--max-outside-cores",
        type=float,
        default=0.35,
        help="CPU that processes outside the benchmark may use while a request runs before it is rerun",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-context", type=int, default=8192)
    ap.add_argument("--engines", default="spyglass,vllm,llamacpp", help="spyglass always runs; vllm, llamacpp")
    ap.add_argument("--dtypes", default=",".join(DTYPES), help="every engine runs in each: float32, bfloat16")
    ap.add_argument("--spyglass-methods", default=",".join(SPYGLASS_METHODS))
    ap.add_argument(
        "--spyglass-linear",
        default=None,
        help="spyglass's linear kernel plan: auto (measured at load, the default) or a backend string; "
        "--smoke: prefill:lanes (auto's usual outcome, lossless, nothing measured)",
    )
    ap.add_argument("--vllm-methods", default=",".join(VLLM_SPEC))
    ap.add_argument("--vllm-kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE per vLLM process")
    ap.add_argument("--peers-dir", type=Path, default=PEERS_DIR, help="where `make peers` installed the engines")
    ap.add_argument("--load-timeout", type=float, default=900.0, help="seconds for every worker to load")
    ap.add_argument("--request-timeout", type=float, default=1800.0)
    ap.add_argument("--smoke", action="store_true", help="one short prompt, a few tokens (checks the plumbing)")
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results JSON (default bench/results/peers.json; with --smoke .cache/peers/peers_smoke.json)",
    )
    args = ap.parse_args(argv)
    if args.max_new_tokens is None:
        args.max_new_tokens = 8 if args.smoke else 256
    if args.retries is None:
        args.retries = 0 if args.smoke else 2
    if args.retries < 0:
        ap.error("--retries must be >= 0")
    if args.spyglass_linear is None:
        args.spyglass_linear = "prefill:lanes" if args.smoke else "auto"
    if args.smoke:
        args.max_context = min(args.max_context, 1024)
    if args.out is None:
        args.out = args.peers_dir / "peers_smoke.json" if args.smoke else RESULTS_DIR / "peers.json"
    if args.out.suffix != ".json":
        ap.error(f"--out must name a .json file, got {args.out}")
    kinds = [k for k in args.kinds.split(",") if k]
    bad = [k for k in kinds if k not in ("code", "edit", "summary")]
    if bad or not kinds:
        ap.error(f"--kinds takes code, edit, summary; got {args.kinds!r}")
    args.kinds = tuple(kinds)
    args.engines = [e for e in args.engines.split(",") if e]
    if bad := [e for e in args.engines if e not in PLAIN]:
        ap.error(f"--engines takes spyglass, vllm, llamacpp; got {bad}")
    dtypes = [d for d in args.dtypes.split(",") if d]
    if not dtypes or (bad := [d for d in dtypes if d not in DTYPES]):
        ap.error(f"--dtypes takes {', '.join(DTYPES)}; got {args.dtypes!r}")
    args.dtypes = [d for d in DTYPES if d in dtypes]  # fp32 first
    args.spyglass_methods = [m for m in args.spyglass_methods.split(",") if m]
    from spyglass.drafters import METHODS

    if bad := [m for m in args.spyglass_methods if m not in METHODS]:
        ap.error(f"--spyglass-methods: unknown {bad} (spyglass's methods: {', '.join(METHODS)})")
    if "ar" not in args.spyglass_methods:
        args.spyglass_methods.insert(0, "ar")  # every comparison needs spyglass's plain decoding
    args.vllm_methods = [m for m in args.vllm_methods.split(",") if m]
    if bad := [m for m in args.vllm_methods if m not in VLLM_SPEC]:
        ap.error(f"--vllm-methods takes {', '.join(VLLM_SPEC)}; got {bad}")
    if "plain" not in args.vllm_methods:
        args.vllm_methods.insert(0, "plain")
    for name in ("per_kind", "max_new_tokens", "repeats", "threads", "max_context"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    return args


def settle(setup: Setup, max_cores: float = 0.05, timeout_s: float = 20.0) -> float:
    """Wait until no engine process uses the CPU (vLLM's workers poll for a second after each request); returns
    the seconds waited."""
    roots = {name: p.pid for name, p in setup.peers.items()}
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        a, ta = tree_cpu_s(roots), time.monotonic()
        time.sleep(0.5)
        b, tb = tree_cpu_s(roots), time.monotonic()
        if all((b[n] - a[n]) / (tb - ta) < max_cores for n in roots):
            break
    return round(time.monotonic() - t0, 2)


def run_lane(peer: Peer, lane: Lane, task, args, setup: Setup, gate: IdleGate) -> dict[str, Any]:
    """One request once the engines are idle and the CPU is free; the CPU time of every other engine around it."""
    settled_s = settle(setup)
    start = gate()
    roots = {name: p.pid for name, p in setup.peers.items()}
    before = tree_cpu_s(roots)
    t0 = time.monotonic()
    with CpuWatch() as watch:
        res = peer.request(
            {
                "cmd": "generate",
                "method": lane.method,
                "prompt_ids": task.prompt_ids,
                "max_new_tokens": args.max_new_tokens,
                "ignore_eos": args.ignore_eos,
            },
            args.request_timeout,
        )
    wall = time.monotonic() - t0
    after = tree_cpu_s(roots)
    used = {name: after[name] - before[name] for name in roots}
    idle = {name: round(s / wall, 3) for name, s in used.items() if name != lane.worker}
    res.pop("ok", None)
    res["cpu"] = {
        "engine_cores": round(used[lane.worker] / wall, 3),
        "idle_engines_cores": idle,  # each other engine process tree, mean cores while this one ran
        "idle_engines_quiet": all(v < 0.05 for v in idle.values()),
        "settle_s": settled_s,
        "other_cores_before": start["other_cores"],
        "outside_cores": None
        if watch.other_cores is None
        else round(max(0.0, watch.other_cores - sum(used.values()) / wall), 3),
    }
    return res


def run_clean_lane(peer: Peer, lane: Lane, task, args, setup: Setup, gate: IdleGate) -> dict[str, Any]:
    """`run_lane`, again (up to --retries times) when processes outside the benchmark used the CPU while it ran."""
    for attempt in range(1, args.retries + 2):
        res = run_lane(peer, lane, task, args, setup, gate)
        outside = res["cpu"]["outside_cores"]
        res["cpu"]["attempts"] = attempt
        res["cpu"]["clean"] = outside is not None and outside < args.max_outside_cores
        if res["cpu"]["clean"] or attempt > args.retries:
            return res
        gate.retried += 1
        log(f"{lane.label}: other processes used {outside:.2f} cores while it ran: measuring again")
    raise AssertionError("unreachable")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from spyglass.models.loader import load_tokenizer, resolve_model

    quiet = wait_for_quiet(max_load=1.0, timeout_s=0 if args.smoke else 180, log=log)
    model_dirs = {d: Path(resolve_model("default", dtype=d).path) for d in DTYPES}
    model_dir = model_dirs["float32"]
    tok = load_tokenizer(model_dir)
    if args.smoke:
        tasks = [smoke_task(tok)]
    else:
        from bench.tasks import heldout_tasks

        tasks = heldout_tasks(tok, kinds=args.kinds, per_kind=args.per_kind)
        if not tasks:
            sys.exit(f"no held-out prompts of kinds {args.kinds} (bench/tasks.py)")
    for t in tasks:
        if len(t.prompt_ids) + args.max_new_tokens + 32 > args.max_context:
            sys.exit(f"{t.name} has {len(t.prompt_ids)} tokens: over --max-context {args.max_context} with the output")
    gguf = args.peers_dir / "gguf" / f"{model_dir.parent.name}-f32.gguf"  # bench/peers_setup.sh's name for it
    logs = args.peers_dir / "logs" / args.out.stem
    log(
        f"{len(tasks)} prompt(s) {[len(t.prompt_ids) for t in tasks]} tokens, {args.max_new_tokens} new tokens; "
        f"worker logs in {logs}"
    )
    facts = model_facts(model_dir)
    setup = start_peers(args, model_dirs, gguf, logs)
    try:
        wait_all_ready(setup, args.load_timeout)
        # Warm-up: every method once on a short prompt (one-off allocations, compiled shapes), not measured; the
        # smoke run measures nothing that it would change.
        warm_ids = tasks[0].prompt_ids[:256]
        for lane in [] if args.smoke else setup.lanes:
            setup.peers[lane.worker].request(
                {"cmd": "generate", "method": lane.method, "prompt_ids": warm_ids, "max_new_tokens": 4},
                args.request_timeout,
            )
        log("warm-up done")
        # Idle engines must not use the CPU (busy-waiting OpenMP threads would slow whoever runs).
        settle(setup)
        roots = {name: p.pid for name, p in setup.peers.items()}
        before, t0 = tree_cpu_s(roots), time.monotonic()
        time.sleep(1.0 if args.smoke else 3.0)
        after, wall = tree_cpu_s(roots), time.monotonic() - t0
        idle_check = {name: round((after[name] - before[name]) / wall, 3) for name in roots}
        log(f"idle engines' CPU (cores): {idle_check}")
        gate = IdleGate(max_cores=0.3, per_wait_s=30.0 if not args.smoke else 0.0, budget_s=600.0, log=log)
        gate()

        def probe_machine() -> dict:
            """The machine's read bandwidth and matmul peak now: a VM's memory bandwidth was seen to move between
            30 and 53 GB/s within an hour, so each prompt's runs are measured against a probe taken just before."""
            prober = setup.peers[worker_name("spyglass", args.dtypes[0])]
            probe = prober.request({"cmd": "probe", "bytes": (256 if args.smoke else 1024) << 20}, args.request_timeout)
            probe.pop("ok", None)
            log(
                f"memory read bandwidth {probe['read_bandwidth_gbs']:.1f} GB/s, fp32 matmul peak "
                f"{probe['matmul_peak_gflops']:.0f} GFLOP/s ({probe['threads']} threads)"
            )
            return probe

        load_before = machine_load()
        rows: dict[str, dict] = {}
        for task in tasks:
            probe = probe_machine()
            runs: dict[str, list[dict]] = {}
            for _ in range(args.repeats):
                for lane in setup.lanes:
                    runs.setdefault(lane.label, []).append(
                        run_clean_lane(setup.peers[lane.worker], lane, task, args, setup, gate)
                    )
            row: dict[str, dict] = {}
            for label, rs in runs.items():
                rs = sorted(rs, key=lambda r: r["tok_s"] or 0.0)
                pick = rs[len(rs) // 2]
                row[label] = {**pick, "tok_s_runs": [r["tok_s"] for r in rs], "ttft_s_runs": [r["ttft_s"] for r in rs]}
            for lane in setup.lanes:  # each against plain decoding in its own dtype
                r = row[lane.label]
                own = row[lane.plain_label]["output_ids"]
                sg_plain = row[lane.spyglass_plain_label]["output_ids"]
                every_run_same = all(x["output_ids"] == r["output_ids"] for x in runs[lane.label])
                r["first_diff_vs_own_plain"] = first_difference(r["output_ids"], own)
                r["identical_to_own_plain"] = r["first_diff_vs_own_plain"] is None and every_run_same
                r["first_diff_vs_spyglass_plain"] = first_difference(r["output_ids"], sg_plain)
                r["identical_to_spyglass_plain"] = r["first_diff_vs_spyglass_plain"] is None and every_run_same
                physical(
                    r,
                    len(task.prompt_ids),
                    facts,
                    setup.peers[lane.worker].info,
                    probe,
                    plain=lane.method == PLAIN[lane.engine],
                    weight_bytes=4 if lane.engine == "llamacpp" else KV_ELEM_BYTES[lane.dtype],  # its F32 GGUF
                )
            rows[task.name] = {"kind": task.kind, "prompt_tokens": len(task.prompt_ids), "probe": probe, "runs": row}
            log(f"{task.name} ({len(task.prompt_ids)} tok):")
            for label, r in row.items():
                tok_s = f"{r['tok_s']:.1f}" if r["tok_s"] is not None else "-"
                same = "same" if r["identical_to_own_plain"] else f"DIFF@{r['first_diff_vs_own_plain']}"
                vs_sg = "same" if r["identical_to_spyglass_plain"] else f"DIFF@{r['first_diff_vs_spyglass_plain']}"
                bw = f" bw {r['bandwidth_fraction']:.2f}" if "bandwidth_fraction" in r else ""
                log(
                    f"  {label:26s} {tok_s:>7s} tok/s  ttft {r['ttft_s']:.2f} s  vs own plain {same}, "
                    f"vs spyglass {vs_sg}{bw}  idle engines quiet: {r['cpu']['idle_engines_quiet']}"
                )
        figures = make_figures(rows, setup)
        meta = {
            "what": "spyglass vs vLLM vs llama.cpp, the same held-out prompt ids, greedy, "
            f"{' and '.join(args.dtypes)}, batch 1, {args.threads} threads each, interleaved per prompt",
            "dtypes": args.dtypes,
            "smoke": args.smoke,
            "tasks": {t.name: len(t.prompt_ids) for t in tasks},
            "max_new_tokens": args.max_new_tokens,
            "ignore_eos": args.ignore_eos,
            "repeats": args.repeats,
            "threads": args.threads,
            "max_context": args.max_context,
            "spyglass_linear": args.spyglass_linear,
            "lanes": [lane.label for lane in setup.lanes],
            "skipped": setup.skipped,
            "engines": {name: {"load_s": p.load_s, "info": p.info} for name, p in setup.peers.items()},
            "vllm_speculative_configs": {m: VLLM_SPEC[m] for m in args.vllm_methods},
            "model": {
                "path": str(model_dir.relative_to(ROOT)) if model_dir.is_relative_to(ROOT) else str(model_dir),
                "gguf": gguf.name if "llamacpp" not in setup.skipped else None,
                **facts,
            },
            "probes": {name: row["probe"] for name, row in rows.items()},
            "idle_check_cores": idle_check,
            "runs_contended": sum(
                not r["cpu"]["clean"] for row in rows.values() for r in row["runs"].values()
            ),  # kept after --retries reruns: other processes used the CPU while they ran
            "idle_engines_quiet_all": all(
                r["cpu"]["idle_engines_quiet"] for row in rows.values() for r in row["runs"].values()
            ),
            "quiet_before": quiet,
            "load_before": load_before,
            "load_after": machine_load(),
            "idle_gate": gate.summary(),
            "cpu": environment().get("cpu"),
        }
        for row in rows.values():  # outputs are compared above; the file keeps their lengths
            for r in row["runs"].values():
                r["output_len"] = len(r.pop("output_ids"))
        meta = no_machine_paths(meta)
        out = write_results(args.out.stem, figures, {"per_prompt": rows}, meta, results_dir=args.out.parent)
        plot_panels(
            args.out.with_suffix(".png"),
            panels(rows, setup, figures),
            title="spyglass vs vLLM vs llama.cpp, held-out long-context prompts "
            f"(SmolLM2 {' and '.join(args.dtypes)} (@bf16), greedy)",
        )
    finally:
        for peer in setup.peers.values():
            peer.close()
    log(f"wrote {out}")
    for k, v in figures.items():
        if not k.endswith("_per_prompt"):
            print(f"{k}: {v}")


if __name__ == "__main__":
    main()
