"""``lm.serve.process`` (how the tests, the benchmark and the screenshot script start ``lm serve``), in
this process, against a stand-in for ``lm serve``: a few lines of Python that answer /health on the
port they are given, or exit, or never answer. The tests that start the real ``lm serve`` are in
``test_server.py``; mutation testing cannot see into them."""

import os
import socket
import subprocess
import sys
import time

import pytest
from helpers.serving import one_page_server

import lm.serve.process as process
from lm.serve.process import free_port, listens_on, start_server

# what stands in for `python -m lm serve ARGS --port N`: ARGS[0] says what it does
STAND_IN = """
import http.server, sys, time
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
if args[0] == "exit":  # ARGS[1]: how many lines of its stderr come before its last
    sys.stderr.write("".join(f"line {i}\\n" for i in range(int(args[1]))) + "  cannot load the checkpoint\\n")
    sys.exit(3)
if args[0] == "silent":
    time.sleep(30)
    sys.exit(0)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *a):
        pass

time.sleep(0 if args[1] == "--port" else float(args[1]))  # a slow start: torch being imported
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


class Started(list):
    """The commands start_server ran (each ran the stand-in with the same arguments instead), and
    ``procs``, the stand-ins' processes."""

    procs: list


@pytest.fixture
def started(monkeypatch):
    commands = Started()
    commands.procs = []
    real_popen = subprocess.Popen

    def popen(argv, **kwargs):
        commands.append(argv)
        assert argv[:4] == [sys.executable, "-m", "lm", "serve"]
        commands.procs.append(real_popen([sys.executable, "-c", STAND_IN, *argv[4:]], **kwargs))
        return commands.procs[-1]

    monkeypatch.setattr(process.subprocess, "Popen", popen)
    return commands


def test_start_server_returns_once_its_own_process_answers_health(started):
    """It waits through a slow start (the stand-in listens after 0.5 s), then returns the process and
    its URL, the socket being the process's own."""
    import httpx

    port = free_port()
    proc, url = start_server(["serving", "0.5"], port)
    try:
        assert url == f"http://127.0.0.1:{port}" and proc.poll() is None
        assert started == [[sys.executable, "-m", "lm", "serve", "serving", "0.5", "--port", str(port)]]
        assert httpx.get(url + "/health").status_code == 200
        if sys.platform == "linux":
            assert listens_on(proc.pid, port) is True and listens_on(os.getpid(), port) is False
    finally:
        proc.kill()
        proc.wait()


def test_a_server_that_exits_is_one_error_naming_the_port_its_status_and_the_end_of_its_stderr(started):
    port = free_port()
    with pytest.raises(RuntimeError) as e:
        start_server(["exit", "0"], port, stderr=subprocess.PIPE, text=True)
    assert str(e.value) == (f"lm serve did not start on port {port} (it exited with status 3): "
                            "cannot load the checkpoint")  # stripped
    with pytest.raises(RuntimeError) as e:  # a long stderr: its last 2,000 characters
        start_server(["exit", "400"], port, stderr=subprocess.PIPE, text=True)
    err = "".join(f"line {i}\n" for i in range(400)) + "  cannot load the checkpoint"
    assert str(e.value) == f"lm serve did not start on port {port} (it exited with status 3): {err[-2000:]}"
    with pytest.raises(RuntimeError) as e:  # its stderr not captured: the status alone
        start_server(["exit", "0"], port, stderr=subprocess.DEVNULL)
    assert str(e.value) == f"lm serve did not start on port {port} (it exited with status 3)"


def test_a_server_that_never_answers_is_killed_after_the_timeout(started):
    """No answer within ``timeout`` seconds: the process is killed and reaped, and the error says so."""
    port = free_port()
    t = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        start_server(["silent"], port, timeout=1.5)
    assert 1.5 <= time.monotonic() - t < 30
    assert str(e.value) == f"lm serve did not start on port {port} (no answer within 1.5 s)"
    assert started.procs[0].returncode == -9  # killed, and reaped


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_another_process_answering_on_the_port_is_not_taken_for_the_server(started):
    """Something else answers /health on the port (here, a server of this process): start_server does
    not return its URL, and the error says that another process answers there."""
    with one_page_server(b"{}", "application/json") as port:
        with pytest.raises(RuntimeError) as e:  # the stand-in cannot bind the port: it exits
            start_server(["serving"], port, stderr=subprocess.PIPE, text=True)
        message = str(e.value)
        assert message.startswith(f"lm serve did not start on port {port} (it exited with status 1; another process "
                                  f"answers on port {port}): Traceback"), message
        assert "Address already in use" in message
        with pytest.raises(RuntimeError) as e:  # one that runs on but never answers, killed at the timeout
            start_server(["silent"], port, timeout=1.0)
        assert str(e.value) == (f"lm serve did not start on port {port} (no answer within 1 s; another process "
                                f"answers on port {port})")
        assert listens_on(os.getpid(), port) is True


def test_free_port_is_a_port_nothing_listens_on_and_listens_on_reads_proc(monkeypatch):
    """A free port can be bound at once; ``listens_on`` finds a listening socket by its inode in
    /proc/net/tcp (IPv4) or tcp6, only while it listens (not a connection accepted on the port),
    only in its own process's files, and says None where /proc cannot tell."""
    port = free_port()
    assert 1024 <= port <= 65535
    if not sys.platform.startswith("linux"):
        assert listens_on(os.getpid(), port) is None
        return
    assert listens_on(os.getpid(), port) is False
    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        with socket.socket(family) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
            assert listens_on(os.getpid(), port) is False  # bound, not listening
            s.listen()
            assert listens_on(os.getpid(), port) is True
            assert listens_on(os.getppid(), port) is False  # another process's files
        assert listens_on(os.getpid(), port) is False
    # a connection accepted on the port is no listening socket: once the listener is closed, it is not
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = listener.accept()
    try:
        assert listens_on(os.getpid(), port) is False
    finally:
        client.close()
        accepted.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert listens_on(2**22 + 7, s.getsockname()[1]) is None  # no such process: /proc cannot tell
        # one table that cannot be read: the other is still read
        with socket.socket(socket.AF_INET6) as s6:
            s6.bind(("::1", 0))
            s6.listen()
            with monkeypatch.context() as m:
                m.setattr(process, "open", _refusing("/proc/net/tcp"), raising=False)
                assert listens_on(os.getpid(), s6.getsockname()[1]) is True
        monkeypatch.setattr(process, "open", _refusing("/proc/net/tcp", "/proc/net/tcp6"), raising=False)
        assert listens_on(os.getpid(), s.getsockname()[1]) is None


def _refusing(*paths: str):
    """``open``, but a PermissionError for ``paths`` (a table of /proc/net that cannot be read)."""

    def opened(path, *args, **kwargs):
        if path in paths:
            raise PermissionError(13, "Permission denied", path)
        return open(path, *args, **kwargs)

    return opened
