"""The engine step's CPU kernels (kernels/cpu_ops.cpp) against their torch references, and the model on them."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu
from spyglass.kv_cache import CacheFullError
from spyglass.models import linear
from spyglass.models.llama import Block, Segment, load_transformer
from spyglass.sampling import SamplingParams

ops = cpu.native()  # `make setup` installs g++ and ninja: the kernels build on the project's machines


def test_kernels_build_here():
    assert ops is not None, "kernels/cpu_ops.cpp did not build (see the warning logged by kernels.cpu.native)"


def test_rms_norm_and_silu_mul_match_references():
    g = torch.Generator().manual_seed(0)
    for rows, width in ((1, 576), (7, 64), (33, 40)):
        x = torch.randn(rows, width, generator=g) * 3
        w = torch.randn(width, generator=g)
        torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), cpu.rms_norm_reference(x, w, 1e-5))
        gu = torch.randn(rows, 2 * width, generator=g) * 8  # large |x|: sigmoid's tails
        torch.testing.assert_close(ops.silu_mul(gu), cpu.silu_mul_reference(gu), rtol=2e-6, atol=2e-6)


def test_rows_of_one_call_equal_a_call_per_row():
    """rms_norm and silu_mul compute each row alone, in a fixed order: bit-identical whatever the row count."""
    x = torch.randn(5, 576)
    w = torch.randn(576)
    whole = ops.rms_norm(x, w, 1e-6)
    assert all(torch.equal(whole[i : i + 1], ops.rms_norm(x[i : i + 1], w, 1e-6)) for i in range(5))


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 2, 16), (2, 2, 40)])
def test_rope_write_rotates_q_and_k_and_writes_the_cache(heads, kv_heads, dim):
    t, row0, n, start, cap = 6, 2, 3, 5, 16
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim)
    ang = torch.randn(t, dim // 2)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    k_cache, v_cache = torch.zeros(kv_heads, cap, dim), torch.zeros(kv_heads, cap, dim)
    q = ops.rope_write(qkv, cos, sin, k_cache, v_cache, row0, n, start, heads)
    rows = qkv[row0 : row0 + n]
    c, s = cos[row0 : row0 + n].unsqueeze(1), sin[row0 : row0 + n].unsqueeze(1)
    q_ref = cpu.rope_reference(rows[:, : heads * dim].view(n, heads, dim), c, s).transpose(0, 1)
    k_ref = cpu.rope_reference(rows[:, heads * dim : (heads + kv_heads) * dim].view(n, kv_heads, dim), c, s)
    v_ref = rows[:, (heads + kv_heads) * dim :].view(n, kv_heads, dim)
    torch.testing.assert_close(q, q_ref)
    torch.testing.assert_close(k_cache[:, start : start + n], k_ref.transpose(0, 1))
    assert torch.equal(v_cache[:, start : start + n], v_ref.transpose(0, 1))
    assert not k_cache[:, :start].any() and not v_cache[:, start + n :].any()  # nothing else touched
    with pytest.raises(RuntimeError, match="exceed capacity"):
        ops.rope_write(qkv, cos, sin, k_cache, v_cache, 0, n, cap - 1, heads)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (14, 2, 64), (8, 8, 128), (4, 2, 40)])
@pytest.mark.parametrize("start", [0, 16, 510, 1300])
@pytest.mark.parametrize("n,tree", [(1, False), (5, False), (7, True)])
def test_cache_attention_matches_reference(heads, kv_heads, dim, start, n, tree):
    """A decode step (n = 1), a chain (causal) and a tree (its mask) over a committed prefix, chunk edges included."""
    g = torch.Generator().manual_seed(start + n)
    k = torch.randn(kv_heads, 1400, dim, generator=g)
    v = torch.randn(kv_heads, 1400, dim, generator=g)
    q = torch.randn(heads, n, dim, generator=g) * 2
    mask = None
    if tree:  # node i's parent is (i - 1) // 2: a binary tree; each node sees its ancestors and itself
        mask = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            mask[i] |= mask[(i - 1) // 2]
    got = ops.cache_attention(q, k, v, start, mask, dim**-0.5)
    ref = cpu.cache_attention_reference(q, k, v, start, mask, dim**-0.5)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_cache_attention_rows_do_not_depend_on_the_other_tokens():
    """A chain's row i equals a decode step at that position over the same keys, bit for bit."""
    k, v = torch.randn(3, 1100, 64), torch.randn(3, 1100, 64)
    q = torch.randn(9, 6, 64)
    chain = ops.cache_attention(q, k, v, 1000, None, 0.125)
    for i in range(6):
        step = ops.cache_attention(q[:, i : i + 1], k, v, 1000 + i, None, 0.125)
        assert torch.equal(chain[i], step[0]), i


