"""Shared fixtures: tiny random models (session-scoped) and the real default model."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from spyglass.models.llama import load_transformer
from tests.tiny import make_tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede any triton import (kernels are tested on CPU)
# Ray reads this once, at import (test modules import it while being collected): the test cluster stays on loopback.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("SPYGLASS_CACHE", str(Path(__file__).resolve().parents[1] / ".cache" / "models"))
# The machine's kept measurements (spyglass/kept.py: matmul plans, cost curves), one file per test run, which the
# xdist workers, their Ray clusters and the CLI's subprocesses inherit: each is timed once per run, not once per
# process, and nothing timed on cores the tests contend for is kept for the servers and benches run later.
_RUN_DIR = None  # set in the process that makes the file (the xdist controller), which removes it at the end
if "SPYGLASS_MEASUREMENTS" not in os.environ:
    _RUN_DIR = tempfile.mkdtemp(prefix="spyglass-test-measurements-")
    os.environ["SPYGLASS_MEASUREMENTS"] = str(Path(_RUN_DIR) / "measurements.json")


def pytest_unconfigure(config):
    if _RUN_DIR:
        shutil.rmtree(_RUN_DIR, ignore_errors=True)


# One thread: tests share the 2 cores with Ray workers and each other, and oversubscribed OpenMP
# threads spin (ops 100x slower). Speed is measured in bench/, never here.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def one_thread():
    """Back to one thread before every test: a test (or an engine loop built in process) that set more would leave
    the rest of its worker's tests oversubscribed (seen: a file's tests 10x slower after a served test)."""
    torch.set_num_threads(1)


# Markers whose tests run only when `-m` names them: minutes each, in make targets of their own.
OPT_IN = {
    "long": "long-context test: run with `make test-long` (pytest -m long)",
    "heavy": "heavy run (training, the benches' smoke runs): run with `make test-heavy` (pytest -m heavy)",
}


# The files that take longest (each 1-8 minutes of a worker's time on 2 cores), longest first: with
# `--no-loadscope-reorder` (make test) xdist hands whole files to its workers in collection order, and these first
# let both workers end together (by test count, xdist's default order, the longest came last and one worker ran
# them alone for minutes: 16 against 9 CPU-minutes).
LONGEST_FIRST = (
    "test_sampling_fidelity.py", "test_smollm2.py", "test_verifier_device.py", "test_trainer.py", "test_serving.py",
    "test_engine_identity.py", "test_grpc_bind.py", "test_cpu_kernels.py", "test_bad_input.py", "test_jobs.py",
    "test_extraction.py", "test_cli.py", "test_stops.py",
)  # fmt: skip


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
    chosen = config.getoption("markexpr") or ""
    for marker, reason in OPT_IN.items():
        if marker in chosen:
            continue
        for item in items:
            if item.get_closest_marker(marker) is not None:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {
        "llama": make_tiny_model(root / "llama", "llama", seed=0),
        "qwen2": make_tiny_model(root / "qwen2", "qwen2", seed=1, tie=True),
    }


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_target(request, tiny_dir):
    return load_transformer(tiny_dir[request.param])


@pytest.fixture(scope="session")
def load_tiny(tiny_dir):
    """`load_tiny(family, dtype)`: a tiny target ("llama" or "qwen2") in `dtype`, loaded once per session."""
    loaded = {}

    def load(family: str, dtype: torch.dtype = torch.float32):
        if (family, dtype) not in loaded:
            loaded[family, dtype] = load_transformer(tiny_dir[family], dtype=dtype)
        return loaded[family, dtype]

    return load


@pytest.fixture(scope="session")
def smollm2():
    """The real embedded default (SmolLM2-135M-Instruct), fp32, with its tokenizer."""
    from spyglass.models.loader import load_tokenizer, resolve_model

    resolved = resolve_model(None, dtype="float32")
    return load_transformer(resolved.path), load_tokenizer(resolved.path)


@pytest.fixture(scope="session")
def smollm2_bf16():
    """The embedded default in bf16 (its bf16 safetensors conversion), with its tokenizer."""
    from spyglass.models.loader import load_tokenizer, resolve_model

    resolved = resolve_model(None, dtype="bfloat16")
    return load_transformer(resolved.path, dtype=torch.bfloat16), load_tokenizer(resolved.path)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One real redis-server per test session on a free loopback port."""
    from tests.redis_server import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster per test session, on loopback only (see environment.md), the gRPC proxy included."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    import ray

    from services import grpc_bind

    if not ray.is_initialized():
        ray.init(
            address="local",
            num_cpus=4,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
            runtime_env=grpc_bind.runtime_env(),  # as start_local_ray: Serve's gRPC proxy on loopback, optional TLS
        )
    yield ray
    ray.shutdown()
