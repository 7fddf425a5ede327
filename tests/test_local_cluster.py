"""The local cluster `spyglass serve` starts (services.app.start_local_ray): its workers, where the engine runs, at
the starting process's nice value rather than Ray's 15 steps below it, and no idle workers kept. A real cluster, in
a process of its own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CODE = """
import json, os, time
import psutil, ray
from services.app import WORKER_NICENESS, start_local_ray

start_local_ray(num_cpus=2)

@ray.remote
def nice():
    return os.getpriority(os.PRIO_PROCESS, 0)

worker = ray.get(nice.remote())

def titles():
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            out.append(" ".join(p.cmdline()))
        except psutil.Error:  # ended since it was listed (a zombie not yet reaped: no command line)
            pass
    return out

def idle():
    return [t for t in titles() if t.startswith("ray::IDLE")]

deadline = time.monotonic() + 30  # Ray ends an idle worker past the soft limit after ~1 s
while idle() and time.monotonic() < deadline:
    time.sleep(0.5)
print(json.dumps({"worker": worker, "driver": os.getpriority(os.PRIO_PROCESS, 0), "step": WORKER_NICENESS,
                  "idle": idle()}))
ray.shutdown()
"""


def test_workers_run_at_the_drivers_nice_value_and_idle_ones_end():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # Ray adds worker_niceness to the nice value it starts from (15 by default); a shell may run at any value
    assert got["step"] == 0
    assert got["worker"] == got["driver"]
    assert got["idle"] == []  # the task's worker, idle once it returned, was not kept
