"""Triton ``fused_mask_attn`` vs the plain-torch reference, plus the exact LSE merge.

Runs on CPU through the Triton interpreter.  Each interpreter launch costs ~0.2-2 s, so the kernel/reference
comparison is a covering design instead of the full product: every (M, N) cell of {1, 5, 68, 130} x
{1, 17, 128, 300} runs in fp32 and bf16, and the mask kind (tree / random / all / diagonal) and GQA ratio
(1 / 3 / 7) are rotated over the cells so that every M and every N meets every mask kind and every ratio.

Tolerances (reference computed in fp32 from the same, already-rounded, inputs):
* fp32: out atol 1e-5 rtol 1e-5; lse atol 1e-5 rtol 1e-5.
* bf16: out atol 2e-2 rtol 1.6e-2 (the kernel rounds P to bf16 before P @ V and both sides round the output
  to bf16, so they may differ by an ulp: 2^-7 relative, e.g. 0.03125 at |out| = 4); fp16: atol 5e-3 rtol 2e-3;
  lse (always fp32) atol 1e-4 rtol 1e-5, since Q.K products of bf16
  values are exact in fp32 and only the summation order differs.
Rows with no visible key must give exactly out = 0 and lse = -inf in both implementations.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels.reference import masked_attention_reference, merge_attention  # noqa: E402

triton = pytest.importorskip("triton")
tree_attention = pytest.importorskip("kernels.tree_attention")
fused_mask_attn = tree_attention.fused_mask_attn
KernelConfig = tree_attention.KernelConfig

if not tree_attention.is_available():  # pragma: no cover - only without GPU and with TRITON_INTERPRET=0
    pytest.skip("no CUDA GPU and triton interpreter not enabled", allow_module_level=True)

DEVICE = "cpu" if tree_attention._INTERPRETED else "cuda"
TOL = {
    torch.float32: {"out": (1e-5, 1e-5), "lse": (1e-5, 1e-5)},
    torch.bfloat16: {"out": (2e-2, 1.6e-2), "lse": (1e-4, 1e-5)},
    torch.float16: {"out": (5e-3, 2e-3), "lse": (1e-4, 1e-5)},
}
# ratio -> number of KV heads; 3 is SmolLM2-135M's layout (9 q / 3 kv), 7 is Qwen2.5-0.5B's (14 q / 2 kv).
KV_HEADS = {1: 2, 3: 3, 7: 2}
M_VALUES = (1, 5, 68, 130)
N_VALUES = (1, 17, 128, 300)
MASK_KINDS = ("tree", "random", "all", "diag")
GQA_RATIOS = (1, 3, 7)
DTYPES = (torch.float32, torch.bfloat16)


# ----------------------------------------------------------------------------------------------- masks


def tree_ancestor_mask(num_nodes: int, gen: torch.Generator) -> torch.Tensor:
    """[num_nodes, num_nodes] ancestor-or-self mask of a random tree in topological order (node 0 = root)."""
    anc = torch.zeros(num_nodes, num_nodes, dtype=torch.bool)
    for i in range(num_nodes):
        anc[i, i] = True
        if i > 0:
            parent = int(torch.randint(0, i, (1,), generator=gen))
            anc[i] |= anc[parent]
    return anc


def make_mask(kind: str, b: int, m: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """[b, m, n] bool mask of a kind; tree and diagonal are aligned bottom-right (query i <-> key n-m+i)."""
    if kind == "all":
        return torch.ones(b, m, n, dtype=torch.bool)
    if kind == "random":
        mask = torch.rand(b, m, n, generator=gen) < 0.5
        mask[0, m // 2] = False  # at least one fully masked row
        return mask
    out = torch.zeros(b, m, n, dtype=torch.bool)
    for bi in range(b):
        if kind == "diag":
            full = torch.eye(m, dtype=torch.bool)
        elif kind == "tree":
            full = tree_ancestor_mask(m, gen)
        else:
            raise ValueError(kind)
        if n >= m:
            out[bi, :, n - m :] = full
            if kind == "tree":
                out[bi, :, : n - m] = True  # committed context before the tree is visible to every node
        else:
            # Only the last n tree nodes are keys: rows whose visible nodes are all cut off become empty.
            out[bi] = full[:, m - n :]
    return out


def covering_cases() -> list[tuple[int, int, str, int, torch.dtype]]:
    """(M, N, mask kind, GQA ratio, dtype): every M x N x dtype; kind and ratio rotated Latin-square style."""
    cases = []
    for i, m in enumerate(M_VALUES):
        for j, n in enumerate(N_VALUES):
            for t, dtype in enumerate(DTYPES):
                kind = MASK_KINDS[(i + j + 2 * t) % len(MASK_KINDS)]
                ratio = GQA_RATIOS[(i + 2 * j + t) % len(GQA_RATIOS)]
                cases.append((m, n, kind, ratio, dtype))
    return cases


def test_covering_design_covers_every_value() -> None:
    """Guard the rotation above: every listed value and every (M|N, kind|ratio|dtype) pair must occur."""
    cases = covering_cases()
    for axis, values in ((0, M_VALUES), (1, N_VALUES)):
        for other, other_values in ((2, MASK_KINDS), (3, GQA_RATIOS), (4, DTYPES)):
            seen = {(c[axis], c[other]) for c in cases}
            assert seen == {(a, o) for a in values for o in other_values}, (axis, other)
    assert {(c[2], c[4]) for c in cases} == {(k, d) for k in MASK_KINDS for d in DTYPES}


# ------------------------------------------------------------------------------------------- helpers


def make_qkv(
    b: int, h: int, hkv: int, m: int, n: int, d: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q/k/v; q is scaled up so softmaxes are peaked enough to notice wrong head or key mapping."""
    q = (torch.randn(b, h, m, d, generator=gen) * 2.0).to(dtype).to(DEVICE)
    k = torch.randn(b, hkv, n, d, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(b, hkv, n, d, generator=gen).to(dtype).to(DEVICE)
    return q, k, v


def assert_matches_reference(
    out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor, dtype: torch.dtype
) -> None:
    """Compare against the reference with the per-dtype tolerances; empty rows must be exactly 0 / -inf."""
    assert out.dtype == dtype and out.shape == ref_out.shape
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    assert not torch.isnan(out.float()).any() and not torch.isnan(lse).any()
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty)
    assert torch.all(out.float()[empty] == 0)
    atol, rtol = TOL[dtype]["out"]
    torch.testing.assert_close(out.float().cpu(), ref_out.float().cpu(), atol=atol, rtol=rtol)
    atol, rtol = TOL[dtype]["lse"]
    torch.testing.assert_close(lse.cpu(), ref_lse.cpu(), atol=atol, rtol=rtol)


