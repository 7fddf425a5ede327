"""Draft weights are stored in bf16 (token ids as integers) and loaded in the dtype the draft runs in."""

from __future__ import annotations

import json
import lzma
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from spyglass.weights import load_weights, save_weights, weights_path

DRAFTS = Path(__file__).resolve().parents[1] / "spyglass" / "drafts"


def stored_dtypes(path: Path) -> dict[str, str]:
    """Each tensor's dtype as the safetensors header records it (of the file, or of the file inside a .xz)."""
    data = lzma.decompress(path.read_bytes()) if path.suffix == ".xz" else path.read_bytes()
    header = json.loads(data[8 : 8 + struct.unpack("<Q", data[:8])[0]])
    return {name: entry["dtype"] for name, entry in header.items() if name != "__metadata__"}


def test_floats_are_stored_in_bf16_and_loaded_in_the_asked_dtype(tmp_path):
    w = torch.randn(4, 3)
    ids = torch.tensor([3, 70000, 2**40])  # not exact in any float type
    save_weights({"w": w, "vocab_ids": ids}, tmp_path / "a.safetensors")
    assert stored_dtypes(tmp_path / "a.safetensors") == {"w": "BF16", "vocab_ids": "I64"}
    for dtype in (torch.float32, torch.bfloat16):
        got = load_weights(tmp_path / "a.safetensors", dtype)
        assert got["w"].dtype == dtype and torch.equal(got["w"], w.bfloat16().to(dtype))
        assert got["vocab_ids"].dtype == torch.int64 and torch.equal(got["vocab_ids"], ids)
    save_weights({"w": w}, tmp_path / "b.safetensors", torch.float32)  # a trainer checkpoint keeps full precision
    assert torch.equal(load_weights(tmp_path / "b.safetensors", torch.float32)["w"], w)


def test_a_tensor_of_the_wrong_kind_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="'mask' is torch.bool"):
        save_weights({"mask": torch.ones(2, dtype=torch.bool)}, tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()
    save_file({"vocab_ids": torch.arange(4).float()}, str(tmp_path / "ids.safetensors"))
    with pytest.raises(ValueError, match="'vocab_ids' is torch.float32, expected integer token ids"):
        load_weights(tmp_path / "ids.safetensors", torch.float32)
    save_file({"w": torch.arange(4)}, str(tmp_path / "w.safetensors"))
    with pytest.raises(ValueError, match="'w' is torch.int64, expected floating-point weights"):
        load_weights(tmp_path / "w.safetensors", torch.float32)


def test_xz_form_is_the_same_weights_and_either_name_loads_it(tmp_path):
    w, ids = torch.randn(64, 8), torch.arange(64)
    save_weights({"w": w, "vocab_ids": ids}, tmp_path / "a.safetensors")
    save_weights({"w": w, "vocab_ids": ids}, tmp_path / "b.safetensors.xz")
    assert lzma.decompress((tmp_path / "b.safetensors.xz").read_bytes()) == (tmp_path / "a.safetensors").read_bytes()
    plain, packed = (
        load_weights(tmp_path / "a.safetensors", torch.float32),
        load_weights(tmp_path / "b.safetensors", torch.float32),
    )
    assert plain.keys() == packed.keys() and all(torch.equal(plain[k], packed[k]) for k in plain)
    assert weights_path(tmp_path / "b.safetensors") == tmp_path / "b.safetensors.xz"
    (tmp_path / "c.safetensors.xz").write_bytes(b"not xz")
    with pytest.raises(lzma.LZMAError):
        load_weights(tmp_path / "c.safetensors", torch.float32)


def test_shipped_drafts_are_stored_in_bf16_and_compressed():
    files = sorted(DRAFTS.glob("*/*.safetensors*"))
    assert len(files) >= 6 and all(f.suffix == ".xz" for f in files), files
    for f in files:
        kinds = stored_dtypes(f)
        assert {d for n, d in kinds.items() if n != "vocab_ids"} == {"BF16"}, f
        assert kinds.get("vocab_ids", "I64") == "I64", f
        assert len(lzma.decompress(f.read_bytes())) <= 25_000_000, f"{f}: more than 25 MB of bf16 safetensors"


@pytest.mark.parametrize("family", ["longspec", "glide"])
def test_each_shipped_draft_is_the_one_found_for_its_models_shape(family):
    """`shipped_draft` picks a draft by the target's shape: every one shipped is found for a target of its own."""
    from types import SimpleNamespace

    from spyglass.drafters.longspec import shipped_draft

    dirs = sorted(DRAFTS.glob(f"*-{family}"))
    assert dirs
    for d in dirs:
        cfg = json.loads((d / "draft_config.json").read_text())
        shape = {k: cfg[k] for k in ("hidden_size", "n_heads", "n_kv_heads", "head_dim", "vocab_size")}
        assert shipped_draft(SimpleNamespace(args=SimpleNamespace(**shape)), family) == d


@pytest.mark.slow
def test_shipped_drafts_load_into_an_fp32_target_as_fp32(smollm2):
    from spyglass.drafters.dflash import DEFAULT_DELS, DEFAULT_DFLASH
    from spyglass.drafters.longspec import SHIPPED, SHIPPED_GLIDE, load_longspec_draft, shipped_draft
    from spyglass.drafters.tokenswift import shipped_heads_for
    from spyglass.models.drafts.dels import load_local_head
    from spyglass.models.drafts.dflash import load_dflash
    from spyglass.models.drafts.tokenswift import load_heads

    target, _ = smollm2
    assert target.dtype == torch.float32
    assert shipped_draft(target) == SHIPPED and shipped_draft(target, "glide") == SHIPPED_GLIDE  # the model's own
    drafts = {
        "longspec": load_longspec_draft(SHIPPED, target),
        "glide": load_longspec_draft(SHIPPED_GLIDE, target),
        "dflash": load_dflash(DEFAULT_DFLASH, target),
        "dels": load_local_head(DEFAULT_DELS, target),
        "tokenswift": load_heads(shipped_heads_for(target), target),
    }
    for name, module in drafts.items():
        floats = {k: t.dtype for k, t in module.state_dict().items() if t.is_floating_point()}
        assert floats and set(floats.values()) == {torch.float32}, name
