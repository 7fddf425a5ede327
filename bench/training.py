"""Training-pipeline benchmark on the real default target (SmolLM2-135M, fp32) -> bench/results/training.json.

figures:
- extraction_vs_forward: extraction throughput (last-layer K/V + top-8 log-probs at Anchor-Offset positions,
  written as a safetensors shard) over a bare target forward producing the same logits, same tokens. Goal >= 0.9.
- redis_reuse_speedup: a context's features read back from Redis vs recomputed by the target. Goal >= 5.
- trainer_steps_per_s_1w / _2w: LongSpec draft steps per second (same global batch) with 1 and 2 Ray Train
  workers (gloo, 1 torch thread each), startup excluded.
Usage: python bench/training.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("SPYGLASS_CACHE", str(ROOT / ".cache" / "models"))

import torch  # noqa: E402

from bench.common import median, time_interleaved, wait_for_quiet, write_results  # noqa: E402


def bench_extraction(target, model_id: str, contexts: torch.Tensor, repeats: int) -> dict:
    from actors.extraction import Extractor, ExtractSpec
    from spyglass.models.llama import Segment

    spec = ExtractSpec(kv_layers=[-1], topk=8, positions={"scheme": "anchor_offset", "max_offset": 7000})
    ex = Extractor(target, spec, model_id)
    out = Path(tempfile.mkdtemp(prefix="bench-extract-"))
    scheme = spec.scheme
    positions = [scheme.positions(c, target.args.max_position) for c in contexts]

    def extract() -> None:
        for f in out.glob("shard-*"):
            f.unlink()
        ex.run_shard(contexts, 0, out, {})

    def forward() -> None:
        for c, p in zip(contexts, positions, strict=True):
            cache = target.new_cache(c.shape[0], 1)
            slot = cache.allocate()
            target([Segment(slot, 0, c, p, None, "all")], cache)

    t = time_interleaved({"extract": extract, "forward": forward}, repeats=repeats, warmup=1)
    shutil.rmtree(out, ignore_errors=True)
    tokens = contexts.numel()
    return {
        "tokens": tokens,
        "extract_ms": t["extract"]["median_ms"],
        "forward_ms": t["forward"]["median_ms"],
        "extract_tok_s": tokens / t["extract"]["median_ms"] * 1e3,
        "forward_tok_s": tokens / t["forward"]["median_ms"] * 1e3,
        "ratio": t["forward"]["median_ms"] / t["extract"]["median_ms"],
        "samples": t,
    }


def bench_redis(target, model_id: str, contexts: torch.Tensor, repeats: int, workdir: Path) -> dict:
    from actors.extraction import Extractor, ExtractSpec
    from tests.redis_server import RedisServer

    (workdir / "redis").mkdir(parents=True, exist_ok=True)
    server = RedisServer(workdir / "redis")
    try:
        kw = dict(kv_layers=[-1], topk=8, positions={"scheme": "anchor_offset", "max_offset": 7000}, block_size=128)
        cached = Extractor(target, ExtractSpec(redis_url=server.url, **kw), model_id)
        plain = Extractor(target, ExtractSpec(redis_url=None, **kw), model_id)
        for c in contexts:  # populate
            assert not cached.features(c)[1]
        hits0 = cached.cache.stats.hits

        def from_redis() -> None:
            for c in contexts:
                assert cached.features(c)[1]

        def recompute() -> None:
            for c in contexts:
                plain.features(c)

        t = time_interleaved({"redis": from_redis, "recompute": recompute}, repeats=repeats, warmup=1)
        return {
            "redis_ms": t["redis"]["median_ms"],
            "recompute_ms": t["recompute"]["median_ms"],
            "speedup": t["recompute"]["median_ms"] / t["redis"]["median_ms"],
            "block_hits": cached.cache.stats.hits - hits0,
            "samples": t,
        }
    finally:
        server.stop()


def bench_trainer(cfg: dict, workers: int, steps: int) -> dict:
    from actors.trainer import run_training

    train_dir = Path(cfg["workdir"]) / "train"
    shutil.rmtree(train_dir, ignore_errors=True)
    cfg = json.loads(json.dumps(cfg))
    cfg["train"].update(workers=workers, steps=steps, checkpoint_every=steps, report_every=1)
    t0 = time.perf_counter()
    out = run_training(cfg)
    wall = time.perf_counter() - t0
    summary = json.loads((train_dir / "train_summary.json").read_text())
    recs = [json.loads(line) for line in (train_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "workers": workers,
        "steps": steps,
        "steps_per_s": summary["steps_per_s"],
        "median_step_compute_s": median([r["step_s"] for r in recs[1:]]),
        "wall_s_incl_startup": wall,
        "loss_first": recs[0]["loss"],
        "loss_last": recs[-1]["loss"],
        "top1_agreement_last": recs[-1]["top1_agreement"],
        "final_metrics": out["metrics"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    quiet = wait_for_quiet(timeout_s=120 if args.quick else 300)
    torch.set_num_threads(os.cpu_count() or 1)
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"

    from actors.common import ensure_ray, load_config
    from actors.extraction import resolve_target, run_extraction
    from spyglass.models.llama import load_transformer

    workdir = ROOT / ".cache" / "bench-training"
    steps = 8 if args.quick else 20
    cfg = load_config(
        ROOT / "bench" / "training.yaml",
        [
            "corpus.max_contexts={train: 16, eval: 0}",
            "extract.splits=[train]",
            "extract.redis_url=null",
            "extract.shard_size=8",
            "train.batch_size=2",
            "train.dtype=float32",
        ],
        str(workdir),
    )
    resolved = resolve_target(cfg.get("model"), "float32")
    target = load_transformer(resolved.path)
    ensure_ray(num_cpus=4)
    run_extraction(cfg)  # also builds the corpus the micro-benchmarks below read
    from spyglass.training.data import load_contexts

    contexts = load_contexts(workdir / "corpus", "train")[:4]
    repeats = 3 if args.quick else 5
    raw: dict = {}
    raw["extraction"] = bench_extraction(target, resolved.model_id, contexts, repeats)
    print("extraction", {k: v for k, v in raw["extraction"].items() if k != "samples"}, flush=True)
    raw["redis"] = bench_redis(target, resolved.model_id, contexts, repeats, workdir)
    print("redis", {k: v for k, v in raw["redis"].items() if k != "samples"}, flush=True)
    del target
    raw["trainer_1w"] = bench_trainer(cfg, 1, steps)
    print("trainer 1w", raw["trainer_1w"], flush=True)
    raw["trainer_2w"] = bench_trainer(cfg, 2, steps)
    print("trainer 2w", raw["trainer_2w"], flush=True)
    figures = {
        "extraction_vs_forward": round(raw["extraction"]["ratio"], 3),
        "redis_reuse_speedup": round(raw["redis"]["speedup"], 2),
        "trainer_steps_per_s_1w": round(raw["trainer_1w"]["steps_per_s"], 3),
        "trainer_steps_per_s_2w": round(raw["trainer_2w"]["steps_per_s"], 3),
    }
    meta = {
        "model": resolved.model_id,
        "dtype": "float32",
        "contexts": list(contexts.shape),
        "goals": {"extraction_vs_forward": 0.9, "redis_reuse_speedup": 5},
        "quiet": quiet,
        "trainer": {"global_batch": 2, "seq_len": int(contexts.shape[1]), "threads_per_worker": 1},
    }
    path = write_results("training_quick" if args.quick else "training", figures, raw, meta)
    print(json.dumps(figures), "->", path)


if __name__ == "__main__":
    main()
