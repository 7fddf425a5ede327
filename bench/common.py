"""The benchmarks' shared harness: machine load and readout, medians of interleaved repeats, results JSON and
PNG plots, loading the model, and running methods side by side on the same prompts.

The machines are small and shared (2 cores), so every result records the load before and after the run
and the environment, speed claims are ratios measured side by side in one run, and timings are medians.
Results go to ``bench/results/<name>.json``: ``{"figures": {...}, "raw": {...}, "meta": {...}}`` where
``figures`` holds the headline numbers a report quotes and ``raw`` every measurement behind them.
"""

from __future__ import annotations

import io
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.tasks import HeldOutTask
from spyglass.context_cache import ContextCache
from spyglass.controller import ControllerConfig
from spyglass.cost import measured_curves
from spyglass.engine import EngineConfig, SpecEngine
from spyglass.models.llama import load_transformer
from spyglass.models.loader import load_tokenizer, resolve_model
from spyglass.sampling import SamplingParams

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def now() -> str:
    """The local time to the second, as results record it (ISO 8601)."""
    return time.strftime("%Y-%m-%dT%H:%M:%S")


def machine_load() -> dict[str, Any]:
    """Load averages and the number of usable cores: a load near or above nproc means timings are shared."""
    one, five, fifteen = os.getloadavg()
    return {
        "loadavg_1m": round(one, 2),
        "loadavg_5m": round(five, 2),
        "loadavg_15m": round(fifteen, 2),
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "time": now(),
    }


