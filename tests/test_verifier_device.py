"""A verifier replica on an accelerator, checked on a CPU-only machine: `VerifierConfig.device` places the target,
every drafter and shipped draft, the one KV pool and the cost-curve measurement on the stand-in device of
tests/fake_device.py (an op mixing it with CPU tensors raises, as CUDA does), the replica serves each method there
with the same output as a CPU replica, `device: auto` resolves to the CPU here and says so, and the context cache's
blocks move between replicas on different devices bitwise, under the same keys (a real redis-server).
bench/gpu_check.py's served section runs the same engine path on a real GPU."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from services.verifier import VerifierConfig, build_engine
from spyglass.device import resolve_device
from spyglass.models.loader import resolve_dtype, resolve_model_dtype
from spyglass.sampling import SamplingParams
from tests.fake_device import DEVICE, FakeAccelerator, OnDevice

# one method of every family that needs no option (small-lm needs a draft model): lookups, the shipped LongSpec,
# GLIDE, DFlash (+ DeLS) and TokenSwift drafts, a composite, self-speculation, plain decoding
METHODS = ["suffix", "ngram", "ar", "longspec-span", "glide-cape", "dflash-dels", "composite-dflash", "tokenswift",
           "streaming"]  # fmt: skip
PROMPT = "Copy this list of functions, then add one more in the same style.\n\n" + "".join(
    f"def add_{i}(x):\n    return x + {i}\n\n" for i in range(12)
)


def _serve_each(engine, tokenizer, methods, max_new_tokens=10):
    from services.verifier import encode_prompt

    ids = encode_prompt(tokenizer, PROMPT, raw=False)
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    with torch.inference_mode():
        seqs = [engine.add_request(ids, params, f"r-{m}", m) for m in methods]  # every method in one batch
        while engine.has_work:
            engine.step()
    return {m: s.output_ids for m, s in zip(methods, seqs, strict=True)}, seqs


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


# max_context 320: the cost curve measures one context (its forwards are slow through the stand-in's dispatch)
@pytest.fixture(scope="module")
def cpu_outputs():
    """The CPU replica: the reference every device replica must equal."""
    cfg = VerifierConfig(device="cpu", dtype="float32", methods=METHODS, max_batch=len(METHODS), max_context=320,
                         threads=1)  # fmt: skip
    engine, tok, info = build_engine(cfg)
    outs, _ = _serve_each(engine, tok, METHODS)
    return outs, info, engine.drafters["dflash-dels"].draft.fc.weight.clone()


# (torch warns that a checkpoint is copied into "meta" parameters: the stand-in's report its device as "meta", and the
# values are copied all the same, as the weights compared below show)
@pytest.mark.filterwarnings("ignore:for .*copying from a non-meta parameter")
def test_a_replica_on_a_device_keeps_everything_there_and_serves_as_the_cpu_replica(cpu_outputs):
    reference, cpu_info, cpu_dflash_fc = cpu_outputs
    with torch.inference_mode(), FakeAccelerator():
        cfg = VerifierConfig(device=str(DEVICE), dtype="float32", methods=METHODS, max_batch=len(METHODS),
                             max_context=320, threads=1)  # fmt: skip
        engine, tok, info = build_engine(cfg)
        target = engine.target
        assert target.device == DEVICE and all(isinstance(t, OnDevice) for t in _tensors(target))
        assert isinstance(engine.cache._k, OnDevice) and isinstance(engine.cache._v, OnDevice)  # the one KV pool
        drafts = {
            "longspec-span": [engine.drafters["longspec-span"].draft],
            "glide-cape": [engine.drafters["glide-cape"].draft],
            "dflash-dels": [engine.drafters["dflash-dels"].draft, engine.drafters["dflash-dels"].local],
            "tokenswift": [engine.drafters["tokenswift"].heads],
        }
        for method, modules in drafts.items():
            for module in modules:
                cpu = [n for n, t in module.named_parameters() if not isinstance(t, OnDevice)]
                assert not cpu, (method, cpu[:3])
        assert torch.equal(engine.drafters["dflash-dels"].draft.fc.weight.elem, cpu_dflash_fc)  # the shipped weights
        # the controller priced trees with a cost curve measured by forwards on the device
        assert engine.controller is not None and info["cost_curve"]["seconds"]
        outs, seqs = _serve_each(engine, tok, METHODS)
    assert info["device"] == "meta" and info["dtype"] == "float32" and info["kernels"]["attention_backend"] == "cpu"
    assert outs == reference
    assert sum(s.stats.drafted_nodes for s in seqs) > 0
    assert cpu_info["device"] == "cpu" and cpu_info["cost_curve"]["contexts"] == info["cost_curve"]["contexts"]


def test_device_auto_resolves_to_the_cpu_here_and_the_replica_says_so():
    assert not torch.cuda.is_available()  # (this suite runs on CPU machines)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_dtype("auto", torch.device("cuda"), None) == "bfloat16"
    expected = resolve_model_dtype(None, "auto", torch.device("cpu"))  # the embedded model's CPU default
    engine, _, info = build_engine(VerifierConfig(methods=["ar"], max_batch=1, max_context=256, threads=1))
    assert VerifierConfig().device == "auto" and VerifierConfig().dtype == "auto"
    assert engine.target.device.type == "cpu" and engine.target.dtype == getattr(torch, expected)
    assert info["device"] == "cpu" and info["dtype"] == expected and info["device_name"]
    assert info["kernels"]["attention_backend"] == "cpu" and info["kernels"]["prefix"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("cuda", "no CUDA device is visible"),
        ("cuda:3", "no CUDA device is visible"),
        ("meta", "cannot hold tensors"),  # the real meta device (outside the stand-in) holds no values
        ("gpu7", "unknown device"),
    ],
)
def test_a_device_that_cannot_be_used_is_refused_before_the_model_loads(spec, message):
    with pytest.raises(ValueError, match=message):
        resolve_device(spec)
    with pytest.raises(ValueError, match=message):
        build_engine(VerifierConfig(device=spec, methods=["ar"]))
    with pytest.raises(ValueError, match="unsupported dtype"):
        build_engine(VerifierConfig(dtype="float64", methods=["ar"]))


def _prefill(engine, ids):
    """Admit one request and step until its prefill is done; returns the sequence (its slot holds the prompt's K/V)."""
    seq = engine.add_request(ids, SamplingParams(max_new_tokens=4, ignore_eos=True), "r")
    with torch.inference_mode():
        while seq.num_generated == 0:
            engine.step()
    return seq


def _span(engine, seq, n):
    k = engine.cache.read_span(seq.slot, 0, n)
    return k.elem.clone() if isinstance(k, OnDevice) else k.clone()


@pytest.mark.parametrize("writer_on_device", [True, False], ids=["device-to-cpu", "cpu-to-device"])
def test_context_cache_blocks_move_between_devices_bitwise(redis_server, writer_on_device):
    import redis

    from services.verifier import encode_prompt

    redis.Redis.from_url(redis_server.url).flushall()
    block = 64
    cfg = {"dtype": "float32", "methods": ["ar"], "max_batch": 1, "max_context": 512, "threads": 1,
           "redis_url": redis_server.url, "cache_block_size": block, "cache_min_uses": 1,  # stored on first sight
           "prefill_chunk": block}  # fmt: skip
    on_device = VerifierConfig(device=str(DEVICE), **cfg)
    on_cpu = VerifierConfig(device="cpu", **cfg)
    writer_cfg, reader_cfg = (on_device, on_cpu) if writer_on_device else (on_cpu, on_device)

    def run(cfg, ids=None):
        fake = cfg.device == str(DEVICE)
        with torch.inference_mode(), FakeAccelerator() if fake else nullcontext():
            engine, tok, _ = build_engine(cfg)
            engine.context_cache.async_writes = False
            ids = ids or encode_prompt(tok, PROMPT, raw=False)
            seq = _prefill(engine, ids)
            n = len(ids) // block * block
            return ids, seq.stats.cached_prefix_tokens, _span(engine, seq, n), engine.context_cache

    ids, hit, written, writer_cc = run(writer_cfg)
    assert hit == 0 and len(ids) >= 3 * block
    n = len(ids) // block * block
    _, hit, loaded, reader_cc = run(reader_cfg, ids)
    assert writer_cc.namespace == reader_cc.namespace  # same model and dtype: the same keys on either device
    assert reader_cc.block_keys(ids) == writer_cc.block_keys(ids)
    assert hit == (len(ids) - 1) // block * block and hit >= 2 * block  # every full block but the last token's
    assert loaded[:, :, :, :hit].dtype == written.dtype == torch.float32
    assert torch.equal(loaded[:, :, :, :hit], written[:, :, :, :hit])  # bitwise
    assert written.shape[3] == n


@pytest.mark.parametrize(
    ("device", "dtype", "backend", "capability", "flash", "prefix", "tree"),
    [
        ("cuda", torch.bfloat16, "triton", (9, 0), True, "flash_attn kvcache", "triton fused_mask_attn"),
        ("cuda", torch.bfloat16, "triton", (9, 0), False, "aten cuda_flash", "triton fused_mask_attn"),
        ("cuda", torch.float32, "triton", (8, 0), True, "aten cuda_efficient", "triton fused_mask_attn"),
        ("cuda", torch.bfloat16, "cpu", (7, 5), False, "torch matmuls", "torch masked attention"),  # pre-Ampere
        ("cpu", torch.bfloat16, "cpu", None, False, "aten cpu_flash", "torch masked attention"),
    ],
)
def test_the_kernels_a_replica_reports_on_each_device(device, dtype, backend, capability, flash, prefix, tree):
    """What `info()["kernels"]` says on a GPU (the facts given: no GPU here) and on the CPU."""
    from kernels.dispatch import kernel_plan

    plan = kernel_plan(device, dtype, 128, backend, capability, flash, cpu_ops=False)
    assert plan == {"attention_backend": backend, "prefix": prefix, "tree": tree}
