"""Running ``lm serve`` as a subprocess (the benchmark, the screenshot script and the tests do)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: list[str], port: int, *, timeout: float = 120.0, **popen) -> tuple[subprocess.Popen, str]:
    """``lm serve ARGS --port PORT`` in a subprocess, once ``/health`` answers 200; returns it and
    its base URL. RuntimeError (with the server's stderr when it was captured) if it exits or does
    not answer within ``timeout`` seconds (importing torch on a loaded machine can take a while)."""
    import httpx

    proc = subprocess.Popen([sys.executable, "-m", "lm", "serve", *args, "--port", str(port)], **popen)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            if proc.poll() is None:
                proc.kill()
            err = proc.stderr.read() if proc.stderr is not None else ""
            raise RuntimeError(f"lm serve did not start: {err.strip()[-2000:]}")
        time.sleep(0.1)
