"""A throwaway redis-server on a free loopback port: used by `spyglass serve` when no Redis is configured,
and by the tests (kept free of Ray and torch imports so both can use it cheaply)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRedis:
    """A throwaway redis-server on a free loopback port, no persistence; `stop()` kills it by pid."""

    def __init__(self, workdir: Path | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server is not installed")
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="spyglass-redis-"))
        self.port = free_port()
        self.pidfile = self.workdir / "redis.pid"
        cmd = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        cmd += ["--daemonize", "yes", "--dir", str(self.workdir), "--pidfile", str(self.pidfile)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        client = redis.Redis(host="127.0.0.1", port=self.port)
        for _ in range(100):
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not come up")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        for _ in range(100):
            if self.pidfile.exists():
                break
            time.sleep(0.05)
        try:
            pid = int(self.pidfile.read_text().strip())
            os.kill(pid, signal.SIGTERM)
            for _ in range(100):
                os.kill(pid, 0)
                time.sleep(0.05)
        except (FileNotFoundError, ProcessLookupError, ValueError):
            pass
