"""The measured choice of CPU matmul kernel (spyglass.models.linear): same numbers, lossless either way."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spyglass.models.linear import Linear, measure_linear_backend, set_linear_backend
from spyglass.models.llama import Segment, load_transformer
from spyglass.sampling import SamplingParams
from tests.test_engine_identity import check_identity, drafters


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_linear_matches_aten(dtype, bias):
    torch.manual_seed(0)
    layer = Linear(48, 80, bias=bias).to(dtype)
    layer.onednn = True
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


def test_training_path_keeps_autograd():
    """With grad enabled the oneDNN flag is ignored: the layer still trains (the op has no backward)."""
    layer = Linear(8, 4)
    layer.onednn = True
    layer(torch.randn(3, 8)).sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0


def test_backend_choice_and_errors(tiny_dir):
    model = load_transformer(tiny_dir["llama"], linear_backend="aten")
    assert model.linear_backend == "aten" and not any(getattr(m, "onednn", False) for m in model.modules())
    assert measure_linear_backend(model) in ("aten", "onednn")
    assert set_linear_backend(model, "onednn") == "onednn"
    assert all(m.onednn for m in model.modules() if isinstance(m, Linear))
    with pytest.raises(ValueError, match="unknown linear backend 'mkl'"):
        set_linear_backend(model, "mkl")
    with pytest.raises(ValueError, match="fp32 or bf16"):
        set_linear_backend(model.to(torch.float16), "onednn")


def test_forward_logits_agree_across_backends(tiny_target):
    """A verify-shaped forward (a tree over a committed prefix) gives the same logits and argmax on both."""
    tokens = torch.randint(0, tiny_target.args.vocab_size, (40,))
    out = {}
    for backend in ("aten", "onednn"):
        set_linear_backend(tiny_target, backend)
        cache = tiny_target.new_cache(64, 1)
        slot = cache.allocate()
        tiny_target.prefill(cache, slot, tokens[:32])
        seg = Segment(slot, 32, tokens[32:], torch.arange(32, 40), None, "all")
        out[backend] = tiny_target([seg], cache)[0]
    set_linear_backend(tiny_target, "auto")
    torch.testing.assert_close(out["onednn"], out["aten"], atol=1e-4, rtol=1e-4)
    assert torch.equal(out["onednn"].argmax(-1), out["aten"].argmax(-1))


@pytest.mark.parametrize("backend", ["aten", "onednn"])
def test_greedy_identity_on_each_backend(tiny_dir, backend):
    """Speculative output equals plain decoding whichever kernel runs the matmuls (the drafts included: they
    take the target's backend when they bind)."""
    target = load_transformer(tiny_dir["llama"], linear_backend=backend)
    keep = {"ngram", "longspec", "dflash"}
    skip = {name for name, _ in drafters(target)} - keep
    check_identity(target, SamplingParams(max_new_tokens=24, ignore_eos=True), skip=skip)