def wait_for_quiet(
    max_load: float = 0.7, timeout_s: float = 300.0, poll_s: float = 15.0, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Wait (up to `timeout_s`) until the 1-minute load is below `max_load`; returns what was seen.

    Never fails: a busy machine still gets measured, but the result says it was busy.
    """
    t0 = time.monotonic()
    seen = [machine_load()["loadavg_1m"]]
    while seen[-1] >= max_load and time.monotonic() - t0 < timeout_s:
        log(f"load {seen[-1]:.2f} >= {max_load}: waiting {poll_s:.0f} s")
        time.sleep(poll_s)
        seen.append(machine_load()["loadavg_1m"])
    return {
        "max_load": max_load,
        "quiet": seen[-1] < max_load,
        "waited_s": round(time.monotonic() - t0, 1),
        "loads_seen": seen,
        "load": machine_load(),
    }


def _busy_jiffies() -> int | None:
    """Busy CPU time of the whole machine (all processes) in clock ticks, from /proc/stat."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return user + nice + system + irq + softirq + steal


def other_cpu_usage(interval_s: float = 1.0) -> float | None:
    """Cores kept busy by other processes, sampled while this process sleeps for `interval_s`.

    Unlike the load average (a 1-minute mean that includes this benchmark's own threads), this tells
    whether someone else is using the CPU right now, so it can gate each measurement block.
    """
    a = _busy_jiffies()
    time.sleep(interval_s)
    b = _busy_jiffies()
    if a is None or b is None:
        return None
    return round((b - a) / os.sysconf("SC_CLK_TCK") / interval_s, 2)


def wait_for_idle_cpu(
    max_cores: float = 0.3, timeout_s: float = 60.0, log: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Before a measurement block: wait (up to `timeout_s`) until other processes use < `max_cores`."""
    t0 = time.monotonic()
    usage = other_cpu_usage()
    while usage is not None and usage >= max_cores and time.monotonic() - t0 < timeout_s:
        if log:
            log(f"other processes use {usage:.2f} cores: waiting")
        time.sleep(4.0)
        usage = other_cpu_usage()
    return {
        "other_cores": usage,
        "waited_s": round(time.monotonic() - t0, 1),
        "idle": usage is not None and usage < max_cores,
    }


class IdleGate:
    """Call before each measurement block: waits for the CPU to be free of other work, within a total
    waiting budget so a benchmark on a busy machine still finishes; keeps what it saw for the results."""

    def __init__(
        self,
        max_cores: float = 0.3,
        per_wait_s: float = 60.0,
        budget_s: float = 300.0,
        log: Callable[[str], None] | None = None,
        retry_for_s: float = float("inf"),
    ) -> None:
        self.max_cores, self.per_wait_s, self.budget_s, self.log = max_cores, per_wait_s, budget_s, log
        self.retry_until = time.monotonic() + retry_for_s  # after this, blocks hit by other work are kept
        self.seen: list[dict[str, Any]] = []
        self.retried = 0

    def __call__(self) -> dict[str, Any]:
        left = self.budget_s - sum(s["waited_s"] for s in self.seen)
        state = wait_for_idle_cpu(self.max_cores, max(0.0, min(self.per_wait_s, left)), self.log)
        self.seen.append(state)
        return state

    def summary(self) -> dict[str, Any]:
        usage = [s["other_cores"] for s in self.seen if s["other_cores"] is not None]
        return {
            "blocks": len(self.seen),
            "blocks_started_busy": sum(not s["idle"] for s in self.seen),
            "max_other_cores_at_block_start": max(usage, default=None),
            "total_wait_s": round(sum(s["waited_s"] for s in self.seen), 1),
            "threshold_cores": self.max_cores,
            "blocks_rerun": self.retried,
        }


class CpuWatch:
    """Context manager: how many cores other processes kept busy while the block ran (machine busy time
    from /proc/stat minus this process's own CPU time, over wall time). None where /proc is missing."""

    other_cores: float | None = None

    def __enter__(self) -> CpuWatch:
        self._busy, self._self, self._t = _busy_jiffies(), _self_cpu_s(), time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        busy, wall = _busy_jiffies(), time.monotonic() - self._t
        if busy is None or self._busy is None or wall <= 0:
            return
        machine = (busy - self._busy) / os.sysconf("SC_CLK_TCK")
        self.other_cores = round(max(0.0, machine - (_self_cpu_s() - self._self)) / wall, 2)


def _self_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def run_clean(
    block: Callable[[], Any], gate: IdleGate, max_other_cores: float = 0.35, retries: int = 2
) -> tuple[Any, dict[str, Any]]:
    """Run a measurement block after `gate()`, and again (up to `retries` times) if other processes used
    more than `max_other_cores` while it ran; returns the last result and what the machine did."""
    attempts = 0
    while True:
        attempts += 1
        start = gate()
        with CpuWatch() as watch:
            result = block()
        clean = watch.other_cores is None or watch.other_cores < max_other_cores
        if clean or attempts > retries or time.monotonic() > gate.retry_until:
            break
        gate.retried += 1
    return result, {
        "other_cores_before": start["other_cores"],
        "other_cores_during": watch.other_cores,
        "attempts": attempts,
        "clean": watch.other_cores is not None and watch.other_cores < max_other_cores,
    }


def vm_status() -> dict[str, float]:
    """This process's resident memory now (VmRSS) and at its peak (VmHWM), MiB, from /proc/self/status."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = round(int(value.split()[0]) / 1024, 1)  # kB
    return {"rss_mib": fields["VmRSS"], "hwm_mib": fields["VmHWM"]}


def reset_peak_rss() -> bool:
    """Reset this process's peak resident memory (VmHWM) to its current RSS (Linux: 5 > /proc/self/clear_refs), so
    the next `vm_status()` reads the peak of what ran in between; False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def code_fingerprint() -> str:
    """A hash of every file of the package (shipped drafts included) and of bench/ (not its results): results kept
    for resuming an interrupted run are reused only by the same code and weights."""
    import hashlib

    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for base in (root / "spyglass", root / "bench"):
        for f in sorted(p for p in base.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
            if f.suffix in (".json", ".png") and "results" in f.parts:
                continue  # results written by benchmarks are outputs, not code
            digest.update(str(f.relative_to(root)).encode())
            digest.update(f.read_bytes())
    return digest.hexdigest()[:16]


def environment() -> dict[str, Any]:
    """Software and hardware facts that change timings."""
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
    }
    try:
        import torch

        from spyglass.cost import cpu_model

        env["cpu"] = cpu_model()
        env["torch"] = torch.__version__
        env["torch_threads"] = torch.get_num_threads()
        env["cuda"] = torch.cuda.is_available()
    except ImportError:
        pass
    return env


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear between the closest ranks (numpy's default); one value is its own."""
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile of no values")
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def ratio(a: float | None, b: float | None, digits: int | None = None) -> float | None:
    """a / b (rounded to `digits` where given); None where either is missing or b is 0."""
    if a is None or not b:
        return None
    return a / b if digits is None else round(a / b, digits)


def median_of(values: Sequence[float | None], all_present: bool = False) -> float | None:
    """The median of the values that exist, None where none does; with `all_present`, None where any is missing."""
    kept = [v for v in values if v is not None]
    if not kept or (all_present and len(kept) < len(values)):
        return None
    return median(kept)


def worst(values: Sequence[float | None], lowest: bool = True) -> float | None:
    """The lowest (or, `lowest=False`, the highest) value; None where there is none or any is missing."""
    if not values or any(v is None for v in values):
        return None
    return min(values) if lowest else max(values)


def random_tree_mask(n: int, gen: torch.Generator, reach: int | None = None) -> torch.Tensor:
    """Ancestor-or-self mask of a random tree of n nodes (node 0 the root): each node's parent drawn from the `reach`
    nodes before it (from all of them where None)."""
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        low = 0 if reach is None else max(0, i - reach)
        mask[i] |= mask[int(torch.randint(low, i, (), generator=gen))]
    return mask


def time_call(fn: Callable[[], Any], repeats: int = 7, warmup: int = 1) -> dict[str, Any]:
    """Median wall time of `fn()` in ms over `repeats` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": median(samples), "min_ms": min(samples), "samples_ms": [round(s, 4) for s in samples]}


def time_interleaved(
    fns: dict[str, Callable[[], Any]],
    repeats: int = 7,
    warmup: int = 1,
    min_block_s: float = 0.0,
    max_repeats: int = 60,
) -> dict[str, dict[str, Any]]:
    """Like `time_call` for several contenders, alternating them each repeat so that load drift on a shared
    machine hits all of them alike (ratios stay fair even when absolute times wobble). Fast contenders get
    more repeats (up to `max_repeats`) so that the block lasts at least `min_block_s`."""
    t0 = time.perf_counter()
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    per_round = (time.perf_counter() - t0) / max(1, warmup)
    if min_block_s > 0 and per_round > 0:
        repeats = max(repeats, min(max_repeats, math.ceil(min_block_s / per_round)))
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[k].append((time.perf_counter() - t0) * 1e3)
    return {
        k: {"median_ms": median(s), "min_ms": min(s), "samples_ms": [round(x, 4) for x in s]}
        for k, s in samples.items()
    }


_NUMBER_LIST = re.compile(r"\[\s*(-?[\d.eE+-]+(?:,\s*-?[\d.eE+-]+)*)\s*\]")


def results_json(doc: dict[str, Any]) -> str:
    """`doc` as a results file's text: indented, with each list of numbers on one line (per-token curves and token
    ids stay a few bytes per entry, which keeps the tracked results small)."""
    text = json.dumps(doc, indent=1, sort_keys=False)
    return _NUMBER_LIST.sub(lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text) + "\n"


def write_results(
    name: str,
    figures: dict[str, Any],
    raw: dict[str, Any],
    meta: dict[str, Any] | None = None,
    results_dir: Path = RESULTS_DIR,
) -> Path:
    """Write `results_dir/<name>.json` with figures, raw measurements, environment and load; returns the path."""
    results_dir.mkdir(parents=True, exist_ok=True)
    doc = {
        "figures": figures,
        "raw": raw,
        "meta": {"environment": environment(), "load_at_write": machine_load(), **(meta or {})},
    }
    path = results_dir / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(results_json(doc))
    tmp.replace(path)
    return path


def plot_panels(path: Path, panels: list[dict[str, Any]], title: str | None = None, ncols: int = 2) -> Path:
    """Line plots, one panel each: ``{"title", "xlabel", "ylabel", "series": {label: (xs, ys)}, "logx",
    "logy", "hline", "xticklabels"}`` (hline: a goal or parity line). Uses the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nrows = max(1, -(-len(panels) // ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.2 * ncols, 4.2 * nrows), squeeze=False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        if len(panel["series"]) > 10:  # the default cycle repeats its 10 colours
            ax.set_prop_cycle(color=plt.cm.tab20.colors)
        for label, (xs, ys) in panel["series"].items():
            ax.plot(xs, ys, marker="o", markersize=3, label=label)
        if panel.get("hline") is not None:
            ax.axhline(panel["hline"], color="grey", linestyle="--", linewidth=1)
        if panel.get("logx"):
            ax.set_xscale("log", base=2)
        if panel.get("logy"):
            ax.set_yscale("log")
        ax.set_title(panel.get("title", ""), fontsize=10)
        ax.set_xlabel(panel.get("xlabel", ""))
        if panel.get("xticklabels"):
            ax.set_xticks(range(len(panel["xticklabels"])), panel["xticklabels"], rotation=30, ha="right", fontsize=7)
        ax.set_ylabel(panel.get("ylabel", ""))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    png = io.BytesIO()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    from PIL import Image

    with Image.open(png) as img:  # saved in 64 colours: a third of the bytes (the tracked tree has a size limit)
        img.convert("RGB").quantize(colors=64).save(path, optimize=True)
    return path


# --- model and prompts, and methods side by side ----------------------------------------------------------------------


def log(msg: str, tag: str = "", stream=sys.stdout) -> None:
    """A progress line with the time (and the bench's `tag`), flushed at once."""
    print(f"[{tag + ' ' if tag else ''}{time.strftime('%H:%M:%S')}] {msg}", file=stream, flush=True)


def load_model(source: str | None = None, dtype: str = "float32", threads: int | None = None):
    """`(target, tokenizer, resolved)` for a model source (None: the embedded default) in `dtype`, with torch on
    `threads` threads when given: what every bench that runs a model does first."""
    if threads is not None:
        torch.set_num_threads(threads)
    resolved = resolve_model(source, dtype=dtype)
    return load_transformer(resolved.path, dtype=getattr(torch, dtype)), load_tokenizer(resolved.path), resolved


def run_task(engine: SpecEngine, task: HeldOutTask, params: SamplingParams) -> dict:
    """One request through `engine`: its tokens, tau, decode tok/s, acceptance by depth and where the time went."""
    (seq,) = engine.run([task.prompt_ids], params)
    st = seq.stats.summary(seq.num_generated)
    return {
        "tokens": seq.output_ids,
        "tau": st["tau"],
        "tok_s": st["tokens_per_s"],
        "acceptance_by_depth": [round(a, 3) for a in st["acceptance_by_depth"][:15]],
        "controller": st["controller"],
        "draft_s": round(st["draft_time_s"], 3),
        "verify_s": round(st["verify_time_s"], 3),
        "prefill_s": round(st["prefill_time_s"], 2),
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
    from services.local_redis import LocalRedis  # redis: absent where bench/gpu_check.py loads this module

    quiet = wait_for_quiet(max_load=1.0, timeout_s=120)
    redis = LocalRedis()
    target, tokenizer, _ = load_model(threads=threads)
    cache = ContextCache(redis.url, f"{cache_name}:{target.model_id}", block_size=128)
    return quiet, redis, target, tokenizer, cache


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
