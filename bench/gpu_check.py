"""The GPU path proven in one prepared run: kernels against references, the engine's lossless output, and speed at a
real model's shape. `make gpu-check` on a GPU machine (one H200: an 8-minute budget, nothing fetched); `--tiny` runs
the same code paths on the CPU with tiny shapes in well under a minute (tests/test_gpu_check.py, so this script cannot
rot between device runs; its output goes under .cache/gpu_check, never bench/results; the Triton kernel runs
interpreted where TRITON_INTERPRET=1, else its checks are skipped and the results say why).

Every model is random weights at a real shape, generated on the device. Sections (each guarded: a failure is recorded
with its traceback and the rest still runs; a global time budget, `--budget`, stops the run in time, and the results
file is rewritten after every section, so a run cut short still leaves what it measured):

1. kernels (bf16 and fp16; fp32 references from the same rounded inputs): the Triton tree kernel `fused_mask_attn`
   (trees of 1-128 nodes, GQA, a batch of padded trees), the prefix part with its log-sum-exp (1K-128K keys, on the
   kernel `kernels.aten_prefix.prefix_kernel` picks: ATen's fused flash op when flash-attn is absent), the exact LSE
   merge of two key halves, and the whole hybrid (one sequence; a batch of different committed lengths, and one of
   equal lengths, which takes the single-launch prefix path). Max errors are printed and asserted.
2. engine: greedy `SpecEngine` output equals plain decoding (`plain_generate`) token for token for ar, ngram, suffix,
   small-lm (the target's first layer as its draft), LongSpec and DFlash (each with the shipped draft's features,
   random weights at the target's shape; with and without spans), at batch 1 and 4, on a random tiny Llama and Qwen2,
   controller off (every proposed node is verified). fp32 is asserted. bf16 (batch 4) is reported: a verify pass and
   a decode step round differently in bf16, so a near-tie can flip; each divergence is listed with plain decoding's
   top-2 logit gap at that token.
3. served: the engine path a verifier replica runs, `services.verifier.build_engine` with `device: auto` on a random
   checkpoint at SmolLM2-135M's shape (written to a temporary directory with a word-level tokenizer; the shipped
   LongSpec and DFlash + DeLS drafts fit it): `suffix`, `ngram`, `ar`, `longspec-span`, `dflash-dels` and `streaming`
   in one continuous batch, greedy output equal to plain decoding per method (fp32 asserted; `dtype:
   auto`, bf16 on a GPU, reported as in 2.), a context-cache round trip (the prompts' blocks stored at their prefill
   and loaded by a second request, through an in-process store with redis-py's interface where there is no Redis),
   what the replica's `info()` says it serves with (device, dtype, kernels), and tokens/s per method at batch 1, 4
   and 16 in `dtype: auto`. Tiny mode: a tiny shape and the three lookup methods.
4. speed, at Llama-3.1-8B's shape (32 layers, 4096 hidden, 32 query / 8 KV heads, 14336 MLP, 128256 vocab, bf16;
   `--layers` fewer, scaled and said so): the plain decode step (tok/s, and the HBM bandwidth it achieves: weight and
   KV bytes read per step / time, as a fraction of 4.8 TB/s) at 4K, 32K and 128K context, eager, replayed as a CUDA
   graph, and with torch.compile'd blocks (graphed too); the verify-cost curve t(k)/t(1), k = 1..64 tree tokens, at
   those contexts and batch 1, 8 and 32 (where the KV cache fits in memory), and t(64)/t(1) at 32K replayed as CUDA
   graphs; one attention call of a 64-node tree at 32K and 128K: hybrid vs masked SDPA vs eager. The issue's goals
   are read off these figures (`figures.speed.goals`), not asserted.
5. writes `gpu_check.json` (figures, device name, torch / triton versions, what failed or was skipped and why) and
   `gpu_check.png` (the cost curves, decode bandwidth, attention times).

Run: `python bench/gpu_check.py [--tiny] [--budget S] [--only kernels,engine,served,speed] [--out DIR]`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script, not when imported (a test process's Ray workers inherit its env)
    os.environ.setdefault("SPYGLASS_CPU_KERNELS", "0")  # the GPU path never runs the CPU kernels: no C++ build
if __package__ in (None, ""):  # allow `python bench/gpu_check.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import plot_panels, random_tree_mask  # noqa: E402
from kernels.aten_prefix import prefix_kernel  # noqa: E402
from spyglass import attention as attn  # noqa: E402
from spyglass.kv_cache import kv_bytes_per_token  # noqa: E402
from spyglass.models.llama import ModelArgs, Segment, Transformer  # noqa: E402
from spyglass.tree import DraftTree  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HBM_BYTES_PER_S = 4.8e12  # the H200's datasheet HBM3e bandwidth
SECTIONS = ("kernels", "engine", "served", "speed")
TREE_REACH = 6  # random trees: a node's parent is one of the 6 nodes before it (deep trees, as drafters build)

# Llama-3.1-8B's shape (what the speed section runs; the weights are random)
LLAMA_8B = ModelArgs(
    vocab_size=128256,
    hidden_size=4096,
    n_layers=32,
    n_heads=32,
    n_kv_heads=8,
    head_dim=128,
    intermediate_size=14336,
    rms_eps=1e-5,
    max_position=131072,
    tie_embeddings=False,
    qkv_bias=False,
    bos_token_id=128000,
    eos_token_ids=(128001,),
)

# Tolerances against the fp32 references (inputs rounded to the dtype first): out (atol, rtol), lse atol.
# bf16: the output itself is rounded to bf16 and P is rounded before P @ V (FlashAttention's numerics).
TOL = {
    torch.bfloat16: ((2e-2, 1.6e-2), 2e-3),
    torch.float16: ((5e-3, 2e-3), 2e-3),
    torch.float32: ((1e-4, 1e-4), 1e-4),
}


# ----------------------------------------------------------------------------------------------- bookkeeping


class Budget:
    """Seconds left of the run's budget. `has(s)`: whether more than `s` seconds of a full run's 480 are left, in
    proportion (a shorter budget keeps the same reserves, scaled)."""

    FULL = 480.0

    def __init__(self, seconds: float) -> None:
        self.total, self.t0 = seconds, time.monotonic()

    def has(self, seconds: float) -> bool:
        return self.left() > seconds * min(1.0, self.total / self.FULL)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.total - self.elapsed()


class Report:
    """What the run found: figures per section, every check (passed or not), failures with tracebacks, what was
    skipped and why. `write` rewrites the JSON (and the plot) in place."""

    def __init__(self, out_dir: Path, meta: dict[str, Any]) -> None:
        self.out_dir = out_dir
        self.figures: dict[str, Any] = {}
        self.checks: list[dict[str, Any]] = []
        self.failures: list[dict[str, Any]] = []
        self.skipped: list[dict[str, str]] = []
        self.meta = meta
        self.lock = threading.Lock()

    def check(self, section: str, what: str, ok: bool, **detail: Any) -> bool:
        self.checks.append({"section": section, "what": what, "ok": bool(ok), **detail})
        extra = " ".join(f"{k}={_short(v)}" for k, v in detail.items())
        print(f"[{section}] {'ok  ' if ok else 'FAIL'} {what} {extra}", flush=True)
        return ok

    def skip(self, section: str, what: str, why: str) -> None:
        self.skipped.append({"section": section, "what": what, "why": why})
        print(f"[{section}] skip {what}: {why}", flush=True)

    def fail(self, section: str, what: str, exc: BaseException) -> None:
        tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
        self.failures.append({"section": section, "what": what, "error": repr(exc), "traceback": "".join(tb[-12:])})
        print(f"[{section}] ERROR {what}: {exc!r}\n{''.join(tb[-6:])}", flush=True)

    @property
    def ok(self) -> bool:
        return not self.failures and all(c["ok"] for c in self.checks)

    def doc(self) -> dict[str, Any]:
        failed = [c for c in self.checks if not c["ok"]]
        return {
            "figures": {
                **self.figures,
                "checks_passed": sum(c["ok"] for c in self.checks),
                "checks_failed": len(failed),
                "errors": len(self.failures),
                "all_ok": self.ok,
            },
            "failed_checks": failed,
            "failures": self.failures,
            "skipped": self.skipped,
            "checks": self.checks,
            "meta": self.meta,
        }

    def write(self) -> Path:
        with self.lock:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            path = self.out_dir / "gpu_check.json"
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(self.doc(), indent=1, default=str) + "\n")
            tmp.replace(path)
            return path


def _short(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def guarded(report: Report, section: str, what: str, fn: Callable[[], Any]) -> Any:
    """Run `fn`; an exception is recorded (the run goes on) and gives None."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - every failure is recorded and the next check runs
        report.fail(section, what, exc)
        return None
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], Any], device: torch.device, repeats: int = 5, warmup: int = 2) -> float:
    """Median wall time of `fn()` in ms, the device synchronised around each call."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        samples.append((time.perf_counter() - t0) * 1e3)
    return sorted(samples)[len(samples) // 2]


def cuda_graph(fn: Callable[[], Any]) -> Callable[[], Any]:
    """`fn` (static shapes, no host sync inside) captured as a CUDA graph; returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