# ------------------------------------------------------------------------------------ kernel vs reference


@pytest.mark.parametrize(
    ("m", "n", "kind", "ratio", "dtype"),
    covering_cases(),
    ids=[f"M{c[0]}-N{c[1]}-{c[2]}-gqa{c[3]}-{str(c[4])[6:]}" for c in covering_cases()],
)
def test_kernel_matches_reference(m: int, n: int, kind: str, ratio: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1000 * m + n)
    b, hkv, d = 2, KV_HEADS[ratio], 64
    q, k, v = make_qkv(b, hkv * ratio, hkv, m, n, d, dtype, gen)
    mask = make_mask(kind, b, m, n, gen).to(DEVICE)
    assert mask.any(), "degenerate case: nothing visible anywhere"
    ref_out, ref_lse = masked_attention_reference(q, k, v, mask)
    out, lse = fused_mask_attn(q, k, v, mask)
    assert_matches_reference(out, lse, ref_out, ref_lse, dtype)


@pytest.mark.parametrize(
    ("d", "dtype"), [(16, torch.float32), (32, torch.float16), (80, torch.float32), (128, torch.bfloat16)]
)
def test_head_dims_small_tiles_mqa(d: int, dtype: torch.dtype) -> None:
    """Other head dims (80 exercises padding to 128), MQA (1 kv head), 16x16 tiles over ragged M and N."""
    gen = torch.Generator().manual_seed(d)
    b, h, hkv, m, n = 1, 4, 1, 37, 45
    q, k, v = make_qkv(b, h, hkv, m, n, d, dtype, gen)
    mask = make_mask("tree", b, m, n, gen).to(DEVICE)
    mask[0, 3] = False
    cfg = KernelConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    out, lse = fused_mask_attn(q, k, v, mask, config=cfg)
    assert_matches_reference(out, lse, *masked_attention_reference(q, k, v, mask), dtype)


