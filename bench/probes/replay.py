"""Replay drafters against recorded greedy outputs: tau and a cost-model decode speedup in seconds, no target.

Under greedy decoding the accepted path depends only on the tree and the target's output, so once the output of
a prompt is recorded, any drafter + the speculation controller can be replayed step by step: the verify time of
each step is read off the cost curve measured on this machine (the controller's own), the drafting time is the
drafter's real time. This is for developing drafters quickly and deterministically; speed claims come from
`bench/drafting.py`, which runs the target.

The prompts are held-out sources (eval split) that the benchmarks do *not* use (`DEV_CODE`, `DEV_DOCS`), so a
drafter tuned here is not tuned to a benchmark prompt.

    python bench/probes/replay.py record [--max-new-tokens 256]     # once: greedy outputs + cost curve
    python bench/probes/replay.py run [--methods ngram,suffix]      # replay

A learned drafter needs the target's state, so its trees are recorded instead: `record-drafts` decodes each prompt
plainly while the drafter proposes at every position (what it would propose there, whatever was verified before:
its proposal depends only on the committed tokens), and `policies` replays speculation policies over those trees,
the controller's and fixed depths, charging drafting a fixed time per drafted depth. Both accept `--curve
RESULTS.json`, a cost curve measured on a quiet machine by another bench (a curve measured while other work runs
says little).

    python bench/probes/replay.py record-drafts --method longspec [--checkpoint DIR --tag NAME] [--max-new-tokens 256]
    python bench/probes/replay.py policies --tag longspec --curve bench/results/longspec_s20_v10.json --draft-ms 3.7

`composite` replays suffix drafting alone and the composite of suffix and the recorded learned drafter (its
lookups timed for real, the learned part charged `--draft-ms`):

    python bench/probes/replay.py composite --tag longspec-v12 --curve bench/results/longspec_s20_v10.json \
        --draft-ms 2.8

`complement` counts, along the recorded outputs, where the learned draft's first token and suffix's lookups are
right (both, one, neither):

    python bench/probes/replay.py complement --tag longspec-v12,dflash-dels-s24
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from bench.common import load_model, median, write_results  # noqa: E402
from bench.tasks import code_completion, code_edit, summary  # noqa: E402
from spyglass.chain_controller import controller_for  # noqa: E402
from spyglass.cost import CostCurve  # noqa: E402
from spyglass.drafters.base import DrafterTraits, DraftRequest, StatelessDrafter  # noqa: E402
from spyglass.sampling import SamplingParams  # noqa: E402
from spyglass.sequence import Sequence  # noqa: E402
from spyglass.tree import SPAN_SOURCE, DraftTree  # noqa: E402
from spyglass.verify import Accepted, walk  # noqa: E402

DEV_CODE = ["inspect.py", "_pyio.py", "profile.py"]  # eval split, not in bench/tasks.py's CODE_FILES
DEV_DOCS = ["library/dataclasses.rst.txt", "library/collections.rst.txt", "library/shutil.rst.txt"]
RECORD = Path(__file__).resolve().parents[2] / ".cache" / "replay" / "dev_outputs.json"


def dev_setup(threads: int) -> tuple:
    """The target and the dev prompts."""
    target, tok, _ = load_model(threads=threads)
    tasks = [code_completion(tok, f) for f in DEV_CODE] + [code_edit(tok, f) for f in DEV_CODE]
    return target, tasks + [summary(tok, d) for d in DEV_DOCS]


def record(max_new_tokens: int, threads: int) -> None:
    from spyglass.cost import measured_curve
    from spyglass.engine import EngineConfig, SpecEngine

    target, tasks = dev_setup(threads)
    engine = SpecEngine(target, None, EngineConfig(max_batch=1, max_context=8192))
    out = {"curve": measured_curve(target, target.new_cache(8192, 1)).to_dict(), "tasks": []}
    for t in tasks:
        (seq,) = engine.run([t.prompt_ids], SamplingParams(max_new_tokens=max_new_tokens))
        out["tasks"].append({"name": t.name, "kind": t.kind, "prompt": t.prompt_ids, "output": seq.output_ids})
        print(f"recorded {t.name}: {len(t.prompt_ids)} + {seq.num_generated} tokens", flush=True)
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    RECORD.write_text(json.dumps(out))


class RecordingDrafter:
    """Wraps a drafter: records the tree it proposes at every position and has only the root verified, so the run
    is plain decoding and every position gets a proposal."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.trees: dict[int, dict] = {}

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def propose(self, batch: list[Sequence], wants: list[DraftRequest]) -> list[DraftTree]:
        t0 = time.perf_counter()
        trees = self.inner.propose(batch, wants)
        ms = 1e3 * (time.perf_counter() - t0) / len(batch)
        for seq, t in zip(batch, trees, strict=True):
            self.trees[seq.num_generated] = {"tokens": t.tokens.tolist(), "parents": t.parents,
                                             "scores": t.scores, "sources": t.sources, "ms": ms}  # fmt: skip
        return [DraftTree.root_only(seq.root) for seq in batch]


