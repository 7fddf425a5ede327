"""Which device a process computes on: `resolve_device("auto" | "cpu" | "cuda" | "cuda:N" | ...)`.

"auto" is the accelerator this process was given, else the CPU. Under Ray a replica that asks for one GPU sees exactly
that GPU (Ray sets CUDA_VISIBLE_DEVICES to the ids it assigned: `ray.get_gpu_ids()`), and one that asks for none sees
none, so "the first visible CUDA device" is the one Ray assigned; outside Ray it is the first GPU of the machine.
A named device is checked at once (present, and able to hold data), so a bad name fails before a model loads.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEVICE_HELP = "auto (the GPU this process was given, else the CPU), cpu, cuda or cuda:N"


def resolve_device(spec: str | torch.device = "auto") -> torch.device:
    """The torch device for `spec`; ValueError with the reason when it cannot be used here."""
    import torch

    if isinstance(spec, str) and spec == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"unknown device {spec!r}: expected {DEVICE_HELP}") from e
    if device.type == "cuda":
        if not torch.cuda.is_available():
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            why = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
            raise ValueError(f"device {spec!r}: no CUDA device is visible to this process{why}")
        count = torch.cuda.device_count()
        index = 0 if device.index is None else device.index
        if index >= count:
            raise ValueError(f"device {spec!r}: this process sees {count} CUDA device(s) (cuda:0..cuda:{count - 1})")
        return torch.device("cuda", index)
    try:  # a device that cannot hold values (torch's "meta") or whose backend is absent fails here, not mid-load
        torch.ones(1, device=device).cpu()
    except (RuntimeError, NotImplementedError, AssertionError) as e:
        raise ValueError(f"device {spec!r} cannot hold tensors here: {e}") from e
    return device


def device_name(device: torch.device) -> str:
    """What the device is, for a replica's info: the GPU's name, or the CPU model."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        from spyglass.cost import cpu_model

        return cpu_model()
    return device.type


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` (a CUDA device runs its kernels after the call returns), so a clock read
    next times it."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
