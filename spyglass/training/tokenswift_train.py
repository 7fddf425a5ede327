"""Train TokenSwift heads on the offline corpus (CPU budget, resumable).

    python -m spyglass.training.tokenswift_train configs/smollm2-135m-tokenswift.yaml

1. corpus: `build_corpus` (train split only: the eval split's packages stay held out for benchmarks);
2. extract: the frozen target's last-layer hidden states of every context, stored bf16 per shard (skipped when
   already on disk);
3. train: the heads only (AdamW, warmup + cosine), `batch_positions` random positions per step, loss = sum over
   heads of CE(head i at t, token t+1+i) mixed with CE against the target's own distribution there (`distill`),
   for the request's `sampling` when given (penalty and min-p, as serving sees them), through the frozen final
   norm + LM head; a checkpoint with optimizer state every `checkpoint_every` steps, so rerunning the same
   command resumes; stops at `steps` or `max_minutes`;
4. evaluate per-head agreement with the corpus and the target on held-out contexts, and write the heads (with
   their training vocabulary, which drafting then keeps to) plus a model card into `out_dir`.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file, save_file

from spyglass.models.drafts.tokenswift import CONFIG_FILE, TokenSwiftHeads, load_heads
from spyglass.models.llama import Segment, load_transformer
from spyglass.models.loader import load_tokenizer, resolve_model
from spyglass.sampling import SamplingParams
from spyglass.training.data import CorpusConfig, build_corpus, load_contexts
from spyglass.training.losses import heads_loss

DEFAULTS = {
    "model": None,
    "workdir": ".cache/runs/tokenswift-heads",
    "out_dir": "spyglass/drafts/smollm2-135m-tokenswift",
    "corpus": {},
    "train_contexts": 240,
    "heldout_contexts": 16,
    "heldout_split": "train",  # "eval": held-out packages/documents (half prose, half code); "train": its last contexts
    "corpus_contexts": None,  # train-split contexts the corpus is built with (default: train + held out)
    "shard": 16,
    "gamma": 3,
    "steps": 200,
    "max_minutes": 15.0,
    "batch_positions": 512,
    "eval_stride": 4,  # held-out evaluation at every n-th position (full vocabulary: the expensive part)
    "train_vocab": None,  # train the CE over the most frequent N training tokens only (None = full vocabulary)
    "distill": 0.0,  # weight of the target's own distribution in the loss (1 - distill: the corpus token)
    # Train (and evaluate) for requests with these sampling parameters (`SamplingParams` fields, e.g. temperature,
    # min_p, contextual_penalty, penalty_window): the teacher is the distribution the target samples from, and the
    # heads' logits get the contextual penalty the drafter applies. None: the target's plain distribution.
    "sampling": None,
    "lr": 5.0e-3,
    "weight_decay": 0.1,
    "warmup": 20,
    "checkpoint_every": 20,
    "seed": 0,
    "threads": 1,
}


def _load_target(model):
    resolved = resolve_model(model, dtype="float32")
    return load_transformer(resolved.path), resolved.path, load_tokenizer(resolved.path)


@torch.inference_mode()
def extract(target, contexts: torch.Tensor, out: Path, shard: int) -> torch.Tensor:
    """Last-layer hidden states `[n, L, d]` (bf16), computed shard by shard and cached on disk with the contexts
    they belong to (a rebuilt corpus with other contexts at the same index is extracted again, never mismatched)."""
    out.mkdir(parents=True, exist_ok=True)
    last = target.args.n_layers - 1
    parts = []
    for lo in range(0, contexts.shape[0], shard):
        path = out / f"hidden-{lo:05d}.safetensors"
        chunk = contexts[lo : lo + shard]
        if path.exists():
            saved = load_file(str(path))
            if torch.equal(saved.get("tokens", torch.empty(0)), chunk):
                parts.append(saved["hidden"])
                continue
            print(f"{path.name}: stored for other contexts (the corpus changed): extracting again", flush=True)
        t0 = time.perf_counter()
        rows = []
        for ctx in chunk:
            cache = target.new_cache(ctx.shape[0], 1)
            slot = cache.allocate()
            target.capture_layers = (last,)
            target([Segment(slot, 0, ctx, torch.arange(ctx.shape[0]), None, "none")], cache)
            rows.append(target.captured[0][last].to(torch.bfloat16))
        target.capture_layers = ()
        hidden = torch.stack(rows)
        save_file({"hidden": hidden, "tokens": chunk.contiguous()}, str(path))  # which contexts these belong to
        parts.append(hidden)
        print(f"extract {lo + len(rows)}/{contexts.shape[0]} ({time.perf_counter() - t0:.1f}s)", flush=True)
    return torch.cat(parts)


def _positions(n: int, length: int, gamma: int, count: int, g: torch.Generator) -> torch.Tensor:
    return torch.stack(
        [torch.randint(0, n, (count,), generator=g), torch.randint(0, length - 1 - gamma, (count,), generator=g)], 1
    )


@torch.no_grad()
def evaluate(
    heads, target, hidden: torch.Tensor, tokens: torch.Tensor, stride: int = 4, sampling: SamplingParams | None = None
) -> dict:
    """Per-head CE and top-1 agreement with the corpus and with the target's argmax, and the target's probability
    of each head's top-1 token (full vocabulary), at every `stride`-th valid position (base head l0 too); under
    `sampling`, against the distribution the target samples from there (penalty, min-p...)."""
    gamma = heads.gamma
    n, length = tokens.shape
    pos = torch.stack(torch.meshgrid(torch.arange(n), torch.arange(length - 1 - gamma), indexing="ij"), -1)
    pos = pos.reshape(-1, 2)[::stride]
    sums: dict[str, torch.Tensor] = {}
    base = 0.0
    for chunk in pos.split(1024):
        _, ces, metrics = heads_loss(heads, target, hidden, tokens, chunk, sampling=sampling)
        h = hidden[chunk[:, 0], chunk[:, 1]].float()
        pred = target.lm_head(target.norm(h)).argmax(-1)
        base += float((pred == tokens[chunk[:, 0], chunk[:, 1] + 1]).float().sum())
        for key, values in {"head_ce": ces, **{f"head_{k}": v for k, v in metrics.items()}}.items():
            sums[key] = sums.get(key, 0) + torch.tensor(values) * len(chunk)
    m = len(pos)
    return {"positions": m, "base_top1": base / m, **{k: (v / m).tolist() for k, v in sums.items()}}


def sampling_of(cfg: dict) -> SamplingParams | None:
    """The config's `sampling` as parameters (temperature 1 unless given); a bad field is a clear error."""
    if not cfg["sampling"]:
        return None
    try:
        params = SamplingParams(**{"temperature": 1.0, **cfg["sampling"]})
    except (TypeError, ValueError) as e:
        raise ValueError(f"tokenswift option sampling: {e}") from e
    if params.repetition_penalty != 1.0:  # it reaches back over the whole context, which a stored one cuts short
        raise ValueError("tokenswift option sampling: repetition_penalty is not modelled in training (use 1)")
    return params


