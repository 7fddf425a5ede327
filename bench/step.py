"""The engine step on the CPU kernels vs the torch ops, with the physical limits it runs against.

One process, the default model (SmolLM2-135M, fp32), the contenders interleaved repeat by repeat:
- decode: one token at 2K and 6K context; ms per step, and bandwidth achieved = (weight + KV bytes read) / step time
  against this machine's read bandwidth, measured in the same run (a reduction over 1 GiB, every thread);
- verify: a chain of 4 and of 16 drafted tokens at 2K (the hybrid tree attention's path);
- prefill: a 2K prompt in chunks of 512 and of 2048; tok/s and FLOP/s against an fp32 matmul peak measured here;
- prefill attention: one layer's attention for a 512-token causal chunk after 0, 2K and 6K committed tokens, the
  kernels' tile_attention vs ATen's flash attention (the torch path), in GFLOP/s.
Figures (bench/results/step.json): `decode_native_vs_torch_2k/_6k`, `verify4_native_vs_torch`,
`decode_bandwidth_fraction_2k`, `prefill_flops_fraction`, `prefill_chunk_2048_vs_512`,
`chunk_attention_tile_vs_flash_0/_2k/_6k`, `chunk_attention_tile_gflops_2k`.

    python bench/step.py [--repeats 15] [--threads 2] [--attention-only]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS_DIR, load_model, median, plot_panels, time_interleaved, wait_for_quiet, write_results  # noqa: E402
from kernels import cpu as cpu_kernels  # noqa: E402
from spyglass.attention import tree_attention  # noqa: E402
from spyglass.models.llama import Block, Segment  # noqa: E402


def read_bandwidth_gbs(repeats: int = 7) -> float:
    """Memory read bandwidth: sum of a 1 GiB fp32 tensor (far past every cache), median GB/s."""
    big = torch.ones(256 * 1024 * 1024)
    big.sum()
    t = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        big.sum()
        t.append(time.perf_counter() - t0)
    return big.numel() * 4 / median(t) / 1e9


def matmul_peak_gflops(repeats: int = 5) -> float:
    """fp32 GEMM throughput on a prefill-like shape (2048 x 576 @ 576 x 1536), median GFLOP/s."""
    a, b = torch.randn(2048, 576), torch.randn(576, 1536)
    a @ b
    t = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(10):
            a @ b
        t.append((time.perf_counter() - t0) / 10)
    return 2 * 2048 * 576 * 1536 / median(t) / 1e9


def weight_bytes(model) -> int:
    """Bytes a one-token step reads: every parameter but the embedding table (one row of it), the tied LM head
    once."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    if not model.args.tie_embeddings:
        total -= model.embed.weight.numel() * model.embed.weight.element_size()
    return total


def prefill_flops(model, tokens: int) -> float:
    """Matmul FLOPs of a prefill (2 per weight per token, no LM head but the last row) plus causal attention."""
    a = model.args
    per_token = 2 * sum(p.numel() for n, p in model.layers.named_parameters() if p.dim() == 2)
    attn = 2 * 2 * a.n_layers * a.n_heads * a.head_dim * tokens * (tokens + 1) / 2
    return per_token * tokens + attn


def attention_flops(a, n: int, start: int) -> float:
    """FLOPs of one layer's causal attention for n new tokens after `start` committed ones (QK^T and PV)."""
    return 4 * a.n_heads * a.head_dim * (n * start + n * (n + 1) / 2)


