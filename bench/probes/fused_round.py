"""What a verify round would save by running beside a prefill forward instead of as a forward of its own.

At 4 streams of long prompts mostly one stream decodes while the others' prompts are prefilled, and each of its
rounds is a target forward of its own. Here, on zeroed K/V `--context` tokens into two prompts: a prefill forward of
`--chunk` tokens, and a verify pass of a chain of `rows` tokens,
  separate:    the prefill forward, then the verify pass as the engine runs it (`Transformer.forward`);
  interleaved: both as staged forwards, one layer of each in turn (each layer's weights just read by the prefill's);
  joint:       one forward over both segments, with `--backend lanes` only (every forward on `lanes`: the prompt's
               and the round's rows in one GEMM per linear, each row's bits as in a forward of its own);
the verify logits must be the same bits every way. Times are medians of `--repeats`, the order rotating.

    python bench/probes/fused_round.py [--backend auto|lanes] [--chunk 96,256] [--rows 1,8,16] [--context 4096]
    python bench/probes/fused_round.py --backend lanes --chunk 95,88,80 --rows 1,8,16 --name fused_round_lanes_whole
                                       # chunk + rows filling whole 16-row tiles (95 + 1, 88 + 8, 80 + 16)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import load_model, median, write_results  # noqa: E402
from spyglass.cost import cpu_model, zero_prefix  # noqa: E402
from spyglass.models.linear import set_linear_backend  # noqa: E402
from spyglass.models.llama import Segment  # noqa: E402


def segments(model, slots: list[int], context: int, chunk: int, rows: int) -> tuple[Segment, Segment]:
    a, b = slots
    ids = torch.randint(0, model.args.vocab_size, (chunk + rows,))
    prefill = Segment(a, context, ids[:chunk], torch.arange(context, context + chunk), None, "last")
    mask = torch.ones(rows, rows, dtype=torch.bool).tril()
    verify = Segment(b, context, ids[chunk:], torch.arange(context, context + rows), mask, "all")
    return prefill, verify


def separate(model, cache, prefill: Segment, verify: Segment):
    model.staged([prefill], cache).run()
    return model([verify], cache)[0]


def interleaved(model, cache, prefill: Segment, verify: Segment):
    a, b = model.staged([prefill], cache), model.staged([verify], cache)
    for _ in range(len(model.layers)):
        a.run(1)
        b.run(1)
    return b.logits[0]


def joint(model, cache, prefill: Segment, verify: Segment):
    return model([prefill, verify], cache)[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--chunk", default="96,256")
    ap.add_argument("--rows", default="1,8,16")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backend", default="auto", choices=["auto", "lanes"], help="the target's linear backend")
    ap.add_argument("--name", default=None, help="results name (default fused_round, fused_round_lanes)")
    args = ap.parse_args()
    model, _, resolved = load_model(None, args.dtype, args.threads)
    set_linear_backend(model, args.backend)
    ways = {"separate": separate, "interleaved": interleaved} | ({"joint": joint} if args.backend == "lanes" else {})
    cache = model.new_cache(args.context + 512, 2)
    slots = [cache.allocate(), cache.allocate()]
    for slot in slots:
        zero_prefix(cache, slot, args.context)
        cache.lengths[slot] = args.context
    torch.manual_seed(0)
    rows_out, figures = [], {}
    for chunk in (int(c) for c in args.chunk.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            prefill, verify = segments(model, slots, args.context, chunk, rows)
            with torch.inference_mode():
                logits = [fn(model, cache, prefill, verify) for fn in ways.values()]
                same = all(torch.equal(x, logits[0]) for x in logits)
                times: dict[str, list[float]] = {k: [] for k in [*ways, "prefill", "verify"]}
                for r in range(args.repeats):
                    order = list(ways)[r % len(ways) :] + list(ways)[: r % len(ways)]
                    for how in order:
                        t0 = time.perf_counter()
                        ways[how](model, cache, prefill, verify)
                        times[how].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    model.staged([prefill], cache).run()
                    times["prefill"].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    model([verify], cache)
                    times["verify"].append(time.perf_counter() - t0)
            ms = {k: round(1e3 * median(v), 2) for k, v in times.items()}
            row = {"chunk": chunk, "rows": rows, "verify_logits_equal": same, **{f"{k}_ms": v for k, v in ms.items()}}
            for how in list(ways)[1:]:  # what each way saves against the two forwards apart, as a share of the round
                row[f"{how}_saved_of_verify"] = round((ms["separate"] - ms[how]) / ms["verify"], 3)
                figures[f"{how}_saved_of_verify_chunk{chunk}_rows{rows}"] = row[f"{how}_saved_of_verify"]
            rows_out.append(row)
            print(row, flush=True)
    figures["verify_logits_equal"] = all(r["verify_logits_equal"] for r in rows_out)
    meta = {"model": resolved.model_id, "dtype": args.dtype, "context": args.context, "cpu": cpu_model(),
            "linear_backend": model.linear_backend}  # fmt: skip
    name = args.name or ("fused_round" if args.backend == "auto" else f"fused_round_{args.backend}")
    print(write_results(name, figures, {"rows": rows_out}, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
