"""Draft trainer on Ray Train: a `TorchTrainer` with N workers (gloo on CPU, NCCL on GPUs), DeepSpeed
ZeRO-1/2 when the config has a `deepspeed:` section, plain DDP otherwise.

The loop is drafter-agnostic: a draft model class and its loss module come from registries in
`spyglass.training`. Data are extraction shards; the sample order is a pure function of (seed, step),
so a run resumed from a checkpoint continues at exactly the step it saved, with the same batches and
the same lag draws. Checkpoints hold only the draft's trainable weights (safetensors), its config and
the optimizer/scheduler state; the frozen embedding and LM head are re-read from the target.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file

from actors.common import ensure_ray
from actors.extraction import build_section
from spyglass.models.drafts.longspec import DRAFT_MODELS, feature_layers
from spyglass.models.llama import load_transformer
from spyglass.training.losses import LOSSES
from spyglass.weights import save_weights

log = logging.getLogger(__name__)


@dataclass
class TrainSpec:
    """The `train:` section of a config."""

    draft: str = "longspec"
    draft_options: dict = field(default_factory=dict)
    workers: int = 2
    steps: int = 100
    batch_size: int = 4  # global, split evenly over the workers
    lr: float = 5e-4
    min_lr_ratio: float = 0.1
    warmup_ratio: float = 0.1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-6
    grad_clip: float = 1.0
    dtype: str = "float32"  # or bfloat16
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    seed: int = 42
    lag: tuple[int, int] = (1, 4)
    distill_weight: float = 0.0
    soft_distill: bool = False  # distil the target's top-k log-probs (KL) rather than its top-1
    all_lags: bool = False  # train every lag in `lag` each step instead of one drawn per step
    lag_weights: list[float] | None = None
    copy_weight: float = 1.0  # positions where copying from the context gives the target's choice weigh this much
    new_lr_scale: float = 1.0  # the learning rate of weights `init_from` lacks (a new input's zero projection), x
    fast_params: list[str] | None = None  # name prefixes also trained at `new_lr_scale` (a new part's second pass)
    loss_from: int = 0  # positions before this get no loss (their logits are not computed): cheaper steps
    diagnose: bool = False  # at each checkpoint: top-1 agreement with the target by lag on the eval split
    threads: int = 1
    split: str = "train"
    deepspeed: dict | None = None  # e.g. {"zero_stage": 2, "config": {...extra DeepSpeed keys}}
    max_failures: int = 1
    crash_at_step: int | None = None  # fault injection (tests): the first attempt dies at this step
    report_every: int = 1
    eval_every: int = 0  # 0 = only at the end; evaluates on the held-out split when it was extracted
    eval_split: str = "eval"
    init_from: str | None = None  # a draft checkpoint dir to start from (parameters it lacks keep their init)
    out_name: str = "train"  # <workdir>/<out_name>: several drafts can train on one extraction

    @classmethod
    def from_dict(cls, d: dict | None) -> TrainSpec:
        spec = build_section(cls, d, "train")
        spec.betas = tuple(spec.betas)
        spec.lag = tuple(spec.lag)
        if spec.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"train.dtype must be float32 or bfloat16, not {spec.dtype!r}")
        if spec.batch_size % spec.workers:
            raise ValueError(f"batch_size {spec.batch_size} must be a multiple of workers {spec.workers}")
        return spec

    def kv_layers(self, manifest: dict) -> list[int]:
        """The extracted target layers this draft reads (GLIDE: draft layer m reads target layer L - N + m)."""
        return manifest["kv_layers"][-int(self.draft_options.get("n_layers", 1)) :]

    def feature_layers(self, manifest: dict) -> list[int]:
        """The extracted target layers whose hidden states a `feed_hidden` draft reads (`hidden_layers`, default
        the last one), in the draft's order; [] for other drafts."""
        if not self.draft_options.get("feed_hidden"):
            return []
        layers = feature_layers(self.draft_options.get("hidden_layers"), manifest["n_layers"])
        missing = [i for i in layers if i not in manifest["hidden_layers"]]
        if missing:
            raise ValueError(
                f"the draft reads target layers {layers}' hidden states but the extraction holds only "
                f"{manifest['hidden_layers']}: add {missing} to extract.hidden_layers"
            )
        return layers


