"""Measurements kept on disk for the next process on this machine: the matmul plan (spyglass/models/linear.py), the
verify-cost curve and the prefill cost (spyglass/cost.py).

Each is timed on this machine the first time a process needs it and kept under `kernels.cpu.machine_key()` (the
CPU, the kernels' build, torch) and the caller's key (shapes, dtype, threads, capacity...): the next process takes
it instead of timing again. The plan decides a prompt's bits (two kernels may round a near tie apart, and where
they time close two measurements can pick differently), so a restart gives the outputs of the last start; the cost
curve takes ~1 minute of forwards on 2 cores, so a restart is that much sooner. `SPYGLASS_REMEASURE=1` times
again (and keeps the new result). The file: `$SPYGLASS_MEASUREMENTS`, else `measurements.json` beside the converted
models (`$SPYGLASS_CACHE`, else ~/.cache/spyglass/models).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kernels import cpu as cpu_kernels


def kept_path() -> Path:
    """The file the measurements are kept in."""
    if given := os.environ.get("SPYGLASS_MEASUREMENTS"):
        return Path(given)
    models = os.environ.get("SPYGLASS_CACHE") or Path.home() / ".cache" / "spyglass" / "models"
    return Path(models) / "measurements.json"


def _read(path: Path) -> dict:
    """The kept measurements; none where the file is missing or damaged (then measured over)."""
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def kept(kind: str, key: Any, measure: Callable[[], Any]) -> Any:
    """`measure()`'s result (JSON-able) for `kind` and `key` on this machine: the kept one, else measured and kept."""
    path = kept_path()
    name = json.dumps([kind, cpu_kernels.machine_key(), repr(key)])
    found = _read(path)
    if name in found and os.environ.get("SPYGLASS_REMEASURE") != "1":
        return found[name]
    value = measure()
    found = {**_read(path), name: value}  # read again: another process may have kept something while this measured
    try:  # a failed write only loses the saving
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(found, indent=1))
        tmp.replace(path)
    except OSError:
        pass
    return value
