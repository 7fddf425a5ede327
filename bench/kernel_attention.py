"""The CPU kernels' attention (kernels/cpu_ops.cpp tile_attention) in fp32 and bf16, against the memory it reads.

One process, contenders interleaved round by round (in alternating order), minimum per contender (a busy machine only
adds time):
- decode: one token's attention over one layer's cache at 4K / 16K / 32K context, SmolLM2-135M shapes (9 heads,
  3 KV heads, dim 64) and Qwen2.5-0.5B's (14 heads, 2 KV heads, dim 64); verify: 3 and 8 new tokens (a draft chain's
  verify pass) over the same caches. Each call reads a different copy of the
  K/V (together past the last-level cache), as a step's layers do. Reported: ms per layer and K/V GB/s, as a fraction
  of the read bandwidth measured in the same run (a sum over 256 MB on the same threads);
- prefill: a 512-token causal chunk after 4096 committed tokens, GFLOP/s.

    python bench/kernel_attention.py [--threads 2] [--rounds 10] [--smoke]
    git show HEAD~1:kernels/cpu_ops.cpp > /tmp/before.cpp
    python bench/kernel_attention.py --against /tmp/before.cpp  # an A/B: both builds, round by round

With `--against`, another version of the kernels' source is built for this CPU too (`kernels.cpu.build_other`) and
timed in the same rounds; each line adds its time, the ratio (its time over this tree's: above 1, this tree is
faster) and whether the two builds return the same bits for that case.

With one thread the calls are timed in process CPU time (robust on a shared machine); with more, in wall time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import cpu as cpu_kernels  # noqa: E402

SHAPES = {"smollm2": (9, 3), "qwen2.5-0.5b": (14, 2)}  # query heads, KV heads; head dim 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="tiny contexts, 2 rounds: checks the bench runs")
    ap.add_argument("--against", type=Path, help="another version of kernels/cpu_ops.cpp to time beside this tree's")
    args = ap.parse_args()
    ops = cpu_kernels.native()
    if ops is None:
        sys.exit("the CPU kernels are not built here (kernels/cpu.py)")
    builds = {"here": ops}
    if args.against:
        builds["against"] = cpu_kernels.build_other(args.against)
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.threads == 1 else time.perf_counter
    contexts = (512, 1024) if args.smoke else (4096, 16384, 32768)
    rounds = 2 if args.smoke else args.rounds
    budget = (16 if args.smoke else 320) * 2**20  # bytes of K/V copies per case: past the last-level cache

    def timed(fn) -> float:
        t0 = clock()
        fn()
        return clock() - t0

    big = torch.ones((8 if args.smoke else 64) * 2**20)
    cases = []
    for name, (heads, kv_heads) in SHAPES.items():
        for ctx in contexts:
            for dtype in (torch.float32, torch.bfloat16):
                size = 2 * kv_heads * ctx * 64 * torch.finfo(dtype).bits // 8
                kv = [
                    tuple(torch.randn(kv_heads, ctx, 64).to(dtype) for _ in range(2))
                    for _ in range(max(2, budget // size))
                ]
                for n in (1, 3, 8):
                    cases.append((name, ctx, dtype, n, torch.randn(heads, n, 64).to(dtype), kv, size))
    prefill = []
    for name, (heads, kv_heads) in SHAPES.items():
        for dtype in (torch.float32, torch.bfloat16):
            k, v = (torch.randn(kv_heads, 4096 + 512, 64).to(dtype) for _ in range(2))
            prefill.append((name, dtype, torch.randn(heads, 512, 64).to(dtype), k, v))
    calls = [((name, ctx, dtype, n), q, kv, ctx - n) for name, ctx, dtype, n, q, kv, _ in cases]
    calls += [((name, "prefill", dtype), q, [(k, v)], 4096) for name, dtype, q, k, v in prefill]
    best: dict = {}
    bandwidth = 0.0
    for r in range(rounds):
        bandwidth = max(bandwidth, big.numel() * 4 / timed(big.sum))
        for key, q, kv, start in calls:
            # each build on its own K/V copy (none warms the other's), the builds' order alternating by round (the
            # first call of a case runs on a colder machine)
            for i, (who, m) in list(enumerate(builds.items()))[:: -1 if r % 2 else 1]:
                k, v = kv[(r * len(builds) + i) % len(kv)]
                t = timed(lambda m=m, q=q, k=k, v=v, start=start: m.tile_attention(q, k, v, start, None, 0.125))
                best[who, key] = min(best.get((who, key), 1e9), t)

    def against(key, q, kv, start) -> str:
        if len(builds) == 1:
            return ""
        k, v = kv[0]
        same = torch.equal(*(m.tile_attention(q, k, v, start, None, 0.125) for m in builds.values()))
        ratio = best["against", key] / best["here", key]
        return f"  against {best['against', key] * 1e3:7.3f} ms ({ratio:.3f}x, {'same' if same else 'other'} bits)"

    print(f"threads {args.threads}, read bandwidth {bandwidth / 1e9:.1f} GB/s")
    for (key, q, kv, start), (name, ctx, dtype, n, *_, size) in zip(calls[: len(cases)], cases, strict=True):
        t = best["here", key]
        what = "decode  " if n == 1 else f"verify {n}"
        print(
            f"{what} {name:13s} {ctx:6d} {str(dtype)[6:]:9s} {t * 1e3:7.3f} ms/layer  {size / t / 1e9:5.1f} GB/s "
            f"({size / t / bandwidth:.2f} of read bandwidth){against(key, q, kv, start)}"
        )
    for key, q, kv, start in calls[len(cases) :]:
        name, _, dtype = key
        flops = 4 * q.shape[0] * 64 * (512 * 4096 + 512 * 513 / 2)
        t = best["here", key]
        print(
            f"prefill {name:13s} 512 @ 4096 {str(dtype)[6:]:9s} {t * 1e3:7.2f} ms  {flops / t / 1e9:5.0f} GFLOP/s"
            f"{against(key, q, kv, start)}"
        )


if __name__ == "__main__":
    main()