def test_mask_dtypes_strided_inputs_and_scale() -> None:
    """uint8/int32 masks with values other than 1, K/V as strided views of a [B,N,Hkv,D] cache, a scale."""
    gen = torch.Generator().manual_seed(7)
    b, h, hkv, m, n, d = 2, 6, 2, 20, 50, 64
    q = torch.randn(b, m, h, d, generator=gen).to(DEVICE).transpose(1, 2)  # [B, H, M, D], non-contiguous
    cache = torch.randn(2, b, n + 10, hkv, d, generator=gen).to(DEVICE)
    k = cache[0, :, 5 : 5 + n].transpose(1, 2)  # [B, Hkv, N, D] view into the cache
    v = cache[1, :, 5 : 5 + n].transpose(1, 2)
    assert not k.is_contiguous() and not q.is_contiguous()
    bool_mask = make_mask("random", b, m, n, gen).to(DEVICE)
    ref_out, ref_lse = masked_attention_reference(q, k, v, bool_mask, scale=0.3)
    for mask in (bool_mask.to(torch.uint8) * 3, bool_mask.to(torch.int32) * -2):
        out, lse = fused_mask_attn(q, k, v, mask, scale=0.3)
        assert_matches_reference(out, lse, ref_out, ref_lse, torch.float32)


def test_degenerate_sizes_do_not_launch() -> None:
    """N = 0 means every row is empty; M = 0 returns empty tensors."""
    q = torch.randn(1, 2, 3, 16, device=DEVICE)
    k = torch.randn(1, 1, 0, 16, device=DEVICE)
    out, lse = fused_mask_attn(q, k, k, torch.zeros(1, 3, 0, dtype=torch.bool, device=DEVICE))
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))
    k = torch.randn(1, 1, 4, 16, device=DEVICE)
    out, lse = fused_mask_attn(q[:, :, :0], k, k, torch.ones(1, 0, 4, dtype=torch.bool, device=DEVICE))
    assert out.shape == (1, 2, 0, 16) and lse.shape == (1, 2, 0)


def test_shape_validation() -> None:
    q = torch.randn(1, 3, 4, 16, device=DEVICE)
    k = torch.randn(1, 2, 5, 16, device=DEVICE)
    with pytest.raises(ValueError, match="multiple"):
        fused_mask_attn(q, k, k, torch.ones(1, 4, 5, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="mask"):
        fused_mask_attn(q, k[:, :1], k[:, :1], torch.ones(1, 5, 4, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="mask"):
        masked_attention_reference(q, k[:, :1], k[:, :1], torch.ones(1, 5, 4, dtype=torch.bool))


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (8, 9), (9, 0), (7, 5), None])
def test_select_config_fits_shared_memory(capability: tuple[int, int] | None) -> None:
    """Tiles are powers of two >= 16 (tl.dot minimum) and the estimated shared memory fits the device."""
    for d in (16, 32, 64, 128):
        for elem in (2, 4):
            cfg = tree_attention.select_config(capability, d, elem)
            for size in (cfg.block_m, cfg.block_n):
                assert size >= 16 and size & (size - 1) == 0, cfg
            assert cfg.num_warps in (1, 2, 4, 8) and cfg.num_stages >= 1
            if capability is not None:
                limit = tree_attention._SMEM_LIMIT.get(capability, 64 * 1024)
                need = tree_attention._smem_bytes(cfg.block_m, cfg.block_n, d, elem, cfg.num_stages)
                assert need <= limit, (capability, d, elem, cfg, need)


# --------------------------------------------------------------------------------- reference self-checks