class ReplayedDrafter(StatelessDrafter):
    """Proposes the recorded tree of each position, cut to the depth the controller asks for (`max_depth` caps
    it for fixed-depth policies; `chain_only` drops the nodes off the first chain). Drafting costs `draft_s`
    per drafted depth (`cost_by_depth`, a drafter that runs once per depth) or per step. A `spans` drafter's chain
    (LongSpec's `span`: drafted tokens, then maybe a span of `SPAN_SOURCE` nodes) is cut after the drafted depth the
    controller asked for (the span below follows whatever it asked) and costs `draft_s` per drafted token: spans
    take no draft step."""

    def __init__(
        self,
        trees: dict[int, dict],
        draft_s: float,
        max_depth: int | None = None,
        cost_by_depth: bool = True,
        drafts_chain: bool = True,
        chain_only: bool = False,
        spans: bool = False,
    ) -> None:
        self.trees, self.draft_s, self.max_depth, self.chain_only = trees, draft_s, max_depth, chain_only
        self.spans = spans
        self.cost_by_depth, self.drafts_chain = cost_by_depth, drafts_chain
        self.traits = DrafterTraits(token_matched=True, drafts_chain=drafts_chain, cost_by_depth=cost_by_depth)
        self.spent = 0.0  # modelled drafting seconds of the trees proposed since the caller last reset it

    def seconds(self, tree: DraftTree) -> float:
        if self.spans:
            return self.draft_s * sum(1 for s in (tree.sources or [0] * len(tree))[1:] if s != SPAN_SOURCE)
        return self.draft_s * (tree.max_depth if self.cost_by_depth else 1)

    def propose(self, batch: list[Sequence], wants: list[DraftRequest]) -> list[DraftTree]:
        out = []
        for seq, want in zip(batch, wants, strict=True):
            r = self.trees[seq.num_generated]
            tree = DraftTree(torch.tensor(r["tokens"]), r["parents"], None, r["scores"], r.get("sources"))
            if self.chain_only:
                n = next((i for i, p in enumerate(tree.parents[1:], start=1) if p != i - 1), len(tree))
                tree = tree.subtree(list(range(n)))
            depth = min(d for d in (want.depth, self.max_depth, tree.max_depth) if d is not None)
            if self.spans and tree.sources is not None and self.max_depth is None:
                # a chain of drafted nodes (root first), then maybe a span: the drafter stops drafting at the asked
                # depth, and a span hangs only below its last drafted node, so cut before the first drafted node
                # beyond that depth (if the chain has one)
                drafted = [i for i, s in enumerate(tree.sources) if s != SPAN_SOURCE]
                keep = list(range(drafted[depth + 1] if depth + 1 < len(drafted) else len(tree)))
            else:
                keep = [i for i, d in enumerate(tree.depths) if d <= depth]
            out.append(tree.subtree(keep))
            self.spent += self.seconds(out[-1])
        return out


def greedy_path(tree: DraftTree, expected: list[int]) -> Accepted:
    """The path greedy verification accepts when the target's output is `expected` (from the root on)."""
    depths = tree.depths
    return walk(tree, lambda node: expected[depths[node]] if depths[node] < len(expected) else -1)


