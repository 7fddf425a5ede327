"""A real redis-server on a free loopback port, started and stopped by the tests."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (make test installs it: apt-get install redis-server)")
        self.workdir = workdir
        self.port = free_port()
        self.pidfile = workdir / "redis.pid"
        subprocess.run(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "yes",
                "--dir",
                str(workdir),
                "--pidfile",
                str(self.pidfile),
            ],
            check=True,
        )
        import redis

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
        import os
        import signal

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
