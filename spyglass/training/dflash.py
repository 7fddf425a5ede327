"""Training the DFlash block drafter and the DeLS-Spec local head on the offline corpus (train split only).

A small CPU recipe, resumable (the work directory holds `state.pt`, written every few minutes, and the
loss log), with a progress bar and a loss-curve PNG, then an export into a checkpoint directory:

    python -m spyglass.training.dflash dflash --workdir .cache/runs/dflash-smollm2 --minutes 14 \
        --out spyglass/drafts/smollm2-135m-dflash
    python -m spyglass.training.dflash dels --workdir .cache/runs/dflash-smollm2 --minutes 6 \
        --out spyglass/drafts/smollm2-135m-dels

DFlash: the target's hidden states are computed on the fly (only its layers up to the deepest tapped one run,
in inference mode); each context feeds `--inner` optimiser steps, each on a fresh set of random anchors. With
`--distill` the whole target runs and its greedy next tokens replace the text as targets (what verification
accepts); `--init-from-target` starts the layers from the target's last ones (see `DFlashDraft.from_target`).
DeLS: only the target's embedding and head are read (`read_frozen_io`); windows of 16 tokens from random
anchors, exp(-k/7)-weighted next-token loss; the unigram prior is counted over the same train split.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from spyglass.drafters.small_lm import truncated_draft
from spyglass.models.drafts.dels import (
    LocalHead,
    LocalHeadConfig,
    read_frozen_io,
    save_local_head,
    token_counts,
    unigram_log_prior,
)
from spyglass.models.drafts.dflash import DFlashDraft, load_dflash, save_dflash
from spyglass.models.llama import Segment, load_transformer
from spyglass.models.loader import load_tokenizer, resolve_model
from spyglass.training import repo_relative
from spyglass.training.data import CorpusConfig, build_corpus, load_contexts
from spyglass.training.losses import dflash_loss, local_head_loss


def _lr(step: int, total: int, base: float, warmup: float = 0.04) -> float:
    w = max(1, int(total * warmup))
    if step < w:
        return base * (step + 1) / w
    return base * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - w) / max(1, total - w))))


def _corpus(
    workdir: Path, model_path: Path, train_contexts: int, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    cfg = CorpusConfig(seq_len=seq_len, max_contexts={"train": train_contexts, "eval": 48})
    manifest = build_corpus(cfg, load_tokenizer(model_path), workdir / "corpus")
    return load_contexts(workdir / "corpus", "train"), load_contexts(workdir / "corpus", "eval"), manifest


def _split_summary(manifest: dict) -> dict:
    train = manifest["splits"]["train"]
    return {"seq_len": manifest["seq_len"], **{k: train[k] for k in ("contexts", "tokens", "kinds")}}


def _plot(log: list[dict], path: Path, title: str) -> None:
    import matplotlib  # the `dev` extra: plots are optional

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = [r["step"] for r in log]
    ax.plot(steps, [r["loss"] for r in log], lw=0.8, label="train loss")
    if len(log) > 20:
        k = 20
        smooth = [sum(r["loss"] for r in log[max(0, i - k) : i + 1]) / min(i + 1, k + 1) for i in range(len(log))]
        ax.plot(steps, smooth, lw=1.5, label="moving mean")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _spent(t0_wall: float, t0_cpu: float, budget: str) -> float:
    """Seconds counted against --minutes: this process's CPU time (default; on a shared machine wall time says
    little about the work done) or wall time."""
    return (time.process_time() - t0_cpu) if budget == "cpu" else (time.monotonic() - t0_wall)


def _recipe(args) -> dict:
    """The run's options as shipped in a model card: paths relative to the repository."""
    paths = ("workdir", "out", "model", "init_from")
    return {k: repo_relative(v) if k in paths and v else v for k, v in vars(args).items() if k != "func"}