def lr_lambda(spec: TrainSpec):
    """Linear warm-up then cosine decay to `min_lr_ratio`."""
    warmup = max(1, int(spec.warmup_ratio * spec.steps))

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, spec.steps - warmup))
        return spec.min_lr_ratio + (1 - spec.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


class ShardDataset:
    """All contexts of a split's extraction shards, in memory (only the keys the loss needs)."""

    def __init__(self, extract_dir: Path, keys: list[str]) -> None:
        self.manifest = json.loads((extract_dir / "manifest.json").read_text())
        parts: dict[str, list[torch.Tensor]] = {k: [] for k in keys}
        for s in self.manifest["shards"]:
            t = load_file(str(extract_dir / s["file"]))
            for k in keys:
                parts[k].append(t[k])
        self.data = {k: torch.cat(v) for k, v in parts.items()}
        self.n = next(iter(self.data.values())).shape[0]
        if self.n == 0:
            raise ValueError(f"no contexts in {extract_dir}")

    def indices(self, step: int, batch_size: int, seed: int) -> list[int]:
        """The global batch of a step: epochs of seeded permutations, a pure function of the step."""
        out = []
        for j in range(step * batch_size, (step + 1) * batch_size):
            epoch, pos = divmod(j, self.n)
            perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
            out.append(int(perm[pos]))
        return out

    def batch(self, step: int, batch_size: int, seed: int, rank: int, world: int) -> dict[str, torch.Tensor]:
        idx = self.indices(step, batch_size, seed)[rank::world]
        return {k: v[idx] for k, v in self.data.items()}


@torch.no_grad()
def evaluate(model, loss_fn, data: ShardDataset | None, spec: TrainSpec, rank: int, world: int, dist) -> dict:
    """Over the held-out split (rank r takes contexts r::world): loss and top-1 agreement with the target at the
    smallest lag, and the agreement at every lag of the range (`eval_agree_lag{l}`: what depth l - 1 of a chain
    can expect)."""
    if data is None:
        return {}
    idx = list(range(rank, data.n, world))
    chunk = max(1, spec.batch_size // world)
    lags = tuple(range(spec.lag[0], spec.lag[1] + 1))
    # loss*n, agreement*n per lag, copy agreement*n and copyable share*n at the smallest lag, n
    sums = torch.zeros(4 + len(lags), dtype=torch.float64)
    for i in range(0, len(idx), chunk):
        batch = {k: v[idx[i : i + chunk]] for k, v in data.data.items()}
        n = len(idx[i : i + chunk])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=spec.dtype == "bfloat16"):
            loss, metrics = loss_fn(model, batch, spec.lag[0])
            row = [loss.item() * n, float(metrics["top1_agreement"]) * n]
            for lg in lags[1:]:
                row.append(float(loss_fn(model, batch, lg)[1]["top1_agreement"]) * n)
        row += [float(metrics.get("copy_agreement", 0.0)) * n, float(metrics.get("copyable", 0.0)) * n]
        sums += torch.tensor([*row, n], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(sums)
    n = max(1.0, float(sums[-1]))
    out = {"eval_loss": float(sums[0]) / n, "eval_top1_agreement": float(sums[1]) / n, "eval_contexts": int(sums[-1])}
    out.update({f"eval_agree_lag{lg}": float(sums[1 + j]) / n for j, lg in enumerate(lags)})
    out.update({"eval_copy_agreement": float(sums[-3]) / n, "eval_copyable": float(sums[-2]) / n})
    return out


def diagnose_line(step: int, record: dict) -> str:
    """The `--diagnose` report: agreement by lag on the eval split (lag l = what chain depth l - 1 drafts from)."""
    lags = sorted(int(k.removeprefix("eval_agree_lag")) for k in record if k.startswith("eval_agree_lag"))
    by_lag = "  ".join(f"lag {lg}: {record[f'eval_agree_lag{lg}']:.3f}" for lg in lags)
    line = f"diagnose step {step}: eval top-1 agreement with the target by lag  {by_lag}"
    if "eval_copy_agreement" in record:  # on the positions where copying from the context is right
        line += f"  | copyable ({record['eval_copyable']:.2f} of positions): {record['eval_copy_agreement']:.3f}"
    return line


def rank_vocab(tokens: torch.Tensor, size: int, vocab: int) -> torch.Tensor:
    """The `size` most frequent token ids of the training contexts (ties by id), for a reduced draft head."""
    counts = torch.bincount(tokens.flatten(), minlength=vocab).double()
    counts -= torch.arange(vocab, dtype=torch.float64) * 1e-9  # deterministic tie-break
    return counts.topk(size).indices.sort().values


def warm_start(draft: torch.nn.Module, ckpt: Path) -> None:
    """Load a trained draft's weights into a (possibly larger) new one, e.g. the KV-only LongSpec draft into a
    `feed_hidden` one whose extra projection starts at zero, or a one-layer draft into the top layer of a GLIDE
    one whose new lower layers start as identities (their output projections at zero): training starts from
    the old draft's behaviour. `run_training` checks that the file exists before any worker starts."""
    missing, unexpected = draft.load_state_dict(load_file(str(ckpt / "draft.safetensors")), strict=False)
    if unexpected:
        raise ValueError(f"train.init_from: {ckpt} has weights this draft does not: {unexpected}")
    new_layers = {k.split(".")[1] for k in missing if k.startswith("layers.")}
    with torch.no_grad():
        for i in new_layers:
            layer = draft.layers[int(i)]
            for out in (layer.wo, layer.cross_o, layer.w_down):
                out.weight.zero_()
    if getattr(draft.cfg, "draft_vocab", 0):
        draft.set_vocab(draft.vocab_ids.clone())


def build_loss(spec: TrainSpec, manifest: dict):
    """The draft's training loss as the spec configures it (also what `bench/probes/draft_agreement.py` evaluates)."""
    return LOSSES[spec.draft](
        kv_layer=spec.kv_layers(manifest),
        lag_min=spec.lag[0],
        lag_max=spec.lag[1],
        distill_weight=spec.distill_weight,
        soft_distill=spec.soft_distill,
        all_lags=spec.all_lags,
        lag_weights=spec.lag_weights,
        loss_from=spec.loss_from,
        hidden_layers=spec.feature_layers(manifest),
        copy_weight=spec.copy_weight,
    )


def param_groups(draft: torch.nn.Module, spec: TrainSpec) -> list[dict]:
    """The optimiser's parameter groups: the trainable weights, and those `init_from` lacks (a new input's zero
    projection on a trained draft) or `fast_params` names at `new_lr_scale` times the rate, so they catch up."""
    trainable = {n: p for n, p in draft.named_parameters() if p.requires_grad}
    known = set(trainable)
    if spec.init_from:  # the checkpoint's names from its header (warm_start reads the weights)
        with safe_open(str(Path(spec.init_from) / "draft.safetensors"), framework="pt") as f:
            known = set(f.keys())
    known -= {n for n in known if n.startswith(tuple(spec.fast_params or ()))}
    groups = [{"params": [p for n, p in trainable.items() if n in known]}]
    if new := [trainable[n] for n in sorted(set(trainable) - known)]:
        groups.append({"params": new, "lr": spec.lr * spec.new_lr_scale})
    return groups


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    done = sorted(p for p in ckpt_root.glob("step-*") if (p / "trainer_state.json").exists())
    return done[-1] if done else None


def _train_loop(config: dict[str, Any]) -> None:
    """Runs on every Ray Train worker."""
    import ray.train  # Ray: imported on the workers, so the trainer's specs and losses load without it

    spec = TrainSpec.from_dict(config["train"])
    torch.set_num_threads(spec.threads)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    out_dir = Path(config["out_dir"])
    ckpt_root = out_dir / "checkpoints"
    extract_dir = Path(config["extract_dir"])
    manifest = json.loads((extract_dir / "manifest.json").read_text())
    kv_layers = spec.kv_layers(manifest)  # checked against the target below

    loss_fn = build_loss(spec, manifest)
    data = ShardDataset(extract_dir, loss_fn.required_keys())
    eval_dir = extract_dir.parent / spec.eval_split
    eval_manifest = eval_dir / "manifest.json"
    has_eval = eval_manifest.exists() and json.loads(eval_manifest.read_text())["contexts"] > 0
    eval_data = ShardDataset(eval_dir, loss_fn.required_keys()) if has_eval else None
    target = load_transformer(manifest["model_path"], dtype=torch.float32)
    torch.manual_seed(spec.seed)  # identical initial weights on every rank
    draft = DRAFT_MODELS[spec.draft].from_target(target, **spec.draft_options)
    if kv_layers != draft.target_layers(target.args.n_layers):
        raise ValueError(
            f"this draft reads the K/V of target layers {draft.target_layers(target.args.n_layers)}; the "
            f"extraction has {manifest['kv_layers']} (set extract.kv_layers)"
        )
    del target
    if getattr(draft.cfg, "draft_vocab", 0):
        draft.set_vocab(rank_vocab(data.data["tokens"], draft.cfg.draft_vocab, draft.cfg.vocab_size))
    groups = param_groups(draft, spec)
    params = [p for g in groups for p in g["params"]]
    opt = torch.optim.AdamW(groups, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(spec))

    resume = latest_checkpoint(ckpt_root)
    start_step = 0
    if resume is None and spec.init_from:
        warm_start(draft, Path(spec.init_from))
    if resume is not None:
        state = json.loads((resume / "trainer_state.json").read_text())
        start_step = state["step"]
        draft.load_state_dict(load_file(str(resume / "draft.safetensors")), strict=False)
        if getattr(draft.cfg, "draft_vocab", 0):
            draft.set_vocab(draft.vocab_ids.clone())

    engine = None
    if spec.deepspeed is not None:
        import deepspeed  # the `train` extra, only for `deepspeed:` configs

        ds_cfg = {
            "train_micro_batch_size_per_gpu": spec.batch_size // world,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": spec.grad_clip,
            "zero_optimization": {"stage": int(spec.deepspeed.get("zero_stage", 2))},
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": spec.dtype == "bfloat16"},
            "steps_per_print": 1 << 30,
        }
        ds_cfg.update(spec.deepspeed.get("config", {}))
        engine, opt, _, sched = deepspeed.initialize(model=draft, optimizer=opt, lr_scheduler=sched, config=ds_cfg)
        if resume is not None:
            engine.load_checkpoint(str(resume / "deepspeed"), tag="state")
        model = engine
    else:
        if resume is not None:
            opt_state = torch.load(resume / "optimizer.pt", weights_only=True)
            opt.load_state_dict(opt_state["optimizer"])
            sched.load_state_dict(opt_state["scheduler"])
        model = torch.nn.parallel.DistributedDataParallel(draft) if world > 1 else draft

    log_path = out_dir / "metrics.jsonl"
    bar = None
    if rank == 0:
        from tqdm import tqdm  # the `train` extra

        bar = tqdm(total=spec.steps, initial=start_step, desc="train", mininterval=5.0)
    use_autocast = spec.dtype == "bfloat16" and engine is None
    if spec.diagnose and spec.init_from and start_step == 0 and eval_data is not None:
        # the warm start's own figures on this run's held-out split: the baseline the run's gains are measured from
        record = {"step": 0, **evaluate(model, loss_fn, eval_data, spec, rank, world, dist)}
        if rank == 0:
            print(diagnose_line(0, record), flush=True)
            with log_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
    t_start = time.perf_counter()
    for step in range(start_step, spec.steps):
        if spec.crash_at_step is not None and step == spec.crash_at_step and rank == 0:
            marker = out_dir / f".crashed-at-{step}"
            if not marker.exists():
                marker.write_text("fault injection\n")
                os._exit(1)
        t0 = time.perf_counter()
        batch = data.batch(step, spec.batch_size, spec.seed, rank, world)
        lag = loss_fn.lag(step, spec.seed)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_autocast):
            loss, metrics = loss_fn(model, batch, lag)
        if engine is not None:
            engine.backward(loss)
            engine.step()
            grad_norm = float(engine.get_global_grad_norm() or 0.0)
            lr = engine.get_lr()[0]
        else:
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, spec.grad_clip))
            lr = sched.get_last_lr()[0]
            opt.step()
            sched.step()
        vals = torch.tensor([loss.item(), *(float(v) for v in metrics.values())], dtype=torch.float64)
        if world > 1:
            dist.all_reduce(vals)
            vals /= world
        record = {"step": step + 1, "loss": float(vals[0])}
        lag = list(lag) if isinstance(lag, tuple) else lag
        record.update({k: float(v) for k, v in zip(metrics, vals[1:].tolist(), strict=True)})
        record.update(
            {
                "lr": lr,
                "grad_norm": grad_norm,
                "lag": lag,
                "step_s": time.perf_counter() - t0,
                "resumed_from": start_step,
                "world": world,
            }
        )
        at_checkpoint = (step + 1) % spec.checkpoint_every == 0
        if (
            step + 1 == spec.steps
            or (spec.eval_every and (step + 1) % spec.eval_every == 0)
            or (spec.diagnose and at_checkpoint)
        ):
            record.update(evaluate(model, loss_fn, eval_data, spec, rank, world, dist))
            if spec.diagnose and rank == 0 and eval_data is not None:
                print(diagnose_line(step + 1, record), flush=True)
        if rank == 0:
            with log_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.3f}", agree=f"{record['top1_agreement']:.3f}", refresh=False)
        checkpoint = None
        if (step + 1) % spec.checkpoint_every == 0 or step + 1 == spec.steps:
            checkpoint = _save_checkpoint(ckpt_root, step + 1, draft, opt, sched, engine, spec, rank, world, dist)
        if checkpoint is not None or (step + 1) % spec.report_every == 0:
            ray.train.report(record, checkpoint=checkpoint)
    if rank == 0:
        bar.close()
        (out_dir / "train_summary.json").write_text(
            json.dumps(
                {
                    "steps": spec.steps,
                    "resumed_from": start_step,
                    "seconds": time.perf_counter() - t_start,
                    "steps_per_s": (spec.steps - start_step) / max(1e-9, time.perf_counter() - t_start),
                    "world": world,
                    "deepspeed": spec.deepspeed,
                }
            )
        )


