"""The engine step's CPU kernels (kernels/cpu_ops.cpp) against their torch references, and the model on them."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu
from spyglass.kv_cache import CacheFullError
from spyglass.models import linear, llama
from spyglass.models.linear import set_linear_backend
from spyglass.models.llama import Block, Segment, load_transformer
from spyglass.sampling import SamplingParams

ops = cpu.native()  # `make setup` installs g++ and ninja: the kernels build on the project's machines


def test_kernels_build_here():
    assert ops is not None, "kernels/cpu_ops.cpp did not build (see the warning logged by kernels.cpu.native)"


def test_a_copy_of_the_source_elsewhere_builds_from_the_same_path(tmp_path, monkeypatch):
    """A checkout at another path (a Ray job's working directory) compiles the same file as this one, so it reuses
    this build instead of rebuilding it (and invalidating it for the processes here); the copy is written once."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    copy = tmp_path / "job" / "kernels" / cpu.SOURCE.name
    copy.parent.mkdir(parents=True)
    copy.write_bytes(cpu.SOURCE.read_bytes())
    built = cpu.build_source()
    assert built == cpu.build_source(copy) and built.is_relative_to(tmp_path / "ext")
    assert built.read_bytes() == cpu.SOURCE.read_bytes()
    mtime = built.stat().st_mtime_ns
    assert cpu.build_source(copy) == built and built.stat().st_mtime_ns == mtime
    copy.write_bytes(cpu.SOURCE.read_bytes() + b"\n// changed\n")
    assert cpu.build_source(copy) != built  # other text: another file


def test_builds_run_this_environments_ninja_whatever_the_path(monkeypatch):
    """Two ninja versions take each other's build of the same command for a changed one: every build runs the
    environment's own (pip's), not whichever PATH finds first (a Ray job's workers and a shell differ)."""
    own = Path(sysconfig.get_path("scripts")) / "ninja"
    assert own.exists()  # a dependency of the project
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    with cpu._own_ninja():
        assert shutil.which("ninja") == str(own)
    assert os.environ["PATH"] == "/usr/bin:/bin"


DTYPES = [torch.float32, torch.bfloat16]
# bf16 results against fp64 references rounded the same way: an fp32 sum rounds to the neighbouring bf16 at most
BF16 = {"rtol": 2**-7, "atol": 1e-5}


def _tol(dtype: torch.dtype, fp32: float = 1e-5) -> dict:
    return BF16 if dtype == torch.bfloat16 else {"rtol": fp32, "atol": fp32}


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_silu_mul_match_references(dtype):
    g = torch.Generator().manual_seed(0)
    for rows, width in ((1, 576), (7, 64), (33, 40)):
        x = (torch.randn(rows, width, generator=g) * 3).to(dtype)
        for w in (torch.randn(width, generator=g).to(dtype), torch.randn(width, generator=g)):  # model's or fp32
            torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), cpu.rms_norm_reference(x, w, 1e-5), **_tol(dtype))
        gu = (torch.randn(rows, 2 * width, generator=g) * 8).to(dtype)  # large |x|: sigmoid's tails
        torch.testing.assert_close(ops.silu_mul(gu), cpu.silu_mul_reference(gu), **_tol(dtype, 2e-6))
        assert ops.rms_norm(x, w, 1e-5).dtype == ops.silu_mul(gu).dtype == dtype