def replay(
    drafter,
    prompt: list[int],
    output: list[int],
    curve: CostCurve,
    controller: bool = True,
) -> dict:
    """Steps, tau and modelled seconds of `drafter` (with the controller) reproducing `output` from `prompt`.
    Drafting is charged what the drafter took, with what a ReplayedDrafter (alone, or a composite's part) says
    it costs in place of its own time (a ReplayedDrafter alone: deterministic replays)."""
    n = len(output)
    seq = Sequence(prompt, SamplingParams(max_new_tokens=n))
    seq.append(output[0])  # the first token comes from prefill
    drafter.start(seq)
    ctl = controller_for(drafter, curve) if controller else None
    spec_s = plain_s = drafting_s = 0.0
    steps = 0
    replayed = [p for p in getattr(drafter, "parts", [drafter]) if isinstance(p, ReplayedDrafter)]
    while seq.num_generated < n:
        for part in replayed:
            part.spent = 0.0
        t0 = time.perf_counter()
        want = DraftRequest() if ctl is None else ctl.wants_draft(seq)
        tree = drafter.propose([seq], [want])[0] if want is not None else None
        real = 0.0 if drafter in replayed else time.perf_counter() - t0
        dt = real + sum(part.spent for part in replayed)
        if ctl is not None:
            if tree is None:
                ctl.skip(seq)
                tree = DraftTree.root_only(seq.root)
            else:
                ctl.note_draft_time(seq, dt, tree.max_depth)
                tree = ctl.size(seq, tree, 1)
        done = seq.num_generated
        acc = greedy_path(tree, output[done : done + tree.max_depth + 1])
        if ctl is not None:
            ctl.observe(seq, tree, acc)
        spec_s += curve.time(len(tree), seq.committed) + dt
        drafting_s += dt
        for t in acc.tokens[: n - done]:
            plain_s += curve.time(1, seq.committed)
            seq.append(t)
        steps += 1
        if seq.num_generated < n:
            drafter.commit(seq, acc)
    drafter.release(seq)
    assert seq.output_ids == output, "replay diverged from the recorded output"
    return {"steps": steps, "tau": (n - 1) / steps, "speedup": plain_s / spec_s, "draft_ms": 1e3 * drafting_s / steps}


def drafts_path(method: str) -> Path:
    return RECORD.parent / f"drafts-{method}.json"


def load_curve(results: str | None) -> CostCurve | None:
    """The first cost curve a results JSON recorded (None: use the record's own)."""
    if not results:
        return None
    return CostCurve(**json.loads(Path(results).read_text())["meta"]["cost_curves"][0])


def load_recording(tag: str, curve_from: str | None) -> tuple[dict, CostCurve, bool, bool, bool]:
    """A `record-drafts` recording, the cost curve to replay it with, and whether its drafter costs per depth,
    drafts chains and ends them in spans."""
    data = json.loads(drafts_path(tag).read_text())
    curve = load_curve(curve_from) or CostCurve(**data["curve"])
    return data, curve, data.get("cost_by_depth", True), data.get("drafts_chain", True), data.get("spans", False)


def record_drafts(method: str, tag: str, checkpoint: str | None, max_new_tokens: int, threads: int) -> None:
    from spyglass.cost import measured_curve
    from spyglass.drafters import build_drafter
    from spyglass.engine import EngineConfig, SpecEngine

    target, tasks = dev_setup(threads)
    drafter = RecordingDrafter(build_drafter(method, target, max_batch=1, draft_checkpoint=checkpoint))
    engine = SpecEngine(target, drafter, EngineConfig(max_batch=1, max_context=8192, controller="off"))
    out = {"method": method, "checkpoint": checkpoint, "tasks": [],
           "curve": measured_curve(target, engine.cache).to_dict(),
           "cost_by_depth": drafter.inner.traits.cost_by_depth,
           "drafts_chain": drafter.inner.traits.drafts_chain,
           "spans": bool(getattr(drafter.inner, "span", 0))}  # fmt: skip
    for t in tasks:
        drafter.trees = {}
        (seq,) = engine.run([t.prompt_ids], SamplingParams(max_new_tokens=max_new_tokens))
        out["tasks"].append({"name": t.name, "kind": t.kind, "prompt": t.prompt_ids, "output": seq.output_ids,
                             "trees": drafter.trees})  # fmt: skip
        print(f"recorded {t.name}: {len(t.prompt_ids)} + {seq.num_generated} tokens", flush=True)
    drafts_path(tag).parent.mkdir(parents=True, exist_ok=True)
    drafts_path(tag).write_text(json.dumps(out))