def warm_start(draft, checkpoint: str | Path, target) -> None:
    """Load a trained DFlash draft's weights into `draft`: the block size is not in them, so a new recipe (another
    block size or loss weighting) starts from what an earlier run learned. Tapping as many target layers but other
    ones keeps `fc` as it is, each new layer taking the columns of the old one in its place (the residual stream of
    nearby layers is alike). ValueError if the draft's layers or the number of tapped layers differ."""
    warm = load_dflash(checkpoint, target)
    mine, theirs = draft.cfg, warm.cfg
    if (theirs.n_layers, len(theirs.target_layers)) != (mine.n_layers, len(mine.target_layers)):
        raise ValueError(
            f"init_from {checkpoint}: {theirs.n_layers} layers reading target layers {list(theirs.target_layers)}, "
            f"this run {mine.n_layers} reading {list(mine.target_layers)}"
        )
    if theirs.copy_head and not mine.copy_head:
        raise ValueError(f"init_from {checkpoint} has a copy head; this run has none (pass --copy-head)")
    # a copy head added to a draft trained without one starts fresh (its initialisation barely moves the ranking)
    missing, _ = draft.load_state_dict(warm.state_dict(), strict=False)
    if any(not k.startswith("copy_") for k in missing):
        raise ValueError(f"init_from {checkpoint}: missing {missing}")


