"""The measured choice of CPU matmul kernel per row count (spyglass.models.linear): same numbers, lossless."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spyglass.kept import kept_path
from spyglass.models import linear as linear_mod
from spyglass.models.drafts.vocab import VocabSubset
from spyglass.models.linear import (
    KERNELS,
    LANES,
    ROW_BUCKETS,
    Linear,
    measure_linear_plan,
    onednn_supported,
    parse_plan,
    plan_name,
    set_linear_backend,
)
from spyglass.models.llama import Block, Segment, load_transformer
from spyglass.sampling import SamplingParams
from tests.test_engine_identity import check_identity, drafters

# every kernel, mixed
MIXED_PLAN = "rows,aten,onednn,wfirst,rows,aten,onednn,wfirst,rows,aten"
ROWS_PLAN = "rows"  # the kernels' row-invariant product, every row count


@pytest.mark.parametrize("kernel", ["onednn", "wfirst"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_each_kernel_matches_aten(kernel, dtype, bias):
    torch.manual_seed(0)
    layer = Linear(48, 80, bias=bias).to(dtype)
    if kernel == "onednn" and not onednn_supported(layer.weight):  # bf16 without AVX-512 BF16 / AMX
        with pytest.raises(ValueError, match="no kernel for torch.bfloat16"):
            set_linear_backend(layer, "onednn")
        return
    assert set_linear_backend(layer, kernel) == kernel
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for shape in [(1, 48), (3, 48), (2, 5, 48), (0, 48)]:
        x = torch.randn(*shape, dtype=dtype)
        with torch.inference_mode():
            got = layer(x)
        want = F.linear(x, layer.weight, layer.bias)
        assert got.shape == want.shape and got.dtype == dtype
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    # a strided input (a transposed view) reads correctly
    xt = torch.randn(48, 4, dtype=dtype).t()
    with torch.no_grad():
        torch.testing.assert_close(layer(xt), F.linear(xt, layer.weight, layer.bias), atol=tol, rtol=tol)


def record_kernels(monkeypatch, entry=lambda name, x: name) -> list:
    """Every linear kernel still runs, and each call appends `entry(kernel name, x)` to the list returned."""
    calls = []

    def recording(name, fn):
        def run(x, w, b):
            calls.append(entry(name, x))
            return fn(x, w, b)

        return run

    for name, fn in list(linear_mod._KERNEL_FNS.items()):
        monkeypatch.setitem(linear_mod._KERNEL_FNS, name, recording(name, fn))
    return calls


def test_plan_dispatches_by_row_count(monkeypatch):
    """Each row count runs the kernel its bucket names (the last bucket also takes every larger count)."""
    calls = record_kernels(monkeypatch)
    layer = Linear(16, 8)
    layer.plan = ("onednn", "wfirst", "aten", "wfirst", "onednn", "aten", "wfirst", "onednn", "aten", "wfirst")
    rows = (1, 2, 3, 4, 5, 7, 8, 12, 20, 40, 64, 65, 128, 300)
    with torch.inference_mode():
        for n in rows:
            x = torch.randn(n, 16)
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    assert calls == [
        *("onednn", "wfirst", "aten", "wfirst", "onednn", "aten", "aten", "wfirst", "onednn", "aten", "aten"),
        *("wfirst", "wfirst", "wfirst"),
    ]


def test_reduced_vocabulary_head_follows_the_heads_plan(monkeypatch):
    """A draft's reduced-vocabulary logits (`VocabSubset`) run the kernel the shared head's plan names for the
    row count, not a fixed one, and equal the full head's logits on those rows (-inf elsewhere)."""
    calls = record_kernels(monkeypatch)
    head = Linear(16, 40, bias=False)
    head.plan = ("wfirst", "onednn", *("aten",) * (len(ROW_BUCKETS) - 2))
    subset = VocabSubset(torch.arange(0, 40, 3))
    with torch.inference_mode():
        for n in (1, 2):
            x = torch.randn(n, 16)
            got = subset.logits(x, head)
            torch.testing.assert_close(got[:, subset.ids], F.linear(x, head.weight[subset.ids]), atol=1e-5, rtol=1e-5)
            assert torch.isneginf(got).sum() == n * (40 - subset.ids.numel())
    assert calls == ["wfirst", "onednn"]


