"""Running ``lm serve`` as a subprocess (the benchmark, the screenshot script and the tests do)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listens_on(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` holds a socket listening on TCP ``port``: the port's listening
    sockets (their inodes, in Linux's ``/proc/net/tcp`` and ``tcp6``) among the process's open
    files (``/proc/PID/fd``). None where /proc cannot tell (not Linux)."""
    inodes, read = set(), False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        read = True
        for line in lines:  # sl local_address rem_address st ... inode: "0100007F:1F90", st 0A is LISTEN
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    if not read:
        return None
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # another user's process, or gone
        return None
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                return True
        except OSError:  # closed since the listing
            continue
    return False


def start_server(args: list[str], port: int, *, timeout: float = 120.0, **popen) -> tuple[subprocess.Popen, str]:
    """``lm serve ARGS --port PORT`` in a subprocess, once it listens on the port and ``/health``
    answers 200; returns it and its base URL. RuntimeError naming the port (with the server's
    stderr when it was captured) if it exits or does not answer within ``timeout`` seconds
    (importing torch on a loaded machine can take a while). Another process that answers on the
    port is not taken for it: on Linux the listening socket must be the new process's own
    (:func:`listens_on`); elsewhere the process must at least still run."""
    import httpx

    proc = subprocess.Popen([sys.executable, "-m", "lm", "serve", *args, "--port", str(port)], **popen)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    other = False  # something else answered /health on the port
    while True:
        try:
            healthy = httpx.get(url + "/health").status_code == 200
        except httpx.TransportError:
            healthy = False
        if healthy:
            ours = listens_on(proc.pid, port)  # after the answer: a socket of ours answered it
            if ours or ours is None and proc.poll() is None:
                return proc, url
            other = True
        exited = proc.poll() is not None
        if exited or time.time() > deadline:
            if not exited:
                proc.kill()
                proc.wait()
            why = f"it exited with status {proc.returncode}" if exited else f"no answer within {timeout:g} s"
            if other:
                why += f"; another process answers on port {port}"
            err = (proc.stderr.read() if proc.stderr is not None else "").strip()
            raise RuntimeError(f"lm serve did not start on port {port} ({why})" + (f": {err[-2000:]}" if err else ""))
        time.sleep(0.1)