# ----------------------------------------------------------------------------------------------- models


def random_model(args: ModelArgs, device: torch.device, dtype: torch.dtype, seed: int = 0, std: float = 0.02,
                 rope_theta: float = 10000.0, name: str = "random") -> Transformer:  # fmt: skip
    """A Transformer with `args`' shapes and random weights generated on `device` (norms at 1, as HF initialises
    them); no file is read or written."""
    inv_freq = 1.0 / (rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim))
    with torch.device("meta"):
        model = Transformer(args, inv_freq.float()).to(dtype)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=gen)
    model.inv_freq = inv_freq.float().to(device)
    model.model_id = name
    return model.eval().requires_grad_(False)


def tiny_args(family: str, vocab: int = 256, hidden: int = 128, layers: int = 2, max_position: int = 512) -> ModelArgs:
    """A tiny Llama (no q/k/v bias, own LM head) or Qwen2 (q/k/v bias, tied embeddings), 4 query / 2 KV heads."""
    qwen = family == "qwen2"
    return ModelArgs(vocab_size=vocab, hidden_size=hidden, n_layers=layers, n_heads=4, n_kv_heads=2,
                     head_dim=hidden // 4, intermediate_size=2 * hidden, rms_eps=1e-6, max_position=max_position,
                     tie_embeddings=qwen, qkv_bias=qwen, bos_token_id=1, eos_token_ids=(2,))  # fmt: skip


def tiny_target(family: str, device: torch.device, dtype: torch.dtype) -> Transformer:
    """Random tiny target; std 0.2 (the tests' tiny models) makes its greedy text repeat, so lookups draft."""
    theta = 1e6 if family == "qwen2" else 1e4
    return random_model(tiny_args(family), device, dtype, seed=11 if family == "qwen2" else 7, std=0.2,
                        rope_theta=theta, name=f"random-tiny-{family}")  # fmt: skip


def shipped_features(name: str, target: Transformer) -> dict[str, Any]:
    """The shipped draft `name`'s options (spyglass/drafts/<name>/draft_config.json) fitted to `target`: shapes
    from the target, target layers in its range, a draft vocabulary of half the target's."""
    cfg = json.loads((ROOT / "spyglass" / "drafts" / name / "draft_config.json").read_text())
    n = target.args.n_layers
    drop = {"kind", "card", "hidden_size", "n_heads", "n_kv_heads", "head_dim", "intermediate_size", "vocab_size",
            "rms_eps", "qkv_bias", "init_std", "init_layer", "extra", "target_layers", "window"}  # fmt: skip
    out = {k: v for k, v in cfg.items() if k not in drop}
    if out.get("hidden_layers"):  # as many of the target's top layers, the last one last (as shipped: -1)
        out["hidden_layers"] = list(range(max(0, n - len(out["hidden_layers"])), n))
    if out.get("draft_vocab"):
        out["draft_vocab"] = target.args.vocab_size // 2
    if "n_layers" in out:
        out["n_layers"] = min(out["n_layers"], n)
    return out


def random_longspec(target: Transformer):
    """A LongSpec draft with the shipped one's features, untrained: its layer starts as the target's first
    (`init_layer`), its other weights random, so it agrees with the target now and then."""
    from spyglass.models.drafts.longspec import LongSpecDraft

    opts = shipped_features("smollm2-135m-longspec", target)
    draft = LongSpecDraft.from_target(target, init_layer=0, window=64, qkv_bias=target.args.qkv_bias, **opts)
    if draft.cfg.draft_vocab:
        g = torch.Generator().manual_seed(3)
        draft.set_vocab(torch.randperm(target.args.vocab_size, generator=g)[: draft.cfg.draft_vocab])
    return draft.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)


def random_dflash(target: Transformer):
    """A DFlash draft with the shipped one's features (copy head, block size, layers), untrained: layers copied from
    the target's last ones (`init_from_target`), the rest random."""
    from spyglass.models.drafts.dflash import DFlashDraft

    opts = shipped_features("smollm2-135m-dflash", target)
    torch.manual_seed(5)
    draft = DFlashDraft.from_target(target, init_from_target=True, **opts)
    return draft.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)


def build_drafter(method: str, target: Transformer, drafts: dict[str, Any]):
    """A fresh drafter for `method` (drafts are built once per target and shared: they hold no per-request state)."""
    from spyglass.drafters.dflash import DFlashDrafter
    from spyglass.drafters.longspec import LongSpecDrafter
    from spyglass.drafters.ngram import NgramDrafter
    from spyglass.drafters.suffix import SuffixDrafter
    from spyglass.spans import SPAN

    if method == "ar":
        return None
    if method == "ngram":
        return NgramDrafter()
    if method == "suffix":
        return SuffixDrafter()
    if method.startswith("longspec"):
        draft = drafts.setdefault("longspec", random_longspec(target))
        return LongSpecDrafter(draft, gamma=5, span=SPAN if method.endswith("-span") else 0)
    if method.startswith("dflash"):
        draft = drafts.setdefault("dflash", random_dflash(target))
        return DFlashDrafter(draft, span=SPAN if method.endswith("-span") else 0)
    if method == "small-lm":  # the target's first layer as the draft model (layer-skip self-speculation)
        from spyglass.drafters.small_lm import SmallLMDrafter, truncated_draft

        return SmallLMDrafter(truncated_draft(target, 1), gamma=4, max_batch=4, max_context=target.args.max_position)
    raise ValueError(method)