def test_fp32_silu_is_within_two_ulps_of_the_exact_one():
    """silu's sigmoid comes from the kernels' exp (the one the attention softmax uses): over [-30, 30] every fp32
    result lies within 2.5 units of 2^-23 relative of silu in float64 (measured: 1.85; one rounding alone is 0.5-1)."""
    x = torch.linspace(-30, 30, 600_001)
    y = ops.silu_mul(torch.cat([x, torch.ones_like(x)]).reshape(1, -1)).double().flatten()
    exact = x.double() * torch.sigmoid(x.double())
    assert exact.abs().min().item() > 0  # no zero among the points
    assert ((y - exact).abs() / exact.abs()).max().item() <= 2.5 * 2**-23


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_of_one_call_equal_a_call_per_row(dtype):
    """rms_norm, silu_mul and rope_write compute each row alone, in a fixed order: bit-identical whatever the row
    count."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 576, generator=g).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)
    whole = ops.rms_norm(x, w, 1e-6)
    assert all(torch.equal(whole[i : i + 1], ops.rms_norm(x[i : i + 1], w, 1e-6)) for i in range(5))
    gu = (torch.randn(5, 3072, generator=g) * 4).to(dtype)
    whole = ops.silu_mul(gu)
    assert all(torch.equal(whole[i : i + 1], ops.silu_mul(gu[i : i + 1])) for i in range(5))
    qkv = torch.randn(5, 15 * 64, generator=g).to(dtype)
    ang = torch.randn(5, 32, generator=g)
    cos, sin = (torch.cat([f(ang)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
    caches = [torch.zeros(3, 8, 64, dtype=dtype) for _ in range(4)]
    q = ops.rope_write(qkv, cos, sin, caches[0], caches[1], 0, 5, 2, 9)
    for i in range(5):
        qi = ops.rope_write(qkv, cos, sin, caches[2], caches[3], i, 1, 2 + i, 9)
        assert torch.equal(qi[:, 0], q[:, i])
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 2, 16), (2, 2, 40)])
def test_rope_write_rotates_q_and_k_and_writes_the_cache(heads, kv_heads, dim, dtype):
    t, row0, n, start, cap = 6, 2, 3, 5, 16
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim).to(dtype)
    ang = torch.randn(t, dim // 2)
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
    k_cache, v_cache = torch.zeros(kv_heads, cap, dim, dtype=dtype), torch.zeros(kv_heads, cap, dim, dtype=dtype)
    q = ops.rope_write(qkv, cos, sin, k_cache, v_cache, row0, n, start, heads)
    rows = qkv[row0 : row0 + n]
    c, s = cos[row0 : row0 + n].unsqueeze(1), sin[row0 : row0 + n].unsqueeze(1)
    q_ref = cpu.rope_reference(rows[:, : heads * dim].view(n, heads, dim), c, s).transpose(0, 1)
    k_ref = cpu.rope_reference(rows[:, heads * dim : (heads + kv_heads) * dim].view(n, kv_heads, dim), c, s)
    v_ref = rows[:, (heads + kv_heads) * dim :].view(n, kv_heads, dim)
    assert q.dtype == dtype
    torch.testing.assert_close(q, q_ref, **_tol(dtype))
    torch.testing.assert_close(k_cache[:, start : start + n], k_ref.transpose(0, 1), **_tol(dtype))
    assert torch.equal(v_cache[:, start : start + n], v_ref.transpose(0, 1))
    assert not k_cache[:, :start].any() and not v_cache[:, start + n :].any()  # nothing else touched
    with pytest.raises(RuntimeError, match="exceed capacity"):
        ops.rope_write(qkv, cos, sin, k_cache, v_cache, 0, n, cap - 1, heads)
    with pytest.raises(RuntimeError, match="share a dtype"):
        other = torch.bfloat16 if dtype == torch.float32 else torch.float32
        ops.rope_write(qkv, cos.to(other), sin, k_cache, v_cache, 0, n, 0, heads)


def _random_tree(n: int, g: torch.Generator) -> torch.Tensor:
    """A random tree over n nodes (node i's parent drawn from 0..i-1): each node sees its ancestors and itself."""
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        mask[i] |= mask[int(torch.randint(0, i, (1,), generator=g))]
    return mask


def _assert_attention_close(got, q, k, v, start, mask, scale):
    """fp32: within 1e-5 of the fp64 reference. bf16: the kernel rounds each block's probabilities to bf16 before
    P @ V (relative error 2^-9 each, as ATen's bf16 flash attention does), so an output is within 2^-8 of the sum of
    p |v| beside the result's own rounding."""
    ref = cpu.cache_attention_reference(q, k, v, start, mask, scale)
    if q.dtype != torch.bfloat16:
        return torch.testing.assert_close(got, ref, **_tol(q.dtype))
    bound = 2**-8 * (ref.double().abs() + cpu.cache_attention_reference(q, k, v, start, mask, scale, True)) + 1e-5
    err = (got.double() - ref.double()).abs()
    assert bool((err <= bound).all()), (
        f"max error {float(err.max()):.3g}, worst excess {float((err - bound).max()):.3g}"
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (14, 2)])  # SmolLM2-135M, Qwen2.5-0.5B (head_dim 64)
@pytest.mark.parametrize("n", [1, 5, 64, 65, 300, 512])
def test_tile_attention_matches_reference(heads, kv_heads, n, dtype):
    """A decode step, a prefill chunk (causal) and a tree (random ancestors) over no, one and 700 committed keys:
    partial key blocks, partial register tiles and tiles across heads included; fp32 and bf16 (K/V, q and the result
    in bf16; the reference in fp64 on the same bf16 values)."""
    g = torch.Generator().manual_seed(n)
    k = torch.randn(kv_heads, 1300, 64, generator=g).to(dtype)
    v = torch.randn(kv_heads, 1300, 64, generator=g).to(dtype)
    q = (torch.randn(heads, n, 64, generator=g) * 2).to(dtype)
    for start in (0, 1, 700):
        for mask in (None, _random_tree(n, g)):
            got = ops.tile_attention(q, k, v, start, mask, 0.125)
            assert got.dtype == dtype
            _assert_attention_close(got, q, k, v, start, mask, 0.125)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tile_attention_other_head_dims(dtype):
    """Head dims that are not a whole number of vectors (padded P @ V tiles, scalar key packing), MHA with dim 128,
    a decode step and a small tree at a chunk edge."""
    g = torch.Generator().manual_seed(1)
    for heads, kv_heads, dim in ((4, 2, 40), (8, 8, 128), (4, 2, 16)):
        k = torch.randn(kv_heads, 600, dim, generator=g).to(dtype)
        v = torch.randn(kv_heads, 600, dim, generator=g).to(dtype)
        for n, start in ((70, 100), (1, 510), (7, 510)):
            q = torch.randn(heads, n, dim, generator=g).to(dtype)
            for mask in (None, _random_tree(n, g)):
                got = ops.tile_attention(q, k, v, start, mask, dim**-0.5)
                _assert_attention_close(got, q, k, v, start, mask, dim**-0.5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tile_attention_rows_do_not_depend_on_the_call(dtype):
    """A row's result is the same bits whatever else is in its call: a prefill in chunks of 256 or 512, single rows,
    the first nodes of a tree alone, and any thread count."""
    g = torch.Generator().manual_seed(2)
    k, v = (torch.randn(3, 1300, 64, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(9, 1024, 64, generator=g).to(dtype)
    by_512 = torch.cat([ops.tile_attention(q[:, c : c + 512], k, v, c, None, 0.125) for c in (0, 512)])
    by_256 = torch.cat([ops.tile_attention(q[:, c : c + 256], k, v, c, None, 0.125) for c in range(0, 1024, 256)])
    assert torch.equal(by_512, by_256)
    for i in (0, 5, 255, 256, 700, 1023):
        assert torch.equal(ops.tile_attention(q[:, i : i + 1], k, v, i, None, 0.125)[0], by_512[i]), i
    mask = _random_tree(60, g)
    tree = ops.tile_attention(q[:, :60], k, v, 900, mask, 0.125)
    for m in (1, 7, 31):  # parents come first: the first m nodes are a tree of their own
        assert torch.equal(ops.tile_attention(q[:, :m], k, v, 900, mask[:m, :m], 0.125), tree[:m]), m
    try:
        torch.set_num_threads(2)
        assert torch.equal(ops.tile_attention(q[:, :60], k, v, 900, mask, 0.125), tree)
        assert torch.equal(ops.tile_attention(q[:, :512], k, v, 0, None, 0.125), by_512[:512])
    finally:
        torch.set_num_threads(1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (14, 2)])
def test_a_token_attends_as_its_decode_step(heads, kv_heads, dtype):
    """Lossless verification: a token's attention in a verify pass (a chain, a tree of any shape and size) or a
    prefill chunk equals, bit for bit, the decode step at its position over the keys it sees: the prefix, then its
    ancestors and itself laid out after it (as the cache holds them once the path is accepted). Contexts on both
    sides of the 64-key blocks and 512-key chunks; trees up to and past 64 tokens (split over the keys or not)."""
    _check_attends_as_decode(ops, heads, kv_heads, dtype)


def _avx512_here() -> bool:
    flags = cpu._cpu_flags().split()
    return all(f in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq"))


@pytest.mark.parametrize(
    "march",
    ["x86-64-v3", pytest.param("skylake-avx512", marks=pytest.mark.skipif(not _avx512_here(), reason="no AVX-512"))],
)
def test_other_builds_attend_as_their_decode_steps(march):
    """The kernel built without AVX-512 (AVX2: 8 lanes, fp32 P @ V) and with AVX-512 but without its bf16 dot
    products (the pair steps as two multiply-adds): each matches the reference, and a verify pass equals its decode
    steps bit for bit."""
    built = cpu.build_for(march)
    g = torch.Generator().manual_seed(3)
    for dtype in DTYPES:
        k, v = (torch.randn(3, 800, 64, generator=g).to(dtype) for _ in range(2))
        q = (torch.randn(9, 70, 64, generator=g) * 2).to(dtype)
        for n, start in ((1, 700), (70, 0), (70, 600)):
            for mask in (None, _random_tree(n, g)):
                got = built.tile_attention(q[:, :n], k, v, start, mask, 0.125)
                _assert_attention_close(got, q[:, :n], k, v, start, mask, 0.125)
        _check_attends_as_decode(built, 9, 3, dtype, starts=(0, 513), ns=(1, 65))


def _check_attends_as_decode(
    built, heads, kv_heads, dtype, starts=(0, 63, 511, 512, 513, 1500), ns=(1, 2, 6, 64, 65, 130)
):
    g = torch.Generator().manual_seed(heads)
    k, v = (torch.randn(kv_heads, 1700, 64, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(heads, 130, 64, generator=g).to(dtype)

    def decode_step(t: int, start: int, seen: torch.Tensor) -> torch.Tensor:
        """Token t's query as one new token after the prefix and the new tokens `seen` (cache indices from start)."""
        kk, vv = (torch.cat([x[:, :start], x[:, start + seen]], 1) for x in (k, v))
        return built.tile_attention(q[:, t : t + 1], kk, vv, start + len(seen) - 1, None, 0.125)[0]

    for start in starts:
        for n in ns:
            chain = built.tile_attention(q[:, :n], k, v, start, None, 0.125)
            for t in sorted({0, n // 2, n - 1}):
                assert torch.equal(chain[t], decode_step(t, start, torch.arange(t + 1))), (start, n, t)
            mask = _random_tree(n, g)
            tree = built.tile_attention(q[:, :n], k, v, start, mask, 0.125)
            for t in sorted({0, 1 % n, n // 3, n - 1}):
                assert torch.equal(tree[t], decode_step(t, start, mask[t].nonzero()[:, 0])), (start, n, t)


@pytest.mark.parametrize("dtype", DTYPES)
def test_group_attention_equals_each_sequences_own_call(dtype):
    """Sequences whose caches begin with the same K/V (decode steps and trees, at different starts): reading the
    shared whole chunks once for all their rows gives each row the bits of its own tile_attention call, whatever
    number of keys the group is told it shares (under a chunk: nothing shared)."""
    g = torch.Generator().manual_seed(4)
    base = [torch.randn(3, 1400, 64, generator=g).to(dtype) for _ in range(2)]
    ks, vs, qs, starts, masks = [], [], [], [], []
    for start, n in ((1100, 1), (1060, 7), (1300, 1), (1040, 30)):
        k, v = (b.clone() for b in base)
        for t in (k, v):  # each sequence's own keys after the prefix they share
            t[:, 1040:] = torch.randn(3, 360, 64, generator=g).to(dtype)
        ks.append(k), vs.append(v), starts.append(start)
        qs.append(torch.randn(9, n, 64, generator=g).to(dtype))
        masks.append(_random_tree(n, g) if n > 1 else None)
    own = [ops.tile_attention(*call, 0.125) for call in zip(qs, ks, vs, starts, masks, strict=True)]
    for shared in (0, 600, 1024, 1040):
        got = ops.group_attention(qs, ks, vs, starts, masks, shared, 0.125)
        assert all(torch.equal(a, b) for a, b in zip(got, own, strict=True)), shared
    with pytest.raises(RuntimeError, match="past a sequence's start"):
        ops.group_attention(qs, ks, vs, starts, masks, 1045, 0.125)
    with pytest.raises(RuntimeError, match="new tokens per sequence"):
        ops.group_attention([torch.randn(9, 65, 64).to(dtype)], ks[:1], vs[:1], [0], [None], 0, 0.125)


def test_tile_attention_rejects_bad_input():
    k = torch.randn(3, 8, 64)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.tile_attention(torch.randn(9, 2, 64), k, k, 7, None, 0.125)
    with pytest.raises(RuntimeError, match="mask must be"):
        ops.tile_attention(torch.randn(9, 2, 64), k, k, 0, torch.ones(3, 3, dtype=torch.bool), 0.125)
    with pytest.raises(RuntimeError, match="sees no key"):
        ops.tile_attention(torch.randn(9, 2, 64), k, k, 0, torch.tensor([[True, False], [False, False]]), 0.125)
    with pytest.raises(RuntimeError, match="head shapes"):
        ops.tile_attention(torch.randn(8, 2, 64), k, k, 0, None, 0.125)
    with pytest.raises(RuntimeError, match="q must be"):
        ops.tile_attention(torch.randn(2, 64), k, k, 0, None, 0.125)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.tile_attention(torch.randn(9, 2, 64).double(), k, k, 0, None, 0.125)
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.tile_attention(torch.randn(9, 2, 64).bfloat16(), k, k, 0, None, 0.125)


# SmolLM2's linears (q/k/v fused: 960 and 1728 = 3 x 576, gate/up fused: 3072, down, o) and odd K and N
ROWS_SHAPES = [(960, 576), (1728, 576), (3072, 576), (576, 1536), (576, 576), (13, 40), (77, 33), (25, 17), (4, 16)]


@pytest.mark.parametrize("n_out,n_in", ROWS_SHAPES)
def test_rows_linear_matches_and_is_row_count_invariant(n_out, n_in):
    """Every row of a call of any size (passes of 64 rows past 64) equals that row alone, bit for bit (a verify pass
    and a decode step sum each output in the same order), and the product within fp32 rounding."""
    g = torch.Generator().manual_seed(n_out * n_in)
    w = torch.randn(n_out, n_in, generator=g)
    b = torch.randn(n_out, generator=g)
    x = torch.randn(140, n_in, generator=g)
    for bias in (b, None):
        singles = torch.cat([ops.rows_linear(x[i : i + 1], w, bias) for i in range(140)])
        want = F.linear(x.double(), w.double(), None if bias is None else bias.double()).float()
        torch.testing.assert_close(singles, want, rtol=1e-5, atol=1e-4)
        for m in [*range(1, 20), 23, 24, 25, 31, 32, 33, 40, 47, 48, 57, 63, 64, 65, 71, 128, 130, 140]:
            start = (m * 7) % (140 - m + 1)  # rows from anywhere in x
            got = ops.rows_linear(x[start : start + m], w, bias)
            assert torch.equal(got, singles[start : start + m]), m
    # leading dims, no rows
    assert torch.equal(ops.rows_linear(x[:6].view(2, 3, n_in), w, b), ops.rows_linear(x[:6], w, b).view(2, 3, n_out))
    assert ops.rows_linear(x[:0], w, b).shape == (0, n_out)
    with pytest.raises(RuntimeError, match="bias has"):
        ops.rows_linear(x[:2], w, torch.randn(n_out + 1))


@pytest.mark.parametrize(
    "march",
    [
        None,
        "x86-64-v3",
        pytest.param("skylake-avx512", marks=pytest.mark.skipif(not _avx512_here(), reason="no AVX-512 here")),
    ],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_lanes_linear_matches_and_is_row_count_invariant(march, dtype):
    """The prefill GEMM, in this CPU's build and in the AVX2 and AVX-512-without-BF16 builds: any run of rows from
    one call equals the same rows in a call of their own, bit for bit (rows in vector lanes, padded tiles, blocks of
    rows, the last group of weight rows overlapping the one before; below a vector's worth of rows the outputs in
    the lanes), and the product within the dtype's rounding; a bias in fp32 or in the dtype. The shapes the tiles do
    not take run on `rows`."""
    if march is not None and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 builds")
    mod = ops if march is None else cpu.build_for(march)
    tol = {torch.float32: 1e-4, torch.bfloat16: 0.05}[dtype]
    for n_out, n_in in [(960, 576), (576, 1536), (13, 40), (100, 64)]:
        g = torch.Generator().manual_seed(n_out + n_in)
        w = (torch.randn(n_out, n_in, generator=g) / n_in**0.5).to(dtype)
        x = torch.randn(300, n_in, generator=g).to(dtype)
        for bias in (None, torch.randn(n_out, generator=g), torch.randn(n_out, generator=g).to(dtype)):
            whole = mod.lanes_linear(x, w, bias)
            want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
            torch.testing.assert_close(whole.double(), want, rtol=tol, atol=tol)
            for m in (1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 33, 100, 256):
                start = (m * 7) % (300 - m + 1)
                assert torch.equal(mod.lanes_linear(x[start : start + m], w, bias), whole[start : start + m]), m
    for x, w in [(torch.randn(9, 5), torch.randn(16, 5)), (torch.randn(9, 8), torch.randn(4, 8))]:  # on `rows`
        for dt in (torch.float32, torch.bfloat16) if w.shape[1] % 2 else (torch.float32,):
            assert torch.equal(mod.lanes_linear(x.to(dt), w.to(dt), None), mod.rows_linear(x.to(dt), w.to(dt), None))


def test_lanes_backend_takes_every_shape():
    """The `lanes` backend runs the shapes its kernel does not take (few outputs, odd bf16 features) on `rows`:
    row-invariant either way."""
    for dtype in DTYPES:
        for n_out, n_in in [(4, 16), (40, 33)]:
            layer = linear.Linear(n_in, n_out).to(dtype)
            assert linear.set_linear_backend(layer, "lanes") == "lanes" and linear.prefill_row_invariant(layer)
            x = torch.randn(40, n_in).to(dtype)
            with torch.inference_mode():
                y = layer(x)
                assert torch.equal(layer(x[3:5]), y[3:5])
            torch.testing.assert_close(y.float(), F.linear(x, layer.weight, layer.bias).float(), rtol=0.05, atol=0.05)
    assert not linear.prefill_row_invariant(linear.Linear(4, 4))  # no plan: aten


def test_rows_kernel_in_linear_plans():
    """`rows` takes any row count, so a plan may name it in every bucket."""
    assert "rows" in linear.KERNELS and linear.LOSSLESS_KERNELS == ("rows", "lanes")
    plan = linear.parse_plan("rows,rows,rows,rows,rows,rows,rows,rows,rows,onednn")
    assert plan[:9] == ("rows",) * 9
    model = torch.nn.Sequential(linear.Linear(16, 8))
    assert linear.set_linear_backend(model, "rows") == "rows"
    x = torch.randn(200, 16)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), F.linear(x, model[0].weight, model[0].bias), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def llama_target(tiny_dir):
    return load_transformer(tiny_dir["llama"])


def _greedy(model, ids: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    cache = model.new_cache(256, 1)
    slot = cache.allocate()
    logits = model.prefill(cache, slot, torch.tensor(ids), chunk_size=7)
    out, all_logits = [], []
    for _ in range(steps):
        tok = int(logits.argmax())
        out.append(tok)
        pos = cache.lengths[slot]
        logits = model.forward([Segment(slot, pos, torch.tensor([tok]), torch.tensor([pos]), None, "last")], cache)[0][
            -1
        ]
        all_logits.append(logits)
        cache.commit(slot, pos, [0])
    return out, all_logits


def test_model_on_kernels_matches_torch_ops(tiny_target):
    """The same model with and without the kernels: logits within fp32 rounding, greedy tokens identical."""
    ids = list(range(3, 40))
    try:
        Block.native = False
        ref_tokens, ref_logits = _greedy(tiny_target, ids, 12)
    finally:
        Block.native = True
    tokens, logits = _greedy(tiny_target, ids, 12)
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_cache_full_is_a_clear_error(tiny_target):
    cache = tiny_target.new_cache(8, 1)
    slot = cache.allocate()
    with pytest.raises(CacheFullError, match="exceed the capacity"):
        tiny_target.forward([Segment(slot, 6, torch.tensor([1, 2, 3]), torch.tensor([6, 7, 8]))], cache)


def test_kernels_can_be_turned_off():
    code = "from kernels import cpu; print(cpu.native())"
    out = subprocess.run(
        [sys.executable, "-c", code], env={"SPYGLASS_CPU_KERNELS": "0", "PATH": ""}, capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.strip() == "None", out.stderr


def test_each_path_equals_its_own_plain_decoding(llama_target):
    """With the kernels off (the torch ops), speculative output still equals plain decoding on the same path."""
    from tests.test_engine_identity import check_identity, drafters

    keep = {"ngram", "suffix", "dflash-dels"}
    skip = frozenset(name for name, _ in drafters(llama_target)) - keep
    try:
        Block.native = False
        check_identity(llama_target, SamplingParams(max_new_tokens=24, ignore_eos=True), skip=skip)
    finally:
        Block.native = True


def test_mixed_shapes_build_the_kernels_once(llama_target):
    """Prompt lengths, tree sizes and batch sizes vary from step to step: nothing is built per shape."""
    from spyglass.drafters.suffix import SuffixDrafter
    from spyglass.engine import EngineConfig, SpecEngine
    from tests.tiny import free_tokens_curve, make_prompts

    before = cpu.builds
    prompts = make_prompts(llama_target.args.vocab_size, 6, seed=3)
    for batch, depth in ((1, 2), (3, 8), (4, 5)):
        engine = SpecEngine(
            llama_target,
            SuffixDrafter(max_depth=depth, max_nodes=4 * depth),
            EngineConfig(max_batch=batch, max_context=512, controller=free_tokens_curve()),
        )
        seqs = engine.run(prompts[: batch + 2], SamplingParams(max_new_tokens=16, ignore_eos=True))
        assert {len(s.output_ids) for s in seqs} == {16}
    assert cpu.builds == before <= 1


def _row_invariant_linears(dtype: torch.dtype) -> str:
    """A linear plan whose rows do not depend on the row count: the `rows` kernel up to 64 rows where it takes the
    dtype. (bf16 without it: ATen's bf16 product, row-invariant on the tiny models' shapes, checked by the test.)"""
    if linear.rows_supported(torch.zeros(1, 1, dtype=dtype)):
        return "rows," * (len(linear.ROW_BUCKETS) - 1) + "aten"
    return "aten"


@pytest.mark.parametrize("lanes", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_verify_pass_logits_equal_decode_steps(tiny_dir, family, dtype, lanes):
    """The model on the kernels, fp32 and bf16, its linears on `rows` (or a library) or on `lanes` throughout: a
    verify pass's logits for a chain and for every node of a tree equal, bit for bit, those of the decode steps along
    the node's path, after prefixes on both sides of a 512-key chunk edge; so greedy speculation reproduces plain
    decoding token for token."""
    backend = "lanes" if lanes else _row_invariant_linears(dtype)
    model = load_transformer(tiny_dir[family], dtype=dtype, linear_backend=backend)
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(3, model.args.vocab_size, (530,), generator=g)
    cache = model.new_cache(600, 1)
    slot = cache.allocate()
    for start, n in ((20, 6), (506, 10)):
        cache.truncate(slot, 0)
        model.prefill(cache, slot, tokens[:start], chunk_size=256)
        new = tokens[start : start + n]
        mask = _random_tree(n, g)
        depth = mask.sum(1) - 1
        chain = model([Segment(slot, start, new, torch.arange(start, start + n), None, "all")], cache)[0]
        tree = model([Segment(slot, start, new, start + depth, mask, "all")], cache)[0]
        for t in range(n):
            for verified, path in ((chain, list(range(t + 1))), (tree, mask[t].nonzero()[:, 0].tolist())):
                cache.truncate(slot, start)
                for i, node in enumerate(path):  # decode steps along the path
                    pos = start + i
                    seg = Segment(slot, pos, new[node : node + 1], torch.tensor([pos]), None, "all")
                    step = model([seg], cache)[0]
                    cache.commit(slot, pos, [0])
                assert torch.equal(step[0], verified[t]), (family, start, t, path)


@pytest.mark.parametrize("backend", ["prefill:lanes", "lanes"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_one_call_layer_stack_equals_the_layer_by_layer_forward(tiny_dir, monkeypatch, family, dtype, backend):
    """A row-invariant forward (decode steps, a tree, several sequences packed) runs its layers in one kernel call
    (`layer_stack`, its linears on `rows` or on `lanes`); its logits, the K/V it writes and the hidden states a
    drafter captures equal, bit for bit, those of the same forward run layer by layer from Python (qwen2: with the
    q/k/v bias)."""
    model = load_transformer(tiny_dir[family], dtype=dtype, linear_backend=backend)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, model.args.vocab_size, (n,), generator=g) for n in (90, 300, 40)]
    tree = _random_tree(6, g)
    new = [torch.randint(3, model.args.vocab_size, (n,), generator=g) for n in (1, 6, 3)]

    forward_stacked = type(model)._forward_stacked

    def run(stacked: bool):
        calls = []
        if stacked:
            monkeypatch.setattr(
                type(model), "_forward_stacked", lambda self, *a: calls.append(1) or forward_stacked(self, *a)
            )
        else:
            monkeypatch.setattr(type(model), "_stack_ops", lambda self, segments: None)
        cache = model.new_cache(400, 3)
        slots = [cache.allocate() for _ in prompts]
        for slot, p in zip(slots, prompts, strict=True):
            model.prefill(cache, slot, p, chunk_size=64)
        segments = [
            Segment(slots[0], 90, new[0], torch.tensor([90]), None, "all"),
            Segment(slots[1], 300, new[1], 300 + tree.sum(1) - 1, tree, "all"),
            Segment(slots[2], 40, new[2], torch.arange(40, 43), None, "all"),
        ]
        model.capture_layers = (0, len(model.layers) - 1)
        try:
            logits = model(segments, cache)
            captured = model.captured
        finally:
            model.capture_layers = ()
            monkeypatch.undo()
        kv = [
            torch.cat([t[s][:, :, : p.shape[0] + n.shape[0]] for t in cache.all_layers()])
            for s, p, n in zip(slots, prompts, new, strict=True)
        ]
        return calls, logits, captured, kv

    calls, logits, captured, kv = run(stacked=True)
    ref_calls, ref_logits, ref_captured, ref_kv = run(stacked=False)
    assert calls == [1] and ref_calls == []
    for a, b in zip(logits, ref_logits, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(captured, ref_captured, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[i], b[i]) for i in a)
    for a, b in zip(kv, ref_kv, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_layer_stack_reads_a_prefix_copied_to_several_slots_once(tiny_dir, monkeypatch, dtype):
    """Prompts that begin with a prefix copied from one slot (several questions about one document): a forward of
    their decode steps and trees reads the prefix's whole attention chunks once for all of them (`layer_stack`'s
    groups), and each sequence's logits are the bits of its own forward; a slot written below the prefix leaves
    the group."""
    model = load_transformer(tiny_dir["llama"], dtype=dtype, linear_backend="lanes")
    g = torch.Generator().manual_seed(5)
    vocab = model.args.vocab_size
    doc = torch.randint(3, vocab, (1100,), generator=g)
    cache = model.new_cache(1400, 4)
    slots = [cache.allocate() for _ in range(4)]
    model.prefill(cache, slots[0], doc, chunk_size=256)
    for slot, n in zip(slots[1:], (1100, 1030, 1100), strict=True):  # each its own question after the document
        cache.copy_prefix(slots[0], slot, n)
        model.prefill(cache, slot, torch.randint(3, vocab, (40,), generator=g), chunk_size=256)
    tree = _random_tree(5, g)
    segments = []
    for slot, n in zip(slots, (1, 5, 1, 3), strict=True):
        start = cache.lengths[slot]
        pos = start + tree.sum(1) - 1 if n == 5 else torch.arange(start, start + n)
        segments.append(
            Segment(slot, start, torch.randint(3, vocab, (n,), generator=g), pos, tree if n == 5 else None, "all")
        )
    seen = []
    shared = llama._shared_prefixes
    monkeypatch.setattr(llama, "_shared_prefixes", lambda *a: seen.append(shared(*a)) or seen[-1])
    together = model(segments, cache)
    assert seen == [([0, 0, 0, 0], [1030] * 4)]  # the fewest any slot shares (two whole chunks, read once)
    alone = [model([seg], cache)[0] for seg in segments]
    for a, b in zip(together, alone, strict=True):
        assert torch.equal(a, b)
    cache.truncate(slots[2], 700)  # slot 2 now shares one chunk: the group shares the fewest keys of its slots
    cache.truncate(slots[3], 300)  # and slot 3 none
    seen.clear()
    segments = [
        Segment(s, cache.lengths[s], torch.tensor([7]), torch.tensor([cache.lengths[s]]), None, "all") for s in slots
    ]
    together = model(segments, cache)
    assert seen == [([0, 0, 0, 3], [700, 700, 700, 0])]
    for seg, a in zip(segments, together, strict=True):
        assert torch.equal(a, model([seg], cache)[0])


def test_the_layer_stacks_weights_follow_the_backend_and_the_kernel_switch(tiny_dir):
    """`layer_stack`'s weight list is gathered once, not per forward, and gathered again when what decides it
    changes: a linear backend without a row-invariant kernel (no stack), back to one (`rows`, or `lanes` throughout),
    a layer off the kernels."""
    model = load_transformer(tiny_dir["llama"], dtype=torch.float32)
    decode = [Segment(0, 5, torch.tensor([7]), torch.tensor([5]), None, "all")]
    backend = model.linear_backend
    first, _ = model._stack_weights()
    assert model._stack_ops(decode) is not None and first is not None
    assert model._stack_weights()[0] is first  # the same list: nothing gathered again
    assert len(first) == 7 * len(model.layers) and first[1] is model.layers[0].wqkv.weight
    set_linear_backend(model, "aten")
    assert model._stack_ops(decode) is None
    for name, lanes in [("prefill:lanes", False), ("lanes", True)]:
        set_linear_backend(model, name)
        assert model._stack_ops(decode) is not None and model._stack_weights()[1] is lanes
    set_linear_backend(model, backend)
    again, _ = model._stack_weights()
    assert (
        model._stack_ops(decode) is not None
        and again is not first
        and all(a is b for a, b in zip(again, first, strict=True))
    )
    model.layers[1].native = False
    try:
        assert model._stack_ops(decode) is None
    finally:
        del model.layers[1].native
    assert model._stack_ops(decode) is not None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_prefill_chunks_of_any_size_give_the_same_bits(tiny_dir, family, dtype):
    """With the prefill on `lanes` (and the layers on the kernels), a prompt prefilled in chunks of any sizes, across
    a 512-key chunk edge of the attention, leaves the same K/V in the cache and the same last logits, bit for bit:
    the engine may size chunks by load. A library prefill plan is not row-invariant, and the model says so."""
    model = load_transformer(tiny_dir[family], dtype=dtype, linear_backend="prefill:lanes")
    assert model.prefill_row_invariant
    tokens = torch.randint(3, model.args.vocab_size, (700,), generator=torch.Generator().manual_seed(3))
    seen = []
    for sizes in ([256], [1, 37, 200, 64], [700], [16, 500, 3]):
        cache = model.new_cache(768, 1)
        slot = cache.allocate()
        start, i, last = 0, 0, None
        while start < 700:
            n = min(sizes[i % len(sizes)], 700 - start)
            last = model([Segment(slot, start, tokens[start : start + n], torch.arange(start, start + n), None,
                                  "last")], cache)[0][-1]  # fmt: skip
            cache.commit(slot, start, list(range(n)))
            start, i = start + n, i + 1
        kv = [t[:, :700].clone() for layer in range(cache.n_layers) for t in cache.layer(slot, layer)]
        seen.append((last, kv))
    for last, kv in seen[1:]:
        assert torch.equal(last, seen[0][0])
        assert all(torch.equal(a, b) for a, b in zip(kv, seen[0][1], strict=True))
    set_linear_backend(model, "prefill:onednn" if linear.onednn_supported(model.lm_head.weight) else "prefill:aten")
    assert not model.prefill_row_invariant


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_prefills_last_layer_runs_only_the_rows_asked_for(tiny_dir, dtype):
    """Past its K/V, a prefill's last layer runs only the rows whose logits are asked for (one of a "last" segment's,
    none of a segment without logits): the same logits and K/V, bit for bit, as every row (which it runs when a
    drafter reads that layer's hidden states)."""
    model = load_transformer(tiny_dir["llama"], dtype=dtype, linear_backend="prefill:lanes")
    tokens = torch.randint(3, model.args.vocab_size, (300,), generator=torch.Generator().manual_seed(5))
    last = model.args.n_layers - 1
    rows_seen = []
    hook = model.layers[last].wo.register_forward_hook(lambda m, args, out: rows_seen.append(args[0].shape[0]))
    seen = []
    try:
        for capture in ((), (last,)):
            model.capture_layers = capture
            cache = model.new_cache(512, 2)
            a, b = cache.allocate(), cache.allocate()
            segs = [Segment(a, 0, tokens[:200], torch.arange(200), None, "last"),
                    Segment(b, 0, tokens[200:], torch.arange(100), None, None)]  # fmt: skip
            logits = model(segs, cache)
            assert logits[1] is None and logits[0].shape[0] == 1
            kv = [t[:, :200].clone() for layer in range(cache.n_layers) for t in cache.layer(a, layer)]
            kv += [t[:, :100].clone() for layer in range(cache.n_layers) for t in cache.layer(b, layer)]
            seen.append((logits[0], kv))
    finally:
        hook.remove()
        model.capture_layers = ()
    assert rows_seen == [1, 300]
    assert torch.equal(seen[0][0], seen[1][0])
    assert all(torch.equal(x, y) for x, y in zip(seen[0][1], seen[1][1], strict=True))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_bf16_model_on_kernels_matches_torch_ops(tiny_dir, family):
    """bf16 on the kernels and on the torch ops (each rounding its output to bf16 the same way): prefill and decode
    logits within a few bf16 roundings."""
    model = load_transformer(tiny_dir[family], dtype=torch.bfloat16, linear_backend="aten")
    tokens = torch.randint(3, model.args.vocab_size, (80,), generator=torch.Generator().manual_seed(1))
    out = {}
    try:
        for native in (False, True):
            Block.native = native
            cache = model.new_cache(128, 1)
            slot = cache.allocate()
            logits = [model.prefill(cache, slot, tokens[:70], chunk_size=32)]
            for pos in range(70, 80):
                seg = Segment(slot, pos, tokens[pos : pos + 1], torch.tensor([pos]), None, "last")
                logits.append(model([seg], cache)[0][-1])
                cache.commit(slot, pos, [0])
            out[native] = torch.stack(logits)
    finally:
        Block.native = True
    assert out[True].dtype == torch.float32
    torch.testing.assert_close(out[True], out[False], rtol=0.05, atol=0.05)


def test_real_model_prefill_on_kernels_matches_torch_ops(smollm2):
    """SmolLM2 on a 600-token prompt, prefilled in chunks of 512 (tile_attention) and decoded, with the kernels and
    with the torch ops (ATen's flash attention): the same greedy tokens, logits within fp32 rounding."""
    from spyglass.demo import code_edit_task

    model, tok = smollm2
    ids = tok(code_edit_task("shlex.py", max_chars=2400).prompt)["input_ids"][:600]
    assert len(ids) > 512
    tokens, logits = {}, {}
    try:
        for native in (False, True):
            Block.native = native
            cache = model.new_cache(768, 1)
            slot = cache.allocate()
            first = model.prefill(cache, slot, torch.tensor(ids), chunk_size=512)
            out = [int(first.argmax())]
            for _ in range(5):
                pos = cache.lengths[slot]
                seg = Segment(slot, pos, torch.tensor(out[-1:]), torch.tensor([pos]), None, "last")
                out.append(int(model.forward([seg], cache)[0][-1].argmax()))
                cache.commit(slot, pos, [0])
            tokens[native], logits[native] = out, first
    finally:
        Block.native = True
    assert tokens[True] == tokens[False]
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-3, atol=1e-3)


@pytest.mark.heavy
def test_another_version_of_the_source_builds_beside_this_one(tmp_path):
    """`build_other` (what `bench/kernel_attention.py --against` times): a copy of the source with a change that leaves
    the arithmetic alone builds as a module of its own beside `native()` and computes the same bits."""
    ops = cpu.native()
    if ops is None:
        pytest.skip("the CPU kernels are not built here")
    source = tmp_path / "cpu_ops.cpp"
    source.write_text(cpu.SOURCE.read_text() + "\n// the same kernels, another file\n")
    other = cpu.build_other(source)
    assert other.__name__ != ops.__name__
    torch.manual_seed(0)
    k, v = (torch.randn(3, 600, 64).to(torch.bfloat16) for _ in range(2))
    for n in (1, 40):
        q = torch.randn(9, n, 64).to(torch.bfloat16)
        here, there = (m.tile_attention(q, k, v, 500, None, 0.125) for m in (ops, other))
        assert torch.equal(here, there)
