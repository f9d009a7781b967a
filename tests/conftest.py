"""The shared fixtures; the helpers live in the tests/helpers package."""

import signal
from pathlib import Path

import pytest
from helpers.data import _test_data_dir


def pytest_configure(config):
    """Started from a shell's background job (``pytest ... &`` without job control), this process and
    every command it runs inherit SIGINT *ignored*, and Python then installs no KeyboardInterrupt
    handler: the tests that deliver a real Ctrl-C (mid-write of a token file, before its sidecar,
    in a deferred block) failed there with "DID NOT RAISE", while they passed from a terminal.
    The tests get the handler a terminal gives them; the commands they start, with SIGINT handled
    here, start with the default one."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def test_data() -> Path:
    """The shared real-text folder (GPT-2 vocab/merges, Gutenberg, TinyStories...); skips when unset."""
    d = _test_data_dir()
    if d is None:
        pytest.skip("LM_TEST_DATA is not set to a folder of reference data")
    return d


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """A test that runs a command in this process with ``--threads N`` (torch.set_num_threads) must
    not leave it set for the tests after it: the serving engine's slot-invariance probe, for one,
    finds other kernels at one thread than at two."""
    import torch

    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
