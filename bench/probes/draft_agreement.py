"""Held-out top-1 agreement by lag of a trained draft checkpoint on an extraction's eval split.

The same measurement `spyglass train --diagnose` prints after each checkpoint, for any checkpoint and any
extraction: e.g. the shipped draft (trained on 512-token contexts) on the long-context stage's 2,048-token
held-out contexts, before that stage trains on them.

    python bench/probes/draft_agreement.py CONFIG.yaml [--checkpoint DIR]   # DIR default: train.init_from
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from actors.common import load_config  # noqa: E402
from actors.trainer import ShardDataset, TrainSpec, build_loss, evaluate, warm_start  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--checkpoint", default=None, help="a draft directory with draft.safetensors")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from spyglass.models.drafts.longspec import DRAFT_MODELS
    from spyglass.models.llama import load_transformer

    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    spec = TrainSpec.from_dict(cfg["train"])
    ckpt = Path(args.checkpoint or spec.init_from)
    eval_dir = Path(cfg["workdir"]) / "extract" / spec.eval_split
    manifest = json.loads((eval_dir / "manifest.json").read_text())
    loss_fn = build_loss(spec, manifest)
    data = ShardDataset(eval_dir, loss_fn.required_keys())
    target = load_transformer(manifest["model_path"], dtype=torch.float32)
    draft = DRAFT_MODELS[spec.draft].from_target(target, **spec.draft_options)
    del target
    warm_start(draft, ckpt)
    draft.eval()
    with torch.no_grad():
        out = evaluate(draft, loss_fn, data, spec, 0, 1, None)
    out.update({"checkpoint": str(ckpt), "eval_dir": str(eval_dir), "loss_from": spec.loss_from})
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