def _save_checkpoint(root: Path, step: int, draft, opt, sched, engine, spec: TrainSpec, rank: int, world: int, dist):
    """Write `step-NNNNNN/` (atomically, via a temp dir renamed by rank 0) and hand it to Ray from rank 0."""

    tmp = root / f".step-{step:06d}.tmp"
    final = root / f"step-{step:06d}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    if world > 1:
        dist.barrier()
    if engine is not None:  # every rank writes its ZeRO partition
        engine.save_checkpoint(str(tmp / "deepspeed"), tag="state")
    if rank == 0:
        # fp32, not the shipped bf16: a resumed run continues from exactly these weights (token ids stay integers)
        save_weights(draft.trainable_state_dict(), tmp / "draft.safetensors", torch.float32)
        (tmp / "draft_config.json").write_text(json.dumps({"kind": spec.draft, **draft.cfg.to_dict()}, indent=1))
        if engine is None:
            torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, tmp / "optimizer.pt")
    if world > 1:
        dist.barrier()
    if rank == 0:
        (tmp / "trainer_state.json").write_text(json.dumps({"step": step, "train": asdict(spec)}))
        shutil.rmtree(final, ignore_errors=True)
        tmp.replace(final)
        for old in sorted(p for p in root.glob("step-*") if p != final)[: -max(0, spec.keep_checkpoints - 1) or None]:
            shutil.rmtree(old, ignore_errors=True)
    if world > 1:
        dist.barrier()
    if rank != 0:
        return None
    from ray.train import Checkpoint  # Ray: see _train_loop

    return Checkpoint.from_directory(str(final))