def _prepare(cfg: dict):
    """The frozen target, the corpus manifest, and (hidden states, tokens) of the training and held-out contexts,
    extracted once and cached in the run's directory."""
    torch.set_num_threads(int(cfg["threads"]))
    torch.manual_seed(cfg["seed"])
    work = Path(cfg["workdir"])
    target, model_path, tokenizer = _load_target(cfg["model"])
    for p in target.parameters():
        p.requires_grad_(False)
    n_train, n_held = int(cfg["train_contexts"]), int(cfg["heldout_contexts"])
    held_split = cfg["heldout_split"]
    if held_split not in ("train", "eval"):
        raise ValueError(f"heldout_split must be 'train' or 'eval', got {held_split!r}")
    from_train = n_held if held_split == "train" else 0
    n_corpus = int(cfg["corpus_contexts"] or n_train + from_train)
    corpus_cfg = CorpusConfig.from_dict(
        {"max_contexts": {"train": n_corpus, "eval": n_held - from_train}, **cfg["corpus"]}
    )
    manifest = build_corpus(corpus_cfg, tokenizer, work / "corpus")
    contexts = load_contexts(work / "corpus", "train")[: n_train + from_train]
    hidden = extract(target, contexts, work / "hidden", int(cfg["shard"]))
    train = hidden[:n_train], contexts[:n_train]
    if held_split == "eval":  # packages and documents no training context comes from
        held_t = load_contexts(work / "corpus", "eval")[:n_held]
        held = extract(target, held_t, work / "hidden-eval", int(cfg["shard"])), held_t
    else:
        held = hidden[n_train:], contexts[n_train:]
    return target, model_path, manifest, train, held


