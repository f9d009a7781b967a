"""Worker processes for the tokenizer's parallel passes (``train_bpe`` counting, ``tokenize_file``).

:class:`WorkerPool` forks ``n`` workers and feeds each through a pipe of its own. Unlike
``multiprocessing.Pool`` the workers share no lock with the parent: a worker killed at any
moment cannot leave the parent waiting on a semaphore it held, so Ctrl-C stops the command at
once (the workers ignore SIGINT; the parent kills them). A worker also ends with its parent
when that dies without cleaning up (SIGKILL, a crash): the kernel kills it (Linux), or its
pipe reports the parent gone. Objects that exist before the fork go to a permanent GC
generation, so the children's collections never copy the parent's pages.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import multiprocessing as mp
import os
import signal
import sys
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.connection import Connection, wait
from typing import Any

from lm.io import interrupts_deferred

_IN_FLIGHT = 2  # tasks queued per worker: one running, one waiting


_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies, however it dies (Linux only).

    (Strictly, when the parent's thread that forked it ends: the pool is made and closed by one thread.)
    """
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the request
        os._exit(1)


def _serve(conn: Connection, func: Callable, initializer: Callable | None, initargs: tuple,
           parent: int, inherited: list[Connection]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides what Ctrl-C does
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a handler the parent set is not this process's
    _die_with_parent(parent)
    # The parent's ends of the pipes (this worker's and the earlier workers'), copied by the fork: held
    # here, they would keep a pipe open after the parent died, and a worker blocked in send would
    # wait for ever instead of failing.
    for c in inherited:
        c.close()
    if initializer is not None:
        initializer(*initargs)
    while True:
        try:
            item = conn.recv()
        except (EOFError, OSError):  # the parent closed its end, or is gone
            return
        if item is None:
            return
        index, task = item
        try:
            reply = (index, True, func(task))
        except BaseException as e:  # noqa: BLE001 (sent to the parent, which raises it)
            reply = (index, False, e)
        try:
            conn.send(reply)
        except OSError:  # the parent is gone: nobody wants the reply
            return
        except BaseException as e:  # noqa: BLE001 (the reply does not pickle: the parent raises why)
            conn.send((index, False, e))


class WorkerDied(OSError):
    """A worker process ended while it had work (killed, most often by the out-of-memory killer): an
    OSError, as the machine's other failures are, so that a command says it in one line."""


class WorkerPool:
    """``n`` forked workers that run ``func`` on tasks; ``map`` yields the results in task order.

    Use as a context manager: leaving the block (normally, by an error or by Ctrl-C) ends
    every worker without waiting on any of them.
    """

    def __init__(self, n: int, func: Callable, initializer: Callable | None = None, initargs: tuple = ()):
        ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
        gc.freeze()
        self._frozen = True
        self._workers: list[tuple[Any, Connection]] = []
        self._maps: list[Iterator[Any]] = []
        try:
            # A Ctrl-C during a fork would run its handler inside the interpreter's at-fork hooks
            # (logging's lock release), which print the KeyboardInterrupt as "Exception ignored"
            # and drop it: it waits until the workers are forked, then goes to whatever handles
            # Ctrl-C here (an InterruptGuard held it back only where Python's own handler was set).
            with interrupts_deferred():
                for _ in range(max(1, n)):
                    parent, child = ctx.Pipe()
                    inherited = [c for _, c in self._workers] + [parent]
                    p = ctx.Process(target=_serve, args=(child, func, initializer, initargs, os.getpid(), inherited),
                                    daemon=True)
                    p.start()
                    child.close()
                    self._workers.append((p, parent))
        except BaseException:
            self.close()
            raise

    def map(self, tasks: Iterable[Any], ordered: bool = True) -> Iterator[Any]:
        """Results of ``func(task)`` for every task, in task order (or as they finish when not ``ordered``)."""
        results = self._map(tasks, ordered)
        self._maps.append(results)  # closed by close(): its frame holds the pipes too
        return results

    def _map(self, tasks: Iterable[Any], ordered: bool) -> Iterator[Any]:
        pending = iter(enumerate(tasks))
        busy: dict[Connection, int] = {conn: 0 for _, conn in self._workers}
        done: dict[int, Any] = {}
        next_out, exhausted = 0, False

        def feed(conn: Connection) -> None:
            nonlocal exhausted
            while not exhausted and busy[conn] < _IN_FLIGHT:
                item = next(pending, None)
                if item is None:
                    exhausted = True
                    return
                try:
                    conn.send(item)
                except OSError:  # BrokenPipeError: the worker is gone
                    raise self._died(conn) from None
                busy[conn] += 1

        for conn in busy:
            feed(conn)
        while any(busy.values()):
            for conn in wait([c for c, k in busy.items() if k]):
                try:
                    index, ok, result = conn.recv()
                except (EOFError, OSError):  # closed, or reset while a task was still unread in its pipe
                    raise self._died(conn) from None
                if not ok:
                    try:
                        raise result
                    finally:  # this frame, on the error's traceback, would hold it: a cycle keeping the
                        del result  # caller's tokenizer, progress bar and chunks until a collection (rest26 R4)
                busy[conn] -= 1
                feed(conn)
                if not ordered:
                    yield result
                    continue
                done[index] = result
                while next_out in done:
                    yield done.pop(next_out)
                    next_out += 1

    def _died(self, conn: Connection) -> WorkerDied:
        """The error for the worker at the other end of ``conn``, saying how it ended."""
        process = next(p for p, c in self._workers if c is conn)
        process.join(5)  # its end is known once it is reaped
        code = process.exitcode
        if code is not None and code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
            if -code == signal.SIGKILL:
                how += " (the kernel's out-of-memory killer sends it: fewer workers take less memory)"
        else:
            how = "ended" if code is None else f"exited with status {code}"
        return WorkerDied(f"a worker process (pid {process.pid}) {how} before it finished its work")

    def close(self) -> None:
        """End every worker now (they hold no lock of ours, so killing them is safe).

        A Ctrl-C meanwhile is raised once every worker is reaped and closed, and every object of theirs
        that has a finalizer (a process's, a pipe's ``__del__``) is gone: a finalizer left to run when
        such an object is collected later, in a weakref callback or ``__del__``, is where a Ctrl-C is
        printed as "Exception ignored ... KeyboardInterrupt" and lost (`lm tokenize` then went on, and
        exited 0 with that traceback: CI, twice on 2026-12-05). So ``Process.close`` runs the process's
        finalizer here, and the generators of :meth:`map`, whose frames hold the pipes, are closed."""
        with interrupts_deferred():
            for results in self._maps:
                results.close()
            self._maps = []
            for p, conn in self._workers:
                if p.is_alive():
                    p.kill()
                conn.close()
            for p, _ in self._workers:
                p.join()
                p.close()
            p = conn = results = None  # the loops' last items: collected here, not when close returns
            self._workers = []
            if self._frozen:
                gc.unfreeze()
                self._frozen = False

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def parallel_map(func: Callable, tasks: list, workers: int, *, initializer: Callable | None = None,
                 initargs: tuple = (), ordered: bool = True, serial: bool = False) -> Iterator[Iterator[Any]]:
    """``with parallel_map(func, tasks, workers) as results:`` the results of ``func`` over ``tasks``.

    In this process when ``workers`` is 1, there is at most one task, or ``serial``; else in a
    :class:`WorkerPool` of ``min(workers, len(tasks))`` processes, ended when the block is left
    (normally, by an error or by Ctrl-C). ``initializer(*initargs)`` runs where ``func`` will.
    """
    if workers <= 1 or len(tasks) <= 1 or serial:
        if initializer is not None:
            initializer(*initargs)
        yield map(func, tasks)
        return
    with WorkerPool(min(workers, len(tasks)), func, initializer, initargs) as pool:
        yield pool.map(tasks, ordered=ordered)
