"""Replay drafters against recorded greedy outputs: tau and a cost-model decode speedup in seconds, no target.

Under greedy decoding the accepted path depends only on the tree and the target's output, so once the output of
a prompt is recorded, any drafter + the speculation controller can be replayed step by step: the verify time of
each step is read off the cost curve measured on this machine (the controller's own), the drafting time is the
drafter's real time. This is for developing drafters quickly and deterministically; speed claims come from
`bench/drafting.py`, which runs the target.

The prompts are held-out sources (eval split) that the benchmarks do *not* use (`DEV_CODE`, `DEV_DOCS`), so a
drafter tuned here is not tuned to a benchmark prompt.

    python bench/replay.py record [--max-new-tokens 256]     # once: greedy outputs + cost curve
    python bench/replay.py run [--methods ngram,suffix]      # replay
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import median  # noqa: E402
from bench.tasks import code_completion, code_edit, summary  # noqa: E402
from spyglass.controller import CostCurve, SpeculationController  # noqa: E402
from spyglass.sampling import SamplingParams  # noqa: E402
from spyglass.sequence import Sequence  # noqa: E402
from spyglass.tree import DraftTree  # noqa: E402
from spyglass.verify import Accepted, walk  # noqa: E402

DEV_CODE = ["inspect.py", "_pyio.py", "profile.py"]  # eval split, not in bench/tasks.py's CODE_FILES
DEV_DOCS = ["library/dataclasses.rst.txt", "library/collections.rst.txt", "library/shutil.rst.txt"]
RECORD = Path(__file__).resolve().parents[1] / ".cache" / "replay" / "dev_outputs.json"


def record(max_new_tokens: int, threads: int) -> None:
    from spyglass.controller import measured_curve
    from spyglass.engine import EngineConfig, SpecEngine
    from spyglass.models.llama import load_transformer
    from spyglass.models.loader import load_tokenizer, resolve_model

    torch.set_num_threads(threads)
    path = resolve_model(None, dtype="float32").path
    target = load_transformer(path, dtype=torch.float32)
    tok = load_tokenizer(path)
    tasks = [code_completion(tok, f) for f in DEV_CODE] + [code_edit(tok, f) for f in DEV_CODE]
    tasks += [summary(tok, d) for d in DEV_DOCS]
    engine = SpecEngine(target, None, EngineConfig(max_batch=1, max_context=8192))
    out = {"curve": measured_curve(target, target.new_cache(8192, 1)).to_dict(), "tasks": []}
    for t in tasks:
        (seq,) = engine.run([t.prompt_ids], SamplingParams(max_new_tokens=max_new_tokens))
        out["tasks"].append({"name": t.name, "kind": t.kind, "prompt": t.prompt_ids, "output": seq.output_ids})
        print(f"recorded {t.name}: {len(t.prompt_ids)} + {seq.num_generated} tokens", flush=True)
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    RECORD.write_text(json.dumps(out))


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
    draft_s: float | None = None,
) -> dict:
    """Steps, tau and modelled seconds of `drafter` (with the controller) reproducing `output` from `prompt`.
    `draft_s`: charge this drafting time per step instead of the measured one (deterministic replays)."""
    n = len(output)
    seq = Sequence(prompt, SamplingParams(max_new_tokens=n))
    seq.append(output[0])  # the first token comes from prefill
    drafter.start(seq)
    ctl = SpeculationController(curve, cost_by_depth=getattr(drafter, "cost_by_depth", False)) if controller else None
    spec_s = plain_s = drafting_s = 0.0
    steps = 0
    while seq.num_generated < n:
        t0 = time.perf_counter()
        wants = ctl is None or ctl.wants_draft(seq)
        tree = drafter.propose([seq])[0] if wants else None
        dt = time.perf_counter() - t0 if draft_s is None else draft_s
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


def make_drafter(name: str):
    """A model-free drafter by method name, or `hf_lookup` (bench/drafting.py's HF-style prompt lookup)."""
    if name == "hf_lookup":
        from bench.drafting import PromptLookupDrafter

        return PromptLookupDrafter()
    from spyglass.drafters import build_drafter

    return build_drafter(name, None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["record", "run"])
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--methods", default="ngram,suffix")
    args = ap.parse_args()
    if args.what == "record":
        record(args.max_new_tokens, args.threads)
        return
    data = json.loads(RECORD.read_text())
    c = data["curve"]
    curve = CostCurve(c["contexts"], c["sizes"], c["seconds"], c["cpu"])
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
