"""``lm serve``: an OpenAI-compatible HTTP server for a trained language model, with a playground."""

from __future__ import annotations

import argparse
import sys

from lm.cli.common import add_checkpoint, add_command, add_compute, add_quiet, check_utf8

EXAMPLES = """
  lm serve --checkpoint runs/cpu-small                     # http://127.0.0.1:8000 (the playground at /)
  lm serve --checkpoint runs/cpu-small --port 8080 --max-batch 32
  LM_API_KEY=secret lm serve --checkpoint runs/cpu-small --host 0.0.0.0   # on the network: a key
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
      -d '{"prompt": "Once upon a time", "max_tokens": 64, "temperature": 0.8}'
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "serve",
        help="serve a model over HTTP (OpenAI completions API, a playground)",
        description="Serve a trained language model: POST /v1/completions (OpenAI's schema, streaming with "
        "stream: true; logprobs and echo), GET /v1/models (and /v1/models/{model}), /health, /metrics "
        "(Prometheus), vLLM's /tokenize, /detokenize and /tokenizer_info, and a playground page at /. Requests "
        "that arrive while others decode join the running batch (continuous batching). A translation "
        "(encoder-decoder) checkpoint is served the same way: the prompt is the source, the completion its "
        "translation. SIGTERM or Ctrl-C finishes the requests in flight, answers new ones with 503, then exits "
        f"(a client still reading its answer gets {GRACEFUL_SHUTDOWN_S:g} s more); a second signal exits at once.",
        examples=EXAMPLES,
    )
    add_checkpoint(p)
    p.add_argument("--tokenizer", default=None, metavar="DIR", help="default: the run's tokenizer/")
    p.add_argument("--host", default="127.0.0.1", help="address to bind; 0.0.0.0 exposes the server to the network")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    p.add_argument("--max-batch", type=int, default=16, metavar="N", help="rows decoded together")
    p.add_argument("--max-queue", type=int, default=256, metavar="N",
                   help="requests waiting for a row before new ones get 503")
    p.add_argument("--compile", action="store_true",
                   help="compile the fixed-shape decode steps with torch.compile at startup (tens of seconds; "
                   "faster steps)")
    p.add_argument("--step-sizes", type=_sizes, default=None, metavar="N,N,...",
                   help="the batch sizes of the decode steps, the smallest that holds the active rows runs "
                   "(default: the powers of two below --max-batch, and --max-batch); sizes whose rows do not "
                   "give the same bits as the largest are dropped at startup")
    p.add_argument("--max-body", type=int, default=1 << 20, metavar="BYTES", help="largest request body (413 above)")
    p.add_argument("--model-name", default=None, metavar="NAME",
                   help="the model's id in the API (default: the run folder's name)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="answer the API only with Authorization: Bearer KEY (the page, /health and /metrics "
                   "stay open; the page asks for it) (default: $LM_API_KEY, which other users cannot read "
                   "from the process list, as they can an argument)")
    p.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                   help="web origins whose pages may call the API from a browser (CORS), as "
                   "http://localhost:3000, or * for any (default: none but the server's own page)")
    add_compute(p)
    add_quiet(p)
    p.set_defaults(func=cmd_serve)


def _sizes(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"need whole numbers separated by commas, got {text!r}") from None


def check_listen_address(host: str, port: int) -> None:
    """``--host`` must resolve and ``host:port`` be free to listen on, checked before the model loads:
    uvicorn found out only after loading it, with ``ERROR: [Errno -2] Name or service not known``
    (or ``address already in use``) and exit status 1 or 3."""
    import errno
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (OSError, ValueError) as e:  # socket.gaierror; ValueError: a NUL, or a name IDNA cannot encode
        raise ValueError(f"--host: cannot resolve {host!r} ({getattr(e, 'strerror', None) or e})") from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind(address)
        except OSError as e:
            which = "--port" if e.errno in (errno.EADDRINUSE, errno.EACCES) else "--host"
            raise ValueError(f"{which}: cannot listen on {host}:{port} ({e.strerror or e})") from None


def served_model_name(checkpoint: str, model_name: str | None = None) -> str:
    """The model's id in the API: ``model_name``, else the run folder's name. The path is resolved
    first: ``--checkpoint .`` (or ``model.safetensors``) from inside the run folder had served the
    model as ``''``, so clients asking for the run's name got 404."""
    from pathlib import Path

    if model_name is not None:
        if not model_name.strip():
            raise ValueError("--model-name: must not be empty")
        check_utf8("--model-name", model_name, "the value")
        _check_printable("--model-name", model_name)
        return model_name
    try:
        run = Path(checkpoint).resolve()
    except (OSError, RuntimeError):  # a symlink loop (RuntimeError on Python 3.11)
        raise ValueError(f"--checkpoint: {checkpoint!r} is a symlink loop") from None
    if not run.is_dir():
        run = run.parent.parent if run.parent.name == "checkpoints" else run.parent
    elif run.name == "checkpoints" and not (run / "checkpoints").is_dir():  # RUN/checkpoints: the run's name
        run = run.parent
    if not run.name:
        from lm.generate.load import resolve_checkpoint

        resolve_checkpoint(checkpoint)  # /nonexist: "--checkpoint: file not found", not a --model-name error (demo21)
        raise ValueError(f"--model-name: {checkpoint!r} is in no named run folder; pass --model-name NAME")
    check_utf8("--model-name", run.name, f"the run folder's name {run.name!r}")
    _check_printable("--model-name", run.name, f"the run folder's name {run.name!r}")
    return run.name