ENGINE_METHODS = ("ar", "ngram", "suffix", "small-lm", "longspec", "longspec-span", "dflash", "dflash-span")


def sample_prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    """Random prompts of mixed lengths, every other one with repeated spans so lookups find something."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(6, 60, (), generator=g))
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        out.append(ids + ids[: length // 2] + ids if i % 2 else ids)
    return out


# ----------------------------------------------------------------------------------------------- 1. kernels


def max_err(out: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> tuple[float, bool]:
    """Max |out - ref| and whether every element is within atol + rtol * |ref| (NaN fails)."""
    out, ref = out.double(), ref.double()
    err = (out - ref).abs()
    ok = bool(torch.isfinite(out).all()) and bool((err <= atol + rtol * ref.abs()).all())
    return float(err.max()) if err.numel() else 0.0, ok


def fp32_prefix_reference(qf, k, v, scale):
    """Folded queries `[Hkv, R, D]` over `[Hkv, S, D]` in fp32: (out, lse)."""
    scores = torch.matmul(qf.float(), k.float().transpose(-1, -2)) * scale
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float()), lse


def section_kernels(report: Report, budget: Budget, device: torch.device, tiny: bool) -> None:
    from kernels.dispatch import flash_attn_available, gpu_tree_attention_batched, prefix_attention, triton_available
    from kernels.reference import masked_attention_reference, merge_attention

    sec = "kernels"
    fig: dict[str, Any] = {"flash_attn": flash_attn_available(), "prefix_kernel": {}}
    report.figures[sec] = fig
    shapes = [(4, 2, 32)] if tiny else [(32, 8, 128), (14, 2, 64)]  # (query heads, KV heads, head dim)
    trees = (1, 5, 12) if tiny else (1, 7, 32, 64, 128)
    prefixes = (1, 100, 300) if tiny else (1, 1000, 1024, 4096, 32768, 131072)
    hybrid_prefixes = (0, 100, 300) if tiny else (0, 1024, 32768, 131072)
    gen = torch.Generator().manual_seed(0)  # tree shapes
    values = torch.Generator(device=device).manual_seed(0)  # q, k, v: generated on the device
    errs: dict[str, float] = {}

    def rnd(*shape, dtype, mul=1.0):
        return (torch.randn(*shape, generator=values, device=device) * mul).to(dtype)

    def tree_masks(sizes: tuple[int, ...]) -> torch.Tensor:
        """`[B, M, M]`: a random tree per row, padded to the largest with hidden rows and columns."""
        m = max(sizes)
        mask = torch.zeros(len(sizes), m, m, dtype=torch.bool)
        for b, size in enumerate(sizes):
            mask[b, :size, :size] = random_tree_mask(size, gen, TREE_REACH)
        return mask.to(device)

    def case(what: str, fn: Callable[[], tuple[float, bool, dict]]) -> None:
        """One comparison, guarded: `fn` gives (max error, within tolerance, details)."""
        if not budget.has(60):
            report.skip(sec, what, "time budget")
            return
        got = guarded(report, sec, what, fn)
        if got is not None:
            err, ok, detail = got
            errs[what] = err
            report.check(sec, what, ok, max_err=err, **detail)

    def tree_kernel(h, hkv, d, dtype, sizes):
        """The Triton tree kernel alone over a batch of trees (padded rows: out 0 and lse -inf exactly)."""
        from kernels.tree_attention import fused_mask_attn

        (atol, rtol), lse_tol = TOL[dtype]
        b, m = len(sizes), max(sizes)
        q, k, v = rnd(b, h, m, d, dtype=dtype, mul=2.0), rnd(b, hkv, m, d, dtype=dtype), rnd(b, hkv, m, d, dtype=dtype)
        mask = tree_masks(sizes)
        out, lse = fused_mask_attn(q, k, v, mask, d**-0.5)
        ref, ref_lse = masked_attention_reference(q, k, v, mask, d**-0.5)
        live = mask.any(-1).unsqueeze(1).expand(-1, h, -1)
        e, ok = max_err(out[live], ref[live], atol, rtol)
        el, okl = max_err(lse[live], ref_lse[live], lse_tol, 0.0)
        dead_ok = bool((out[~live] == 0).all()) and bool(torch.isneginf(lse[~live]).all())
        return e, ok and okl and dead_ok, {"lse_err": el}

    def prefix(h, hkv, d, dtype, s, n):
        """The prefix part with its LSE through the GPU entry point, and the merge of its two key halves."""
        (atol, rtol), lse_tol = TOL[dtype]
        scale = d**-0.5
        q, k, v = rnd(h, n, d, dtype=dtype, mul=2.0), rnd(hkv, s, d, dtype=dtype), rnd(hkv, s, d, dtype=dtype)
        qf = q.reshape(hkv, (h // hkv) * n, d)
        kernel = "flash_attn" if flash_attn_available() and device.type == "cuda" else prefix_kernel(qf, k, v)
        fig["prefix_kernel"][str(dtype).removeprefix("torch.")] = kernel
        out, lse = prefix_attention(q, k, v, scale)
        ref, ref_lse = fp32_prefix_reference(qf, k, v, scale)
        e, ok = max_err(out.float(), ref.reshape(h, n, d), atol, rtol)
        el, okl = max_err(lse, ref_lse.reshape(h, n), lse_tol, 1e-5)
        detail = {"lse_err": el, "kernel": kernel}
        if s >= 2:  # the exact merge: the two key halves' (out, lse) merged equal the whole
            half = s // 2
            a = attn.prefix_attention(qf, k[:, :half], v[:, :half], scale)
            b = attn.prefix_attention(qf, k[:, half:], v[:, half:], scale)
            merged, merged_lse = merge_attention(a[0].float(), a[1], b[0].float(), b[1])
            em, okm = max_err(merged, ref, atol, rtol)
            eml, okml = max_err(merged_lse, ref_lse, lse_tol, 1e-5)
            detail.update(merge_err=em, merge_lse_err=eml)
            ok, okl = ok and okm, okl and okml
        return e, ok and okl, detail

    def hybrid(h, hkv, d, dtype, s, n):
        """The whole hybrid for one sequence: Triton tree part + prefix part + merge, against the naive oracle."""
        (atol, rtol), _ = TOL[dtype]
        q, kp, vp = rnd(h, n, d, dtype=dtype, mul=2.0), rnd(hkv, s, d, dtype=dtype), rnd(hkv, s, d, dtype=dtype)
        kt, vt = rnd(hkv, n, d, dtype=dtype), rnd(hkv, n, d, dtype=dtype)
        mask = random_tree_mask(n, gen, TREE_REACH).to(device)
        out = attn.tree_attention(q, kp, vp, kt, vt, mask, d**-0.5, backend="triton")
        e, ok = max_err(out, attn.reference_attention(q, kp, vp, kt, vt, mask, d**-0.5), atol, rtol)
        return e, ok, {}

    def hybrid_batch(h, hkv, d, dtype, lens, rows, sizes):
        """Several sequences in one call (cache rows `rows` up to `lens`, trees of `sizes` padded), each against the
        naive oracle on its own."""
        (atol, rtol), _ = TOL[dtype]
        m, cap = max(sizes), max(lens) + 1
        k_cache, v_cache = rnd(4, hkv, cap, d, dtype=dtype), rnd(4, hkv, cap, d, dtype=dtype)
        q, kt, vt = (
            rnd(4, h, m, d, dtype=dtype, mul=2.0),
            rnd(4, hkv, m, d, dtype=dtype),
            rnd(4, hkv, m, d, dtype=dtype),
        )
        mask = tree_masks(sizes)
        out = gpu_tree_attention_batched(q, k_cache, v_cache, list(lens), kt, vt, mask, d**-0.5, list(rows))
        worst, all_ok = 0.0, True
        for b, (length, row, size) in enumerate(zip(lens, rows, sizes, strict=True)):
            kp, vp = k_cache[row, :, :length], v_cache[row, :, :length]
            tree = (kt[b, :, :size], vt[b, :, :size], mask[b, :size, :size])
            e, ok = max_err(
                out[b, :, :size], attn.reference_attention(q[b, :, :size], kp, vp, *tree, d**-0.5), atol, rtol
            )
            worst, all_ok = max(worst, e), all_ok and ok
        return worst, all_ok, {}

    triton_ok = triton_available()
    if not triton_ok:
        report.skip(sec, "triton tree kernel, hybrid", "Triton cannot run: no CUDA GPU and TRITON_INTERPRET is not 1")
    for dtype in (torch.bfloat16, torch.float16):
        for h, hkv, d in shapes:
            shape = (h, hkv, d, dtype)
            tag = f"{str(dtype).removeprefix('torch.')} h{h}/{hkv} d{d}"
            if triton_ok:
                for n in trees:
                    case(f"tree_kernel {tag} n{n}", partial(tree_kernel, *shape, (n,)))
                sizes = (2, trees[-1], max(1, trees[-1] // 2), 3)
                case(f"tree_kernel batch {tag} sizes{sizes}", partial(tree_kernel, *shape, sizes))
            for s in prefixes:
                for n in (1, trees[-2]):
                    case(f"prefix {tag} s{s} n{n}", partial(prefix, *shape, s, n))
            if not triton_ok:
                continue
            n = trees[-2]
            for s in hybrid_prefixes:
                case(f"hybrid {tag} s{s} n{n}", partial(hybrid, *shape, s, n))
            big = hybrid_prefixes[2]
            sizes = (n, 1, max(1, n // 2), 3)
            for lens, rows in (((0, 17, big, big // 2), (2, 0, 3, 1)), ((big,) * 4, (0, 1, 2, 3))):
                case(f"hybrid batch {tag} lens{lens} rows{rows}", partial(hybrid_batch, *shape, lens, rows, sizes))
    fig["max_err"] = {"worst": max(errs.values(), default=0.0), "cases": len(errs)}


# ----------------------------------------------------------------------------------------------- 2. engine


def top2_gap(model: Transformer, ids: list[int]) -> float:
    """Plain decoding's top-2 logit gap for the token after `ids` (a fresh prefill)."""
    cache = model.new_cache(len(ids) + 2, 1)
    slot = cache.allocate()
    logits = model.prefill(cache, slot, torch.tensor(ids))
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