def test_reference_matches_sdpa_and_float64() -> None:
    """The reference agrees with torch SDPA (rows with a visible key) and float64 lse; empty rows: 0, -inf."""
    gen = torch.Generator().manual_seed(3)
    b, h, hkv, m, n, d = 2, 6, 2, 9, 14, 32
    q, k, v = make_qkv(b, h, hkv, m, n, d, torch.float32, gen)
    q, k, v = q.cpu(), k.cpu(), v.cpu()
    mask = make_mask("random", b, m, n, gen)
    out, lse = masked_attention_reference(q, k, v, mask)
    sdpa = F.scaled_dot_product_attention(
        q, k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1), attn_mask=mask[:, None]
    )
    rows = mask.any(-1)[:, None, :].expand(b, h, m)
    torch.testing.assert_close(out[rows], sdpa[rows], atol=1e-5, rtol=1e-5)
    scores = torch.einsum("bhmd,bhnd->bhmn", q.double(), k.double().repeat_interleave(h // hkv, 1))
    expected = torch.full((b, h, m), float("-inf"), dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            for mi in range(m):
                sel = scores[bi, hi, mi][mask[bi, mi]] / math.sqrt(d)
                if sel.numel():
                    expected[bi, hi, mi] = torch.log(torch.exp(sel).sum())
    torch.testing.assert_close(lse.double(), expected, atol=1e-5, rtol=1e-6)
    assert torch.all(out[~rows] == 0) and torch.all(torch.isneginf(lse[~rows]))
    assert (~rows).any()


# ------------------------------------------------------------------------------------------------ merge


@pytest.mark.parametrize("split", ["random", "a_empty", "b_empty", "rowwise_empty"])
def test_merge_of_disjoint_key_sets_equals_union(split: str) -> None:
    gen = torch.Generator().manual_seed(11)
    b, h, hkv, m, n, d = 2, 4, 2, 7, 23, 16
    q, k, v = make_qkv(b, h, hkv, m, n, d, torch.float32, gen)
    q, k, v = q.cpu(), k.cpu(), v.cpu()
    mask = make_mask("random", b, m, n, gen)  # has a fully masked row: both sides empty there
    if split == "random":
        in_a = torch.rand(b, m, n, generator=gen) < 0.5
    elif split == "a_empty":
        in_a = torch.zeros(b, m, n, dtype=torch.bool)
    elif split == "b_empty":
        in_a = torch.ones(b, m, n, dtype=torch.bool)
    else:  # some rows see keys only in A, others only in B
        in_a = (torch.arange(m) % 2 == 0)[None, :, None].expand(b, m, n)
    out_a, lse_a = masked_attention_reference(q, k, v, mask & in_a)
    out_b, lse_b = masked_attention_reference(q, k, v, mask & ~in_a)
    out, lse = merge_attention(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = masked_attention_reference(q, k, v, mask)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    assert torch.isneginf(lse).any()  # the fully masked row stayed 0 / -inf


def test_merge_special_values_and_dtype() -> None:
    """-inf on either or both sides, and out keeps out_a's dtype while the math is fp32."""
    out_a = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=torch.bfloat16)
    out_b = torch.tensor([[7.0, 8.0], [0.0, 0.0], [0.0, 0.0]], dtype=torch.bfloat16)
    lse_a = torch.tensor([float("-inf"), 0.5, float("-inf")])
    lse_b = torch.tensor([1.5, float("-inf"), float("-inf")])
    out, lse = merge_attention(out_a, lse_a, out_b, lse_b)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), torch.tensor([[7.0, 8.0], [3.0, 4.0], [0.0, 0.0]]))
    torch.testing.assert_close(lse, torch.tensor([1.5, 0.5, float("-inf")]))
    # Equal lse: weights 1/2 each, lse + log 2.
    out, lse = merge_attention(out_a[:1].float(), torch.tensor([2.0]), out_b[:1].float(), torch.tensor([2.0]))
    torch.testing.assert_close(out, torch.tensor([[4.0, 5.0]]))
    torch.testing.assert_close(lse, torch.tensor([2.0 + math.log(2.0)]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hybrid_prefix_plus_tree_with_kernel(dtype: torch.dtype) -> None:
    """The verify-pass decomposition: unmasked prefix + tree-masked tree keys, both by the kernel, merged."""
    gen = torch.Generator().manual_seed(5)
    b, h, hkv, m, p, d = 1, 9, 3, 21, 70, 64
    q, k, v = make_qkv(b, h, hkv, m, p + m, d, dtype, gen)
    tree = make_mask("tree", b, m, m, gen).to(DEVICE)
    prefix = torch.ones(b, m, p, dtype=torch.bool, device=DEVICE)
    out_p, lse_p = fused_mask_attn(q, k[:, :, :p], v[:, :, :p], prefix)
    out_t, lse_t = fused_mask_attn(q, k[:, :, p:], v[:, :, p:], tree)
    out, lse = merge_attention(out_p, lse_p, out_t, lse_t)
    ref_out, ref_lse = masked_attention_reference(q, k, v, torch.cat([prefix, tree], dim=-1))
    assert_matches_reference(out, lse, ref_out, ref_lse, dtype)
