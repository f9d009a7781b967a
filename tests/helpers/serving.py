"""A tiny model served by uvicorn in a thread, for the server and playground tests."""

import threading
import time

import uvicorn

from helpers.run_dir import make_run_dir
from lm.tokenizer import EOT

TEXT = ("Lily had a red ball. She liked to play with it in the park. " + EOT
        + "Tom saw a big dog. The dog was happy and ran to Tom. " + EOT) * 30


class ServerThread:
    """uvicorn serving ``app`` on a free port of 127.0.0.1, in a thread."""

    def __init__(self, app):
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
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


def model_and_tokenizer(tmp_path_factory, **kw):
    """A run folder (tokenizer saved, model not), a seeded tiny model and its tokenizer."""
    d = tmp_path_factory.mktemp("run")
    cfg = dict(context_length=64, d_model=32, num_layers=2, num_heads=2, d_ff=64)
    cfg.update(kw)
    run, model, tok = make_run_dir(d, TEXT, 300, **cfg)
    return run, model.eval(), tok