def section_engine(report: Report, budget: Budget, device: torch.device, tiny: bool) -> None:
    from spyglass.engine import EngineConfig, SpecEngine, plain_generate
    from spyglass.sampling import SamplingParams

    sec = "engine"
    fig: dict[str, Any] = {}
    report.figures[sec] = fig
    max_new = 32 if tiny else 48
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    families = ("llama",) if tiny else ("llama", "qwen2")
    dtypes = (torch.float32,) if tiny else (torch.float32, torch.bfloat16)
    methods = ("ar", "ngram", "longspec", "dflash-span") if tiny else ENGINE_METHODS

    def one_run(target, drafts, prompts, plain, method: str, batch: int) -> dict[str, Any]:
        engine = SpecEngine(
            target, build_drafter(method, target, drafts), EngineConfig(max_batch=batch, controller="off")
        )
        seqs = [engine.run([p], params)[0] for p in prompts] if batch == 1 else engine.run(prompts, params)
        outs = [s.output_ids for s in seqs]
        row: dict[str, Any] = {
            "identical": sum(o == p for o, p in zip(outs, plain, strict=True)),
            "of": len(plain),
            "drafted": sum(s.stats.drafted_nodes for s in seqs),
            "accepted": sum(s.num_generated - 1 - s.stats.steps for s in seqs),  # tokens beyond one per step
            "steps": sum(s.stats.steps for s in seqs),
        }
        divergences = []
        for o, p, prompt in zip(outs, plain, prompts, strict=True):
            if o != p:  # where, and how close plain decoding's top two were there
                i = next((j for j, (a, b) in enumerate(zip(o, p, strict=False)) if a != b), min(len(o), len(p)))
                gap = top2_gap(target, prompt + p[:i]) if i < len(p) else None
                divergences.append({"at": i, "plain_top2_gap": None if gap is None else round(gap, 6)})
        if divergences:
            row["divergences"] = divergences
        return row

    for dtype in dtypes:
        dname = str(dtype).removeprefix("torch.")
        asserted = dtype == torch.float32
        for family in families:

            def setup(family=family, dtype=dtype):
                target = tiny_target(family, device, dtype)
                prompts = sample_prompts(target.args.vocab_size, 4, seed=1)
                return target, prompts, [plain_generate(target, p, params) for p in prompts]

            got = guarded(report, sec, f"plain decoding {family} {dname}", setup)
            if got is None:
                continue
            target, prompts, plain = got
            drafts: dict[str, Any] = {}
            for method in methods:
                for batch in (1, 4) if asserted else (4,):  # bf16 (reported only): the batched path
                    what = f"{method} {family} {dname} batch {batch}"
                    if not budget.has(45):
                        report.skip(sec, what, "time budget")
                        continue
                    run = partial(one_run, target, drafts, prompts, plain, method, batch)
                    row = guarded(report, sec, what, run)
                    if row is None:
                        continue
                    fig.setdefault(dname, {}).setdefault(family, {}).setdefault(method, {})[f"batch{batch}"] = row
                    if asserted:
                        report.check(sec, what, row["identical"] == row["of"], **row)
                    else:
                        print(f"[{sec}] info {what}: {row}", flush=True)
            del target, drafts
    fp32 = [c for c in report.checks if c["section"] == sec]
    fig["fp32_identical"] = all(c["ok"] for c in fp32) and bool(fp32)


# ----------------------------------------------------------------------------------------------- 3. served

# SmolLM2-135M-Instruct's shape (the embedded default model; the shipped drafts fit it), random weights
SMOLLM2_135M = ModelArgs(vocab_size=49152, hidden_size=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
                         intermediate_size=1536, rms_eps=1e-5, max_position=8192, tie_embeddings=True, qkv_bias=False,
                         bos_token_id=1, eos_token_ids=(2,))  # fmt: skip
# (TokenSwift's shipped heads check the target's weight statistics, which a random target does not match: `streaming`
# stands in for the partial-cache self-speculation they share; tests/test_verifier_device.py covers TokenSwift)
SERVED_METHODS = ("suffix", "ngram", "ar", "longspec-span", "dflash-dels", "streaming")


