"""A stand-in accelerator for machines without one: tensors that say they live on another device ("meta") but hold
real CPU values, and an error wherever an op mixes them with CPU tensors the way CUDA refuses to.

The GPU path's most common bug cannot show on a CPU-only machine: a tensor built on the CPU (token ids, positions,
a mask, a drafter's buffer) meeting one on the GPU. Under `FakeAccelerator`, `module.to(DEVICE)`, `x.to(DEVICE)` and
factories given `device=DEVICE` make `OnDevice` tensors, every op runs on their CPU values, and an op that takes
tensors of both kinds raises as CUDA does. What CUDA allows is allowed: copies across devices (`copy_`, `.to`), CPU
tensors of zero dimensions (scalars) in any op, and CPU index tensors in indexing. Code that tests
`device.type == "cuda"` takes its generic non-CPU branch here, so this checks where tensors live, not CUDA's own
kernels (bench/gpu_check.py runs those on a GPU). Use it inside `torch.inference_mode()` (views of these tensors need
it throughout), after building modules on the CPU: `model.to(DEVICE)`.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

DEVICE = torch.device("meta")
aten = torch.ops.aten

# ops whose tensors may sit on different devices (a copy between them), and indexing, whose index tensors may be CPU
_CROSS = {aten._to_copy.default, aten.copy_.default, aten.lift_fresh.default, aten.lift_fresh_copy.default}
_INDEX = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


class OnDevice(torch.Tensor):
    """A tensor on the stand-in device; `elem` holds its values (on the CPU)."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        if elem.device.type != "cpu":
            raise AssertionError(f"stand-in device values must live on the CPU, not {elem.device}")
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.size(),
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            layout=elem.layout,
            device=DEVICE,
            requires_grad=False,
        )
        r.elem = elem
        return r

    def __repr__(self) -> str:
        return f"OnDevice({self.elem!r})"

    def tolist(self):  # (reads the values back, as on CUDA)
        return self.elem.tolist()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func}: a stand-in device tensor used outside FakeAccelerator")


class DeviceMixError(RuntimeError):
    """An op took tensors on the stand-in device and on the CPU (CUDA raises on it too)."""


def _is_device(d) -> bool:
    return isinstance(d, torch.device | str) and not isinstance(d, torch.Tensor) and str(d) == str(DEVICE)


def _is_cpu(t: torch.Tensor) -> bool:
    return not isinstance(t, OnDevice)


class _HostData(TorchFunctionMode):
    """Calls that would make a real "meta" tensor before any op runs, dropping the data: `torch.tensor(data,
    device=DEVICE)` and its kind (built on the CPU, then moved), and `x.to(DEVICE, dtype)` (cast, then moved)."""

    BUILDERS = (torch.tensor, torch.as_tensor, torch.asarray)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.to and not isinstance(args[0], OnDevice):
            device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
            if device is not None and torch.device(device) == DEVICE:
                x = args[0] if dtype is None else args[0].to(dtype)
                return x.to(DEVICE)
        if func in self.BUILDERS and kwargs.get("device") is not None and torch.device(kwargs["device"]) == DEVICE:
            kwargs["device"] = "cpu"
            return func(*args, **kwargs).to(DEVICE)
        if func is torch.Tensor.new_tensor and isinstance(args[0], OnDevice) and kwargs.get("device") is None:
            return args[0].elem.new_tensor(*args[1:], **kwargs).to(DEVICE)
        return func(*args, **kwargs)


class FakeAccelerator:
    """Runs every op on CPU values; raises DeviceMixError where CUDA would refuse the devices (a context manager)."""

    def __enter__(self) -> FakeAccelerator:
        # `module.to(DEVICE)` must give its parameters new tensors: assigning `.data` would keep a "meta" one
        self.overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
        torch.__future__.set_overwrite_module_params_on_conversion(True)
        self.modes = [_HostData(), _Dispatch()]
        for mode in self.modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self.modes):
            mode.__exit__(*exc)
        torch.__future__.set_overwrite_module_params_on_conversion(self.overwrite)


class _Dispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is aten._has_compatible_shallow_copy_type.default:  # (nn.Module.to asks: not across devices)
            return isinstance(args[0], OnDevice) == isinstance(args[1], OnDevice)
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        on = any(isinstance(t, OnDevice) for t in tensors)
        devices = [torch.device(d) for d in flat if isinstance(d, torch.device)]  # asked for (factories, `.to`)
        if isinstance(kwargs.get("device"), str):
            devices.append(torch.device(kwargs["device"]))
        to_fake = on if not devices else devices[-1] == DEVICE
        if DEVICE in devices:
            args, kwargs = tree_map(lambda d: torch.device("cpu") if _is_device(d) else d, (args, kwargs))
            gen = kwargs.get("generator")
            if gen is not None and gen.device.type == "cpu":
                raise DeviceMixError(f"{func}: a CPU generator for a tensor on the device")
        if on and func not in _CROSS:
            checked = tensors
            if func in _INDEX:  # indices may stay on the CPU: the op moves them
                checked = [args[0], *(a for a in args[2:] if isinstance(a, torch.Tensor))]
            cpu = [t for t in checked if _is_cpu(t) and t.dim() > 0]
            if cpu:
                shapes = [tuple(t.shape) for t in cpu]
                raise DeviceMixError(f"{func}: CPU tensors {shapes} beside tensors on the device")
        owners = {id(t.elem): t for t in tensors if isinstance(t, OnDevice)}
        plain_args, plain_kwargs = tree_map(lambda t: t.elem if isinstance(t, OnDevice) else t, (args, kwargs))
        out = func(*plain_args, **plain_kwargs)

        def wrap(t):
            if not isinstance(t, torch.Tensor):
                return t
            if id(t) in owners:  # an in-place op returns its input; so does `.to("cpu")` of these CPU values
                return owners[id(t)] if to_fake or not devices else t.clone()  # (a copy to the CPU, as from CUDA)
            if func is aten.copy_.default:  # copy_ returns its destination, whatever the source
                return args[0]
            return OnDevice(t) if to_fake else t

        return tree_map(wrap, out)