def policies(tag: str, curve_from: str | None, draft_ms: float, max_depth: int, out: str | None = None) -> None:
    """Speculation policies over the recorded trees, by modelled decode speedup: the controller as the engine
    builds it, per-step sizing from the draft's scores (the tree policy, whatever the drafter drafts), a tree
    drafter's first chain alone sized by its acceptance profile, and every fixed depth of the first chain."""
    data, curve, by_depth, chain, spans = load_recording(tag, curve_from)
    # name -> (controller, fixed depth, first chain only, sized as a chain)
    variants = {"controller": (True, None, False, chain), "per-step": (True, None, False, False)}
    if not chain:
        variants["chain-profile"] = (True, None, True, True)
    variants |= {f"depth-{d}": (False, d, True, True) for d in range(1, max_depth + 1)}
    rows: dict = {}
    for t in data["tasks"]:
        trees = {int(k): v for k, v in t["trees"].items()}
        rows[t["name"]] = {}
        for name, (control, depth, chain_only, as_chain) in variants.items():
            drafter = ReplayedDrafter(trees, draft_ms / 1e3, depth, by_depth, as_chain, chain_only, spans)
            rows[t["name"]][name] = replay(drafter, t["prompt"], t["output"], curve, controller=control)
        _print_row(t["name"], rows[t["name"]])
    meta = {"what": f"speculation policies replayed over {tag}'s recorded trees (modelled, not timed)",
            "method": data["method"], "checkpoint": data.get("checkpoint"),
            "curve": curve.to_dict(), "curve_from": curve_from, "draft_ms": draft_ms, "cost_by_depth": by_depth,
            "dev_prompts": DEV_CODE + DEV_DOCS}  # fmt: skip
    print(write_results(out or f"replay_policies_{tag}", _figures(rows, list(variants)), rows, meta))


def composite_policies(tag: str, curve_from: str | None, draft_ms: float, out: str | None = None) -> None:
    """The composite (suffix + the recorded learned drafter, as `--method composite` builds it) against suffix
    alone."""
    from spyglass.drafters.composite import CompositeDrafter
    from spyglass.drafters.suffix import SuffixDrafter

    data, curve, by_depth, chain, spans = load_recording(tag, curve_from)
    variants = ["suffix", "composite"]
    rows: dict = {}
    for t in data["tasks"]:
        trees = {int(k): v for k, v in t["trees"].items()}
        rows[t["name"]] = {}
        for name in variants:
            learned = ReplayedDrafter(trees, draft_ms / 1e3, None, by_depth, chain, spans=spans)
            drafter = SuffixDrafter() if name == "suffix" else CompositeDrafter([SuffixDrafter(), learned])
            rows[t["name"]][name] = replay(drafter, t["prompt"], t["output"], curve)
        _print_row(t["name"], rows[t["name"]])
    meta = {"what": f"suffix + {tag}'s recorded trees as a composite, replayed (modelled, not timed)",
            "method": data["method"], "checkpoint": data.get("checkpoint"), "curve": curve.to_dict(),
            "curve_from": curve_from, "draft_ms": draft_ms, "dev_prompts": DEV_CODE + DEV_DOCS}  # fmt: skip
    print(write_results(out or f"replay_composite_{tag}", _figures(rows, variants), rows, meta))


def complement(tags: list[str], out: str | None = None) -> None:
    """Where each recorded learned draft and suffix drafting are right, position by position along the greedy
    outputs: the learned draft's first token, and any of suffix's first-level candidates (as a composite merges
    them), against the target's next token. `learned_only` is what a learned part adds to copying."""
    from spyglass.drafters.suffix import SuffixDrafter

    kinds = ("both", "learned_only", "suffix_only", "neither")
    figures: dict = {}
    rows: dict = {}
    for tag in tags:
        data = json.loads(drafts_path(tag).read_text())
        total = dict.fromkeys(kinds, 0)
        for t in data["tasks"]:
            output, trees = t["output"], {int(k): v for k, v in t["trees"].items()}
            seq = Sequence(t["prompt"], SamplingParams(max_new_tokens=len(output)))
            seq.append(output[0])
            suffix = SuffixDrafter()
            suffix.start(seq)
            counts = dict.fromkeys(kinds, 0)
            while seq.num_generated < len(output):
                nxt, tree = output[seq.num_generated], trees.get(seq.num_generated)
                learned = tree is not None and len(tree["tokens"]) > 1 and tree["tokens"][1] == nxt
                lookup = suffix.propose([seq])[0]
                copied = any(int(lookup.tokens[i]) == nxt for i in lookup.children()[0])
                counts[
                    ("both" if copied else "learned_only") if learned else ("suffix_only" if copied else "neither")
                ] += 1
                seq.append(nxt)
                suffix.commit(seq, None)
            rows.setdefault(t["name"], {})[tag] = counts
            total = {k: total[k] + counts[k] for k in kinds}
        n = sum(total.values())
        figures[tag] = {k: round(v / n, 3) for k, v in total.items()} | {"positions": n}
        print(tag, figures[tag], flush=True)
    meta = {"what": "first-token right: learned draft vs suffix lookups along recorded greedy outputs",
            "dev_prompts": DEV_CODE + DEV_DOCS}  # fmt: skip
    print(write_results(out or "replay_complement", figures, rows, meta))