def random_checkpoint(path: Path, args: ModelArgs, rope_theta: float, seed: int = 0, std: float = 0.02) -> Path:
    """A Llama checkpoint in Hugging Face's format at `args`' shape with random fp32 weights (norms at 1), and a
    word-level tokenizer of its vocabulary (token i is "t<i>"): what `resolve_model` and `build_engine` take."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    q, kv, h = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim, args.hidden_size

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    tensors = {"model.embed_tokens.weight": w(args.vocab_size, h), "model.norm.weight": torch.ones(h)}
    if not args.tie_embeddings:
        tensors["lm_head.weight"] = w(args.vocab_size, h)
    for i in range(args.n_layers):
        p = f"model.layers.{i}."
        shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                  "self_attn.o_proj": (h, q), "mlp.gate_proj": (args.intermediate_size, h),
                  "mlp.up_proj": (args.intermediate_size, h), "mlp.down_proj": (h, args.intermediate_size)}  # fmt: skip
        tensors.update({f"{p}{name}.weight": w(*shape) for name, shape in shapes.items()})
        tensors.update(
            {f"{p}input_layernorm.weight": torch.ones(h), f"{p}post_attention_layernorm.weight": torch.ones(h)}
        )
    save_file(tensors, str(path / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": args.vocab_size,
              "hidden_size": h, "intermediate_size": args.intermediate_size, "num_hidden_layers": args.n_layers,
              "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
              "max_position_embeddings": args.max_position, "rms_norm_eps": args.rms_eps, "rope_theta": rope_theta,
              "tie_word_embeddings": args.tie_embeddings, "bos_token_id": args.bos_token_id,
              "eos_token_id": args.eos_token_ids[0], "torch_dtype": "float32"}  # fmt: skip
    (path / "config.json").write_text(json.dumps(config, indent=1))
    vocab = {f"t{i}": i for i in range(args.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token=f"t{args.bos_token_id}",
                                   eos_token=f"t{args.eos_token_ids[0]}")  # fmt: skip
    fast.save_pretrained(str(path))
    return path


class MemoryStore:
    """An in-process key-value store with the part of redis-py's interface the context cache uses (strings, one
    sorted set, counters, non-transactional pipelines): the context cache's round trip where there is no Redis."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.sorted: dict[str, dict[str, float]] = {}

    def get(self, key: str) -> Any:
        return self.values.get(key)

    def set(self, key: str, value: Any) -> bool:
        self.values[key] = bytes(value) if isinstance(value, (bytes, bytearray, memoryview)) else str(value).encode()
        return True

    def exists(self, key: str) -> int:
        return int(key in self.values)

    def delete(self, key: str) -> int:
        return int(self.values.pop(key, None) is not None)

    def strlen(self, key: str) -> int:
        return len(self.values.get(key, b""))

    def incrby(self, key: str, amount: int) -> int:
        value = int(self.values.get(key) or 0) + amount
        self.values[key] = str(value).encode()
        return value

    def decrby(self, key: str, amount: int) -> int:
        return self.incrby(key, -amount)

    def zadd(self, key: str, mapping: dict[str, float]) -> int:
        self.sorted.setdefault(key, {}).update(mapping)
        return len(mapping)

    def zrem(self, key: str, member: str) -> int:
        return int(self.sorted.get(key, {}).pop(member, None) is not None)

    def zpopmin(self, key: str, count: int = 1) -> list[tuple[str, float]]:
        members = sorted(self.sorted.get(key, {}).items(), key=lambda kv: kv[1])[:count]
        for member, _ in members:
            del self.sorted[key][member]
        return members

    def pipeline(self, transaction: bool = False) -> _Pipeline:
        return _Pipeline(self)


class _Pipeline:
    def __init__(self, store: MemoryStore) -> None:
        self.store, self.calls = store, []

    def __getattr__(self, name: str) -> Callable[..., _Pipeline]:
        def queue(*args: Any, **kwargs: Any) -> _Pipeline:
            self.calls.append((getattr(self.store, name), args, kwargs))
            return self

        return queue

    def execute(self) -> list[Any]:
        calls, self.calls = self.calls, []
        return [fn(*args, **kwargs) for fn, args, kwargs in calls]


def section_served(report: Report, budget: Budget, device: torch.device, tiny: bool) -> None:
    import tempfile

    from services.verifier import VerifierConfig, build_engine
    from spyglass.context_cache import ContextCache
    from spyglass.engine import plain_generate
    from spyglass.sampling import SamplingParams

    sec = "served"
    fig: dict[str, Any] = {}
    report.figures[sec] = fig
    args = tiny_args("llama", vocab=256, hidden=128, layers=2, max_position=1024) if tiny else SMOLLM2_135M
    methods = SERVED_METHODS[:3] if tiny else SERVED_METHODS
    block = 16 if tiny else 64
    max_new = 32 if tiny else 48
    batches = (1, 4, 16)
    tmp = tempfile.TemporaryDirectory(prefix="spyglass-served-")
    path = random_checkpoint(Path(tmp.name) / "random-smollm2-shape", args, rope_theta=1e5, std=0.2 if tiny else 0.02)
    fig["model"] = {"shape": "tiny" if tiny else "SmolLM2-135M", "layers": args.n_layers, "vocab": args.vocab_size,
                    "weights": "random (fp32 checkpoint)", "methods": list(methods)}  # fmt: skip
    # four copies: prompts past a prefill chunk (256 tokens), the grain of a context-cache hit
    prompts = [p * 4 for p in sample_prompts(args.vocab_size, 2 * len(methods), seed=4)]
    per_method = [m for m in methods for _ in range(2)]
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)

    def replica(dtype: str):
        cfg = VerifierConfig(model=str(path), device="auto", dtype=dtype, methods=list(methods), max_batch=max(batches),
                             max_context=1024 if tiny else 2048, cache_block_size=block)  # fmt: skip
        engine, _, info = build_engine(cfg)
        engine.context_cache = ContextCache(None, f"{info['model']}:{info['dtype']}", block_size=block,
                                            async_writes=False, client=MemoryStore())  # fmt: skip
        keep = ("device", "device_name", "dtype", "kernels", "linear_backend", "context_length")
        fig.setdefault("info", {})[dtype] = {k: info.get(k) for k in keep}
        want = dtype if dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
        placed = info["device"].split(":")[0] == device.type and info["dtype"] == want
        report.check(sec, f"replica {dtype}: on {info['device']} in {info['dtype']}", placed, kernels=info["kernels"])
        return engine, info

    def identity(engine, dtype: str) -> dict[str, Any]:
        """Every method's prompts in one continuous batch (storing their blocks), each output against plain decoding;
        then each prompt again (its blocks loaded from the store where its method reads the cache)."""
        if tiny:  # every proposed node verified: a random tiny model's timings would size most trees to nothing
            engine.controllers = dict.fromkeys(engine.controllers)
        with torch.inference_mode():
            plain = [plain_generate(engine.target, p, params) for p in prompts]
            first = engine.run(prompts, params, method=per_method)
            engine.cache.kept.clear()  # the second run's prefixes come from the store, not from released slots
            again = engine.run(prompts, params, method=per_method)
        out: dict[str, Any] = {}
        for m in methods:
            rows = [i for i, pm in enumerate(per_method) if pm == m]
            out[m] = {
                "identical": sum(first[i].output_ids == plain[i] for i in rows),
                "identical_after_cache": sum(again[i].output_ids == plain[i] for i in rows),
                "of": len(rows),
                "drafted": sum(first[i].stats.drafted_nodes for i in rows),
                "accepted": sum(first[i].num_generated - 1 - first[i].stats.steps for i in rows),
                "cached_prefix_tokens": [again[i].stats.cached_prefix_tokens for i in rows],
            }
        cc = engine.context_cache
        out["cache"] = {"stored_blocks": cc.stats.stored_blocks, "hit_blocks": cc.stats.hits, "errors": cc.stats.errors}
        return out

    for dtype in ("float32", "auto"):
        if not budget.has(60):
            report.skip(sec, f"replica {dtype}", "time budget")
            continue
        got = guarded(report, sec, f"replica {dtype}", lambda dtype=dtype: replica(dtype))
        if got is None:
            continue
        engine, info = got
        label = info["dtype"] if dtype == info["dtype"] else f"{dtype} ({info['dtype']})"
        row = guarded(report, sec, f"identity {dtype}", lambda engine=engine, dtype=dtype: identity(engine, dtype))
        if row is not None:
            fig.setdefault("identity", {})[dtype] = {"dtype": info["dtype"], **row}
            cache = row["cache"]
            loaded = sum(sum(row[m]["cached_prefix_tokens"]) for m in methods)
            report.check(sec, f"context cache round trip {label}", cache["stored_blocks"] > 0 and loaded > 0
                         and not cache["errors"], loaded_tokens=loaded, **cache)  # fmt: skip
            for m in methods:
                r = row[m]
                what = f"{m} {label} served batch"
                if dtype == "float32":  # asserted; bf16 reported (a verify pass and a decode step round differently)
                    report.check(sec, what, r["identical"] == r["of"] == r["identical_after_cache"], **r)
                else:
                    print(f"[{sec}] info {what}: {r}", flush=True)
        if dtype == "auto":
            fig["speed"] = guarded(report, sec, "tokens/s", lambda engine=engine: served_speed(engine, budget, tiny))
        report.write()
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    tmp.cleanup()


