"""What every module of actors/ shares: reading a run's YAML config (with its `base:` chain and `--set`
overrides) and joining or starting the Ray cluster. It imports nothing of actors/, so the job entry points
(jobs.py), the extraction actors and the trainer all import it without a loop."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import yaml


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`base` with `over` laid on top, section by section (a nested mapping merges, anything else replaces)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def read_yaml_config(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A YAML config; one with `base: other.yaml` (relative to its own directory) is that config with this
    one's keys laid on top, so a follow-up run states only what it changes."""
    path = Path(path).resolve()
    if path in _seen:
        raise ValueError(f"config {path} is its own base (via {' -> '.join(p.name for p in _seen)})")
    if not path.is_file():
        raise FileNotFoundError(f"config {path} does not exist")
    cfg = yaml.safe_load(path.read_text()) or {}
    if not isinstance(cfg, dict):
        raise ValueError(f"config {path} is not a mapping of sections")
    base = cfg.pop("base", None)
    if base is None:
        return cfg
    return _merged(read_yaml_config(path.parent / base, (*_seen, path)), cfg)


def load_config(path: str | Path, overrides: list[str] | None = None, workdir: str | None = None) -> dict[str, Any]:
    """Read a YAML config (and its `base`) and apply `key.sub=value` overrides; a relative workdir is resolved
    against the current directory (pass an absolute one to `ray job submit`, whose working dir is a temporary
    copy)."""
    cfg = read_yaml_config(path)
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"override {item!r} is not key=value")
        node = cfg
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = yaml.safe_load(value)
    if workdir is not None:
        cfg["workdir"] = workdir
    cfg.setdefault("workdir", f"runs/{cfg.get('name', Path(path).stem)}")
    cfg["workdir"] = str(Path(cfg["workdir"]).expanduser().resolve())
    return cfg


def ensure_ray(num_cpus: int | None = None) -> None:
    """Join the job's cluster when there is one; else start a local cluster bound to loopback."""
    import ray  # Ray: imported only when a cluster is used, so that reading a config needs no Ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if os.environ.get("RAY_ADDRESS"):
        ray.init(log_to_driver=True)
    else:
        ray.init(
            num_cpus=num_cpus,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            runtime_env={"worker_process_setup_hook": "actors.common.local_worker_setup"},
        )


def local_worker_setup() -> None:
    """Every worker of a local cluster: Ray Train's placement-group cleaner polls the state API, which finds its
    cluster by scanning the machine (it failed with "multiple active Ray instances" beside another cluster) and
    lives in the dashboard, off here (a warning every second buried the progress). Name the cluster; quiet it."""
    import ray  # Ray: see ensure_ray

    os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
    logging.getLogger("ray.train.v2._internal.execution.controller.placement_group_cleaner").setLevel(logging.ERROR)
