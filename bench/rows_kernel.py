"""The `rows` linear kernel (kernels/cpu_ops.cpp rows_linear) against the other CPU matmuls, alone, per row count.

Random weights of SmolLM2-135M's linears (30 layers + the tied 49K-row LM head) and Qwen2.5-0.5B's (8 of its 24 layers
+ the 152K-row LM head, with the q/k/v bias), in bf16 and fp32. For each row count (a decode step, verify passes)
every kernel runs the whole set of weights once per round, the kernels interleaved and their order rotating, the
fastest round kept; the table gives ms per pass and the weight bytes read per second against the machine's read
bandwidth (a large `x.sum()`, measured in the same process). Kernels: `rows` and `lanes` (the other row-invariant
kernel: below a vector's worth of rows its outputs in the lanes) bf16 and fp32, `F.linear` (ATen) bf16, oneDNN's
inner product bf16 (where this CPU has a kernel for it). With one thread the clock is the thread's CPU time
(time.thread_time: the time it was descheduled by other processes is left out; their memory traffic is not), else
wall time. Prints a table; writes nothing.

    python bench/rows_kernel.py [--rows 1,2,4,8,16,64] [--repeats 5] [--threads 2] [--smoke]
    git show HEAD~1:kernels/cpu_ops.cpp > /tmp/before.cpp
    python bench/rows_kernel.py --against /tmp/before.cpp  # an A/B: that source's `rows` and `lanes` beside these
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels import cpu  # noqa: E402
from spyglass.models.linear import onednn_supported  # noqa: E402

# (hidden, q heads, kv heads, head dim, intermediate, vocab, layers timed, q/k/v bias)
MODELS = {
    "SmolLM2-135M": (576, 9, 3, 64, 1536, 49152, 30, False),
    "Qwen2.5-0.5B": (896, 14, 2, 64, 4864, 151936, 8, True),
}


def weights(model: str, dtype: torch.dtype, smoke: bool) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    h, nh, nkv, d, inter, vocab, layers, qkv_bias = MODELS[model]
    if smoke:
        layers, vocab = 1, 4096
    g = torch.Generator().manual_seed(0)
    shapes = [((nh + 2 * nkv) * d, h, qkv_bias), (h, nh * d, False), (2 * inter, h, False), (h, inter, False)]
    out = []
    for _ in range(layers):
        for n, k, bias in shapes:
            w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype)
            out.append((w, (torch.randn(n, generator=g) * 0.1).to(dtype) if bias else None))
    out.append(((torch.randn(vocab, h, generator=g) * h**-0.5).to(dtype), None))
    return out


def read_bandwidth(smoke: bool, clock) -> float:
    """Bytes per second of a large fp32 sum (all threads), the fastest of 5."""
    x = torch.ones((16 if smoke else 256) << 20)
    best = float("inf")
    for _ in range(5):
        t0 = clock()
        x.sum()
        best = min(best, clock() - t0)
    return x.nbytes / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16,64")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="one layer and a small head: proves the script runs")
    ap.add_argument(
        "--against",
        type=Path,
        help="another version of kernels/cpu_ops.cpp, its row-invariant kernels "
        "timed in the same rounds (columns '... against')",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = cpu.native()
    if ops is None:
        sys.exit("the CPU kernels are not built here (kernels/cpu.py)")
    rows = [int(r) for r in args.rows.split(",")]
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    bw = read_bandwidth(args.smoke, clock)
    print(f"read bandwidth (x.sum, {args.threads} threads, {clock.__name__}): {bw / 1e9:.1f} GB/s")
    kernels = {
        "rows bf16": (torch.bfloat16, ops.rows_linear),
        "aten bf16": (torch.bfloat16, F.linear),
        "onednn bf16": (torch.bfloat16, lambda x, w, b: torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")),
        "lanes bf16": (torch.bfloat16, ops.lanes_linear),
        "rows fp32": (torch.float32, ops.rows_linear),
        "lanes fp32": (torch.float32, ops.lanes_linear),
    }
    if not onednn_supported(torch.ones(1, dtype=torch.bfloat16)):
        del kernels["onednn bf16"]
    if args.against:
        other = cpu.build_other(args.against)
        for name in ("rows bf16", "lanes bf16", "rows fp32", "lanes fp32"):
            dt, fn = kernels[name]
            kernels[f"{name} against"] = (dt, getattr(other, fn.__name__))
    for model in MODELS:
        ws = {dt: weights(model, dt, args.smoke) for dt in (torch.bfloat16, torch.float32)}
        nbytes = {dt: sum(w.nbytes + (0 if b is None else b.nbytes) for w, b in v) for dt, v in ws.items()}
        print(f"\n{model}: {len(ws[torch.float32])} matrices, {nbytes[torch.bfloat16] / 1e6:.0f} MB in bf16")
        print(f"{'rows':>5} " + " ".join(f"{k + ' ms':>15} {'GB/s':>6}" for k in kernels))
        with torch.inference_mode():
            for m in rows:
                xs = {dt: torch.randn(m, ws[dt][0][0].shape[1], dtype=dt) for dt in ws}
                xs_down = {dt: torch.randn(m, ws[dt][3][0].shape[1], dtype=dt) for dt in ws}
                best = dict.fromkeys(kernels, float("inf"))
                names = list(kernels)
                for r in range(args.repeats + 1):  # round 0 warms up (oneDNN builds its primitives)
                    for name in names[r % len(names) :] + names[: r % len(names)]:
                        dt, fn = kernels[name]
                        t0 = clock()
                        for w, b in ws[dt]:
                            fn(xs[dt] if w.shape[1] == xs[dt].shape[1] else xs_down[dt], w, b)
                        if r:
                            best[name] = min(best[name], clock() - t0)
                cells = [f"{best[k] * 1e3:15.2f} {nbytes[kernels[k][0]] / best[k] / 1e9:6.1f}" for k in kernels]
                print(f"{m:5d} " + " ".join(cells))


if __name__ == "__main__":
    main()