def served_speed(engine, budget: Budget, tiny: bool) -> dict[str, Any]:
    """Tokens/s per method at batch 1, 4 and 16 (that many requests together, the context cache detached): generated
    tokens over the wall time of the batch (prefill included), and the decode rate (tokens after each first one over
    the time from the batch's first first-token to its last token)."""
    from spyglass.sampling import SamplingParams

    vocab = engine.target.args.vocab_size
    params = SamplingParams(max_new_tokens=8 if tiny else 64, ignore_eos=True)
    saved, engine.context_cache = engine.context_cache, None
    out: dict[str, Any] = {}
    try:
        for method in engine.methods:
            with torch.inference_mode():
                engine.run(sample_prompts(vocab, 1, seed=9), params, method=method)  # warm: this method's shapes
            for batch in (1, 4, 16):
                if not budget.has(30):
                    break
                prompts = sample_prompts(vocab, batch, seed=10 + batch)
                t0 = time.perf_counter()
                with torch.inference_mode():
                    seqs = engine.run(prompts, params, method=method)
                wall = time.perf_counter() - t0
                generated = sum(s.num_generated for s in seqs)
                span = max(s.stats.t_end for s in seqs) - min(s.stats.t_first_token for s in seqs)
                row = {"tok_s": round(generated / wall, 2), "wall_s": round(wall, 3),
                       "decode_tok_s": round((generated - batch) / span, 2) if span > 0 else None,
                       "tokens_per_step": round(generated / max(1, sum(s.stats.steps for s in seqs)), 3)}  # fmt: skip
                out.setdefault(method, {})[f"batch{batch}"] = row
                print(f"[served] {method} batch {batch}: {row}", flush=True)
    finally:
        engine.context_cache = saved
    return out


# ----------------------------------------------------------------------------------------------- 4. speed


