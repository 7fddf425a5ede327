"""The row-invariant `rows` linear kernel (kernels/cpu_ops.cpp rows_linear) in bf16 and past 64 rows, and the rule
that puts every forward but a prefill chunk on it (spyglass.models.linear `row_invariant`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu
from spyglass.models import linear as linear_mod
from spyglass.models.linear import LANES, ROW_BUCKETS, Linear, parse_backend, set_linear_backend
from spyglass.models.llama import Segment, load_transformer

ops = cpu.native()  # `make setup` installs g++ and ninja: the kernels build on the project's machines

# SmolLM2 (q/k/v fused 960, gate/up 3072, down, o) and Qwen2.5-0.5B (q/k/v 1152) shapes; K not a multiple of 32 or 16
SHAPES = [(960, 576), (3072, 576), (576, 1536), (1152, 896), (13, 40), (77, 33), (25, 17), (4, 16), (30, 70)]
COUNTS = (1, 2, 3, 5, 8, 17, 64, 65, 130)


def _inputs(n_out: int, n_in: int, rows: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(n_out * 1000 + n_in)
    w = (torch.randn(n_out, n_in, generator=g) * n_in**-0.5).to(dtype)
    x = torch.randn(rows, n_in, generator=g).to(dtype)
    return w, x, torch.randn(n_out, generator=g)


def _biases(b: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor | None]:
    """No bias, the model's dtype, and (bf16 weights) an fp32 one."""
    return [None, b.to(dtype)] + ([b] if dtype == torch.bfloat16 else [])