def run_training(cfg: dict[str, Any]) -> dict[str, Any]:
    """Driver: a TorchTrainer over the extraction shards of `cfg`; returns the final metrics and paths."""
    import ray  # Ray: imported when the run starts, so the specs load without it
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    spec = TrainSpec.from_dict(cfg.get("train"))
    workdir = Path(cfg["workdir"]).resolve()
    out_dir = workdir / spec.out_name
    out_dir.mkdir(parents=True, exist_ok=True)
    extract_dir = workdir / "extract" / spec.split
    if not (extract_dir / "manifest.json").exists():
        raise FileNotFoundError(f"no extraction manifest in {extract_dir}: run `spyglass extract` first")
    if spec.init_from:  # relative to where the driver runs, not to the workers' directories
        spec.init_from = str(Path(spec.init_from).resolve())
        if not (Path(spec.init_from) / "draft.safetensors").is_file():
            raise FileNotFoundError(f"train.init_from: no draft.safetensors in {spec.init_from}")
    # Each report waits for the controller's next poll of the workers (2 s by default): poll faster so
    # per-step reports do not dominate small steps. Propagated to the Train controller by Ray.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    ensure_ray()  # joins RAY_ADDRESS's cluster, else a loopback one
    use_gpu = ray.cluster_resources().get("GPU", 0) >= spec.workers
    trainer = TorchTrainer(
        _train_loop,
        train_loop_config={"train": asdict(spec), "out_dir": str(out_dir), "extract_dir": str(extract_dir)},
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=spec.workers, use_gpu=use_gpu, resources_per_worker=None if use_gpu else {"CPU": 1}
        ),
        run_config=RunConfig(
            name="ray-train",
            storage_path=str(out_dir / "ray_results"),
            failure_config=FailureConfig(max_failures=spec.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=spec.keep_checkpoints),
            # Use the driver's environment (threads, offline flags) on every worker.
        ),
    )
    t0 = time.perf_counter()
    result = trainer.fit()
    summary = {
        "metrics": result.metrics,
        "checkpoint": result.checkpoint.path if result.checkpoint else None,
        "local_checkpoint": str(latest_checkpoint(out_dir / "checkpoints")),
        "metrics_log": str(out_dir / "metrics.jsonl"),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    log.info("training done: %s", summary)
    return summary
