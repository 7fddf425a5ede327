"""Entry points of `spyglass extract CONFIG` and `spyglass train CONFIG` (also what `ray job submit` runs).

A config is one YAML file (see configs/): model, dtype, workdir, corpus, extract, train; `base: other.yaml`
starts from another config (a follow-up run states only what it changes). `--set a.b=v` overrides any key (the
value is parsed as YAML). Inside a Ray job (RAY_ADDRESS set by `ray job submit`)
the commands join that cluster; otherwise they start a local one on loopback.

Submitting to a local head node (what `make train-local` does; ports outside Ray's worker range 10002-19999):

    export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=token   # stay on loopback; token auth on both sides
    ray start --head --block --node-ip-address 127.0.0.1 --port 46379 \
        --dashboard-host 127.0.0.1 --dashboard-port 48265 &           # stop it by killing this pid
    ray job submit --address http://127.0.0.1:48265 --working-dir . -- \
        spyglass train configs/smollm2-135m-longspec/01-v2.yaml --workdir $PWD/.cache/runs/smollm2-135m-longspec/01-v2

Use an absolute `--workdir`: a job runs in a temporary copy of the working dir. Outputs: `<workdir>/corpus`
(contexts + split manifest), `<workdir>/extract/<split>` (shards + manifest), `<workdir>/train`
(`metrics.jsonl`, `checkpoints/step-N/{draft.safetensors, draft_config.json, optimizer state}`).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

from actors.common import ensure_ray, load_config
from actors.extraction import ExtractSpec, run_extraction
from actors.trainer import TrainSpec, run_training
from spyglass.training import dflash
from spyglass.training import tokenswift_train as ts
from spyglass.training.data import CorpusConfig


def validate(cfg: dict[str, Any]) -> None:
    """Fail on a bad config before any Ray cluster starts."""
    corpus = CorpusConfig.from_dict(cfg.get("corpus"))
    extract = ExtractSpec.from_dict(cfg.get("extract"))
    extract.scheme  # noqa: B018 - validates the position scheme
    if extract.continue_from and not 0 < extract.continue_from < corpus.seq_len:
        raise ValueError(
            f"extract.continue_from must be in 1..{corpus.seq_len - 1} (corpus.seq_len), not {extract.continue_from}"
        )
    if "train" in cfg:
        TrainSpec.from_dict(cfg.get("train"))


def _logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)


def extract_command(args) -> int:
    """`spyglass extract CONFIG`: resumable sharded extraction."""
    _logging()
    cfg = load_config(args.config, args.set, args.workdir)
    validate(cfg)
    ensure_ray()
    summary = run_extraction(cfg)
    print(json.dumps(summary, indent=1))
    return 0


# Drafts trained in one process (no extraction, no Ray Train): the config's `trainer` key names one of them.
SINGLE_PROCESS_TRAINERS = ("dflash", "dels", "tokenswift")


def single_process_training(cfg: dict[str, Any]) -> dict[str, Any]:
    """DFlash / DeLS (`spyglass.training.dflash`, options under `args`) or TokenSwift heads
    (`spyglass.training.tokenswift_train`, options at the top level), resumable from their workdir."""
    trainer = cfg["trainer"]
    if trainer == "tokenswift":
        report = ts.run(ts.resolve_config(cfg))
        ts.write_card(report, Path(report["config"]["out_dir"]))
        return {k: v for k, v in report.items() if k != "config"}
    argv = [trainer, "--workdir", cfg["workdir"]]
    if cfg.get("out"):
        argv += ["--out", str(cfg["out"])]
    for key, value in (cfg.get("args") or {}).items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            argv += [flag, str(value)]
    return dflash.main(argv, return_summary=True)


def train_command(args) -> int:
    """`spyglass train CONFIG`: extraction (finished shards are skipped), then the Ray Train run; or, for a
    config whose `trainer` is one of SINGLE_PROCESS_TRAINERS, that trainer in this process."""
    _logging()
    overrides = [*args.set, "train.diagnose=true"] if getattr(args, "diagnose", False) else args.set
    cfg = load_config(args.config, overrides, args.workdir)
    trainer = cfg.get("trainer", "longspec")
    if trainer in SINGLE_PROCESS_TRAINERS:
        print(json.dumps(single_process_training(cfg), indent=1, default=str))
        return 0
    if trainer != "longspec":
        raise ValueError(f"unknown trainer {trainer!r}: longspec (Ray Train), {', '.join(SINGLE_PROCESS_TRAINERS)}")
    validate(cfg)
    ensure_ray()
    out: dict[str, Any] = {}
    if not args.skip_extract:
        out["extract"] = run_extraction(cfg)
    out["train"] = run_training(cfg)
    print(json.dumps(out, indent=1, default=str))
    return 0