def _check_printable(option: str, value: str, what: str | None = None) -> None:
    """Refuse a control character or line break in the model's id: it is printed on the start-up
    line and sent in every response, where ``a\\nb`` broke the line in two."""
    import unicodedata

    bad = next((i for i, c in enumerate(value) if unicodedata.category(c) in ("Cc", "Zl", "Zp")), None)
    if bad is not None:
        raise ValueError(f"{option}: {what or 'the value'} holds U+{ord(value[bad]):04X}, a control character or "
                         f"line break, at character {bad + 1}; pass {option} without one")


def check_api_key(key: str) -> None:
    """The key must be visible ASCII (``!`` to ``~``), as a Bearer token in an HTTP header is:
    ``ключ`` started a server that no OpenAI client could call (they encode headers as ASCII or
    Latin-1), and a line break one that nobody could (a header holds no line break). The key
    itself is never shown."""
    if not key.strip():
        raise ValueError("--api-key: must not be empty (nor $LM_API_KEY, when set)")
    check_utf8("--api-key", key, "the key (or $LM_API_KEY)")
    bad = next((i for i, c in enumerate(key) if not "!" <= c <= "~"), None)
    if bad is not None:
        c = key[bad]
        kind = "a space" if c == " " else "a control character" if c < " " or c == "\x7f" else "a non-ASCII character"
        raise ValueError(f"--api-key: the key (or $LM_API_KEY) has {kind} at character {bad + 1}; use printable ASCII "
                         "characters without spaces (letters, digits, punctuation): HTTP clients send no others in a "
                         "Bearer token")


GRACEFUL_SHUTDOWN_S = 30.0  # once the engine has drained: the most time the answers still being sent get


