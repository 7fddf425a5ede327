"""Hybrid tree attention (prefix with LSE + masked tree part + exact merge) equals full masked attention over
the concatenated sequence.

Oracles: the "reference" backend (fp32 naive softmax over prefix+tree) and an independent fp64 computation
written here (per-head loop, explicit head->KV-head map). Inputs are rounded to the tested dtype first, so the
oracles see exactly what the backend sees and only the backend's arithmetic is judged.

Tolerances (|out| is up to ~3 with these inputs):
* fp32: atol 2e-5, rtol 2e-5 against fp64 (fp32 accumulation over <= 1.4K keys).
* bf16: atol 2e-2, rtol 2e-2 per element (the output itself is rounded to bf16: half an ulp is 7.8e-3 at
  |out| in [2, 4); probabilities are rounded to bf16 before P @ V, and the matmul prefix path rounds scores
  to bf16), and the mean absolute error must stay below 2e-3 so a systematic error cannot hide in the
  per-element slack.
The Triton path runs under TRITON_INTERPRET=1 (set in conftest.py before triton is imported).
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels import aten_prefix
from kernels.dispatch import flash_attn_available, triton_available
from spyglass import attention as attn
from spyglass.tree import DraftTree

TOL = {torch.float32: (2e-5, 2e-5, 2e-6), torch.bfloat16: (2e-2, 2e-2, 2e-3)}  # atol, rtol, mean abs
KV_HEADS = {1: 2, 3: 3, 7: 2}  # GQA ratio -> KV heads (3: SmolLM2's 9/3, 7: Qwen2.5-0.5B's 14/2)


def random_tree(n: int, gen: torch.Generator) -> DraftTree:
    parents = [-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, n)]
    return DraftTree(torch.zeros(n, dtype=torch.long), parents)


def make_case(ratio: int, s: int, n: int, dtype: torch.dtype, seed: int, d: int = 64, q_scale: float = 2.0):
    """q [H, n, D], prefix K/V [Hkv, S, D], tree K/V [Hkv, n, D] in `dtype` (q_scale > 1: peaky softmax)."""
    g = torch.Generator().manual_seed(seed)
    hkv = KV_HEADS[ratio]
    h = hkv * ratio

    def rnd(*shape: int, mul: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * mul).to(dtype)

    return rnd(h, n, d, mul=q_scale), rnd(hkv, s, d), rnd(hkv, s, d), rnd(hkv, n, d), rnd(hkv, n, d)


def fp64_attention(q, kp, vp, kt, vt, mask: torch.Tensor | None) -> torch.Tensor:
    """Independent oracle: per query head, softmax over [prefix, visible tree keys] in float64."""
    h, n, d = q.shape
    hkv, s = kt.shape[0], kp.shape[1]
    visible = torch.ones(n, n, dtype=torch.bool).tril() if mask is None else mask
    out = torch.empty(h, n, d, dtype=torch.float64)
    for head in range(h):
        kv = head // (h // hkv)
        keys = torch.cat([kp[kv], kt[kv]]).double()
        vals = torch.cat([vp[kv], vt[kv]]).double()
        scores = q[head].double() @ keys.T / math.sqrt(d)
        scores[:, s:][~visible] = -math.inf
        out[head] = torch.softmax(scores, dim=-1) @ vals
    return out


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    atol, rtol, mean_tol = TOL[dtype]
    err = (actual.double() - expected.double()).abs()
    assert torch.allclose(actual.double(), expected.double(), atol=atol, rtol=rtol), f"{what}: max err {err.max():.3g}"
    assert err.mean() <= mean_tol, f"{what}: mean err {err.mean():.3g}"


@pytest.fixture(params=["matmul", "flash", "split"])
def prefix_path(request, monkeypatch):
    """Force the CPU prefix part through two matmuls or through ATen's flash kernel for CPU, whole or
    split into 3 key chunks (plus a remainder) run as one batch."""
    rows = 10**9 if request.param == "matmul" else 0
    monkeypatch.setattr(aten_prefix, "MATMUL_PREFIX_MAX_ROWS", {torch.float32: rows, torch.bfloat16: rows})
    parts = 3 if request.param == "split" else 1
    monkeypatch.setattr(aten_prefix, "kv_split_parts", lambda dtype, keys: parts)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("ratio", [1, 3, 7])
@pytest.mark.parametrize("s", [0, 1, 37, 300, 1100])
@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_hybrid_equals_full_masked_attention(prefix_path, dtype, ratio, s, kind):
    n = 9 if kind == "chain" else 23
    seed = 1000 * ratio + s + (7 if kind == "tree" else 0)
    q, kp, vp, kt, vt = make_case(ratio, s, n, dtype, seed)
    mask = None if kind == "chain" else random_tree(n, torch.Generator().manual_seed(seed)).mask()
    out = attn.tree_attention(q, kp, vp, kt, vt, mask, backend="cpu")
    assert out.shape == q.shape and out.dtype == dtype
    exact = fp64_attention(q, kp, vp, kt, vt, mask)
    assert_close(out, exact, dtype, f"cpu vs fp64 ({prefix_path})")
    ref = attn.tree_attention(q, kp, vp, kt, vt, mask, backend="reference")
    assert_close(out, ref, dtype, f"cpu vs reference ({prefix_path})")
    assert_close(ref, exact, dtype, "reference vs fp64")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["eager", "sdpa_masked", "sdpa_hf"])
@pytest.mark.parametrize("s", [0, 200])
def test_baselines_equal_reference(dtype, backend, s):
    """The benchmark baselines compute the same function (bf16: HF-style bf16 scores, so looser)."""
    q, kp, vp, kt, vt = make_case(3, s, 17, dtype, seed=5 + s)
    mask = random_tree(17, torch.Generator().manual_seed(s)).mask()
    out = attn.tree_attention(q, kp, vp, kt, vt, mask, backend=backend)
    exact = fp64_attention(q, kp, vp, kt, vt, mask)
    if dtype == torch.float32:
        assert_close(out, exact, dtype, backend)
    else:  # eager rounds the scores to bf16 before the softmax, as HF does
        assert torch.allclose(out.double(), exact, atol=6e-2, rtol=6e-2)


@pytest.mark.parametrize("ratio", [1, 3, 7])
@pytest.mark.parametrize("s", [0, 5, 700])
def test_cross_attention_equals_unmasked_fp64(prefix_path, ratio, s):
    """Draft cross-attention (every query sees the whole context) on the hybrid's prefix path."""
    q, kp, vp, _, _ = make_case(ratio, s, 6, torch.float32, seed=77 + s + ratio)
    out = attn.cross_attention(q, kp, vp, backend="cpu")
    hkv = kp.shape[0]
    exact = torch.zeros(q.shape, dtype=torch.float64)
    for head in range(q.shape[0]) if s else ():
        kv = head // (q.shape[0] // hkv)
        probs = torch.softmax(q[head].double() @ kp[kv].double().T / math.sqrt(q.shape[-1]), dim=-1)
        exact[head] = probs @ vp[kv].double()
    assert out.shape == q.shape
    assert_close(out, exact, torch.float32, f"cross attention s={s}")
    if triton_available():  # the GPU entry point's torch fallback when no GPU is present
        assert_close(attn.cross_attention(q, kp, vp, backend="triton"), exact, torch.float32, "triton backend")
    assert_close(attn.cross_attention(q, kp, vp, backend="reference"), exact, torch.float32, "reference backend")


