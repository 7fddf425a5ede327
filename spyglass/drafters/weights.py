"""How a draft's weights are stored: every floating-point tensor in bfloat16 (half the bytes of fp32; a draft
only proposes and the target verifies every token, so the draft's precision never changes the output, only how
often a proposal is accepted), integer tensors (token ids) exactly as they are. Loading accepts bf16, fp16 or
fp32 files and casts the floating tensors to the dtype the draft runs in, so a draft for an fp32 target runs in
fp32."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

STORED_DTYPE = torch.bfloat16
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT_DTYPES = (torch.int64, torch.int32)
INT_NAMES = ("vocab_ids",)  # the token ids of a reduced-vocabulary draft


def save_weights(state: Mapping[str, torch.Tensor], path: str | Path, dtype: torch.dtype = STORED_DTYPE) -> None:
    """Write `state` to the safetensors file `path`: floating tensors in `dtype`, integer ones unchanged."""
    out = {}
    for name, t in state.items():
        if t.is_floating_point():
            t = t.detach().to(dtype)
        elif t.dtype not in INT_DTYPES:
            raise ValueError(f"weight {name!r} is {t.dtype}: only floating-point and integer tensors are stored")
        out[name] = t.detach().contiguous()
    save_file(out, str(path))


def load_weights(path: str | Path, dtype: torch.dtype, int_names: Collection[str] = INT_NAMES) -> dict:
    """The tensors of the safetensors file `path`: those named in `int_names` must be integers (returned as
    stored), all others floating-point (returned in `dtype`). ValueError names a tensor of another kind."""
    state = load_file(str(path))
    for name, t in state.items():
        if name in int_names:
            if t.dtype not in INT_DTYPES:
                raise ValueError(f"{path}: tensor {name!r} is {t.dtype}, expected integer token ids (int64 or int32)")
        elif t.dtype in FLOAT_DTYPES:
            state[name] = t.to(dtype)
        else:
            raise ValueError(f"{path}: tensor {name!r} is {t.dtype}, expected floating-point weights (bf16 or fp32)")
    return state


__all__ = ["STORED_DTYPE", "load_weights", "save_weights"]
