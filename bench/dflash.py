"""DFlash and DFlash + DeLS-Spec on held-out long-context prompts (bench/tasks.py), SmolLM2 fp32, vs plain
decoding and n-gram drafting, side by side in one run. Writes bench/results/dflash.json (+ .png).

    python bench/dflash.py [--per-kind 1] [--max-new-tokens 96] [--kinds code,edit,summary] [--sampled]

Two parts:
1. End to end through the engine (speculation controller on, as served): per prompt, decode tokens/s of ar,
   ngram, suffix, dflash, dflash-dels, composite-dflash (suffix lookups + DFlash + DeLS in one tree) and, for a
   draft with a copy head, dflash-span and dflash-dels-span (speedup = ratio to ar on the same prompt), tau,
   greedy identity; `--sampled` adds T=1 runs (seeded) of all but ngram, and of DFlash and DeLS with the
   controller off (every block verified: the drafts' own tau, not the controller's choices).
2. Acceptance along the greedy output (no controller, no timing): one target forward over prompt + ar's
   output gives the hidden states; at every output position the block is drafted exactly as served (context
   stream = positions before the root; a copy head's mixture as served) and its chain compared with the text
   that follows (no spans: the block's own positions). This gives acceptance
   by block position for DFlash and DeLS and the 3x3 grid of alpha, beta in {0.1, 0.3, 0.5} (chain tau =
   1 + mean accepted drafts per position). At T=1: per block position, sum_x min(p, q), how often rejection
   sampling accepts a token drawn from the draft's row q where the target's is p (DeLS's local head stepped on
   the text, what it has seen whenever the chain before that position was accepted).

No Redis context cache here: a cached prefix has no target hidden states, and DFlash's context stream would
then miss it. Decode speed is measured after the first token, so prefill does not enter the ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import (  # noqa: E402
    RESULTS_DIR,
    load_model,
    machine_load,
    median,
    median_runs,
    plot_panels,
    wait_for_quiet,
    write_results,
)
from bench.tasks import HeldOutTask, heldout_tasks  # noqa: E402
from spyglass.cost import measured_curve  # noqa: E402
from spyglass.drafters import METHODS  # noqa: E402
from spyglass.drafters.composite import CompositeDrafter  # noqa: E402
from spyglass.drafters.dflash import DEFAULT_DELS, DEFAULT_DFLASH, DFlashDrafter, fuse, mix_copies  # noqa: E402
from spyglass.drafters.ngram import NgramDrafter  # noqa: E402
from spyglass.drafters.suffix import SuffixDrafter  # noqa: E402
from spyglass.models.drafts.dels import load_local_head  # noqa: E402
from spyglass.models.drafts.dflash import load_dflash  # noqa: E402
from spyglass.models.llama import Segment  # noqa: E402
from spyglass.sampling import SamplingParams  # noqa: E402
from spyglass.spans import SPAN  # noqa: E402
from spyglass.training import repo_relative  # noqa: E402
from spyglass.training.losses import training_mask  # noqa: E402

GRID = (0.1, 0.3, 0.5)


def chain_acceptance(target, draft, head, task: HeldOutTask, output: list[int], grid, chunk: int = 16) -> dict:
    """Accepted drafted tokens per output position for DFlash alone and for each (alpha, beta) of DeLS."""
    tokens = torch.tensor(task.prompt_ids + output)
    n_prompt = len(task.prompt_ids)
    layers = draft.cfg.target_layers
    cache = target.new_cache(tokens.shape[0] + 1, 1)
    slot = cache.allocate()
    target.capture_layers = tuple(layers)
    target_logits = []  # the target's rows from the last prompt token on: row i predicts token n_prompt + i
    try:
        for s in range(0, tokens.shape[0], 512):
            part = tokens[s : s + 512]
            (rows,) = target([Segment(slot, s, part, torch.arange(s, s + part.shape[0]), None, "all")], cache)
            target_logits.append(rows[max(0, n_prompt - 1 - s) :])
            cache.commit(slot, s, list(range(part.shape[0])))
            feats_part = torch.cat([target.captured[0][i] for i in layers], dim=-1)
            ctx_part = draft.context_kv(feats_part, torch.arange(s, s + part.shape[0]))
            if s == 0:
                ctx = [([k], [v]) for k, v in ctx_part]
            else:
                for (ks, vs), (k, v) in zip(ctx, ctx_part, strict=True):
                    ks.append(k)
                    vs.append(v)
    finally:
        target.capture_layers = ()
    ctx = [(torch.cat(ks, dim=1), torch.cat(vs, dim=1)) for ks, vs in ctx]
    b = draft.cfg.block_size
    # roots at every output position with a full block of text after it
    roots = torch.arange(n_prompt, tokens.shape[0] - b)
    runs = {"dflash": [], **{f"{a},{bt}": [] for a, bt in grid}}
    by_pos = {"dflash": torch.zeros(b - 1), "dels": torch.zeros(b - 1)}
    p_t1 = torch.softmax(torch.cat(target_logits), -1)
    t1_by_pos = {"dflash": torch.zeros(b - 1), "dels": torch.zeros(b - 1)}
    for c in range(0, roots.shape[0], chunk):
        anchors = roots[c : c + chunk]
        x = draft.block_input(tokens[anchors], b)
        pos = (anchors.unsqueeze(1) + torch.arange(b)).reshape(-1)
        mask = training_mask(anchors, tokens.shape[0], b)
        out = draft.blocks_hidden(x, pos, ctx, mask).view(anchors.shape[0], b, -1)
        long = draft.logits(out[:, 1:].reshape(-1, x.shape[-1]))
        if draft.cfg.copy_head:  # the served rows: mixed with the pointer's copies of what precedes the root
            n = tokens.shape[0]
            keys = cache.layer(slot, target.args.n_layers - 1)[0][:, :n]
            visible = torch.arange(n).unsqueeze(0) < anchors.repeat_interleave(b - 1).unsqueeze(1)
            query_pos = (anchors.unsqueeze(1) + torch.arange(b - 1)).reshape(-1)
            keep, mass = draft.copy_read(out[:, :-1].reshape(-1, x.shape[-1]), query_pos, keys, visible)
            long = mix_copies(long, keep, mass, torch.cat([tokens[1:], tokens[-1:]]))
        long = long.view(anchors.shape[0], b - 1, -1)
        for r, a in enumerate(anchors.tolist()):
            truth = tokens[a + 1 : a + b].tolist()
            chain = long[r].argmax(-1).tolist()
            k = _run(chain, truth)
            runs["dflash"].append(k)
            by_pos["dflash"][:k] += 1
            for alpha, beta in grid:
                chain = _fused_rows(long[r], head, alpha, beta).argmax(-1).tolist()
                k = _run(chain, truth)
                runs[f"{alpha},{beta}"].append(k)
                if (alpha, beta) == (0.3, 0.3):
                    by_pos["dels"][:k] += 1
            p = p_t1[a + 1 - n_prompt : a + b - n_prompt]
            t1_by_pos["dflash"] += _overlap(p, long[r])
            t1_by_pos["dels"] += _overlap(p, _fused_rows(long[r], head, 0.3, 0.3, truth))
    # the local head on its own, teacher-forced on the text after each root (what it sees when the chain is right)
    head_hits = head_total = 0
    for c in range(0, roots.shape[0], 64):
        anchors = roots[c : c + 64]
        win = tokens[(anchors.unsqueeze(1) + torch.arange(1, b)).clamp(max=tokens.shape[0] - 1)]
        pred = head.sequence_logits(win[:, :-1]).argmax(-1)
        head_hits += int((pred == win[:, 1:]).sum())
        head_total += pred.numel()
    n = max(1, roots.shape[0])
    return {
        "local_head_top1_teacher_forced": head_hits / max(1, head_total),
        "positions": int(roots.shape[0]),
        "tau": {k: 1 + sum(v) / n for k, v in runs.items()},
        "acceptance_by_position": {k: (v / n).tolist() for k, v in by_pos.items()},
        "t1_acceptance_by_position": {k: (v / n).tolist() for k, v in t1_by_pos.items()},
    }


def _run(chain: list[int], truth: list[int]) -> int:
    k = 0
    while k < len(chain) and chain[k] == truth[k]:
        k += 1
    return k


def _overlap(p: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """sum_x min(p, q) per row, q = softmax(logits): how often rejection sampling accepts a token drawn from q
    where the target samples from p (T=1)."""
    return torch.minimum(p, torch.softmax(logits, -1)).sum(-1)


def _fused_rows(long: torch.Tensor, head, alpha: float, beta: float, text: list[int] | None = None) -> torch.Tensor:
    """DeLS's rows as served (`DFlashDrafter._position_logits`): the first position DFlash alone, then fused with the
    local head stepped on `text` (what it has seen whenever the chain before a position was accepted) or, without
    it, on the chain's own argmaxes (the served greedy chain)."""
    rows, h = [long[0]], None
    for j in range(1, long.shape[0]):
        h = head.step(text[j - 1] if text is not None else int(rows[-1].argmax()), h)
        rows.append(fuse(long[j], head.logits(h), head.log_unigram, alpha, beta))
    return torch.stack(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--per-kind", type=int, default=1)
    ap.add_argument("--kinds", default="code,edit,summary")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sampled", action="store_true", help="also T=1 runs of every method but ngram")
    ap.add_argument("--no-grid", action="store_true")
    ap.add_argument("--repeats", type=int, default=1, help="greedy runs per method and prompt (the median is kept)")
    ap.add_argument("--shortest", type=int, default=0, help="keep only the N shortest prompts (0 = all)")
    ap.add_argument("--dflash", default=str(DEFAULT_DFLASH))
    ap.add_argument("--dels", default=str(DEFAULT_DELS))
    ap.add_argument("--name", default="dflash")
    args = ap.parse_args()
    quiet = wait_for_quiet(max_load=1.0, timeout_s=60)
    target, tok, _ = load_model(threads=args.threads)
    draft = load_dflash(args.dflash, target)
    head = load_local_head(args.dels, target)
    t0 = time.perf_counter()
    curve = measured_curve(target, target.new_cache(8192, 1))
    curve_s = time.perf_counter() - t0
    tasks = heldout_tasks(tok, kinds=tuple(args.kinds.split(",")), per_kind=args.per_kind)
    if args.shortest:  # a reduced run: the shortest held-out prompts only (prefill dominates a CPU run)
        tasks = sorted(tasks, key=lambda t: len(t.prompt_ids))[: args.shortest]
    makers = {
        "ngram": NgramDrafter,
        "dflash": lambda: DFlashDrafter(draft),
        "dflash-dels": lambda: DFlashDrafter(draft, head),
        "suffix": SuffixDrafter,
    }
    if draft.cfg.copy_head:  # a copied drafted token brings its context's continuation
        makers["dflash-span"] = lambda: DFlashDrafter(draft, span=SPAN)
        makers["dflash-dels-span"] = lambda: DFlashDrafter(draft, head, span=SPAN)
    # as `--method composite-dflash` builds it, from this run's drafts (its learned part drafts for token matching)
    part_makers = {"suffix": SuffixDrafter, "dflash-dels": lambda: DFlashDrafter(draft, head, token_matched=True)}
    parts = METHODS["composite-dflash"].options["parts"]
    makers["composite-dflash"] = lambda: CompositeDrafter([part_makers[m]() for m in parts], "composite-dflash")
    load_before = machine_load()
    greedy = SamplingParams(max_new_tokens=args.max_new_tokens)
    results: dict[str, dict] = {}
    offline: dict[str, dict] = {}
    grid = [] if args.no_grid else [(a, b) for a in GRID for b in GRID]
    if (0.3, 0.3) not in grid:
        grid.append((0.3, 0.3))
    for task in tasks:
        row = median_runs(target, task, makers, greedy, args.repeats)
        if args.sampled:  # one seeded run each; DFlash and DeLS also with the controller off (the drafts' own tau)
            sp = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=1234)
            off = {f"{m}-controller-off": makers[m] for m in ("dflash", "dflash-dels")}
            t1 = {m: make for m, make in makers.items() if m != "ngram"} | off
            t1_row = median_runs(target, task, t1, sp, 1, controller_off=tuple(off))
            row |= {f"{n}@T1": r for n, r in t1_row.items()}
        base, base_t1 = row["ar"]["tok_s"], row.get("ar@T1", {}).get("tok_s")
        for name, r in row.items():
            ref = base_t1 if name.endswith("@T1") else base
            r["speedup"] = r["tok_s"] / ref if ref else None
        offline[task.name] = chain_acceptance(target, draft, head, task, row["ar"]["tokens"], grid)
        print(
            f"{task.name} ({len(task.prompt_ids)} tok): "
            + "  ".join(f"{n} {r['speedup']:.2f}x tau {r['tau']:.2f}" for n, r in row.items())
            + f"  | chain tau {json.dumps({k: round(v, 2) for k, v in offline[task.name]['tau'].items()})}",
            flush=True,
        )
        for r in row.values():
            r.pop("tokens")
        results[task.name] = row

    def med(method: str, key: str) -> float | None:
        vals = [results[t.name][method][key] for t in tasks if method in results[t.name]]
        return median(vals) if vals else None

    def over_ngram(method: str) -> float | None:
        """Geometric mean over prompts of `method`'s speedup / n-gram's: the prompt-by-prompt comparison (a
        median over prompts can favour either method by which prompt lands in the middle)."""
        ratios = [results[t.name][method]["speedup"] / results[t.name]["ngram"]["speedup"] for t in tasks
                  if method in results[t.name]]  # fmt: skip
        return math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None

    def pooled_tau(key: str) -> float:
        pos = sum(offline[t.name]["positions"] for t in tasks)
        return sum((offline[t.name]["tau"][key] - 1) * offline[t.name]["positions"] for t in tasks) / max(1, pos) + 1

    cards = {}
    for d in (Path(args.dflash), Path(args.dels)):
        for f in ("draft_config.json", "head_config.json"):
            if (d / f).exists():
                cards[d.name] = json.loads((d / f).read_text()).get("card", {})
    figures = {
        "tau_dflash": med("dflash", "tau"),
        "tau_dels": med("dflash-dels", "tau"),
        "speedup_dflash": med("dflash", "speedup"),
        "speedup_dels": med("dflash-dels", "speedup"),
        "speedup_ngram": med("ngram", "speedup"),
        "tau_ngram": med("ngram", "tau"),
        "speedup_suffix": med("suffix", "speedup"),
        "tau_suffix": med("suffix", "tau"),
        "speedup_composite": med("composite-dflash", "speedup"),
        "tau_composite": med("composite-dflash", "tau"),
        "speedup_dflash_span": med("dflash-span", "speedup"),
        "tau_dflash_span": med("dflash-span", "tau"),
        "speedup_dels_span": med("dflash-dels-span", "speedup"),
        "tau_dels_span": med("dflash-dels-span", "tau"),
        "dels_span_over_ngram_per_prompt_geomean": over_ngram("dflash-dels-span"),
        "dflash_span_over_ngram_per_prompt_geomean": over_ngram("dflash-span"),
        "dels_over_ngram_per_prompt_geomean": over_ngram("dflash-dels"),
        "identical_all_greedy": all(
            r["identical"] for row in results.values() for n, r in row.items() if not n.endswith("@T1")
        ),
        "chain_tau_dflash": pooled_tau("dflash"),
        "chain_tau_dels": pooled_tau("0.3,0.3"),
        "chain_tau_grid": {k: pooled_tau(k) for k in offline[tasks[0].name]["tau"] if k != "dflash"} if tasks else {},
        "training": {
            name: {
                k: c.get(k)
                for k in (
                    "steps",
                    "wall_time_s",
                    "context_tokens_seen",
                    "block_tokens_trained",
                    "window_tokens_trained",
                    "eval_loss",
                )
            }  # fmt: skip
            for name, c in cards.items()
        },
    }
    if args.sampled:
        figures.update(
            {
                "tau_dflash_T1": med("dflash@T1", "tau"),
                "tau_dels_T1": med("dflash-dels@T1", "tau"),
                "speedup_dflash_T1": med("dflash@T1", "speedup"),
                "speedup_dels_T1": med("dflash-dels@T1", "speedup"),
                "speedup_suffix_T1": med("suffix@T1", "speedup"),
                "speedup_composite_T1": med("composite-dflash@T1", "speedup"),
                "tau_composite_T1": med("composite-dflash@T1", "tau"),
                "speedup_dels_span_T1": med("dflash-dels-span@T1", "speedup"),
                "tau_dflash_T1_controller_off": med("dflash-controller-off@T1", "tau"),
                "tau_dels_T1_controller_off": med("dflash-dels-controller-off@T1", "tau"),
            }
        )
    n_pos = {t.name: offline[t.name]["positions"] for t in tasks}

    def pooled_by_position(field: str) -> dict[str, list[float]]:
        total = max(1, sum(n_pos.values()))
        return {
            k: [
                round(sum(offline[t.name][field][k][i] * n_pos[t.name] for t in tasks) / total, 4)
                for i in range(draft.cfg.block_size - 1)
            ]
            for k in ("dflash", "dels")
        }

    figures["acceptance_by_block_position"] = pooled_by_position("acceptance_by_position")
    # T=1: how often rejection sampling accepts each block position's draw along the greedy text (offline)
    figures["t1_acceptance_by_block_position"] = pooled_by_position("t1_acceptance_by_position")
    figures["local_head_top1_teacher_forced"] = median(
        [offline[t.name]["local_head_top1_teacher_forced"] for t in tasks]
    )
    # timings on a machine busier than its cores are not speed evidence (tau and acceptance still are)
    figures["machine_busy"] = load_before["loadavg_1m"] > load_before["nproc"]
    meta = {
        "what": "DFlash / DFlash+DeLS (with spans, for a copy-head draft) / composite-dflash vs plain decoding, "
        "n-gram and suffix on held-out prompts (eval split), SmolLM2 fp32",
        "run": {**vars(args), "dflash": repo_relative(args.dflash), "dels": repo_relative(args.dels)},
        "tasks": {t.name: len(t.prompt_ids) for t in tasks},
        "cost_curve": curve.to_dict(),
        "cost_curve_measure_s": round(curve_s, 2),
        "quiet_before": quiet,
        "load_before": load_before,
        "load_after": machine_load(),
        "pid": os.getpid(),
        "note": "speedups are medians over prompts of decode tok/s ratios to ar on the same prompt; per prompt the "
        "greedy run with the median tok/s of --repeats (tok_s_runs), one seeded run at T=1",
    }
    out = write_results(args.name, figures, {"per_task": results, "chain_acceptance": offline}, meta)
    xs = list(range(1, draft.cfg.block_size))
    plot_panels(
        RESULTS_DIR / f"{args.name}.png",
        [
            {
                "title": "P(block position accepted) along the greedy output",
                "xlabel": "block position",
                "ylabel": "P(accepted)",
                "series": {
                    **{f"{k}, T=0": (xs, v) for k, v in figures["acceptance_by_block_position"].items()},
                    **{f"{k}, T=1 draw": (xs, v) for k, v in figures["t1_acceptance_by_block_position"].items()},
                },
            },
            {
                "title": "decode speedup vs plain decoding (T=0)",
                "xlabel": "prompt",
                "ylabel": "x",
                "series": {
                    m: (list(range(len(tasks))), [results[t.name][m]["speedup"] for t in tasks])
                    for m in ("ngram", "suffix", *(m for m in makers if m.startswith("dflash")), "composite-dflash")
                },
                "hline": 1.0,
            },
            {
                "title": "DeLS chain tau over the alpha x beta grid",
                "xlabel": "alpha",
                "ylabel": "chain tau",
                "series": {
                    f"beta={b}": (list(GRID), [figures["chain_tau_grid"].get(f"{a},{b}") for a in GRID])
                    for b in GRID
                    if all(f"{a},{b}" in figures["chain_tau_grid"] for a in GRID)
                }
                | {"dflash alone": (list(GRID), [figures["chain_tau_dflash"]] * len(GRID))},
            },
        ],
        title="DFlash / DeLS-Spec, held-out long-context prompts (SmolLM2 fp32)",
    )
    print(out)
    for k, v in figures.items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