def test_training_path_keeps_autograd():
    """With grad enabled the plan is ignored: the layer still trains (the oneDNN op has no backward)."""
    layer = Linear(8, 4)
    layer.plan = ("onednn",) * len(ROW_BUCKETS)
    layer(torch.randn(3, 8)).sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0


def assert_valid_plan(plan: tuple[str, ...], weight: torch.Tensor) -> None:
    """A kernel per row bucket, each one that runs here; its name parses back to it."""
    assert len(plan) == len(ROW_BUCKETS) and set(plan) <= set(KERNELS)
    assert "onednn" not in plan or onednn_supported(weight)
    assert parse_plan(plan_name(plan)) == plan


def test_timing_sample_stands_for_every_layer(monkeypatch):
    """At every bucket the timed calls, weighted by their shares, add up to all the model's weights; up to 8 rows
    every shape is timed on several layers and the largest whole; past 8 fewer layers and a part of the largest;
    a weight over the call limit is timed in consecutive parts under it."""
    monkeypatch.setattr(linear_mod, "TIMED_CALL_BYTES", 16384)  # the 999 x 32 head (128 KB) only
    model = torch.nn.Sequential(*[Linear(32, n, bias=n == 48) for _ in range(9) for n in (48, 96, 32)], Linear(32, 999))
    linears = list(model)
    total = sum(m.weight.numel() for m in linears)
    for rows in ROW_BUCKETS:
        sample = linear_mod._timing_sample(linears, rows)
        assert sum(w.numel() * share for _, w, _, share in sample) == pytest.approx(total)
        order = [linears.index(m) for m, _, _, _ in sample]
        assert order == sorted(order) and {w.shape[1] for _, w, _, _ in sample} == {32}
        assert {linears[i].out_features for i in order} == {48, 96, 32, 999}
        assert all(b is None if m.bias is None else b.shape == w.shape[:1] for m, w, b, _ in sample)
        head = [w for m, w, _, _ in sample if m is linears[-1]]
        used = 999 if rows <= 8 else -(-999 // (rows // 8))
        assert torch.equal(torch.cat(head), linears[-1].weight[:used])  # consecutive rows from the first
        assert len(head) == -(-used * 128 // 16384) and all(w.nbytes <= 16384 for w in head)
        assert len(sample) - len(head) == 3 * (3 if rows <= 8 else 2 if rows == 16 else 1)  # of 9 layers per shape


def test_a_measured_plan_is_kept_for_the_next_process_on_this_machine(tiny_dir, tmp_path, monkeypatch):
    """The plan and the prefill choice are timed once per machine: a new process (here: the per-process memo
    cleared) takes the kept ones without timing, so it runs the same kernels (and a prompt gets the same bits) as the
    last; SPYGLASS_REMEASURE=1 times again."""
    monkeypatch.setenv("SPYGLASS_CACHE", str(tmp_path))
    monkeypatch.delenv("SPYGLASS_MEASUREMENTS", raising=False)  # the default place: beside the models
    monkeypatch.delenv("SPYGLASS_REMEASURE", raising=False)
    model = load_transformer(tiny_dir["llama"], linear_backend="aten")
    timed = []
    real = linear_mod._time_kernels
    monkeypatch.setattr(linear_mod, "_time_kernels", lambda *a: timed.append(a[2]) or real(*a))

    def fresh_process():
        monkeypatch.setattr(linear_mod, "_PLANS", {})
        monkeypatch.setattr(linear_mod, "_LANES", {})

    fresh_process()
    plan, lanes = measure_linear_plan(model), linear_mod.lanes_for_prefill(model)
    assert len(timed) == len(ROW_BUCKETS) + (1 if linear_mod.rows_supported(model.layers[0].wo.weight) else 0)
    assert kept_path().parent == tmp_path and kept_path().exists()
    fresh_process()
    timed.clear()
    assert measure_linear_plan(model) == plan and linear_mod.lanes_for_prefill(model) == lanes and not timed
    fresh_process()
    monkeypatch.setenv("SPYGLASS_REMEASURE", "1")
    assert_valid_plan(measure_linear_plan(model), model.layers[0].wo.weight)
    assert len(timed) == len(ROW_BUCKETS)
    kept_path().write_text("not json")  # a damaged file is measured over, not an error
    monkeypatch.delenv("SPYGLASS_REMEASURE")
    fresh_process()
    timed.clear()
    assert_valid_plan(measure_linear_plan(model), model.layers[0].wo.weight)
    assert len(timed) == len(ROW_BUCKETS)


def test_backend_choice_and_errors(tiny_dir):
    model = load_transformer(tiny_dir["llama"], linear_backend="aten")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert model.linear_backend == "aten" and all(m.plan is None for m in linears)
    assert_valid_plan(measure_linear_plan(model), linears[0].weight)
    assert set_linear_backend(model, "onednn") == "onednn"
    assert all(m.plan == ("onednn",) * len(ROW_BUCKETS) for m in linears)
    # a plan string (what a draft copies from its target) round-trips
    mixed = MIXED_PLAN
    assert set_linear_backend(model, mixed) == mixed and linears[0].plan == tuple(mixed.split(","))
    with pytest.raises(ValueError, match="unknown linear backend 'mkl'"):
        set_linear_backend(model, "mkl")
    with pytest.raises(ValueError, match="one kernel per row bucket"):
        set_linear_backend(model, "onednn,aten")
    with pytest.raises(ValueError, match="no kernel for torch.float16"):
        set_linear_backend(model.to(torch.float16), "onednn")


def test_forward_logits_agree_across_backends(tiny_target):
    """A verify-shaped forward (a tree over a committed prefix) gives the same logits and argmax on each."""
    tokens = torch.randint(0, tiny_target.args.vocab_size, (40,))
    out = {}
    for backend in ("aten", "onednn", "wfirst", ROWS_PLAN, MIXED_PLAN):
        set_linear_backend(tiny_target, backend)
        cache = tiny_target.new_cache(64, 1)
        slot = cache.allocate()
        tiny_target.prefill(cache, slot, tokens[:32])
        seg = Segment(slot, 32, tokens[32:], torch.arange(32, 40), None, "all")
        out[backend] = tiny_target([seg], cache)[0]
    set_linear_backend(tiny_target, "auto")
    for backend, logits in out.items():
        torch.testing.assert_close(logits, out["aten"], atol=1e-4, rtol=1e-4, msg=backend)
        assert torch.equal(logits.argmax(-1), out["aten"].argmax(-1)), backend


@pytest.mark.parametrize("backend", ["aten", "onednn", "wfirst", ",".join(["rows"] * 9 + ["wfirst"])])
def test_greedy_identity_on_each_backend(tiny_dir, backend):
    """Speculative output equals plain decoding whichever kernel runs the matmuls (the drafts included: they
    take the target's backend when they bind)."""
    target = load_transformer(tiny_dir["llama"], linear_backend=backend)
    keep = {"ngram", "longspec", "dflash"}
    skip = {name for name, _ in drafters(target)} - keep
    check_identity(target, SamplingParams(max_new_tokens=24, ignore_eos=True), skip=skip)


def test_measured_plan_on_the_real_model(smollm2):
    """SmolLM2's plan (measured at load) is valid, and greedy decoding on it and the kernels equals the torch ops."""
    from spyglass.engine import plain_generate

    model, tok = smollm2
    assert_valid_plan(parse_plan(model.linear_backend), model.lm_head.weight)
    ids = tok("def fibonacci(n):\n    ")["input_ids"]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    fast = plain_generate(model, ids, params)
    plan = model.linear_backend
    try:
        Block.native = False
        set_linear_backend(model, "aten")
        assert plain_generate(model, ids, params) == fast
    finally:
        Block.native = True
        set_linear_backend(model, plan)


def test_auto_takes_lanes_for_prefill_where_measured_close_and_keeps_drafts_on_the_measured_plan(tiny_dir, monkeypatch):
    """ "auto": where `lanes` is timed within LANES_SLACK at a prefill chunk's rows, every prefill bucket runs it (the
    model says its prefill is row-invariant), and where it is also no slower than `rows` at decode and verify rows,
    every forward runs it ("lanes"); a draft beside it takes the measured plan, `lanes` left out; where `lanes` is
    slower at prefill the measured plan runs prefill and `rows` the rest."""
    model = load_transformer(tiny_dir["llama"], linear_backend="aten")
    library = measure_linear_plan(model)
    assert "lanes" not in library
    for wins, decodes in [(True, True), (True, False), (False, True), (False, False)]:
        monkeypatch.setattr(linear_mod, "lanes_for_prefill", lambda m, wins=wins: wins)
        monkeypatch.setattr(linear_mod, "lanes_for_decode", lambda m, decodes=decodes: decodes)
        name = set_linear_backend(model, "auto")
        assert model.draft_linear_backend == plan_name(library, True)
        want = plan_name(library, True) if not wins else "lanes" if decodes else plan_name(LANES, True)
        assert name == want
        assert model.prefill_row_invariant is (wins or set(library) == {"rows"})
        assert model._stack_weights()[1] is (name == "lanes")  # decode steps run `layer_stack` on the same kernel
    assert set_linear_backend(model, "prefill:onednn") == model.draft_linear_backend == "prefill:onednn"


def test_a_truncated_draft_steps_on_rows_while_its_shared_layers_prefill_on_lanes(tiny_dir, monkeypatch):
    """The small-lm draft made of the target's first layers shares their `Linear`s and so their plan: with the
    target on `prefill:lanes`, its prompt prefill runs `lanes` and its draft steps (a few rows each) run the decode
    steps' `rows` kernel, never `lanes` (16 rows of work for one); the engine's output is still plain decoding's."""
    from spyglass.drafters.small_lm import SmallLMDrafter, truncated_draft
    from spyglass.engine import EngineConfig, SpecEngine, plain_generate
    from tests.tiny import free_tokens_curve

    target = load_transformer(tiny_dir["llama"], linear_backend="prefill:lanes")
    drafter = SmallLMDrafter(truncated_draft(target, 1), gamma=4, max_batch=1, max_context=256)
    calls = record_kernels(monkeypatch, lambda name, x: (name, x.numel() // x.shape[-1]))
    prompt = [5, 6, 7, 8, 9, 10, 11, 12] * 6
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    engine = SpecEngine(target, drafter, EngineConfig(max_batch=1, max_context=256, controller=free_tokens_curve()))
    seq = engine.add_request(prompt, params)
    start = drafter.start
    drafter.start = lambda s: (calls.append(("draft prefill", 0)), start(s), calls.append(("drafting", 0)))
    while engine.has_work:
        engine.step()
    ran = list(calls)  # the engine's run alone
    assert seq.output_ids == plain_generate(target, prompt, params)
    assert seq.stats.steps < 12  # the drafts were used
    at, then = ran.index(("draft prefill", 0)), ran.index(("drafting", 0))
    assert {k for k, _ in ran[:at]} == {"lanes"}  # the target's prompt
    assert {k for k, _ in ran[at + 1 : then]} == {"lanes"} and ("lanes", len(prompt)) in ran[at:then]
    # then the draft's steps and the target's verify passes
    assert {k for k, _ in ran[then + 1 :]} == {"rows"} and ("rows", 1) in ran[then:]