def chunk_attention(a, repeats: int, n: int = 512) -> dict:
    """One layer's attention for a causal prefill chunk of n tokens over 0, 2K and 6K committed keys (random, the
    model's head shapes): the kernels' tile_attention vs ATen's flash attention (`tree_attention`, backend "cpu",
    what the torch path runs), interleaved; median ms and GFLOP/s per contender."""
    ops = cpu_kernels.native()
    g = torch.Generator().manual_seed(1)
    scale = a.head_dim**-0.5
    out = {}
    for start in (0, 2048, 6144):
        k, v = (torch.randn(a.n_kv_heads, start + n, a.head_dim, generator=g) for _ in range(2))
        q = torch.randn(a.n_heads, n, a.head_dim, generator=g)
        r = time_interleaved(
            {
                "tile": lambda q=q, k=k, v=v, s=start: ops.tile_attention(q, k, v, s, None, scale),
                "flash": lambda q=q, k=k, v=v, s=start: tree_attention(
                    q, k[:, :s], v[:, :s], k[:, s:], v[:, s:], None, scale, backend="cpu"
                ),
            },
            repeats=repeats,
            warmup=2,
        )
        for who in r:
            r[who]["gflops"] = attention_flops(a, n, start) / (r[who]["median_ms"] / 1e3) / 1e9
        out[start] = r
        print(
            f"attention, {n}-token causal chunk at {start}: tile_attention {r['tile']['gflops']:.0f} GFLOP/s, "
            f"ATen flash {r['flash']['gflops']:.0f} GFLOP/s"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--name", default="step")
    ap.add_argument("--attention-only", action="store_true", help="only the prefill attention part; writes nothing")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_kernels.native() is None:
        raise SystemExit("the CPU kernels did not build here (see the warning above): nothing to compare")
    if args.attention_only:
        chunk_attention(load_model()[0].args, args.repeats)
        return
    quiet = wait_for_quiet(timeout_s=300)
    model, _, _ = load_model()
    a = model.args
    g = torch.Generator().manual_seed(0)
    raw: dict = {"linear_plan": model.linear_backend}
    bw = read_bandwidth_gbs()
    peak = matmul_peak_gflops()
    raw["read_bandwidth_gbs"], raw["matmul_peak_gflops"] = bw, peak
    print(f"read bandwidth {bw:.1f} GB/s, fp32 matmul {peak:.0f} GFLOP/s, linear plan {model.linear_backend}")

    def on(native: bool, fn):
        def run():
            Block.native = native
            return fn()

        return run

    caches = {}
    for ctx in (2048, 6144):
        cache = model.new_cache(ctx + 64, 1)
        model.prefill(cache, 0, torch.randint(100, a.vocab_size - 100, (ctx,), generator=g), chunk_size=2048)
        caches[ctx] = cache

    def step(ctx: int, n: int):
        cache = caches[ctx]
        start = cache.lengths[0]
        toks = torch.randint(100, a.vocab_size - 100, (n,), generator=g)
        seg = Segment(0, start, toks, torch.arange(start, start + n), None, "all")
        return lambda: model.forward([seg], cache)

    kv_bytes = lambda ctx: 2 * a.n_layers * a.n_kv_heads * a.head_dim * ctx * 4  # noqa: E731
    wbytes = weight_bytes(model)
    rows = {}
    for ctx, n in ((2048, 1), (6144, 1), (2048, 4), (2048, 16)):
        fn = step(ctx, n)
        r = time_interleaved({"torch": on(False, fn), "native": on(True, fn)}, repeats=args.repeats, warmup=2)
        rows[f"{ctx}x{n}"] = r
        gbs = (wbytes + kv_bytes(ctx)) / (r["native"]["median_ms"] / 1e3) / 1e9
        print(
            f"ctx {ctx} tokens {n}: torch {r['torch']['median_ms']:.1f} ms, native {r['native']['median_ms']:.1f} ms"
            + (f", bandwidth achieved {gbs:.1f} GB/s ({gbs / bw:.0%})" if n == 1 else "")
        )
    raw["steps"] = rows
    Block.native = True
    prompt = torch.randint(100, a.vocab_size - 100, (2048,), generator=g)
    pf_cache = model.new_cache(2048, 1)

    def prefill(chunk: int):
        def run():
            pf_cache.lengths[0] = 0
            model.prefill(pf_cache, 0, prompt, chunk_size=chunk)

        return run

    pf = time_interleaved(
        {
            "torch_512": on(False, prefill(512)),
            "native_512": on(True, prefill(512)),
            "native_2048": on(True, prefill(2048)),
        },
        repeats=max(3, args.repeats // 5),
        warmup=1,
    )
    Block.native = True
    raw["prefill_2048"] = pf
    attn = chunk_attention(a, args.repeats)
    raw["chunk_attention_512"] = attn
    best = min(pf["native_512"]["median_ms"], pf["native_2048"]["median_ms"]) / 1e3
    gflops = prefill_flops(model, 2048) / best / 1e9
    print({k: round(v["median_ms"]) for k, v in pf.items()}, f"prefill {gflops:.0f} GFLOP/s ({gflops / peak:.0%})")
    ms = lambda key, who: rows[key][who]["median_ms"]  # noqa: E731
    figures = {
        "decode_native_vs_torch_2k": ms("2048x1", "torch") / ms("2048x1", "native"),
        "decode_native_vs_torch_6k": ms("6144x1", "torch") / ms("6144x1", "native"),
        "verify4_native_vs_torch": ms("2048x4", "torch") / ms("2048x4", "native"),
        "verify16_native_vs_torch": ms("2048x16", "torch") / ms("2048x16", "native"),
        "decode_tok_s_2k": 1e3 / ms("2048x1", "native"),
        "decode_bandwidth_fraction_2k": (wbytes + kv_bytes(2048)) / (ms("2048x1", "native") / 1e3) / 1e9 / bw,
        "decode_bandwidth_fraction_6k": (wbytes + kv_bytes(6144)) / (ms("6144x1", "native") / 1e3) / 1e9 / bw,
        "prefill_chunk_2048_vs_512": pf["native_512"]["median_ms"] / pf["native_2048"]["median_ms"],
        "prefill_native_vs_torch": pf["torch_512"]["median_ms"] / pf["native_512"]["median_ms"],
        "prefill_flops_fraction": gflops / peak,
        "chunk_attention_tile_vs_flash_0": attn[0]["flash"]["median_ms"] / attn[0]["tile"]["median_ms"],
        "chunk_attention_tile_vs_flash_2k": attn[2048]["flash"]["median_ms"] / attn[2048]["tile"]["median_ms"],
        "chunk_attention_tile_vs_flash_6k": attn[6144]["flash"]["median_ms"] / attn[6144]["tile"]["median_ms"],
        "chunk_attention_tile_gflops_2k": attn[2048]["tile"]["gflops"],
        "read_bandwidth_gbs": bw,
    }
    figures = {k: round(v, 3) for k, v in figures.items()}
    meta = {"threads": args.threads, "repeats": args.repeats, "quiet_check": quiet, "weight_bytes": wbytes}
    path = write_results(args.name, figures, raw, meta)
    keys = list(rows)
    plot_panels(
        RESULTS_DIR / f"{args.name}.png",
        [
            {
                "title": "engine step, ms (median)",
                "xlabel": "context x new tokens",
                "ylabel": "ms",
                "series": {who: (list(range(len(keys))), [ms(k, who) for k in keys]) for who in ("torch", "native")},
                "xticklabels": keys,
            }
        ],
        title=f"SmolLM2-135M fp32, {args.threads} threads",
        ncols=1,
    )
    print(path, figures)


if __name__ == "__main__":
    main()