def test_single_token_and_tiny_prefix(prefix_path):
    """n = 1 (a plain decode step) and S = 1: the degenerate shapes of the engine's plain path."""
    for s in (0, 1, 513):
        q, kp, vp, kt, vt = make_case(3, s, 1, torch.float32, seed=s)
        out = attn.tree_attention(q, kp, vp, kt, vt, None, backend="cpu")
        assert_close(out, fp64_attention(q, kp, vp, kt, vt, None), torch.float32, f"n=1 s={s}")
        # the model's decode path: one call over the prefix with the token's own K/V appended
        one = attn.single_token_attention(q, torch.cat([kp, kt], 1), torch.cat([vp, vt], 1))
        assert_close(one, fp64_attention(q, kp, vp, kt, vt, None), torch.float32, f"single-token call s={s}")


def test_adjacent_kv_is_joined_without_copy():
    """The baselines read prefix + tree in place when the tree entries already follow the prefix in the
    buffer (as in a KV cache slot after the model wrote them), and concatenate otherwise."""
    buf = torch.randn(3, 64, 8)  # capacity 64: the slot has room after the 40 committed positions
    joined = attn._join_kv(buf[:, :40], buf[:, 40:50])
    assert joined.data_ptr() == buf.data_ptr() and torch.equal(joined, buf[:, :50])
    written = attn._join_kv(buf[:, :40], buf[:, 40:50].clone())  # equal values in other memory: still a view
    assert written.data_ptr() == buf.data_ptr() and torch.equal(written, buf[:, :50])
    other = torch.randn(3, 10, 8)
    copied = attn._join_kv(buf[:, :40], other)
    assert copied.data_ptr() != buf.data_ptr() and torch.equal(copied, torch.cat([buf[:, :40], other], dim=1))
    past_end = attn._join_kv(buf[:, :60], torch.randn(3, 10, 8))  # would run past the slot's capacity
    assert past_end.shape == (3, 70, 8) and past_end.data_ptr() != buf.data_ptr()