def _save_state(path: Path, **state) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def target_features(
    stack, cache, slot: int, tokens: torch.Tensor, layers: tuple[int, ...], greedy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Concatenated hidden states `[L, len(layers)*H]` of `tokens` (one forward, nothing committed) and, with
    `greedy` (`stack` must then be the whole target), the target's argmax next token at every position and its
    last layer's keys `[kvh, L, D]` (a copy head's pointer reads them)."""
    stack.capture_layers = layers
    n = tokens.shape[0]
    out = stack([Segment(slot, 0, tokens, torch.arange(n), None, "all" if greedy else "none")], cache)
    feats = torch.cat([stack.captured[0][i] for i in layers], dim=-1).clone()
    if not greedy:
        return feats, None, None
    return feats, out[0].argmax(-1), cache.layer(slot, stack.args.n_layers - 1)[0][:, :n].clone()


def write_model_card(out: Path, title: str, what: str, summary: dict) -> None:
    """MODEL_CARD.md beside an exported checkpoint: data, tokens, steps, time, losses (acceptance on held-out
    prompts is measured by bench/dflash.py and added under its own heading)."""
    skip = ("config", "recipe", "train_split")
    lines = [f"# {title}", "", what, "", "## Training (this repository, `python -m spyglass.training.dflash`)", ""]
    split = summary.get("train_split", {})
    lines.append(
        f"- data: the offline corpus's **train split** only ({split.get('contexts')} contexts of "
        f"{split.get('seq_len', 512)} tokens, "
        f"{split.get('tokens')} tokens; groups: {split.get('kinds')}); the eval split's packages and documents "
        "(the benchmark prompts' sources) were never trained on"
    )
    lines += [f"- {k}: {v}" for k, v in summary.items() if k not in skip]
    lines += ["", "Recipe:", "", "```json", json.dumps(summary.get("recipe", {}), indent=1), "```", ""]
    lines += ["Configuration:", "", "```json", json.dumps(summary.get("config", {}), indent=1), "```", ""]
    (Path(out) / "MODEL_CARD.md").write_text("\n".join(lines))


def train_dflash(args) -> dict:
    from tqdm import tqdm  # the `train` extra

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    model_path = resolve_model(args.model, dtype="float32").path
    train, evals, manifest = _corpus(work, model_path, args.train_contexts, args.seq_len)
    target = load_transformer(model_path)
    overrides = {"n_layers": args.layers, "block_size": args.block, "intermediate_size": args.intermediate}
    if args.copy_head:
        if not args.distill:
            raise ValueError("--copy-head reads the target's last-layer keys: it needs --distill (the whole target)")
        overrides["copy_head"] = True
    if args.target_layers:
        overrides["target_layers"] = tuple(int(x) for x in args.target_layers.split(","))
    draft = DFlashDraft.from_target(target, init_from_target=args.init_from_target, **overrides).float().train()
    if args.init_from:
        warm_start(draft, args.init_from, target)
    layers = draft.cfg.target_layers
    # distillation needs the target's own next-token choices, so the whole target runs; otherwise only the
    # layers up to the deepest tapped one
    stack = target if args.distill else truncated_draft(target, max(layers) + 1)
    cache = stack.new_cache(train.shape[1], 1)
    slot = cache.allocate()
    params = [p for p in draft.parameters() if p.requires_grad]
    # a copy head added to a trained draft learns at `copy_lr_scale` times the rate (at the base rate its gate
    # barely moves: the first run kept ~0.9 of the mass on the LM head, spread its copies thin, and rarely copied)
    copy_ids = {id(p) for n, p in draft.named_parameters() if n.startswith("copy_")}
    groups = [{"params": [p for p in params if id(p) not in copy_ids], "scale": 1.0}]
    if copy_ids:
        groups.append({"params": [p for p in params if id(p) in copy_ids], "scale": args.copy_lr_scale})
    opt = torch.optim.AdamW(groups, lr=args.lr, weight_decay=0.0)
    vocab_ids = None
    if args.train_vocab:  # the most frequent train-split tokens: the head's softmax is most of a CPU step
        counts = torch.bincount(train.reshape(-1), minlength=draft.cfg.vocab_size)
        vocab_ids = counts.argsort(descending=True)[: args.train_vocab].sort().values
    state_path = work / "dflash-state.pt"
    step, log, elapsed, seen_tokens, cpu_s = 0, [], 0.0, 0, 0.0
    if state_path.exists() and not args.fresh:
        st = torch.load(state_path, weights_only=False)
        draft.load_state_dict(st["draft"])
        opt.load_state_dict(st["opt"])
        step, log, elapsed, seen_tokens = st["step"], st["log"], st["elapsed"], st["seen_tokens"]
        cpu_s = st.get("cpu_s", elapsed)  # states written before CPU accounting: count their wall time
    order = torch.randperm(train.shape[0], generator=torch.Generator().manual_seed(args.seed))
    b = draft.cfg.block_size
    total = args.max_steps
    bar = tqdm(total=total, initial=step, desc="dflash", mininterval=5)
    t_last_save = time.monotonic()
    t0 = time.monotonic() - elapsed
    t0_cpu = time.process_time() - cpu_s
    gen = torch.Generator().manual_seed(args.seed + step)
    while step < total and _spent(t0, t0_cpu, args.budget) < args.minutes * 60:
        tokens = train[order[(step // args.inner) % train.shape[0]]]
        with torch.no_grad():  # (the forward runs in inference mode; the concatenation makes a normal tensor)
            feats, labels, keys = target_features(stack, cache, slot, tokens, layers, args.distill)
        seen_tokens += tokens.shape[0]
        for _ in range(args.inner):
            anchors = torch.randperm(tokens.shape[0] - b - 1, generator=gen)[: args.anchors].sort().values + 1
            for g in opt.param_groups:
                g["lr"] = _lr(step, total, args.lr) * g.get("scale", 1.0)  # (states saved before scales: 1)
            loss, m = dflash_loss(draft, feats, tokens, anchors, args.gamma, vocab_ids, labels, keys)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            log.append({"step": step, "loss": float(loss), **m})
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{float(loss):.3f}", acc1=f"{m['acc_first']:.2f}", chain=f"{m['accepted_chain']:.2f}")
        if time.monotonic() - t_last_save > 120:
            _save_state(
                state_path,
                draft=draft.state_dict(),
                opt=opt.state_dict(),
                step=step,
                log=log,
                elapsed=time.monotonic() - t0,
                cpu_s=time.process_time() - t0_cpu,
                seen_tokens=seen_tokens,
            )
            t_last_save = time.monotonic()
    bar.close()
    elapsed, cpu_s = time.monotonic() - t0, time.process_time() - t0_cpu
    _save_state(
        state_path,
        draft=draft.state_dict(),
        opt=opt.state_dict(),
        step=step,
        log=log,
        elapsed=elapsed,
        cpu_s=cpu_s,
        seen_tokens=seen_tokens,
    )
    # held-out: the eval split's packages/documents never trained on
    draft.eval()
    ev_loss, ev_acc1, ev_chain = [], [], []
    with torch.inference_mode():
        for i in range(min(args.eval_contexts, evals.shape[0])):
            tokens = evals[i]
            feats, labels, keys = target_features(stack, cache, slot, tokens, layers, args.distill)
            anchors = torch.arange(1, tokens.shape[0] - b - 1, 7)
            loss, m = dflash_loss(draft, feats, tokens, anchors, args.gamma, labels=labels, keys=keys)
            ev_loss.append(float(loss))
            ev_acc1.append(m["acc_first"])
            ev_chain.append(m["accepted_chain"])
    _plot(log, work / "dflash-loss.png", "DFlash draft, SmolLM2-135M")
    tail = log[-50:]
    against = "target" if args.distill else "text"
    summary = {
        "steps": step,
        "wall_time_s": round(elapsed, 1),
        "cpu_time_s": round(cpu_s, 1),
        "context_tokens_seen": seen_tokens,
        "block_tokens_trained": step * args.anchors * (b - 1),
        "final_train_loss_mean50": sum(r["loss"] for r in tail) / max(1, len(tail)),
        "eval_loss": sum(ev_loss) / max(1, len(ev_loss)),
        f"eval_first_token_acc_vs_{against}": sum(ev_acc1) / max(1, len(ev_acc1)),
        f"eval_chain_accepted_vs_{against}": sum(ev_chain) / max(1, len(ev_chain)),
        "train_split": _split_summary(manifest),
        "config": draft.cfg.to_dict(),
        "recipe": _recipe(args),
    }
    (work / "dflash-summary.json").write_text(json.dumps(summary, indent=1))
    if args.out:
        draft.vocab_ids = vocab_ids  # served over the rows it was trained on
        save_dflash(draft, args.out, card=summary)
        write_model_card(
            Path(args.out),
            "DFlash block drafter for SmolLM2-135M(-Instruct)",
            "Block drafter (spyglass/models/drafts/dflash.py): [root, MASK x (b-1)] through "
            f"{draft.cfg.n_layers} non-causal layers whose keys/values also cover the context stream "
            f"(target layers {list(draft.cfg.target_layers)} concatenated -> fc -> RMSNorm); the target's "
            "embedding and LM head are shared and frozen (not in this checkpoint). Weights in bf16.",
            summary,
        )
    return summary


def train_dels(args) -> dict:
    from tqdm import tqdm  # the `train` extra

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    model_path = resolve_model(args.model, dtype="float32").path
    train, evals, manifest = _corpus(work, model_path, args.train_contexts, args.seq_len)
    embed, head_w = read_frozen_io(model_path)  # the target's layers are never loaded
    cfg = LocalHeadConfig(embed.shape[1], embed.shape[0], args.gru_hidden, args.rank, args.window, args.gamma)
    head = LocalHead(cfg, embed, head_w).train()
    head.log_unigram.copy_(unigram_log_prior(token_counts(train, cfg.vocab_size)))
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    state_path = work / "dels-state.pt"
    step, log, elapsed, cpu_s = 0, [], 0.0, 0.0
    if state_path.exists() and not args.fresh:
        st = torch.load(state_path, weights_only=False)
        head.load_state_dict(st["head"])
        opt.load_state_dict(st["opt"])
        step, log, elapsed, cpu_s = st["step"], st["log"], st["elapsed"], st.get("cpu_s", st["elapsed"])
    flat = train.reshape(-1)
    gen = torch.Generator().manual_seed(args.seed + step)
    bar = tqdm(total=args.max_steps, initial=step, desc="dels", mininterval=5)
    t0 = time.monotonic() - elapsed
    t0_cpu = time.process_time() - cpu_s
    t_last_save = time.monotonic()
    while step < args.max_steps and _spent(t0, t0_cpu, args.budget) < args.minutes * 60:
        starts = torch.randint(0, flat.shape[0] - cfg.window, (args.batch,), generator=gen)
        windows = flat[starts.unsqueeze(1) + torch.arange(cfg.window)]
        for g in opt.param_groups:
            g["lr"] = _lr(step, args.max_steps, args.lr)
        loss = local_head_loss(head, windows)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        log.append({"step": step, "loss": float(loss)})
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{float(loss):.3f}")
        if time.monotonic() - t_last_save > 120:
            _save_state(state_path, head=head.state_dict(), opt=opt.state_dict(), step=step, log=log,
                        elapsed=time.monotonic() - t0, cpu_s=time.process_time() - t0_cpu)  # fmt: skip
            t_last_save = time.monotonic()
    bar.close()
    elapsed, cpu_s = time.monotonic() - t0, time.process_time() - t0_cpu
    _save_state(
        state_path, head=head.state_dict(), opt=opt.state_dict(), step=step, log=log, elapsed=elapsed, cpu_s=cpu_s
    )
    head.eval()
    with torch.no_grad():
        ev = evals.reshape(-1)
        starts = torch.arange(0, ev.shape[0] - cfg.window, 97)[:512]
        ev_loss = float(local_head_loss(head, ev[starts.unsqueeze(1) + torch.arange(cfg.window)]))
    _plot(log, work / "dels-loss.png", "DeLS local head, SmolLM2-135M")
    tail = log[-50:]
    summary = {
        "steps": step,
        "wall_time_s": round(elapsed, 1),
        "cpu_time_s": round(cpu_s, 1),
        "window_tokens_trained": step * args.batch * cfg.window,
        "final_train_loss_mean50": sum(r["loss"] for r in tail) / max(1, len(tail)),
        "eval_loss": ev_loss,
        "unigram_counted_tokens": int(train.numel()),
        "train_split": _split_summary(manifest),
        "config": cfg.to_dict(),
        "recipe": _recipe(args),
    }
    (work / "dels-summary.json").write_text(json.dumps(summary, indent=1))
    if args.out:
        save_local_head(head, args.out, card=summary)
        write_model_card(
            Path(args.out),
            "DeLS-Spec local head for SmolLM2-135M(-Instruct)",
            "Short-context expert (spyglass/models/drafts/dels.py): the target's frozen embeddings -> bias-free GRU "
            f"({cfg.gru_hidden}) -> rank {cfg.rank} (SiLU) -> w_up -> the target's frozen LM head, plus the "
            "unigram log-prior of the train split (add-one smoothing). Trained without the target's layers "
            "(only its embedding and head matrices are read). Fused into DFlash's block as "
            "l = l_L + alpha * l_S - beta * log p_unigram from the second drafted position on.",
            summary,
        )
    return summary


def main(argv: list[str] | None = None, return_summary: bool = False):
    p = argparse.ArgumentParser(prog="python -m spyglass.training.dflash", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="stage", required=True)
    for name in ("dflash", "dels"):
        s = sub.add_parser(name)
        s.add_argument("--workdir", required=True)
        s.add_argument("--out", default=None, help="checkpoint directory to export to")
        s.add_argument("--model", default=None, help="target (default: the embedded SmolLM2)")
        s.add_argument("--minutes", type=float, default=10.0, help="budget (resumed runs count it all)")
        s.add_argument("--budget", choices=("cpu", "wall"), default="cpu", help="what --minutes counts")
        s.add_argument("--threads", type=int, default=1)
        s.add_argument("--seed", type=int, default=42)
        s.add_argument("--train-contexts", type=int, default=1024)
        s.add_argument("--seq-len", type=int, default=512, help="tokens per corpus context")
        s.add_argument("--gamma", type=float, default=7.0)
        s.add_argument("--fresh", action="store_true", help="ignore a saved state")
    d = sub.choices["dflash"]
    d.add_argument("--layers", type=int, default=2)
    d.add_argument("--block", type=int, default=16)
    d.add_argument("--intermediate", type=int, default=None, help="draft MLP width (default: the target's)")
    d.add_argument("--target-layers", default=None, help="comma-separated target layer indices")
    d.add_argument("--init-from-target", action=argparse.BooleanOptionalAction, default=True)
    d.add_argument("--init-from", default=None, help="start from this DFlash checkpoint's weights")
    d.add_argument("--anchors", type=int, default=32)
    d.add_argument("--inner", type=int, default=2, help="optimiser steps per target forward")
    d.add_argument("--lr", type=float, default=6e-4)
    d.add_argument("--max-steps", type=int, default=600)
    d.add_argument("--train-vocab", type=int, default=0, help="softmax over the N most frequent tokens (0 = all)")
    d.add_argument("--eval-contexts", type=int, default=8)
    d.add_argument("--copy-lr-scale", type=float, default=1.0, help="the copy head's learning rate over --lr")
    d.add_argument(
        "--copy-head",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="a pointer over the target's last-layer keys",
    )
    d.add_argument(
        "--distill",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="train on the target's greedy next tokens (what verification accepts) instead of the text",
    )
    d.set_defaults(func=train_dflash)
    h = sub.choices["dels"]
    h.add_argument("--gru-hidden", type=int, default=256)
    h.add_argument("--rank", type=int, default=128)
    h.add_argument("--window", type=int, default=16)
    h.add_argument("--batch", type=int, default=64)
    h.add_argument("--lr", type=float, default=2e-3)
    h.add_argument("--max-steps", type=int, default=400)
    h.set_defaults(func=train_dels)
    args = p.parse_args(argv)
    summary = args.func(args)
    if return_summary:
        return summary
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
