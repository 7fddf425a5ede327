"""The engine step's CPU kernels (kernels/cpu_ops.cpp), built for this CPU at first use, and their torch references.

`native()` compiles the C++ file once per (source, CPU flags, torch version) with `-O3 -march=native` into torch's
extension cache and returns the module, or None where it cannot be built (no C++ compiler, an unsupported platform):
the model then runs its torch ops, which compute the same thing (the `*_reference` functions below are those ops and
the tests' oracle). `SPYGLASS_CPU_KERNELS=0` turns the kernels off.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_ops.cpp")
# -fno-trapping-math / -fno-math-errno: loops with a compare or a float->int conversion vectorise (the exp of the
# softmax and SwiGLU); no reassociation, so every sum keeps the order written in the source; -ffp-contract=off: no
# product and sum fused unless the source says so (GCC's default fuses where its passes see fit: the softmax's
# `l * alpha + sum` came out fused in one build of the file and not in another), so an expression gives the same bits
# in every function it is compiled into.
CFLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off")
builds = 0  # times this process built (or loaded) the extension: once, whatever shapes it then serves


@functools.cache
def cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo, up to its flags (none where the file is missing)."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
            if key.strip() == "flags":
                break
    except OSError:
        pass
    return info


def _cpu_flags() -> str:
    return cpuinfo().get("flags") or platform.processor()


@functools.cache
def machine_key() -> str:
    """This CPU (its model and instruction sets) with these kernels and this torch: what a measurement of kernel
    speeds kept on disk holds for."""
    h = hashlib.sha1(build_name().encode())
    info, fields = cpuinfo(), ("vendor_id", "model name", "cpu family", "model", "stepping")
    h.update(repr([info.get(f) for f in fields] if info else platform.processor()).encode())
    return h.hexdigest()[:16]


def build_name(source: Path = SOURCE, tag: str = "") -> str:
    """Extension name: changes with the source, the flags, the CPU's instruction sets and torch's version; `tag` tells
    apart builds of one source for other targets."""
    h = hashlib.sha1()
    for part in (source.read_bytes(), " ".join(CFLAGS).encode(), _cpu_flags().encode(), torch.__version__.encode()):
        h.update(part)
    return f"spyglass_cpu_{tag}{h.hexdigest()[:12]}"


@contextlib.contextmanager
def _own_ninja():
    """The ninja of this Python environment first on PATH while building (pip's `ninja`, a dependency): torch runs
    whichever `ninja` PATH finds, and two versions (here pip's 1.13 and the system's 1.11) hash a build command
    differently, so each takes the other's build for a changed one and compiles again (~50 s): a Ray job's workers
    (PATH with the environment's bin) and a test run (without it) rebuilt the kernels in turn."""
    scripts = sysconfig.get_path("scripts")
    path = os.environ.get("PATH", "")
    if not (Path(scripts) / "ninja").exists() or path.split(os.pathsep)[0] == scripts:
        yield
        return
    os.environ["PATH"] = os.pathsep.join([scripts, path])
    try:
        yield
    finally:
        os.environ["PATH"] = path


def build_source(source: Path = SOURCE) -> Path:
    """A copy of `source` at a path fixed by its contents, in torch's extension cache: what every build compiles. The
    build reruns when the compile command changes, and the command names the source's path, so a checkout elsewhere
    (a `ray job submit --working-dir` copy, unpacked in a session directory) would rebuild the same code (~50 s on 2
    cores) and leave the next process here to rebuild it again."""
    from torch.utils.cpp_extension import get_default_build_root

    text = source.read_bytes()
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()  # where torch's builds go
    path = Path(root) / "spyglass_sources" / hashlib.sha1(text).hexdigest()[:12] / source.name
    if not path.is_file():  # written once: a newer copy of the same text would still look changed to the build
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_bytes(text)
        tmp.replace(path)
    return path


@functools.cache
def native():
    """The compiled module, or None (logged once, with the reason) where it cannot be built or is turned off."""
    if os.environ.get("SPYGLASS_CPU_KERNELS", "1") == "0":
        return None
    if platform.machine() not in ("x86_64", "AMD64", "aarch64", "arm64"):
        log.warning("spyglass CPU kernels: not built for %s; using torch ops", platform.machine())
        return None
    global builds
    builds += 1
    try:
        # inside the try: torch.utils.cpp_extension imports setuptools, which a bare torch install may lack (then
        # the torch ops run, as for a missing compiler); only a build needs it
        return _build(build_name(), "-march=native" if platform.machine() in ("x86_64", "AMD64") else "-mcpu=native")
    except Exception as exc:  # a missing compiler or ninja: the torch ops still run, only slower
        log.warning("spyglass CPU kernels could not be built (%s); using torch ops", exc)
        return None


@functools.cache
def build_for(march: str):
    """The same source built for another x86 target (`-march=x86-64-v3`: AVX2, no AVX-512; `skylake-avx512`:
    AVX-512 without its bf16 dot products), so the tests check the paths this CPU's own build does not take. Where
    this CPU's own build takes the same branches of the source (x86-64-v3 on an AVX2 CPU without AVX-512: the source
    branches on AVX-512F, AVX-512 BF16, AVX2 and FMA only), that build, without a second compile (~50 s)."""
    flags = set(_cpu_flags().split())
    if march == "x86-64-v3" and {"avx2", "fma"} <= flags and "avx512f" not in flags and native() is not None:
        return native()
    return _build(build_name(tag=march.replace("-", "_") + "_"), f"-march={march}")


def build_other(source: Path):
    """This CPU's build of another version of the kernels' source (an earlier commit's file, a change under test), as a
    module beside `native()`'s: what a bench times the kernels against (`bench/kernel_attention.py --against`)."""
    source = Path(source)
    return _build(build_name(source, tag="other_"), "-march=native", source)


def _build(name: str, arch: str, source: Path = SOURCE):
    """torch's JIT build of the source (its copy at `build_source`) with CFLAGS and `arch`, run by our own ninja."""
    from torch.utils.cpp_extension import load

    with _own_ninja():
        return load(name, [str(build_source(source))], extra_cflags=[*CFLAGS, arch], extra_ldflags=["-fopenmp"])


# ----------------------------------------------------------------------------- references (plain torch)


def rms_norm_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """In fp64, rounded to x's dtype where the model's torch ops round (the normalised row, then the product)."""
    xd = x.double()
    normed = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (w.double() * normed.double()).to(x.dtype)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """In fp64, rounded to the dtype as the torch ops round (silu, then the product)."""
    gate, up = gate_up.double().chunk(2, dim=-1)
    return (F.silu(gate).to(gate_up.dtype).double() * up).to(gate_up.dtype)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[T, heads, D]`, cos/sin `[T, 1, D]` (half-rotation layout, as HF Llama), in fp64 rounded to x's dtype as the
    torch ops round (each product, then the sum)."""
    half = x.shape[-1] // 2
    xd, rotated = x.double(), torch.cat([-x[..., half:], x[..., :half]], dim=-1).double()
    return ((xd * cos.double()).to(x.dtype).double() + (rotated * sin.double()).to(x.dtype).double()).to(x.dtype)


def cache_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    mask: torch.Tensor | None,
    scale: float,
    magnitude: bool = False,
) -> torch.Tensor:
    """q `[H, n, D]` over cache keys `[Hkv, >= start + n, D]`: all of 0..start-1, then the n new tokens' own keys
    through `mask` `[n, n]` (None = causal) -> `[n, H * D]`, in fp64 then rounded to q's dtype. `magnitude`: the
    same sum over |v| instead (fp64), the scale of the error of a kernel that rounds the probabilities to bf16."""
    h, n, d = q.shape
    g = h // k.shape[0]
    kk = k[:, : start + n].double().repeat_interleave(g, 0)
    vv = v[:, : start + n].double().repeat_interleave(g, 0)
    visible = torch.ones(n, start + n, dtype=torch.bool)
    visible[:, start:] = mask if mask is not None else torch.ones(n, n, dtype=torch.bool).tril()
    scores = torch.einsum("hnd,hsd->hns", q.double(), kk) * scale
    p = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    out = torch.einsum("hns,hsd->hnd", p, vv.abs() if magnitude else vv).transpose(0, 1).reshape(n, h * d)
    return out if magnitude else out.to(q.dtype)