def test_prefix_path_follows_threshold(monkeypatch):
    """Rows <= MATMUL_PREFIX_MAX_ROWS[dtype] take two matmuls; more rows take the flash kernel."""
    calls = []
    real = aten_prefix._flash_cpu

    def spy(*a, **kw):
        calls.append(a[0].shape[2])
        return real(*a, **kw)

    monkeypatch.setattr(aten_prefix, "_flash_cpu", spy)
    monkeypatch.setattr(aten_prefix, "MATMUL_PREFIX_MAX_ROWS", {torch.float32: 20, torch.bfloat16: 20})
    k = torch.randn(3, 64, 16)
    for rows in (20, 21):
        aten_prefix.prefix_attention(torch.randn(3, rows, 16), k, k, 0.25)
    assert calls == [21]
    assert aten_prefix.matmul_prefix_max_rows(torch.float16) == 20  # fp16 follows bf16


def test_kv_split_rule():
    """Two chunks per thread where bench/attention.py measured a gain, one call elsewhere and on one thread."""
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert aten_prefix.kv_split_parts(torch.float32, 8192) == 4
        assert aten_prefix.kv_split_parts(torch.float32, 8191) == 1
        assert aten_prefix.kv_split_parts(torch.bfloat16, 16384) == 1
        assert aten_prefix.kv_split_parts(torch.float16, 32768) == 4  # fp16 follows bf16
        torch.set_num_threads(1)
        assert aten_prefix.kv_split_parts(torch.float32, 1 << 16) == 1
    finally:
        torch.set_num_threads(old)


def test_resolve_backend():
    assert attn.resolve_backend("auto", torch.device("cpu")) == "cpu"
    assert attn.resolve_backend("reference", torch.device("cpu")) == "reference"
    with pytest.raises(ValueError, match="unknown attention backend"):
        attn.resolve_backend("flash", torch.device("cpu"))


# --- the GPU path (kernels.dispatch) on CPU: torch prefix fallback + Triton tree kernel, interpreted -------

triton_ok = pytest.mark.skipif(
    not triton_available(),
    reason="triton kernel cannot run (no GPU and no TRITON_INTERPRET=1)",
)