def weight_bytes(model: Transformer) -> int:
    """Bytes a decode step reads from the weights: every parameter but the embedding table (one row of it)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.embed.weight
    if not model.args.tie_embeddings:
        total -= embed.numel() * embed.element_size()
    return total


def filled_cache(model: Transformer, context: int, batch: int, room: int):
    """A KV cache of `batch` slots holding `context` random committed tokens each (attention's cost does not
    depend on the values), with `room` free positions after them."""
    cache = model.new_cache(context + room, batch)
    cache._k.normal_()
    cache._v.normal_()
    for _ in range(batch):
        cache.lengths[cache.allocate()] = context
    return cache


def verify_segments(model: Transformer, cache, batch: int, k: int, context: int, gen) -> list[Segment]:
    """One verify-shaped segment per slot: a random k-node tree (k = 1: a decode step) after `context` tokens,
    everything already on the device (so the step can be captured as a CUDA graph)."""
    device = model.device
    segs = []
    for slot in range(batch):
        parents = [-1] + [int(torch.randint(max(0, i - 4), i, (), generator=gen)) for i in range(1, k)]
        tree = DraftTree(torch.randint(3, model.args.vocab_size, (k,), generator=gen), parents)
        mask = tree.mask()
        segs.append(Segment(slot, context, tree.tokens.to(device), tree.positions(context).to(device),
                            None if mask is None else mask.to(device), "all"))  # fmt: skip
    return segs


def compiled_blocks(backend: str = "inductor") -> Callable[[], None]:
    """torch.compile each decoder block's forward (one compiled code, the blocks' weights as its inputs); returns a
    function that restores the eager forwards. The layer index changes per block: it is made dynamic at the first
    recompile. `backend` "eager" traces with Dynamo only (the tiny CPU run checks that the blocks trace)."""
    from spyglass.models.llama import Block

    eager = Block.forward
    compiled = torch.compile(eager, backend=backend)
    Block.forward = compiled

    def restore() -> None:
        Block.forward = eager

    return restore


def section_speed(report: Report, budget: Budget, device: torch.device, tiny: bool, layers: int | None) -> None:
    sec = "speed"
    fig: dict[str, Any] = {}
    report.figures[sec] = fig
    args = LLAMA_8B
    if tiny:
        args = tiny_args("llama", vocab=512, hidden=128, layers=2, max_position=4096)
    elif layers:
        args = ModelArgs(**{**args.__dict__, "n_layers": layers})
    dtype = torch.bfloat16
    model = random_model(args, device, dtype, seed=0, name="random-llama-3.1-8b-shape")
    wbytes = weight_bytes(model)
    kv_token = kv_bytes_per_token(model.args, model.dtype)  # K and V of one token, every layer
    fig["model"] = {"shape": "Llama-3.1-8B" if not tiny else "tiny", "layers": args.n_layers,
                    "full_layers": LLAMA_8B.n_layers, "dtype": "bfloat16", "weight_bytes_read_per_step": wbytes,
                    "weights": "random, generated on the device",
                    "note": ("" if args.n_layers == LLAMA_8B.n_layers or tiny else
                             f"{args.n_layers} of 32 layers: step times and bytes are this model's; a 32-layer "
                             "step reads about 32/n times the layers' bytes")}  # fmt: skip
    contexts = (64, 256) if tiny else (4096, 32768, 131072)
    batches = (1, 2) if tiny else (1, 8, 32)
    ks = (1, 2, 4, 8) if tiny else (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
    repeats = 2 if tiny else 5
    cuda = device.type == "cuda"
    free_bytes = torch.cuda.mem_get_info(device)[0] if cuda else 1 << 40
    kv_budget = free_bytes - (8 << 30)  # room for activations, logits (k x vocab fp32) and the references
    gen = torch.Generator().manual_seed(0)

    # -- plain decode: eager and CUDA graph at every context (compiled blocks last, at the first context)
    decode: dict[str, Any] = {}
    fig["decode"] = decode

    def decode_modes(ctx: int, modes: list[str]) -> None:
        need = kv_token * (ctx + 128)
        if need > kv_budget:
            why = f"KV cache needs {need / 2**30:.1f} GiB, {kv_budget / 2**30:.1f} free"
            report.skip(sec, f"decode ctx {ctx}", why)
            return
        cache = filled_cache(model, ctx, 1, 128)
        segs = verify_segments(model, cache, 1, 1, ctx, gen)
        bytes_step = wbytes + kv_token * ctx
        row = decode.setdefault(str(ctx), {"bytes_per_step": bytes_step})
        for mode in modes:
            if not budget.has(150 if mode.startswith("compile") else 40):
                report.skip(sec, f"decode ctx {ctx} {mode}", "time budget")
                continue

            def measure(mode=mode):
                if mode.startswith("compile"):
                    from torch._dynamo.utils import counters

                    counters.clear()
                restore = compiled_blocks("inductor" if cuda else "eager") if mode.startswith("compile") else None
                try:
                    t0 = time.perf_counter()
                    fn = lambda: model(segs, cache)  # noqa: E731
                    fn()
                    if mode.endswith("cuda_graph"):
                        fn = cuda_graph(fn)
                    fn()
                    sync(device)
                    setup_s = time.perf_counter() - t0
                    return time_ms(fn, device, repeats=2 * repeats), setup_s
                finally:
                    if restore:
                        restore()

            got = guarded(report, sec, f"decode ctx {ctx} {mode}", measure)
            if got is None:
                continue
            ms, setup_s = got
            bw = bytes_step / (ms / 1e3)
            row[mode] = {"ms": round(ms, 4), "tok_s": round(1e3 / ms, 2), "bandwidth_tb_s": round(bw / 1e12, 3),
                         "hbm_fraction": round(bw / HBM_BYTES_PER_S, 4), "setup_s": round(setup_s, 1)}  # fmt: skip
            if mode.startswith("compile"):  # how whole the compiled code was (graph breaks run eagerly between)
                from torch._dynamo.utils import counters

                breaks = counters["graph_break"]
                reasons = [r.splitlines()[0][:160] for r in list(breaks)[:3]]
                graphs = counters["stats"]["unique_graphs"]
                row[mode]["dynamo"] = {"graphs": graphs, "graph_breaks": sum(breaks.values()), "reasons": reasons}
            print(f"[{sec}] decode ctx {ctx} {mode}: {row[mode]}", flush=True)
            best = max((v["hbm_fraction"], m) for m, v in row.items() if isinstance(v, dict) and "ms" in v)
            row["best"] = {"mode": best[1], "hbm_fraction": best[0]}
        report.write()

    if not cuda:
        report.skip(sec, "decode cuda_graph", "no CUDA device (tiny mode: compile traces with Dynamo only)")
    for ctx in contexts:
        decode_modes(ctx, ["eager", "cuda_graph"] if cuda else ["eager"])
        if cuda:
            torch.cuda.empty_cache()  # (the step's KV cache, freed with decode_modes' frame)

    # -- the verify-cost curve t(k)/t(1), eager (graphed at 32K, batch 1, for k = 1 and 64)
    curves: dict[str, Any] = {}
    fig["verify_cost"] = curves
    for ctx in contexts:
        for batch in batches:
            name = f"ctx{ctx}_b{batch}"
            need = kv_token * (ctx + ks[-1]) * batch
            if need > kv_budget:
                report.skip(
                    sec, f"verify {name}", f"KV cache needs {need / 2**30:.1f} GiB, {kv_budget / 2**30:.1f} free"
                )
                continue
            if not budget.has(45):
                report.skip(sec, f"verify {name}", "time budget")
                continue

            def curve(ctx=ctx, batch=batch):
                cache = filled_cache(model, ctx, batch, ks[-1])
                times = {}
                for k in ks:
                    if not budget.has(30):
                        break
                    segs = verify_segments(model, cache, batch, k, ctx, gen)
                    times[k] = time_ms(lambda segs=segs: model(segs, cache), device, repeats=repeats)
                return times

            times = guarded(report, sec, f"verify {name}", curve)
            if not times:
                continue
            curves[name] = {"ms": {k: round(v, 4) for k, v in times.items()},
                            "ratio": {k: round(v / times[1], 4) for k, v in times.items()}}  # fmt: skip
            print(f"[{sec}] verify {name}: t(k)/t(1) {curves[name]['ratio']}", flush=True)
            if cuda:
                torch.cuda.empty_cache()
            report.write()
    mid = contexts[1]
    if cuda and budget.has(40):

        def graphed_ratio():
            cache = filled_cache(model, mid, 1, ks[-1])
            out = {}
            for k in (1, ks[-1]):
                segs = verify_segments(model, cache, 1, k, mid, gen)
                out[k] = time_ms(cuda_graph(lambda segs=segs: model(segs, cache)), device, repeats=2 * repeats)
            return out

        got = guarded(report, sec, f"verify ctx{mid} b1 cuda_graph", graphed_ratio)
        if got:
            curves[f"ctx{mid}_b1_cuda_graph"] = {"ms": got, "ratio": {k: round(v / got[1], 4) for k, v in got.items()}}

    # -- one attention call, 64-node tree: hybrid vs masked SDPA vs eager
    fig["attention"] = guarded(
        report, sec, "attention backends", lambda: attention_backends(report, budget, model, contexts, tiny)
    )
    report.write()
    # -- last (its compile time is the least predictable): torch.compile'd blocks, eager and graphed, first context
    decode_modes(contexts[0], ["compile", "compile_cuda_graph"] if cuda else ["compile"])
    if cuda:
        for ctx in contexts[1:]:
            report.skip(sec, f"decode ctx {ctx} compile", "compiled at the first context only (compile time)")
    goals(report, fig, contexts, ks)


def attention_backends(report: Report, budget: Budget, model: Transformer, contexts, tiny: bool) -> dict[str, Any]:
    """One layer's attention for a 64-node tree (16 in tiny mode) over 32K and 128K committed tokens: the hybrid
    ("triton" where it runs, else "cpu") vs masked SDPA vs HF-style eager, reading prefix + tree in place from one
    buffer as a KV cache slot holds them."""
    a, device, dtype = model.args, model.device, model.dtype
    n = 16 if tiny else 64
    hybrid = attn.resolve_backend("auto", device)  # "triton" on a GPU
    gen = torch.Generator().manual_seed(1)
    mask = random_tree_mask(n, gen, TREE_REACH).to(device)
    out: dict[str, Any] = {"tree_nodes": n, "hybrid_backend": hybrid}
    for ctx in contexts[1:]:
        if not budget.has(30):
            report.skip("speed", f"attention ctx {ctx}", "time budget")
            continue
        buf_k = torch.randn(a.n_kv_heads, ctx + n, a.head_dim, device=device, dtype=dtype)
        buf_v = torch.randn_like(buf_k)
        q = torch.randn(a.n_heads, n, a.head_dim, device=device, dtype=dtype)
        call = (q, buf_k[:, :ctx], buf_v[:, :ctx], buf_k[:, ctx:], buf_v[:, ctx:], mask)
        row = {}
        for backend in (hybrid, "sdpa_masked", "eager"):
            row[backend if backend != hybrid else "hybrid"] = round(
                time_ms(lambda backend=backend, call=call: attn.tree_attention(*call, backend=backend), device), 4
            )
        row["sdpa_over_hybrid"] = round(row["sdpa_masked"] / row["hybrid"], 3)
        row["eager_over_hybrid"] = round(row["eager"] / row["hybrid"], 3)
        out[str(ctx)] = row
        print(f"[speed] attention ctx {ctx} (ms): {row}", flush=True)
        del buf_k, buf_v
    return out


def goals(report: Report, fig: dict[str, Any], contexts, ks) -> None:
    """The issue's goals, read off the figures (recorded, not asserted: they are measurements, not checks)."""
    g: dict[str, Any] = {}
    d4 = fig.get("decode", {}).get(str(contexts[0]), {}).get("best")
    if d4:
        frac = d4["hbm_fraction"]
        g[f"decode_ctx{contexts[0]}_b1_hbm_fraction_best"] = {
            "value": frac,
            "mode": d4["mode"],
            "goal": ">= 0.70",
            "met": frac >= 0.70,
        }
    mid = contexts[1]
    ratios = [c["ratio"].get(ks[-1]) for name, c in fig.get("verify_cost", {}).items()
              if name.startswith(f"ctx{mid}_b1") and c["ratio"].get(ks[-1])]  # fmt: skip
    if ratios:
        g[f"verify_{ks[-1]}_at_ctx{mid}_b1_over_decode"] = {"value": min(ratios), "goal": "<= 1.3",
                                                             "met": min(ratios) <= 1.3}  # fmt: skip
    att = (fig.get("attention") or {}).get(str(contexts[-1]))
    if att:
        g[f"hybrid_vs_sdpa_at_ctx{contexts[-1]}"] = {"value": att["sdpa_over_hybrid"], "goal": ">= 2",
                                                     "met": att["sdpa_over_hybrid"] >= 2}  # fmt: skip
    fig["goals"] = g


