"""`python -m moe_jax.serve` as a child process on a free local port, waited for until it answers: what the
tests and `bench/serve.py` talk to over HTTP (with plain urllib, so that a check needs no client library)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

START_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, args: list[str], log: Path, processes: int = 1):
        """`processes` > 1: over that many processes (moe_jax.launch; `process` is then the launcher)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        launcher = ["-m", "moe_jax.launch", "-n", str(processes)] if processes > 1 else []
        self.process = subprocess.Popen(
            [
                sys.executable,
                *launcher,
                "-m",
                "moe_jax.serve",
                "--port",
                str(self.port),
                "--log-level",
                "warning",
                *args,
            ],
            env=env,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self):
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log.read_text()}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            time.sleep(0.3)
        raise TimeoutError(f"the server did not start in {START_TIMEOUT_S} s:\n{self.log.read_text()}")

    def get(self, path: str, headers: dict | None = None) -> tuple[int, bytes]:
        request = urllib.request.Request(self.url + path, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def post(self, path: str, body, headers: dict | None = None) -> tuple[int, dict, dict]:
        """(status, JSON answer, headers); `body` bytes are sent as they are, anything else as JSON."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, headers={"content-type": "application/json", **(headers or {})}
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                return r.status, json.loads(r.read()), dict(r.headers)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read()), dict(e.headers)

    def metrics(self, headers: dict | None = None) -> dict[str, float]:
        """/metrics as {'name{labels}': value}."""
        _, text = self.get("/metrics", headers)
        samples = {}
        for line in text.decode().splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                samples[key] = float(value)
        return samples

    def stop(self, sig=signal.SIGTERM, timeout_s: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


@contextlib.contextmanager
def running_server(args: list[str], log: Path, processes: int = 1):
    server = Server(args, log, processes)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
