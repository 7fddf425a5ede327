"""The engine, the model and every drafter the GPU check covers keep their tensors on the target's device: they run
on the stand-in accelerator of tests/fake_device.py (values on the CPU, an error wherever an op mixes device and CPU
tensors as CUDA refuses to), and greedy output still equals plain decoding on that device. This is the check a
CPU-only machine can make of the GPU path's most common bug; bench/gpu_check.py runs the same on a real GPU."""

from __future__ import annotations

import pytest
import torch

from bench.gpu_check import ENGINE_METHODS, build_drafter, random_model, sample_prompts, tiny_args
from spyglass.engine import EngineConfig, SpecEngine, plain_generate
from spyglass.sampling import SamplingParams
from tests.fake_device import DEVICE, DeviceMixError, FakeAccelerator, OnDevice

# every method on the tiny Llama; on the tiny Qwen2 (q/k/v biases, tied embeddings) the drafter that reads the most
# of the target (hidden states of several layers, its KV cache, copies)
CASES = [("llama", m) for m in ENGINE_METHODS] + [("qwen2", "dflash-span")]


def test_the_stand_in_refuses_what_cuda_refuses():
    with FakeAccelerator():
        x = torch.ones(3, 4).to(DEVICE)
        assert isinstance(x, OnDevice) and x.device == DEVICE
        assert float((x * torch.tensor(2.0)).sum()) == 24.0  # a CPU scalar is fine
        assert x[torch.tensor([0, 2])].shape == (2, 4)  # CPU indices are fine
        y = torch.zeros(3, 4)
        y.copy_(x)  # copies cross devices
        assert float(y.sum()) == 12.0 and not isinstance(y, OnDevice)
        back = x.cpu()  # a copy on the CPU (what the context cache writes to Redis)
        assert type(back) is torch.Tensor and back.numpy().sum() == 12.0
        x.mul_(2)
        assert float(back.sum()) == 12.0
        with pytest.raises(DeviceMixError):
            x + torch.ones(3, 4)
        with pytest.raises(DeviceMixError):
            torch.nn.functional.embedding(torch.tensor([1]), x)
        z = torch.arange(4, device=DEVICE)
        assert isinstance(z, OnDevice) and z.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize(("family", "method"), CASES)
def test_engine_keeps_tensors_on_the_device(family, method):
    cpu_target = random_model(tiny_args(family), torch.device("cpu"), torch.float32, seed=3, std=0.2)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    prompts = sample_prompts(cpu_target.args.vocab_size, 2, seed=2)
    with torch.inference_mode(), FakeAccelerator():  # (views of stand-in tensors need inference mode throughout)
        target = cpu_target.to(DEVICE)
        assert target.device == DEVICE
        plain = [plain_generate(target, p, params) for p in prompts]
        engine = SpecEngine(target, build_drafter(method, target, {}), EngineConfig(max_batch=2, controller="off"))
        seqs = engine.run(prompts, params)
    assert [s.output_ids for s in seqs] == plain
    assert method == "ar" or sum(s.stats.drafted_nodes for s in seqs) > 0
