"""CLI wiring, config overrides, and `ray job submit -- spyglass train CONFIG` against a local head node."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from actors.common import load_config
from cli.main import build_parser
from tests.redis_server import free_port

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


def test_cli_has_extract_and_train_commands():
    args = build_parser().parse_args(
        ["train", "configs/tiny-longspec.yaml", "--set", "train.steps=3", "--skip-extract"]
    )
    assert args.command == "train" and args.set == ["train.steps=3"] and args.skip_extract
    args = build_parser().parse_args(["extract", "x.yaml", "--workdir", "/tmp/w"])
    assert args.command == "extract" and args.workdir == "/tmp/w"


def test_load_config_applies_overrides(tmp_path):
    cfg = load_config(
        ROOT / "configs" / "tiny-longspec.yaml",
        ["train.steps=7", "extract.positions={scheme: plain}", "train.deepspeed.zero_stage=1"],
        str(tmp_path / "w"),
    )
    assert cfg["train"]["steps"] == 7 and cfg["extract"]["positions"] == {"scheme": "plain"}
    assert cfg["train"]["deepspeed"] == {"zero_stage": 1}
    assert cfg["workdir"] == str((tmp_path / "w").resolve())
    for name in ("smollm2-135m-longspec/01-v2.yaml", "smollm2-135m-glide.yaml", "tiny-longspec-zero2.yaml"):
        assert load_config(ROOT / "configs" / name)["train"]["draft"] == "longspec"


def test_a_config_with_a_base_changes_only_what_it_states(tmp_path):
    (tmp_path / "a.yaml").write_text("name: a\ntrain: {steps: 10, lr: 0.1, lag_weights: [1, 1]}\nextract: {topk: 8}\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.yaml").write_text("base: ../a.yaml\nname: b\ntrain: {lr: 0.2, lag_weights: [4]}\n")
    cfg = load_config(tmp_path / "sub" / "b.yaml", ["train.steps=3"])
    assert cfg["name"] == "b" and cfg["extract"] == {"topk": 8}
    assert cfg["train"] == {"steps": 3, "lr": 0.2, "lag_weights": [4]}  # a list replaces, a section merges
    assert "base" not in cfg
    (tmp_path / "a.yaml").write_text("base: sub/b.yaml\n")
    with pytest.raises(ValueError, match="its own base"):
        load_config(tmp_path / "sub" / "b.yaml")
    (tmp_path / "c.yaml").write_text("base: missing.yaml\n")
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        load_config(tmp_path / "c.yaml")


def _wait_http(url: str, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except urllib.error.HTTPError:  # answering (e.g. 401 under token auth) is up
            return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"{url} did not come up in {timeout} s")


def test_ray_job_submit_end_to_end(tiny_dir, tmp_path):
    """A real `ray start --head` on loopback (ports outside 10002-19999), a real `ray job submit`."""
    env = dict(os.environ)
    env.update(
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        RAY_USAGE_STATS_ENABLED="0",
        RAY_AUTH_MODE="token",
        PATH=f"{VENV_BIN}:{env.get('PATH', '')}",
        OMP_NUM_THREADS="1",
        RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",  # torn down at once when the test ends (not after 30 s of draining)
    )
    env.pop("RAY_ADDRESS", None)
    ports = [free_port() for _ in range(4)]
    gcs, dash, client, agent = ports
    temp_dir = tempfile.mkdtemp(prefix="sgray-", dir="/tmp")  # short: Ray's unix socket paths are length-limited
    log = (tmp_path / "head.log").open("w")
    head = subprocess.Popen(
        [str(VENV_BIN / "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
         "--port", str(gcs), "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash),
         "--ray-client-server-port", str(client), "--dashboard-agent-listen-port", str(agent),
         "--num-cpus", "3", "--temp-dir", temp_dir, "--include-dashboard", "true"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    workdir = tmp_path / "run"
    try:
        _wait_http(f"http://127.0.0.1:{dash}/api/version", 90)
        cmd = [
            str(VENV_BIN / "ray"), "job", "submit", "--address", f"http://127.0.0.1:{dash}", "--working-dir", str(ROOT),
            "--", "spyglass", "train", "configs/tiny-longspec.yaml", "--workdir", str(workdir),
            "--set", f"model={tiny_dir['llama']}", "--set", "train.steps=4", "--set", "train.checkpoint_every=2",
            "--set", "extract.splits=[train]", "--set", "corpus.max_contexts={train: 8, eval: 0}",
            "--set", "extract.workers=1", "--set", "train.workers=1", "--set", "train.batch_size=2",
        ]  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400, cwd=ROOT)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + (tmp_path / "head.log").read_text()
        assert "succeeded" in proc.stdout + proc.stderr
    finally:
        head.terminate()  # `ray start --block` tears down the processes it started
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
        shutil.rmtree(temp_dir, ignore_errors=True)
    recs = [json.loads(line) for line in (workdir / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    manifest = json.loads((workdir / "extract" / "train" / "manifest.json").read_text())
    assert manifest["contexts"] == 8
    assert (workdir / "train" / "checkpoints" / "step-000004" / "draft.safetensors").exists()


@pytest.mark.heavy
def test_local_train_runs_on_loopback_without_flooding_the_log(tiny_dir, tmp_path, ray_cluster):
    """`spyglass train` outside a job starts its own cluster; here beside the test session's, as a user's training
    beside a server. Its nodes are on loopback and Ray Train's cleaner neither warns every second (no dashboard)
    nor fails to tell the two clusters apart."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # as a user's shell: the package sets it
    cmd = [sys.executable, "-m", "spyglass", "train", "configs/tiny-longspec.yaml", "--workdir", str(tmp_path)]
    cmd += ["--set", f"model={tiny_dir['llama']}", "--set", "train.steps=2", "--set", "train.checkpoint_every=2"]
    cmd += ["--set", "corpus.max_contexts={train: 8, eval: 4}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    workers = re.findall(r"\(ip=([0-9.]+), pid=\d+\) world_rank=", out)
    assert len(workers) == 2 and set(workers) == {"127.0.0.1"}, out[-3000:]
    assert "Failed to query Ray Train Controller" not in out and "multiple active Ray instances" not in out


def test_bad_config_fails_before_any_cluster_starts(capsys):
    from cli.main import main

    assert main(["train", str(ROOT / "configs" / "tiny-longspec.yaml"), "--set", "train.stepz=3"]) == 2
    assert "unknown train option(s): stepz" in capsys.readouterr().err
    bad_positions = ["extract", str(ROOT / "configs" / "tiny-longspec.yaml"), "--set", "extract.positions={scheme: x}"]
    assert main(bad_positions) == 2
    assert main(["extract", str(ROOT / "configs" / "tiny-longspec.yaml"), "--set", "extract.continue_from=64"]) == 2
    assert "extract.continue_from must be in 1..63" in capsys.readouterr().err


def test_train_dispatches_single_process_trainers(smollm2, tmp_path, capsys):
    """`spyglass train` on a `trainer: dels` config runs the DeLS trainer (the shipped config, shortened) and
    exports a loadable head; an unknown trainer is one clear error."""
    import yaml

    from cli.main import main
    from spyglass.models.drafts.dels import load_local_head

    cfg = yaml.safe_load((ROOT / "configs" / "smollm2-135m-dels.yaml").read_text())
    cfg["out"] = str(tmp_path / "head")
    cfg["args"].update(max_steps=3, train_contexts=16, batch=8)
    path = tmp_path / "dels.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["train", str(path), "--workdir", str(tmp_path / "work")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 3 and summary["train_split"]["contexts"] == 16
    head = load_local_head(tmp_path / "head", smollm2[0])
    assert head.logits(head.step(5, None)).shape[-1] == smollm2[0].args.vocab_size
    assert main(["train", str(path), "--set", "trainer=glide"]) == 2
    assert "unknown trainer 'glide'" in capsys.readouterr().err