@triton_ok
@pytest.mark.parametrize(
    ("dtype", "ratio", "s", "kind"),
    [
        (torch.float32, 3, 0, "tree"),
        (torch.float32, 7, 120, "chain"),
        (torch.float32, 1, 45, "tree"),
        (torch.bfloat16, 3, 300, "tree"),
    ],
)
def test_triton_backend_equals_reference(dtype, ratio, s, kind):
    assert not flash_attn_available() or torch.cuda.is_available()  # on CPU the torch prefix fallback runs
    n = 12 if kind == "chain" else 20
    q, kp, vp, kt, vt = make_case(ratio, s, n, dtype, seed=s + ratio)
    mask = None if kind == "chain" else random_tree(n, torch.Generator().manual_seed(s)).mask()
    out = attn.tree_attention(q, kp, vp, kt, vt, mask, backend="triton")
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out, fp64_attention(q, kp, vp, kt, vt, mask), dtype, "triton vs fp64")
    assert_close(out, attn.tree_attention(q, kp, vp, kt, vt, mask, backend="reference"), dtype, "triton vs ref")


# --- several sequences with different committed lengths in one call ----------------------------------------


def _batched_case(dtype: torch.dtype):
    """3 sequences, committed lengths 0 / 17 / 130 in cache rows 2 / 0 / 3 of a 4-row cache, trees of 5 / 12 /
    9 nodes padded to 12 (padded mask rows and columns are False)."""
    g = torch.Generator().manual_seed(42)
    hkv, ratio, d, cap = 3, 3, 64, 160
    h = hkv * ratio
    lens, rows, sizes = [0, 17, 130], [2, 0, 3], [5, 12, 9]
    m = max(sizes)
    k_cache = torch.randn(4, hkv, cap, d, generator=g).to(dtype)
    v_cache = torch.randn(4, hkv, cap, d, generator=g).to(dtype)
    q = (torch.randn(3, h, m, d, generator=g) * 2).to(dtype)
    k_tree = torch.randn(3, hkv, m, d, generator=g).to(dtype)
    v_tree = torch.randn(3, hkv, m, d, generator=g).to(dtype)
    mask = torch.zeros(3, m, m, dtype=torch.bool)
    for b, size in enumerate(sizes):
        mask[b, :size, :size] = random_tree(size, g).mask()
    return q, k_cache, v_cache, lens, rows, sizes, k_tree, v_tree, mask


