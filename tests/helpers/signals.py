"""Commands terminated from inside: SIGTERM sent while a command runs, as `kill PID` would."""

import signal
import time
from collections.abc import Callable, Sequence


class Escaped(Exception):
    """SIGTERM reached no handler of lm's (it would have ended pytest)."""


def main_terminated_inside(monkeypatch, owner, name: str, argv: Sequence[str],
                           check: Callable[[], None] | None = None) -> int:
    """``lm.cli.main(argv)``'s exit status when ``owner.name`` sends this process SIGTERM as it is
    called (after ``check()``, which may assert what is on disk by then). The handler in place
    outside the command must be the one put back after it."""
    from lm.cli import main

    original = getattr(owner, name)

    def terminated(*args, **kwargs):
        if check is not None:
            check()
        signal.raise_signal(signal.SIGTERM)
        time.sleep(5)  # the handler raises here
        return original(*args, **kwargs)

    def escaped(signum, frame):
        raise Escaped

    monkeypatch.setattr(owner, name, terminated)
    previous = signal.signal(signal.SIGTERM, escaped)
    try:
        return main(list(argv))
    finally:
        assert signal.signal(signal.SIGTERM, previous) is escaped  # and lm's handler was put back