# ----------------------------------------------------------------------------------------------- plot and main


def plot(report: Report) -> Path | None:
    speed = report.figures.get("speed") or {}
    panels = []
    curves = speed.get("verify_cost") or {}
    if curves:
        shape = (speed.get("model") or {}).get("shape", "")
        panels.append({"title": f"verify cost t(k)/t(1), {shape} shape, bf16", "xlabel": "tree tokens k",
                       "ylabel": "t(k) / t(1)", "logx": True, "hline": 1.3,
                       "series": {name: (list(map(int, c["ratio"])), list(c["ratio"].values()))
                                  for name, c in curves.items()}})  # fmt: skip
    decode = speed.get("decode") or {}
    modes = sorted({m for row in decode.values() for m, v in row.items() if isinstance(v, dict) and "ms" in v})
    if decode and modes:
        ctxs = list(decode)
        panels.append({"title": "plain decode: achieved HBM bandwidth / 4.8 TB/s", "xlabel": "context",
                       "ylabel": "fraction", "hline": 0.7, "xticklabels": ctxs,
                       "series": {m: ([i for i, c in enumerate(ctxs) if m in decode[c]],
                                      [decode[c][m]["hbm_fraction"] for c in ctxs if m in decode[c]])
                                  for m in modes}})  # fmt: skip
    att = speed.get("attention") or {}
    ctxs = [c for c in att if c.isdigit()]
    if ctxs:
        panels.append({"title": f"one attention call, {att['tree_nodes']}-node tree", "xlabel": "context",
                       "ylabel": "ms", "logy": True, "xticklabels": ctxs,
                       "series": {b: (list(range(len(ctxs))), [att[c][b] for c in ctxs])
                                  for b in ("hybrid", "sdpa_masked", "eager")}})  # fmt: skip
    if not panels:
        return None
    return plot_panels(report.out_dir / "gpu_check.png", panels, title=report.meta.get("device"), ncols=3)


def versions() -> dict[str, Any]:
    meta: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0]}
    try:
        import triton

        meta["triton"] = triton.__version__
    except Exception as exc:  # noqa: BLE001
        meta["triton"] = f"unavailable: {exc!r}"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        meta.update(device=p.name, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1),
                    cuda=torch.version.cuda, sms=p.multi_processor_count)  # fmt: skip
    else:
        meta["device"] = "cpu"
    meta["triton_interpret"] = os.environ.get("TRITON_INTERPRET", "0")
    return meta


def default_out(tiny: bool) -> Path:
    """Where results go: bench/results for a device run, .cache/gpu_check (git-ignored) for a tiny one."""
    return ROOT / ".cache" / "gpu_check" if tiny else ROOT / "bench" / "results"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--tiny", action="store_true", help="tiny shapes, the same code paths (CPU: Triton interpreted or skipped)"
    )
    ap.add_argument("--budget", type=float, default=None, help="seconds for the whole run (default 480; tiny 120)")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {SECTIONS}")
    ap.add_argument("--layers", type=int, default=None, help="fewer than 32 layers in the speed section")
    ap.add_argument(
        "--out", type=Path, default=None, help="output folder (default bench/results; tiny .cache/gpu_check)"
    )
    args = ap.parse_args(argv)
    only = [s for s in args.only.split(",") if s]
    bad = [s for s in only if s not in SECTIONS]
    if bad:
        ap.error(f"unknown sections {bad}; choose from {SECTIONS}")
    budget = Budget(args.budget if args.budget is not None else (120.0 if args.tiny else 480.0))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda and not args.tiny:
        print("no CUDA device: use --tiny on a machine without a GPU", file=sys.stderr)
        return 2
    if not cuda:  # the CPU only checks code paths: one thread (spinning OpenMP threads on a shared machine crawl)
        torch.set_num_threads(1)
    out_dir = args.out or default_out(args.tiny)
    meta = {**versions(), "tiny": args.tiny, "budget_s": budget.total, "sections": only, "argv": sys.argv[1:]}
    report = Report(out_dir, meta)
    print(f"gpu_check: {meta}", flush=True)
    report.write()
    # a watchdog: a section stuck past the budget (a compile, a hung kernel) still leaves the results file
    timer = threading.Timer(budget.total + 20, lambda: (report.meta.update(watchdog="budget exceeded: results "
                            "written by the watchdog, the run was cut"), report.write(), os._exit(3)))  # fmt: skip
    timer.daemon = True
    timer.start()
    runners = {
        "kernels": lambda: section_kernels(report, budget, device, args.tiny),
        "engine": lambda: section_engine(report, budget, device, args.tiny),
        "served": lambda: section_served(report, budget, device, args.tiny),
        "speed": lambda: section_speed(report, budget, device, args.tiny, args.layers),
    }
    for name in only:
        t0 = time.perf_counter()
        guarded(report, name, f"section {name}", runners[name])
        report.meta.setdefault("section_s", {})[name] = round(time.perf_counter() - t0, 1)
        report.write()
    guarded(report, "plot", "plot", lambda: plot(report))
    report.meta["elapsed_s"] = round(budget.elapsed(), 1)
    path = report.write()
    timer.cancel()
    print(f"gpu_check: {'all ok' if report.ok else 'FAILURES'} in {budget.elapsed():.0f} s -> {path}", flush=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
