"""How fast TokenSwift's learned drafting could be on this machine with perfect heads: a measured upper bound.

TokenSwift drafts with one target forward over the partial KV cache per step (the "pass"), which gives
p_0..p_gamma, so at most gamma + 1 drafted tokens a step. If every drafted token were accepted, a step would emit
D + 1 tokens (D drafted, D <= gamma + 1, plus the verifier's own) for the cost of the pass and a verification of
D + 1 tokens, against D + 1 plain decode steps:

    bound(D, c) = (D + 1) * t(1, c) / (pass(c) + t(D + 1, c))

Measured here at several contexts c on the benchmark's model and budget (the verify times t from the same
`CostCurve` the controller sizes trees by, the pass timed on a real sequence prefilled to c tokens of the
benchmark's eval-split prose), and averaged over a generation from `--prefix` to `--prefix + --gen` tokens (the
harmonic mean over contexts: a speedup is a ratio of summed times). Also the same bound where only p_0's token is
drafted and accepted as often as it was under rejection sampling at the benchmark's T=1 (`--p0-acceptance`,
measured with the drafter's `sampled_chain`), the heads adding nothing. And the bound of the variant without the
pass (`draft_pass=False`, Medusa-style: the heads read the verify pass's hidden state of the last accepted token, so
the step's own sample is the root and the heads draft gamma tokens after it, the first two tokens ahead):
(gamma + 1) t(1, c) / t(gamma + 1, c). Lookups (n-grams, the context lookup) are not covered: they draft without
the pass and are bounded only by how much the text repeats.

    python bench/probes/tokenswift_bound.py [--model M] [--prefix 2048] [--gen 6144] [--budget 1024]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import load_model, machine_load, plot_panels, wait_for_quiet, write_results  # noqa: E402
from bench.tokenswift import eval_prose_prompt  # noqa: E402
from spyglass.cost import CostCurve  # noqa: E402
from spyglass.drafters.tokenswift import build_tokenswift  # noqa: E402
from spyglass.engine import EngineConfig, SpecEngine  # noqa: E402
from spyglass.sampling import SamplingParams  # noqa: E402

SIZES = (1, 2, 3, 4, 5, 6, 8)


def pass_seconds(engine: SpecEngine, text: list[int], context: int, repeats: int) -> float:
    """Median time of TokenSwift's pass (partial-cache forward + the heads' logits) at `context` tokens of `text`
    (repeated as needed: the time does not depend on the tokens), on `engine`'s TokenSwift drafter."""
    drafter = engine.drafter
    prompt = (text * (context // len(text) + 1))[:context]
    params = SamplingParams(temperature=1.0, min_p=0.1, seed=0, max_new_tokens=64, ignore_eos=True)
    seq = engine.add_request(prompt, params)
    engine.step()  # prefill and one drafted step: the partial cache is built and synced
    times = []
    for _ in range(repeats + 1):  # the first call warms up the shapes
        t0 = time.perf_counter()
        drafter._distributions([seq])
        times.append(time.perf_counter() - t0)
    engine.abort(seq.seq_id)
    return statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model source (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--gen", type=int, default=6144)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--points", type=int, default=4, help="contexts measured between prefix and prefix + gen")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--p0-acceptance", type=float, default=0.73)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="tokenswift_bound")
    args = ap.parse_args()
    target, tok, resolved = load_model(args.model, threads=args.threads)
    text, _ = eval_prose_prompt(tok, args.prefix)
    capacity = args.prefix + args.gen + 128
    step = args.gen // (args.points - 1)
    contexts = [args.prefix + i * step for i in range(args.points)]
    contexts[-1] = min(contexts[-1], capacity - 2 * max(SIZES) - 8)
    quiet = wait_for_quiet(max_load=1.0, timeout_s=120)
    load_before = machine_load()
    curve = CostCurve.measure(target, target.new_cache(capacity, 1), contexts=tuple(contexts), sizes=SIZES)
    drafter = build_tokenswift(target, None, budget=args.budget, ngram_k=0, context_lookup=False)  # shipped heads
    engine = SpecEngine(target, drafter, EngineConfig(1, capacity, controller="off"))
    passes = [pass_seconds(engine, text, c, args.repeats) for c in contexts]
    gamma = drafter.heads.gamma
    max_d = gamma + 1
    rows = []
    for c, p in zip(contexts, passes, strict=True):
        t1 = curve.time(1, c)
        bounds = {d: (d + 1) * t1 / (p + curve.time(d + 1, c)) for d in range(1, max_d + 1)}
        p0_only = (1 + args.p0_acceptance) * t1 / (p + curve.time(2, c))
        no_pass = (gamma + 1) * t1 / curve.time(gamma + 1, c)
        rows.append(
            {"context": c, "step_s": t1, "pass_s": p, "pass_over_step": p / t1, "bound_by_depth": bounds,
             "bound_p0_only": p0_only, "bound_heads_only": no_pass}
        )  # fmt: skip
        shown = " ".join(f"{d}:{b:.2f}x" for d, b in bounds.items())
        print(f"context {c:6d}: step {t1 * 1e3:.1f} ms, pass {p * 1e3:.1f} ms ({p / t1:.2f} steps); "
              f"bound by depth {shown}; p0 only {p0_only:.2f}x; no pass {no_pass:.2f}x", flush=True)  # fmt: skip

    def over_run(per_context: list[float]) -> float:  # the whole generation: summed times, so a harmonic mean
        return len(per_context) / sum(1 / x for x in per_context)

    by_depth = {d: over_run([r["bound_by_depth"][d] for r in rows]) for d in range(1, max_d + 1)}
    figures = {
        "bound_perfect_heads": max(by_depth.values()),
        "bound_perfect_heads_by_depth": by_depth,
        "bound_p0_only": over_run([r["bound_p0_only"] for r in rows]),
        "bound_heads_only": over_run([r["bound_heads_only"] for r in rows]),
        "pass_over_step": statistics.mean(r["pass_over_step"] for r in rows),
        "goal": 2.5,
    }
    print({k: v for k, v in figures.items() if k != "bound_perfect_heads_by_depth"}, flush=True)
    meta = {
        "what_was_run": {
            **vars(args),
            "model": resolved.path.name,
            "dtype": "float32",
            "contexts": contexts,
            "gamma": gamma,
        },
        "cost_curve": curve.to_dict(),
        "quiet_before": quiet,
        "load_before": load_before,
    }
    path = write_results(args.name, figures, {"per_context": rows}, meta)
    plot_panels(
        path.with_suffix(".png"),
        [{
            "title": f"TokenSwift upper bound, every drafted token accepted ({resolved.path.name})",
            "xlabel": "context (tokens)",
            "ylabel": "speedup over plain decoding",
            "series": {f"{d} drafted": (contexts, [r["bound_by_depth"][d] for r in rows]) for d in range(1, max_d + 1)}
            | {"p0 only, measured acceptance": (contexts, [r["bound_p0_only"] for r in rows]),
               "no pass (heads on the verify pass), all accepted": (contexts, [r["bound_heads_only"] for r in rows])},
            "hline": 2.5,
        }],
        ncols=1,
    )  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
