"""Inference matmuls on whichever CPU kernel is faster here, chosen by measurement at start-up.

On AMD Zen 4, MKL's fp32 GEMM handles 2-3 rows as that many passes over the weights (verifying 2 tokens cost
1.6 decode steps) and reads the 49K-row LM head at half the memory speed even for one row, while oneDNN's inner
product reads the weights once for a few rows: the same SmolLM2 decode step takes 41 instead of 59 ms and 4 tree
tokens cost 1.2 instead of 1.4 steps. On other CPUs MKL may be the faster one, so each process times both on the
model's own weight shapes and keeps the faster. Autograd always takes `F.linear` (the oneDNN op has no backward).
"""

from __future__ import annotations

import time
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

BACKENDS = ("auto", "aten", "onednn")


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and state dict) whose inference path can run on oneDNN."""

    onednn = False  # set per module by `set_linear_backend`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.onednn and not torch.is_grad_enabled():
            return _onednn_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def onednn_supported(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and (torch.backends.mkldnn.is_available())
    )


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _best_time(fn, args: tuple, repeats: int) -> float:
    fn(*args)  # warm-up (oneDNN creates its primitive on first use)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t0)
    return best


_CHOICES: dict[tuple, str] = {}


@torch.inference_mode()
def measure_linear_backend(model: nn.Module, rows: tuple[int, ...] = (1, 4), repeats: int = 5) -> str:
    """ "onednn" when it runs the model's linear layers faster than ATen's `F.linear` (MKL) for `rows` tokens
    (the shapes of decoding and of verifying a small tree), summed over the layers; else "aten". Measured once
    per process for a given set of shapes, dtype and thread count."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if not linears or not onednn_supported(linears[0].weight):
        return "aten"
    shapes: Counter = Counter()
    sample: dict[tuple, Linear] = {}  # one module of each weight shape
    for m in linears:
        shape = (tuple(m.weight.shape), m.bias is not None)
        shapes[shape] += 1
        sample.setdefault(shape, m)
    key = (tuple(sorted(shapes.items())), str(linears[0].weight.dtype), torch.get_num_threads())
    if key not in _CHOICES:
        totals = {"aten": 0.0, "onednn": 0.0}
        for shape, count in shapes.items():
            w, b = sample[shape].weight, sample[shape].bias
            for n in rows:
                x = torch.randn(n, w.shape[1], dtype=w.dtype)
                totals["aten"] += count * _best_time(F.linear, (x, w, b), repeats)
                totals["onednn"] += count * _best_time(_onednn_linear, (x, w, b), repeats)
        _CHOICES[key] = min(totals, key=totals.get)
    return _CHOICES[key]


def set_linear_backend(model: nn.Module, backend: str = "auto") -> str:
    """Point every `Linear` of `model` at `backend` ("auto" measures); returns the backend in use."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown linear backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = measure_linear_backend(model)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if backend == "onednn" and linears and not onednn_supported(w := linears[0].weight):
        raise ValueError(
            f"the oneDNN linear backend needs fp32 or bf16 weights on the CPU, not {w.dtype} on {w.device}"
        )
    for m in linears:
        m.onednn = backend == "onednn"
    model.linear_backend = backend
    return backend