def evaluate_checkpoint(cfg: dict, heads_dir: str) -> dict:
    """Heads trained elsewhere, evaluated on this run's held-out positions (a like-for-like comparison)."""
    target, _, _, _, (held_h, held_t) = _prepare(cfg)
    heads, stride, sampling = load_heads(heads_dir, target), int(cfg["eval_stride"]), sampling_of(cfg)
    out = {"checkpoint": heads_dir, "heldout": evaluate(heads, target, held_h, held_t, stride)}
    if sampling is not None:
        out["heldout_sampled"] = evaluate(heads, target, held_h, held_t, stride, sampling)
    return out


def run(cfg: dict) -> dict:
    """Train (resuming from the run's checkpoint), evaluate on the held-out contexts, write the heads."""
    work = Path(cfg["workdir"])
    target, model_path, manifest, (train_h, train_t), (held_h, held_t) = _prepare(cfg)
    n_train, n_held = len(train_t), len(held_t)

    heads = TokenSwiftHeads(target.args.hidden_size, int(cfg["gamma"]), target.args.rms_eps)
    opt = torch.optim.AdamW(heads.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    steps, warmup = int(cfg["steps"]), int(cfg["warmup"])

    def schedule(s: int) -> float:
        return (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / (steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    ckpt = work / "checkpoint.pt"
    state = {"step": 0, "seconds": 0.0, "log": []}
    if ckpt.exists():
        saved = torch.load(ckpt, weights_only=False)
        heads.load_state_dict(saved["heads"])
        opt.load_state_dict(saved["opt"])
        sched.load_state_dict(saved["sched"])
        state = saved["state"]
        print(f"resumed at step {state['step']}", flush=True)
    g = torch.Generator().manual_seed(cfg["seed"] + state["step"])
    sampling = sampling_of(cfg)
    vocab = None
    if cfg["train_vocab"]:
        counts = torch.bincount(train_t.flatten(), minlength=target.args.vocab_size)
        vocab = torch.sort(torch.topk(counts, int(cfg["train_vocab"])).indices).values
        print(f"train vocab: {len(vocab)} tokens cover {float(counts[vocab].sum() / counts.sum()):.3f}", flush=True)
    budget = 60.0 * float(cfg["max_minutes"])
    t_run = time.perf_counter()
    while state["step"] < steps and state["seconds"] < budget:
        t0 = time.perf_counter()
        pos = _positions(n_train, train_t.shape[1], heads.gamma, int(cfg["batch_positions"]), g)
        loss, ces, metrics = heads_loss(heads, target, train_h, train_t, pos, vocab, float(cfg["distill"]), sampling)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(heads.parameters(), 1.0)
        opt.step()
        sched.step()
        state["step"] += 1
        state["seconds"] += time.perf_counter() - t0
        state["log"].append({"step": state["step"], "loss": float(loss), "ce": ces, **metrics})
        if state["step"] % 5 == 0:
            print(
                f"step {state['step']} loss {float(loss):.3f} ce {[round(c, 3) for c in ces]} "
                f"top1 {[round(a, 3) for a in metrics['top1']]} "
                f"vs target {[round(a, 3) for a in metrics['target_top1']]} ({state['seconds']:.0f}s)",
                flush=True,
            )
        done = state["step"] >= steps or state["seconds"] >= budget
        if state["step"] % int(cfg["checkpoint_every"]) == 0 or done:
            tmp = ckpt.with_suffix(".tmp")
            torch.save(
                {"heads": heads.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(), "state": state}, tmp
            )
            tmp.replace(ckpt)
    heads.eval()
    stride = int(cfg["eval_stride"])
    held = evaluate(heads, target, held_h, held_t, stride)
    untrained = evaluate(
        TokenSwiftHeads(target.args.hidden_size, heads.gamma, target.args.rms_eps), target, held_h, held_t, stride
    )
    held_sampled = evaluate(heads, target, held_h, held_t, stride, sampling) if sampling is not None else None
    split = manifest["splits"]["train"]
    report = {
        "model": str(model_path.name),
        "train_contexts": n_train,
        "heldout_contexts": n_held,
        "heldout_split": cfg["heldout_split"],
        "context_tokens": int(train_t.shape[1]),
        "corpus_train_groups": len(split["groups_used"]),
        "steps": state["step"],
        "positions_per_step": int(cfg["batch_positions"]),
        "train_vocab": int(cfg["train_vocab"]) if cfg["train_vocab"] else None,
        "train_seconds": round(state["seconds"], 1),
        "final_train_loss": state["log"][-1]["loss"] if state["log"] else None,
        "heldout": held,
        "heldout_untrained": untrained,
        "heldout_sampled": held_sampled,
        "config": cfg,
        "wall_seconds_this_run": round(time.perf_counter() - t_run, 1),
    }
    out = Path(cfg["out_dir"])
    heads.vocab_ids = vocab  # drafting scores the tokens the heads were trained on (None: all)
    heads.save(out, target, {"trained": {k: report[k] for k in ("steps", "train_contexts", "heldout")}})
    (work / "report.json").write_text(json.dumps(report, indent=1))
    return report


def write_card(report: dict, out_dir: Path, config_file: str | None = None) -> Path:
    """MODEL_CARD.md beside the heads: data, tokens, steps, time, losses and held-out accuracy."""
    held, base = report["heldout"], report["heldout_untrained"]
    cfg = report["config"]
    rows = "\n".join(
        f"| head {i + 1} (token t+{i + 2}) | {held['head_ce'][i]:.3f} | {held['head_top1'][i]:.3f} | "
        f"{held['head_target_top1'][i]:.3f} | {held['head_target_prob'][i]:.3f} | "
        f"{base['head_top1'][i]:.3f} | {base['head_target_prob'][i]:.3f} |"
        for i in range(len(held["head_ce"]))
    )
    distill = float(cfg.get("distill", 0.0))
    held_what = (
        f"{report['heldout_contexts']} contexts of the corpus's eval split (packages and documents no training\n"
        "  context comes from; half prose, half code)"
        if report.get("heldout_split") == "eval"
        else f"{report['heldout_contexts']} further train-split contexts never trained on"
    )
    labels = (
        f"{1 - distill:g} x CE(head i at t, corpus token t+1+i) + {distill:g} x CE against the target's own\n"
        "  distribution at that position (computed from the stored hidden states)"
        if distill
        else "CE(head i at t, corpus token t+1+i)"
    )
    sampled = report.get("heldout_sampled")
    if sampled:
        params = ", ".join(f"{k} {v}" for k, v in cfg["sampling"].items())
        sampling_note = (
            f"- Trained for requests sampled with {params}: the target's distribution above is the one it\n"
            "  samples from there (contextual penalty over the window before the predicted token, min-p), and the\n"
            "  heads' logits get the penalty the drafter applies (over the window ending at the step's root).\n"
        )
        sampled_rows = "\n".join(
            f"| head {i + 1} | {sampled['head_target_top1'][i]:.3f} | {sampled['head_target_prob'][i]:.3f} |"
            for i in range(len(sampled["head_ce"]))
        )
        sampled_table = f"""
Under that sampling, on the same positions: "top-1 = target" against the target's
penalised argmax, "P(top-1)" the probability that the target's sampling distribution there gives the head's
penalised top token (its acceptance in serving at these parameters).

| head | top-1 = target | P(top-1) |
|---|---|---|
{sampled_rows}
"""
    else:
        sampling_note = sampled_table = ""
    vocab_note = (
        f"- Drafting scores only these {report['train_vocab']} tokens (their ids ship with the heads), so a draft reads"
        "\n  that fraction of the LM head's rows; other tokens are never proposed.\n"
        if report.get("train_vocab")
        else ""
    )
    target = json.loads((Path(out_dir) / CONFIG_FILE).read_text())["target"]  # written with the heads
    name, d = cfg.get("model") or "SmolLM2-135M-Instruct (the embedded default)", target["hidden_size"]
    text = f"""# TokenSwift heads for {name}

Three residual linear heads (h_i = h_(i-1) + W_i rmsnorm_i(h_(i-1)), W_i {d}x{d}, no bias) on the target's last
hidden state; their logits go through the target's own frozen final norm and LM head. Used by
`--method tokenswift` (`spyglass/drafters/tokenswift.py`) on this model when no `--draft-checkpoint` is given.

- Target: {name}, `{report["model"]}` (the GGUF's fp32 conversion); the checkpoint records a signature of the
  target's final norm and LM head and refuses to load on another model.
- Data: the offline corpus's **train split** only (`spyglass/training/data.py`: Python documentation prose and
  installed packages' source, split by package/document; the eval split's groups are held out for benchmarks):
  {report["train_contexts"]} contexts of {report["context_tokens"]} tokens
  ({report["train_contexts"] * report["context_tokens"]:,} tokens) from {report["corpus_train_groups"]} groups,
  hidden states extracted once by the frozen target.
- Training: {report["steps"]} steps of {report["positions_per_step"]} random positions
  (AdamW lr {cfg["lr"]}, weight decay {cfg["weight_decay"]}, {cfg["warmup"]} warm-up steps then cosine,
  grad clip 1.0); loss per head = {labels}, summed over heads, over the
  {report.get("train_vocab") or "full"} most frequent training tokens (a CPU budget: positions whose corpus
  token is outside are skipped); {report["train_seconds"]:.0f} s of training steps on
  {cfg["threads"]} CPU thread(s). Final training loss (reduced vocabulary): {report["final_train_loss"]:.3f}.
{sampling_note}{vocab_note}- Held-out: {held_what}, every {cfg.get("eval_stride", 4)}th position
  ({held["positions"]:,} positions), **full {target["vocab_size"]:,}-token vocabulary**. Base next-token top-1
  (the target itself): {held["base_top1"]:.3f}.

"top-1 = target" is greedy acceptance (the head's top token is the target's); "P_target(top-1)" is the chance
the target samples the head's top token at T=1 (its acceptance there, before min-p and penalties).

| head | CE (corpus) | top-1 = corpus | top-1 = target | P_target(top-1) | untrained: = corpus | untrained: P_target |
|---|---|---|---|---|---|---|
{rows}
{sampled_table}
Reproduce (resumable): `python -m spyglass.training.tokenswift_train {config_file or "CONFIG.yaml"}`.
This is a short run on a CPU; the paper trains 200 steps of ~1M tokens each on GPUs.
"""
    path = Path(out_dir) / "MODEL_CARD.md"
    path.write_text(text)
    return path


def resolve_config(raw: dict) -> dict:
    """DEFAULTS overlaid with a config's options (`spyglass train`'s `trainer` and `name` keys aside)."""
    options = {k: v for k, v in raw.items() if k not in ("trainer", "name")}
    unknown = set(options) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown tokenswift option(s): {', '.join(sorted(unknown))}")
    cfg = {**DEFAULTS, **options}
    sampling_of(cfg)
    return cfg


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--max-minutes", type=float)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--card-only", action="store_true", help="rewrite MODEL_CARD.md from the last report.json")
    ap.add_argument("--evaluate", metavar="HEADS_DIR", help="only evaluate these heads on the run's held-out split")
    args = ap.parse_args(argv)
    try:
        cfg = resolve_config(yaml.safe_load(Path(args.config).read_text()) or {})
    except ValueError as e:
        raise SystemExit(str(e)) from e
    for key in ("max_minutes", "steps", "threads"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    if args.card_only:
        report = json.loads((Path(cfg["workdir"]) / "report.json").read_text())
        print(write_card(report, Path(cfg["out_dir"]), args.config))
        return 0
    if args.evaluate:
        print(json.dumps(evaluate_checkpoint(cfg, args.evaluate), indent=1))
        return 0
    report = run(cfg)
    write_card(report, Path(cfg["out_dir"]), args.config)
    print(json.dumps({k: v for k, v in report.items() if k != "config"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
