"""Shared benchmark helpers: machine load, medians of repeats, results JSON and PNG plots.

The machines are small and shared (2 cores), so every result records the load before and after the run
and the environment, speed claims are ratios measured side by side in one run, and timings are medians.
Results go to ``bench/results/<name>.json``: ``{"figures": {...}, "raw": {...}, "meta": {...}}`` where
``figures`` holds the headline numbers a report quotes and ``raw`` every measurement behind them.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine_load() -> dict[str, Any]:
    """Load averages and the number of usable cores: a load near or above nproc means timings are shared."""
    one, five, fifteen = os.getloadavg()
    return {
        "loadavg_1m": round(one, 2),
        "loadavg_5m": round(five, 2),
        "loadavg_15m": round(fifteen, 2),
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
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


def environment() -> dict[str, Any]:
    """Software and hardware facts that change timings."""
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                env["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import torch

        env["torch"] = torch.__version__
        env["torch_threads"] = torch.get_num_threads()
        env["cuda"] = torch.cuda.is_available()
    except ImportError:
        pass
    return env


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


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


def time_interleaved(fns: dict[str, Callable[[], Any]], repeats: int = 7, warmup: int = 1) -> dict[str, dict[str, Any]]:
    """Like `time_call` for several contenders, alternating them each repeat so that load drift on a shared
    machine hits all of them alike (ratios stay fair even when absolute times wobble)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
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
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
    tmp.replace(path)
    return path


def plot_panels(path: Path, panels: list[dict[str, Any]], title: str | None = None, ncols: int = 2) -> Path:
    """Line plots, one panel each: ``{"title", "xlabel", "ylabel", "series": {label: (xs, ys)}, "logx",
    "logy", "hline"}`` (hline: a goal or parity line). Uses the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nrows = max(1, -(-len(panels) // ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.2 * ncols, 4.2 * nrows), squeeze=False)
    for ax, panel in zip(axes.flat, panels, strict=False):
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
        ax.set_ylabel(panel.get("ylabel", ""))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
