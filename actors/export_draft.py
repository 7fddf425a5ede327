"""Ship a trained draft: copy a run's checkpoint into the package with its training record.

    python -m actors.export_draft RUN_DIR OUT_DIR [--step N] [--train-dir NAME]

RUN_DIR is a config's workdir (`.cache/runs/<name>`), NAME its `train.out_name` (default `train`). OUT_DIR gets
`draft.safetensors` + `draft_config.json` (what `load_longspec_draft` reads), `training.json` (tokens seen,
steps, wall time, eval agreement by lag at each checkpoint, the config) and `training.png` (loss and agreement
curves). The model card is written by hand from these. The weights ship in bfloat16 (`save_weights`: half the
bytes of the trainer's fp32 checkpoint, token ids as integers; the loader casts them to the target's dtype).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from safetensors.torch import load_file

from actors.trainer import latest_checkpoint
from spyglass.training import repo_relative
from spyglass.weights import save_weights


def summarise(run_dir: Path, step: int | None = None, train_dir: str = "train") -> tuple[Path, dict]:
    ckpts = run_dir / train_dir / "checkpoints"
    ckpt = ckpts / f"step-{step:06d}" if step else latest_checkpoint(ckpts)
    if ckpt is None or not (ckpt / "draft.safetensors").exists():
        raise FileNotFoundError(f"no finished checkpoint under {ckpts}")
    state = json.loads((ckpt / "trainer_state.json").read_text())
    spec = state["train"]
    if spec.get("init_from"):
        spec["init_from"] = repo_relative(spec["init_from"])
    manifest = json.loads((run_dir / "extract" / spec.get("split", "train") / "manifest.json").read_text())
    records = [json.loads(line) for line in (run_dir / train_dir / "metrics.jsonl").read_text().splitlines() if line]
    records = [r for r in records if r["step"] <= state["step"]]
    seq_len = manifest["seq_len"]
    evals = [
        {"step": r["step"], **{k.removeprefix("eval_"): round(v, 4) for k, v in r.items() if k.startswith("eval_")}}
        for r in records
        if "eval_top1_agreement" in r
    ]
    last_eval = evals[-1] if evals else {}
    summary = {
        "checkpoint": repo_relative(ckpt),
        "steps": state["step"],
        "train_tokens": state["step"] * spec["batch_size"] * seq_len,
        "train_wall_s": round(sum(r.get("step_s", 0.0) for r in records), 1),
        "corpus_contexts": manifest["contexts"],
        "corpus_tokens": manifest["tokens"],
        "position_scheme": manifest["position_tag"],
        "eval_agree_by_lag": {k.removeprefix("agree_lag"): v for k, v in last_eval.items() if k.startswith("agree_")},
        "evals": evals,
        "final_train_loss": records[-1].get("loss") if records else None,
        "train": spec,
    }
    return ckpt, summary


def plot(records_path: Path, evals: list[dict], out: Path) -> None:
    import matplotlib  # the `dev` extra: plots are optional

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in map(json.loads, filter(None, records_path.read_text().splitlines())) if "loss" in r]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot([r["step"] for r in recs], [r["loss"] for r in recs], lw=0.8)
    a.set(title="training loss", xlabel="step")
    lags = sorted({k for e in evals for k in e if k.startswith("agree_lag")})
    for k in lags:
        b.plot([e["step"] for e in evals], [e[k] for e in evals], marker="o", label=f"eval {k}")
    b.set(title="top-1 agreement with the target (eval split)", xlabel="step")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--step", type=int, default=None)
    ap.add_argument("--train-dir", default="train", help="the run's train.out_name")
    args = ap.parse_args()
    ckpt, summary = summarise(args.run_dir, args.step, args.train_dir)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy2(ckpt / "draft_config.json", args.out_dir / "draft_config.json")
    weights = load_file(str(ckpt / "draft.safetensors"))
    if "vocab_ids" in weights:  # token ids (older checkpoints hold them as floats): exact integers
        weights["vocab_ids"] = weights["vocab_ids"].round().long()
    shipped = args.out_dir / "draft.safetensors.xz"  # the package's form (spyglass.weights)
    save_weights(weights, shipped)
    (args.out_dir / "draft.safetensors").unlink(missing_ok=True)  # a stale uncompressed copy would load first
    (args.out_dir / "training.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(args.run_dir / args.train_dir / "metrics.jsonl", summary["evals"], args.out_dir / "training.png")
    size = shipped.stat().st_size
    print(f"shipped {ckpt.name} to {args.out_dir} ({size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