def test_cache_attention_rejects_bad_input():
    k = torch.randn(3, 8, 64)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.cache_attention(torch.randn(9, 2, 64), k, k, 7, None, 0.125)
    with pytest.raises(RuntimeError, match="mask must be"):
        ops.cache_attention(torch.randn(9, 2, 64), k, k, 0, torch.ones(3, 3, dtype=torch.bool), 0.125)
    with pytest.raises(RuntimeError, match="sees no key"):
        ops.cache_attention(torch.randn(9, 2, 64), k, k, 0, torch.zeros(2, 2, dtype=torch.bool), 0.125)


def _random_tree(n: int, g: torch.Generator) -> torch.Tensor:
    """A random tree over n nodes (node i's parent drawn from 0..i-1): each node sees its ancestors and itself."""
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        mask[i] |= mask[int(torch.randint(0, i, (1,), generator=g))]
    return mask


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (14, 2)])  # SmolLM2-135M, Qwen2.5-0.5B (head_dim 64)
@pytest.mark.parametrize("n", [1, 5, 64, 65, 300, 512])
def test_tile_attention_matches_reference(heads, kv_heads, n):
    """A prefill chunk (causal) and a tree (random ancestors) over no, one and 700 committed keys: partial key blocks,
    partial register tiles and tiles across heads included."""
    g = torch.Generator().manual_seed(n)
    k = torch.randn(kv_heads, 1300, 64, generator=g)
    v = torch.randn(kv_heads, 1300, 64, generator=g)
    q = torch.randn(heads, n, 64, generator=g) * 2
    for start in (0, 1, 700):
        for mask in (None, _random_tree(n, g)):
            got = ops.tile_attention(q, k, v, start, mask, 0.125)
            ref = cpu.cache_attention_reference(q, k, v, start, mask, 0.125)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_tile_attention_other_head_dims():
    """Head dims that are not a whole number of vectors (padded P @ V tiles, scalar key packing)."""
    g = torch.Generator().manual_seed(1)
    for heads, kv_heads, dim in ((4, 2, 40), (8, 8, 128)):
        k, v = torch.randn(kv_heads, 200, dim, generator=g), torch.randn(kv_heads, 200, dim, generator=g)
        q = torch.randn(heads, 70, dim, generator=g)
        for mask in (None, _random_tree(70, g)):
            got = ops.tile_attention(q, k, v, 100, mask, dim**-0.5)
            ref = cpu.cache_attention_reference(q, k, v, 100, mask, dim**-0.5)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_tile_attention_rows_do_not_depend_on_the_call():
    """A row's result is the same bits whatever else is in its call: a prefill in chunks of 256 or 512, single rows,
    the first nodes of a tree alone, and any thread count."""
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(3, 1300, 64, generator=g), torch.randn(3, 1300, 64, generator=g)
    q = torch.randn(9, 1024, 64, generator=g)
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
    with pytest.raises(RuntimeError, match="float32"):
        ops.tile_attention(torch.randn(9, 2, 64).double(), k, k, 0, None, 0.125)


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


def test_rows_kernel_in_linear_plans():
    """`rows` takes any row count, so a plan may name it in every bucket."""
    assert "rows" in linear.KERNELS and linear.LOSSLESS_KERNELS == ("rows",)
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


def test_attention_plan_measured_and_forced(llama_target):
    """A verify pass through cache_attention (plan 32) and through tile_attention (plan 1): same logits within
    rounding; the measured plan is at least a decode step; bad values are refused."""
    from spyglass.models.llama import measure_attention_plan, set_attention_plan

    assert measure_attention_plan(llama_target) >= 1
    tokens = torch.randint(0, llama_target.args.vocab_size, (40,))
    mask = torch.eye(8, dtype=torch.bool)
    for i in range(1, 8):  # a binary tree
        mask[i] |= mask[(i - 1) // 2]
    out = {}
    try:
        for plan in (1, 32):
            set_attention_plan(llama_target, plan)
            cache = llama_target.new_cache(64, 1)
            slot = cache.allocate()
            llama_target.prefill(cache, slot, tokens[:32])
            seg = Segment(slot, 32, tokens[32:], 32 + torch.tensor([0, 1, 1, 2, 2, 2, 2, 3]), mask, "all")
            out[plan] = llama_target([seg], cache)[0]
    finally:
        set_attention_plan(llama_target, "auto")
    torch.testing.assert_close(out[32], out[1], rtol=1e-4, atol=1e-4)
    assert torch.equal(out[32].argmax(-1), out[1].argmax(-1))
    with pytest.raises(ValueError, match="1 or more tokens"):
        set_attention_plan(llama_target, 0)


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
