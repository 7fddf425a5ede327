"""How a draft's weights are stored: every floating-point tensor in bfloat16 (half the bytes of fp32; a draft
only proposes and the target verifies every token, so the draft's precision never changes the output, only how
often a proposal is accepted), integer tensors (token ids) exactly as they are. Loading accepts bf16, fp16 or
fp32 files and casts the floating tensors to the dtype the draft runs in, so a draft for an fp32 target runs in
fp32.

The drafts shipped in the package are xz-compressed safetensors (`draft.safetensors.xz`: bf16 weights lose about
30% more, losslessly), which keeps the repository small enough to travel; every loader takes `name` or `name.xz`
(`weights_path`). `python -m spyglass.weights SRC DST.xz` writes one (the `make train-<draft>` targets)."""

from __future__ import annotations

import argparse
import lzma
from collections.abc import Collection, Mapping
from pathlib import Path

import torch
from safetensors.torch import load, load_file, save

XZ = ".xz"

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
    data = save(out)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")  # a failed write leaves no truncated file under the real name
    tmp.write_bytes(lzma.compress(data, preset=9) if path.suffix == XZ else data)
    tmp.replace(path)


def weights_path(path: str | Path) -> Path:
    """`path` if it exists, else its xz-compressed form `path.xz` if that exists (else `path`, for the error)."""
    path = Path(path)
    packed = path.with_name(path.name + XZ)
    return packed if not path.exists() and packed.exists() else path


def load_weights(path: str | Path, dtype: torch.dtype, int_names: Collection[str] = INT_NAMES) -> dict:
    """The tensors of the safetensors file `path`: those named in `int_names` must be integers (returned as
    stored), all others floating-point (returned in `dtype`). ValueError names a tensor of another kind. `path`
    may also name the file's xz-compressed form (`weights_path`)."""
    path = weights_path(path)
    state = load(lzma.decompress(path.read_bytes())) if path.suffix == XZ else load_file(str(path))
    for name, t in state.items():
        if name in int_names:
            if t.dtype not in INT_DTYPES:
                raise ValueError(f"{path}: tensor {name!r} is {t.dtype}, expected integer token ids (int64 or int32)")
        elif t.dtype in FLOAT_DTYPES:
            state[name] = t.to(dtype)
        else:
            raise ValueError(f"{path}: tensor {name!r} is {t.dtype}, expected floating-point weights (bf16 or fp32)")
    return state


def main() -> None:
    ap = argparse.ArgumentParser(description="Store a draft's weights as shipped: floats in bf16, xz-compressed.")
    ap.add_argument("src", type=Path, help="a safetensors file (a training run's output)")
    ap.add_argument("dst", type=Path, help="where to write it (name ending in .safetensors.xz)")
    args = ap.parse_args()
    if not args.dst.name.endswith(".safetensors" + XZ):
        ap.error(f"dst must end with .safetensors.xz, got {args.dst}")
    save_weights(load_file(str(args.src)), args.dst)
    stale = args.dst.with_suffix("")  # an uncompressed copy beside it would be loaded first
    stale.unlink(missing_ok=True)
    print(f"wrote {args.dst} ({args.dst.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()


__all__ = ["STORED_DTYPE", "load_weights", "save_weights", "weights_path"]