@pytest.mark.parametrize(
    "backend", ["cpu", "reference", pytest.param("triton", marks=triton_ok)], ids=["cpu", "reference", "triton"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_batched_equals_per_sequence(backend, dtype):
    q, k_cache, v_cache, lens, rows, sizes, k_tree, v_tree, mask = _batched_case(dtype)
    out = attn.batched_tree_attention(
        q, k_cache, v_cache, torch.tensor(lens), k_tree, v_tree, mask, backend=backend, cache_batch_idx=rows
    )
    assert out.shape == q.shape
    for b, (length, row, size) in enumerate(zip(lens, rows, sizes, strict=True)):
        args = (
            q[b, :, :size],
            k_cache[row, :, :length],
            v_cache[row, :, :length],
            k_tree[b, :, :size],
            v_tree[b, :, :size],
        )
        single = attn.tree_attention(*args, mask[b, :size, :size], backend="cpu")
        assert_close(out[b, :, :size], single, dtype, f"{backend} seq {b} vs per-sequence cpu")
        assert_close(out[b, :, :size], fp64_attention(*args, mask[b, :size, :size]), dtype, f"{backend} seq {b}")
        if backend != "reference":  # the naive oracle gives NaN for padded rows of an empty prefix
            assert torch.isfinite(out[b]).all(), "padded rows must not turn into NaN"


# --- the prefix part's fused kernels (ATen's, returning the log-sum-exp) -------------------------------------


def test_prefix_kernel_choice():
    """ATen's fused kernels wherever they take the inputs: on CUDA torch's FlashAttention-2 op for fp16/bf16 on
    Ampere or newer (no flash-attn needed), its memory-efficient op for fp32 (and fp16 before Ampere); two matmuls
    for head dims the kernels lack, bf16 before Ampere and other devices."""
    choose = aten_prefix.choose_prefix_kernel
    assert choose("cuda", torch.bfloat16, 128, 4, (9, 0)) == "cuda_flash"
    assert choose("cuda", torch.float16, 64, 1, (8, 0)) == "cuda_flash"
    assert choose("cuda", torch.float32, 128, 4, (9, 0)) == "cuda_efficient"
    assert choose("cuda", torch.float16, 64, 4, (7, 5)) == "cuda_efficient"
    assert choose("cuda", torch.bfloat16, 64, 4, (7, 5)) == "matmul"
    assert choose("cuda", torch.bfloat16, 100, 4, (9, 0)) == "matmul"  # not a multiple of 8
    assert choose("cuda", torch.bfloat16, 512, 4, (9, 0)) == "matmul"
    assert choose("cpu", torch.float32, 64, 1) == "cpu_flash"  # MATMUL_PREFIX_MAX_ROWS is 0
    assert choose("meta", torch.float32, 64, 1) == "matmul"
    q = torch.randn(3, 4, 16)
    assert aten_prefix.prefix_kernel(q, q, q) == "cpu_flash"
    assert aten_prefix.prefix_kernel(q, q.double(), q) == "matmul"
    with pytest.raises(ValueError, match="no fused prefix kernel"):
        aten_prefix.fused_attention_with_lse(q[None], q[None], q[None], 0.25, "matmul")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("ratio", [1, 4])
def test_fused_prefix_kernel_returns_out_and_lse(dtype, ratio):
    """The fused prefix kernel on the CPU (the CUDA ones run in bench/gpu_check.py): a batch of folded GQA rows over
    keys read in place (a strided view of a cache), its output and log-sum-exp against fp64."""
    g = torch.Generator().manual_seed(ratio)
    b, hkv, n, s, d = 2, 2, 5, 300, 64
    q = (torch.randn(b, hkv, ratio * n, d, generator=g) * 2).to(dtype)
    cache_k = torch.randn(b, hkv, s + 40, d, generator=g).to(dtype)  # room after the prefix, as in a KV slot
    cache_v = torch.randn(b, hkv, s + 40, d, generator=g).to(dtype)
    k, v = cache_k[:, :, :s], cache_v[:, :, :s]
    out, lse = aten_prefix.fused_attention_with_lse(q, k, v, d**-0.5, aten_prefix.prefix_kernel(q, k, v))
    assert out.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    scores = q.double() @ k.double().transpose(-1, -2) * d**-0.5
    exact_lse = torch.logsumexp(scores, -1)
    exact = torch.softmax(scores, -1) @ v.double()
    fp32 = dtype == torch.float32
    assert_close(out, exact, torch.float32 if fp32 else torch.bfloat16, "fused prefix out")
    assert torch.allclose(lse.double(), exact_lse, atol=1e-5 if fp32 else 1e-3, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_batched_prefix_without_flash_attn(dtype):
    """The GPU entry point's prefix part without flash-attn: sequences of one length in consecutive cache rows take
    one fused launch over views of the cache, others one launch each; both equal the per-sequence computation."""
    from kernels.dispatch import _aten_prefix_batched

    q, k_cache, v_cache, _, _, _, _, _, _ = _batched_case(dtype)
    for lens, rows in (([40, 40, 40], [1, 2, 3]), ([0, 17, 130], [2, 0, 3])):
        out, lse = _aten_prefix_batched(q, k_cache, v_cache, lens, rows, 0.125)
        for b, (length, row) in enumerate(zip(lens, rows, strict=True)):
            if length == 0:
                assert torch.isneginf(lse[b]).all() and (out[b] == 0).all()
                continue
            h, m, d = q.shape[1:]
            qf = q[b].reshape(k_cache.shape[1], -1, d)
            kp, vp = k_cache[row, :, :length].double(), v_cache[row, :, :length].double()
            scores = qf.double() @ kp.transpose(-1, -2) * 0.125
            ref_out, ref_lse = torch.softmax(scores, -1) @ vp, torch.logsumexp(scores, -1)
            assert_close(out[b], ref_out.reshape(h, m, d), dtype, f"batched prefix {lens} seq {b}")
            assert torch.allclose(lse[b].double(), ref_lse.reshape(h, m), atol=1e-3, rtol=0)