@pytest.mark.parametrize("n_out,n_in", SHAPES)
def test_bf16_rows_linear_matches_a_float64_product(n_out, n_in):
    """Of the same bf16 inputs: fp32 sums then one rounding to bf16, so within half a bf16 ulp of the exact value
    plus the fp32 sum's error (a few fp32 ulps of the sum of |products|)."""
    w, x, b = _inputs(n_out, n_in, 24, torch.bfloat16)
    for bias in _biases(b, torch.bfloat16):
        got = ops.rows_linear(x, w, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (24, n_out)
        exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        magnitude = F.linear(x.double().abs(), w.double().abs())
        assert ((got.double() - exact).abs() <= 2.0**-8 * exact.abs() + 2.0**-20 * magnitude).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n_out,n_in", SHAPES)
def test_rows_linear_rows_equal_the_row_alone(dtype, n_out, n_in):
    """Each row of an M-row call (any M, from anywhere in x: a different tile, group and pass of 64) equals the
    1-row call of that row, bit for bit: a verify pass of a batch of trees gives the decode steps' bits."""
    w, x, b = _inputs(n_out, n_in, 150, dtype)
    for bias in _biases(b, dtype):
        singles = torch.cat([ops.rows_linear(x[i : i + 1], w, bias) for i in range(150)])
        for m in COUNTS:
            start = (m * 11) % (150 - m + 1)
            assert torch.equal(ops.rows_linear(x[start : start + m], w, bias), singles[start : start + m]), m


@pytest.mark.parametrize("n_out,n_in", SHAPES[:4])
def test_widen_is_the_fp32_product_of_the_widened_operands_rounded_once(n_out, n_in):
    """`widen` (a bf16 prefill kernel where the CPU has no bf16 GEMM): the fp32 product of the operands widened, the
    bias added in fp32, rounded to bf16 once; a plan may pick it for bf16 weights only."""
    w, x, b = _inputs(n_out, n_in, 256, torch.bfloat16)
    for bias in _biases(b, torch.bfloat16):
        got = linear_mod._KERNEL_FNS["widen"](x, w, bias)
        want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        assert got.dtype == torch.bfloat16 and got.shape == (256, n_out)
        # one rounding to bf16 of an fp32 sum: within a bf16 unit in the last place of the float64 product
        assert ((got.double() - want).abs() <= want.abs() * 2**-8 + 1e-5).all()
    assert "widen" in linear_mod._library_kernels(w) and "widen" not in linear_mod._library_kernels(w.float())


def test_rows_linear_bf16_shapes_and_errors():
    w, x, b = _inputs(40, 48, 6, torch.bfloat16)
    assert torch.equal(ops.rows_linear(x.view(2, 3, 48), w, b), ops.rows_linear(x, w, b).view(2, 3, 40))
    assert ops.rows_linear(x[:0], w, None).shape == (0, 40)
    assert torch.equal(ops.rows_linear(x.t().contiguous().t(), w, None), ops.rows_linear(x, w, None))
    with pytest.raises(RuntimeError, match="both float32 or both bfloat16"):
        ops.rows_linear(x.float(), w, None)  # mixed dtypes
    with pytest.raises(RuntimeError, match="both float32 or both bfloat16"):
        ops.rows_linear(x.half(), w.half(), None)
    with pytest.raises(RuntimeError, match="bias must be a CPU float32 or bfloat16"):
        ops.rows_linear(x, w, b.half())
    with pytest.raises(RuntimeError, match="bias must be a CPU float32 tensor"):
        ops.rows_linear(x.float(), w.float(), b.bfloat16())  # fp32 weights take an fp32 bias only
    with pytest.raises(RuntimeError, match="bias has 41 entries for 40"):
        ops.rows_linear(x, w, torch.randn(41))
    with pytest.raises(RuntimeError, match="x has 47 features, the weight 48"):
        ops.rows_linear(x[:, :47], w, None)
    with pytest.raises(RuntimeError, match="weight must be contiguous"):
        ops.rows_linear(x, w.t().contiguous().t(), None)


def test_portable_build_is_row_invariant_too(tmp_path):
    """Without AVX-512 (an AVX2 build of the same file: bf16 widened to fp32 as it is loaded, 8 lanes) the kernel
    still matches the product and gives every row its 1-row bits, in bf16 and fp32."""
    built = cpu.build_for("x86-64-v3")
    for dtype in (torch.bfloat16, torch.float32):
        for n_out, n_in in [(77, 33), (60, 576), (25, 17)]:
            w, x, b = _inputs(n_out, n_in, 70, dtype)
            for bias in _biases(b, dtype):
                singles = torch.cat([built.rows_linear(x[i : i + 1], w, bias) for i in range(70)])
                exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
                tol = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-20
                assert ((singles.double() - exact).abs() <= tol * exact.abs() + 1e-5).all()
                for m in (2, 5, 8, 17, 65, 70):
                    assert torch.equal(built.rows_linear(x[70 - m :], w, bias), singles[70 - m :]), m


def _recording(monkeypatch) -> list[str]:
    calls: list[str] = []
    for name, fn in list(linear_mod._KERNEL_FNS.items()):
        monkeypatch.setitem(
            linear_mod._KERNEL_FNS, name, lambda x, w, b, name=name, fn=fn: calls.append(name) or fn(x, w, b)
        )
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forwards_but_prefill_run_the_row_invariant_kernel(tiny_dir, monkeypatch, dtype):
    """Decode steps and verify passes (every row's logits, or a tree) run every linear on `rows` whatever their row
    count and whatever the prefill plan says (their layers in one `layer_stack` call, which runs `rows` only; the LM
    head from Python); prefill chunks (the last row's logits, or none) follow the plan."""
    model = load_transformer(tiny_dir["qwen2"], dtype=dtype, linear_backend="prefill:wfirst")
    assert model.linear_backend == "prefill:wfirst"
    calls = _recording(monkeypatch)
    stacked = []
    forward_stacked = type(model)._forward_stacked
    monkeypatch.setattr(
        type(model), "_forward_stacked", lambda self, *a: stacked.append(1) or forward_stacked(self, *a)
    )
    n_linears = 4 * len(model.layers)
    cache = model.new_cache(512, 3)
    slots = [cache.allocate() for _ in range(3)]
    prompt = torch.arange(3, 203)
    model([Segment(slots[0], 0, prompt[:100], torch.arange(100), None, "last")], cache)  # a prefill chunk
    assert calls == ["wfirst"] * (n_linears + 1)  # + the LM head on the last row
    calls.clear()
    model([Segment(s, 0, prompt[:40], torch.arange(40), None, "none") for s in slots], cache)  # packed prefill
    assert calls == ["wfirst"] * (n_linears - 3)  # no row's logits: the last layer stops at its K/V (q/k/v only)
    for s in slots:
        cache.commit(s, 0, list(range(40)))
    tree = torch.ones(70, 70, dtype=torch.bool).tril()
    for segments in (
        [Segment(slots[0], 40, prompt[40:41], torch.tensor([40]), None, "all")],  # a decode step
        [Segment(s, 40, prompt[40:110], torch.arange(40, 110), tree) for s in slots],  # verify: 3 trees, 210 rows
        [Segment(slots[0], 40, prompt[40:45], torch.arange(40, 45), None, "all")],  # a chain, every row's logits
    ):
        calls.clear()
        stacked.clear()
        model(segments, cache)
        assert calls == ["rows"] and stacked == [1], segments
        with monkeypatch.context() as layer_by_layer:
            layer_by_layer.setattr(type(model), "_stack_ops", lambda self, segments: None)
            calls.clear()
            model(segments, cache)
            assert calls == ["rows"] * (n_linears + 1), segments
    # outside a forward a Linear follows its plan (drafts call theirs directly)
    calls.clear()
    with torch.inference_mode():
        model.layers[0].wo(torch.randn(3, model.args.n_heads * model.args.head_dim, dtype=dtype))
    assert calls == ["wfirst"]


def test_backend_strings_say_what_is_lossless(tiny_dir, monkeypatch):
    """The default ("auto") is one of its two lossless forms, as measured here: "lanes" for every forward (where
    `lanes` is measured no slower than `rows` at a decode step's and a verify pass's rows) or a measured plan for
    prefill chunks, "prefill:<plan>", every other forward on `rows`; a plan alone runs every forward on it (nothing
    row-invariant: its name has no prefix); "prefill:" needs a weight `rows` can take."""
    model = load_transformer(tiny_dir["llama"], dtype=torch.bfloat16)
    plan, invariant = parse_backend(model.linear_backend)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if linear_mod.lanes_for_prefill(model) and linear_mod.lanes_for_decode(model):
        assert model.linear_backend == "lanes" and plan == LANES and not invariant
        assert all(m.plan == LANES and not m.invariant for m in linears)
    else:
        assert invariant and model.linear_backend.startswith("prefill:") and len(plan) == len(ROW_BUCKETS)
        assert all(m.invariant for m in linears)
    # a library kernel every CPU runs in bf16 (oneDNN's needs AVX-512 BF16 or AMX)
    assert set_linear_backend(model, "wfirst") == "wfirst"
    assert not any(m.invariant for m in model.modules() if isinstance(m, Linear))
    calls = _recording(monkeypatch)
    cache = model.new_cache(64, 1)
    model([Segment(cache.allocate(), 0, torch.arange(3, 8), torch.arange(5), None, "all")], cache)
    assert set(calls) == {"wfirst"}  # an explicit plan runs every forward (not lossless)
    assert set_linear_backend(model, "prefill:aten") == "prefill:aten"  # the plan "aten" still needs the rows path
    head = model.lm_head
    assert head.plan == ("aten",) * len(ROW_BUCKETS) and head.invariant
    with pytest.raises(ValueError, match="row-invariant 'rows'"):
        set_linear_backend(model, "prefill:mkl")
    with pytest.raises(ValueError, match="needs fp32 or bf16 weights on the CPU"):
        set_linear_backend(model.to(torch.float16), "prefill:aten")
    with pytest.raises(ValueError, match="needs fp32 or bf16 weights on the CPU"):
        set_linear_backend(model, "rows")


def test_bf16_verify_pass_equals_decode_steps_in_the_linears(tiny_dir):
    """In bf16 the linears of a verify pass give each row the bits of that row alone: the LM head's logits of a
    5-row forward equal those of 5 separate 1-row products of the same hidden states."""
    model = load_transformer(tiny_dir["llama"], dtype=torch.bfloat16)
    h = torch.randn(5, model.args.hidden_size).bfloat16()
    with torch.inference_mode(), linear_mod.row_invariant():
        together = model.lm_head(h)
        alone = torch.cat([model.lm_head(h[i : i + 1]) for i in range(5)])
    assert torch.equal(together, alone)