def _print_row(name: str, row: dict) -> None:
    print(f"{name:38s} " + "  ".join(f"{n} {r['speedup']:.2f}x/{r['tau']:.2f}" for n, r in row.items()), flush=True)


def _figures(rows: dict, variants: list[str]) -> dict:
    """Mean and median modelled speedup per variant over the prompts."""
    figures = {}
    for name in variants:
        sp = [r[name]["speedup"] for r in rows.values()]
        figures[f"modelled_speedup_mean_{name}"] = round(sum(sp) / len(sp), 3)
        figures[f"modelled_speedup_median_{name}"] = round(median(sp), 3)
        print(f"{name}: mean {sum(sp) / len(sp):.3f}x, median {median(sp):.3f}x, min {min(sp):.3f}x")
    return figures


def make_drafter(name: str):
    """A model-free drafter by method name, or `hf_lookup` (bench/drafting.py's HF-style prompt lookup)."""
    if name == "hf_lookup":
        from bench.drafting import PromptLookupDrafter

        return PromptLookupDrafter()
    from spyglass.drafters import build_drafter

    return build_drafter(name, None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["record", "run", "record-drafts", "policies", "composite", "complement"])
    ap.add_argument("--method", default="longspec", help="record-drafts: the learned drafter")
    ap.add_argument("--checkpoint", default=None, help="record-drafts: its draft (default: the shipped one)")
    ap.add_argument("--tag", default=None, help="the recording's name (default: the method; complement: a list)")
    ap.add_argument("--curve", default=None, help="a results JSON whose first cost curve to use")
    ap.add_argument("--draft-ms", type=float, default=3.7, help="policies: drafting time (per depth if by depth)")
    ap.add_argument("--max-depth", type=int, default=4)
    ap.add_argument(
        "--name",
        default=None,
        help="policies, composite: the results file (default replay_policies_TAG / replay_composite_TAG)",
    )
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--methods", default="ngram,suffix")
    args = ap.parse_args()
    if args.what == "record":
        record(args.max_new_tokens, args.threads)
        return
    if args.what == "record-drafts":
        record_drafts(args.method, args.tag or args.method, args.checkpoint, args.max_new_tokens, args.threads)
        return
    if args.what == "policies":
        policies(args.tag or args.method, args.curve, args.draft_ms, args.max_depth, args.name)
        return
    if args.what == "composite":
        composite_policies(args.tag or args.method, args.curve, args.draft_ms, args.name)
        return
    if args.what == "complement":
        complement((args.tag or args.method).split(","), args.name)
        return
    data = json.loads(RECORD.read_text())
    curve = load_curve(args.curve) or CostCurve(**data["curve"])
    methods = args.methods.split(",")
    rows = {}
    for t in data["tasks"]:
        rows[t["name"]] = {
            m: replay(make_drafter(m), t["prompt"], t["output"], curve, controller=m != "hf_lookup") for m in methods
        }
        print(
            f"{t['name']:40s} "
            + "  ".join(
                f"{m} {r['speedup']:.2f}x tau {r['tau']:.2f} {r['draft_ms']:.1f}ms" for m, r in rows[t["name"]].items()
            ),
            flush=True,
        )
    for m in methods:
        sp = [r[m]["speedup"] for r in rows.values()]
        print(f"{m}: median {median(sp):.3f}x, min {min(sp):.3f}x")
    (RECORD.parent / "replay.json").write_text(json.dumps({"cpu": curve.cpu, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