def listen_url(address: tuple) -> str:
    """The base URL of a socket bound to ``address`` (``getsockname()``'s): an IPv6 host in brackets.

    >>> listen_url(("::1", 8470, 0, 0))
    'http://[::1]:8470'
    """
    host, port = address[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def draining_server(app, *, host: str, port: int, quiet: bool = False,
                    graceful_shutdown: float = GRACEFUL_SHUTDOWN_S, announce=None):
    """A uvicorn server of ``app`` (:func:`lm.serve.app.create_app`'s) that drains on SIGTERM or
    Ctrl-C: new requests get 503 at once, the engine finishes the requests in it (their generation,
    bounded by ``max_tokens``), then the server stops, giving the answers still being sent at most
    ``graceful_shutdown`` seconds (uvicorn's graceful timeout), so that a client that stops reading
    cannot keep the process up. A second signal exits at once (status 128 + the signal: 143 for
    SIGTERM, 130 for Ctrl-C), the requests still in flight cut off. Once it listens,
    ``announce(url)`` gets its address (:func:`listen_url`: the port it was given for port 0)."""
    import contextlib
    import os
    import signal

    import uvicorn

    state = app.state.server
    engine = state.engine

    class Server(uvicorn.Server):
        signalled: int | None = None  # the first SIGTERM or SIGINT
        draining = False  # the event loop has begun the drain

        def handle_exit(self, sig, frame):
            """Plain stores, no lock: Python runs a signal handler on the main thread between two
            bytecodes, which may be the event loop's, inside ``with engine._lock:`` (``submit_all``).
            Taking that lock here (``engine.stop_accepting()``) had waited for ever, the server frozen
            for good. The event loop's next tick (:meth:`on_tick`) does the rest."""
            if self.signalled is not None:  # the second: at once
                # os.write, not print: sys.stderr's buffer has a lock, which this handler may have interrupted
                with contextlib.suppress(OSError):  # (stderr gone: exit all the same)
                    os.write(2, f"lm serve: {signal.Signals(sig).name} again: exiting, the requests in flight "
                                "cut off\n".encode())
                os._exit(128 + sig)
            self.signalled = sig
            state.draining = True  # /v1/completions and /health answer 503 from here on

        async def on_tick(self, counter: int) -> bool:
            """uvicorn's check every 0.1 s, on the event loop: after a signal, start the drain, then
            exit once the engine is idle (a response whose tokens are all made may still wait for its
            client to read it, which the graceful timeout bounds once should_exit is set)."""
            if self.signalled is not None:
                if not self.draining:
                    self.draining = True
                    engine.stop_accepting()
                    if not quiet:
                        print(f"lm serve: {signal.Signals(self.signalled).name}: finishing {state.inflight} "
                              f"request(s) in flight (then at most {graceful_shutdown:g} s to send them); new "
                              "ones get 503", file=sys.stderr, flush=True)
                if not engine.busy:
                    self.should_exit = True
            return await super().on_tick(counter)

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started and announce is not None:
                announce(listen_url(self.servers[0].sockets[0].getsockname()))

    config = uvicorn.Config(app, host=host, port=port, log_level="warning" if quiet else "info",
                            access_log=not quiet, timeout_graceful_shutdown=graceful_shutdown)
    return Server(config)


def cmd_serve(args: argparse.Namespace) -> int:
    import os
    import traceback

    from lm.cli.common import check_fits, compute_dtype, load_model_and_tokenizer, model_fits, plural

    try:  # checked before anything loads; draining_server uses uvicorn
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ValueError(f"lm serve needs starlette and uvicorn ({e}); pip install starlette uvicorn") from None
    # the arguments that need no model, checked before torch is imported: a wrong flag is said in a
    # fraction of a second, not after the seconds that importing torch takes
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port: must be in [0, 65535], got {args.port}")
    api_key = args.api_key if args.api_key is not None else os.environ.get("LM_API_KEY")
    if api_key is not None:
        check_api_key(api_key)
    for name in ("max_batch", "max_queue", "max_body"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    bad = next((b for b in args.step_sizes or () if not 1 <= b <= args.max_batch), None)
    if bad is not None:
        raise ValueError(f"--step-sizes: each must be in [1, --max-batch={args.max_batch}], got {bad}")
    check_listen_address(args.host, args.port)
    from lm.checks import check_origins
    from lm.io import check_not_empty, check_threads

    check_threads(args.threads)
    origins = check_origins(args.allowed_origins, "--allowed-origins")
    check_not_empty(args.checkpoint, "--checkpoint")  # before its folder's name is taken for the model's
    name = served_model_name(args.checkpoint, args.model_name)
    from lm.device import set_threads
    from lm.generate.seq2seq import line_break_ids
    from lm.serve.app import create_app
    from lm.serve.engine import Engine
    from lm.serve.translation import TranslationEngine

    set_threads(args.threads)
    loaded = load_model_and_tokenizer(args.checkpoint, args.tokenizer, args.device)
    model, tok, _ = loaded
    dtype = compute_dtype("lm serve", args, model.device)
    if args.compile and not args.quiet:
        print("lm serve: compiling the decode steps (tens of seconds) ...", file=sys.stderr, flush=True)
    common = dict(max_batch=args.max_batch, max_queue=args.max_queue, dtype=dtype, vocab_size=tok.vocab_size,
                  compile=args.compile, step_sizes=args.step_sizes)
    seq2seq = model.config.architecture == "encoder_decoder"  # a translation model: prompt in, translation out
    batch = f"--max-batch: a batch of {args.max_batch} {plural(args.max_batch, 'row')}"
    # the slots' cache, every context position of every row, is made at once: refused with the numbers
    check_fits(batch, (TranslationEngine if seq2seq else Engine).cache_class.bytes_for(model, args.max_batch),
               "their key/value cache needs at least", model.device, "lower --max-batch")
    with model_fits(batch, "lower --max-batch"):  # what the count leaves out: the probe's activations, a wider step
        if seq2seq:
            engine = TranslationEngine(model, banned_ids=line_break_ids(tok), **common)  # one line, as lm translate
        else:
            engine = Engine(model, eos_id=tok.eot_id, **common)
    top = max(engine.steps)  # the largest step: every slot, and idle rows where it is wider
    if not args.quiet:
        dropped = (f" ({', '.join(map(str, engine.dropped_sizes))}: a row's logits differ from the "
                   f"{top}-row step's here, so not used)" if engine.dropped_sizes else "")
        spans = "the positions in use (power-of-two spans)" if engine.bucketed else "the whole context"
        print(f"lm serve: decode steps of {', '.join(map(str, engine.step_sizes))} rows{dropped}, attending over "
              f"{spans}", file=sys.stderr, flush=True)
        if top > args.max_batch:
            print(f"lm serve: {args.max_batch} slots in a {top}-row step: the {args.max_batch}-row step gives a row "
                  "other bits in other slots here", file=sys.stderr, flush=True)
    if not engine.slot_invariant:  # even --quiet: the server cannot keep its promise
        print(f"lm serve: warning: the {top}-row decode step gives a row other bits in other slots "
              "on this device, and no wider step does either: a seeded request may get other text beside "
              "others than alone", file=sys.stderr, flush=True)
    app = create_app(engine, tok, name, max_body=args.max_body, api_key=api_key, allowed_origins=origins)
    state = app.state.server

    def announce(where: str) -> None:  # once it listens, even with --quiet: where it is (--port 0: which port)
        print(f"lm serve: {name} ({loaded.source}; {model.num_parameters():,} parameters, context "
              f"{model.config.context_length}, max batch {args.max_batch}) at {where}/v1 — playground at {where}/"
              + (" (the API needs the key)" if api_key is not None else ""), file=sys.stderr, flush=True)

    server = draining_server(app, host=args.host, port=args.port, quiet=args.quiet, announce=announce)
    if api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"lm serve: warning: --host {args.host} without --api-key (or $LM_API_KEY): anyone who can reach "
              "this address can use the model", file=sys.stderr, flush=True)

    def on_engine_error(error: BaseException) -> None:  # the engine's thread; the requests in are failed
        print("lm serve: the model failed while generating (every request in flight got a 500); exiting:",
              file=sys.stderr, flush=True)
        traceback.print_exception(error, file=sys.stderr)
        state.draining = True
        server.should_exit = True

    engine.on_error = on_engine_error
    engine.on_row_error = lambda request, error: print(f"lm serve: a request failed: {error}", file=sys.stderr,
                                                        flush=True)
    server.run()
    return 1 if engine.error is not None else 0
