"""A tiny model served by uvicorn in a thread, for the server and playground tests."""

import contextlib
import http.server
import threading
import time

import uvicorn

import lm.serve.engine as engine_module
from helpers.run_dir import make_run_dir, save_model
from lm.tokenizer import EOT

TEXT = ("Lily had a red ball. She liked to play with it in the park. " + EOT
        + "Tom saw a big dog. The dog was happy and ran to Tom. " + EOT) * 30


class ServerThread:
    """uvicorn serving ``app`` on a free port of 127.0.0.1, in a thread; or ``server`` (a
    uvicorn.Server of ``app``), listening on ``sock`` (a socket bound and listening) if given."""

    def __init__(self, app, server=None, sock=None):
        self.server = server or uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]} if sock else {},
                                       daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def close(self):
        self.server.should_exit = True
        self.thread.join(30)


@contextlib.contextmanager
def one_page_server(body: bytes, content_type: str):
    """A plain HTTP server on a free port of 127.0.0.1, in a thread, answering every GET with
    ``body``: another process's server on a port, or another web app's origin. Yields the port."""

    class OnePage(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), OnePage)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def model_and_tokenizer(tmp_path_factory, **kw):
    """A run folder (tokenizer saved, model not), a seeded tiny model and its tokenizer."""
    d = tmp_path_factory.mktemp("run")
    cfg = dict(context_length=64, d_model=32, num_layers=2, num_heads=2, d_ff=64)
    cfg.update(kw)
    run, model, tok = make_run_dir(d, TEXT, 300, **cfg)
    return run, model.eval(), tok


def saved_run(tmp_path_factory, **kw):
    """:func:`model_and_tokenizer` with the model saved too: a run folder `lm serve --checkpoint` loads."""
    run, model, tok = model_and_tokenizer(tmp_path_factory, **kw)
    save_model(run, model)
    return run, model, tok


def logits_beside(engine, target, companions, join_at: int, steps: int = 60) -> list[bytes]:
    """The logits (as bytes) ``target`` (a Request) sampled its tokens from, run in ``engine`` with
    ``companions`` (Requests) that arrive ``join_at`` steps after it (-1: just before it, so that
    it takes a slot after theirs), until the engine is idle."""
    log = []
    real = engine_module.next_token_and_finite

    def spy(logits, **kw):
        if any(r is not None and r.request is target and r.generator is kw["generator"] for r in engine.rows):
            log.append(logits.float().numpy().tobytes())  # bfloat16 (autocast) exactly in float32
        return real(logits, **kw)

    engine_module.next_token_and_finite = spy
    try:
        if join_at >= 0:
            engine.submit(target)
        for step in range(steps):
            if step == max(join_at, 0):
                for request in companions:
                    engine.submit(request)
                if join_at < 0:
                    engine.submit(target)
            engine.step()
        for _ in range(10_000):
            if not engine.step():
                return log
        raise AssertionError("the engine did not finish")
    finally:
        engine_module.next_token_and_finite = real


def lm_serve_in_process(monkeypatch, argv, while_serving=None) -> tuple[int, dict]:
    """``lm serve ARGV`` run by ``lm.cli.main`` in this process, its uvicorn server a stand-in: the
    status, and what was made (``engine``, ``name``, the ``app`` and ``app_kwargs``, the ``server``,
    ``server_app`` and ``server_kwargs``). The stand-in says it listens at http://127.0.0.1:1234 (as
    uvicorn's start-up calls ``announce``), calls ``while_serving(made)``, and returns, as a server
    stopped by a signal does. Mutation testing sees this run; it cannot see `lm serve` processes."""
    import lm.cli.serve as serve_cli
    import lm.serve.app
    from lm.cli import main

    made = {}
    real_create_app = lm.serve.app.create_app

    def create_app(engine, tok, name, **kwargs):
        made.update(engine=engine, name=name, app_kwargs=kwargs, app=real_create_app(engine, tok, name, **kwargs))
        return made["app"]

    class Server:
        should_exit = False

        def __init__(self, app, **kwargs):
            made.update(server=self, server_app=app, server_kwargs=kwargs)

        def run(self):
            made["server_kwargs"]["announce"]("http://127.0.0.1:1234")
            if while_serving is not None:
                while_serving(made)

    monkeypatch.setattr(lm.serve.app, "create_app", create_app)
    monkeypatch.setattr(serve_cli, "draining_server", lambda app, **kwargs: Server(app, **kwargs))
    return main(["serve", *argv]), made
