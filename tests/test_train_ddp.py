"""DDP as one process sees it (audit "train", items 4 and 9): the trainer believes it is rank 0 of
two, and DDP wraps the model over a real one-process gloo group, so that the wrapping and the
collectives are torch's own; the other process's death is the error gloo raises then. One torchrun
case (slow) checks the same against a process that really dies."""

import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
from test_train import REPO, _raw_config, _write_toml

from lm.train import Trainer, config_from_dict
from lm.train.distributed import Dist
from lm.train.trainer import peer_stopped

# what rank 0 raised in the audit when rank 1 was killed (from the DDP all-reduce in backward)
GLOO_PEER_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                    "[127.0.0.1]:8335. This is typically caused by a remote worker crashing. Check the logs of the "
                    "remote worker before reporting an error.")


class _RankOfTwo(Dist):
    """Rank 0 of two as far as the trainer can tell; ``fail_at`` makes the agreement (an all-reduce)
    of that step or a later one raise ``error``, as the other rank's death would."""

    def __init__(self, trainer_of, fail_at=None, error=None):
        super().__init__(rank=0, local_rank=0, world_size=2)
        self.trainer_of, self.fail_at, self.error = trainer_of, fail_at, error

    def agree(self, flag, seconds, device):
        if self.fail_at is not None and self.trainer_of().step >= self.fail_at:
            raise self.error
        return super().agree(flag, seconds, device)


@pytest.fixture
def rank_of_two(tmp_path, monkeypatch):
    """``set_failure(step, error)``; the Trainers built then are rank 0 of two over a one-process group."""
    import lm.train.trainer as trainer_module

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    made, failure = [], {}
    real_init = Trainer.__init__

    def init(self, *args, **kwargs):
        made.append(self)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "__init__", init)
    monkeypatch.setattr(trainer_module, "init_distributed", lambda device: (
        _RankOfTwo(lambda: made[-1], failure.get("step"), failure.get("error")), torch.device("cpu")))
    yield lambda step, error: failure.update(step=step, error=error)
    if dist.is_initialized():  # a run shuts the group down itself
        dist.destroy_process_group()


def test_wrapping_for_ddp_emits_no_future_warning(tmp_path, rank_of_two):
    """torch 2.13 deprecates DDP's broadcast_buffers with a FutureWarning that each rank printed as an
    `lm train: warning:` line the user could do nothing about; forward_sync_buffers=False is the
    same: the constant buffers are not sent before each forward."""
    raw = _raw_config(tmp_path, train={"max_steps": 2}, eval={"interval": 0}, checkpoint={"interval": 0})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Trainer(config_from_dict(raw))
    assert isinstance(trainer.train_model, torch.nn.parallel.DistributedDataParallel)
    assert trainer.train_model.broadcast_buffers is False  # forward_sync_buffers, where torch has it
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)] == []
    assert trainer.run() == 0


def test_another_rank_stopping_is_one_line_naming_the_last_checkpoint(tmp_path, capsys, rank_of_two):
    """The survivor used to print a 25-line traceback ending in gloo's message."""
    from lm.cli import main

    rank_of_two(7, RuntimeError(GLOO_PEER_CLOSED))  # the agreement of step 10 fails: step 5 is saved
    raw = _raw_config(tmp_path, train={"max_steps": 20}, log={"interval": 100}, checkpoint={"interval": 5})
    rc = main(["train", "--config", str(_write_toml(tmp_path / "c.toml", raw)), "--quiet"])
    err = capsys.readouterr().err
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000005.pt"
    assert rc == 1 and err == ("lm train: error: another process of the run stopped (gloo: connection closed by "
                               f"peer); the last good checkpoint is {ckpt}; --resume continues from it\n"), err


def test_other_errors_keep_their_traceback(tmp_path, rank_of_two):
    """Only a lost peer is one line: any other error of a DDP run is raised as it was."""
    rank_of_two(3, RuntimeError("something else broke"))
    raw = _raw_config(tmp_path, train={"max_steps": 20}, log={"interval": 3}, checkpoint={"interval": 0})
    with pytest.raises(RuntimeError, match="^something else broke$"):
        Trainer(config_from_dict(raw)).run()


def test_a_lost_peer_is_told_apart_from_other_errors():
    assert peer_stopped(RuntimeError(GLOO_PEER_CLOSED)) == "another process of the run stopped (gloo: connection " \
        "closed by peer)"
    reset = "[../gloo/transport/tcp/pair.cc:598] Read error [127.0.0.1]:1234: Connection reset by peer"
    assert peer_stopped(RuntimeError(reset)) == "another process of the run stopped (gloo: connection reset by peer)"
    nccl = dist.DistBackendError("NCCL communicator was aborted on rank 0.\nmore")
    assert peer_stopped(nccl) == ("another process of the run stopped or cannot be reached (DistBackendError: NCCL "
                                  "communicator was aborted on rank 0.)")
    for other in (RuntimeError("Connection closed by peer"), ValueError(GLOO_PEER_CLOSED), RuntimeError("boom")):
        assert peer_stopped(other) is None


def test_a_lost_peer_in_one_process_is_not_taken_for_one(tmp_path):
    """Without DDP there is no other process: the same message keeps its traceback."""
    trainer = Trainer(config_from_dict(_raw_config(tmp_path, train={"max_steps": 3})))

    def fails(lr):
        raise RuntimeError(GLOO_PEER_CLOSED)

    trainer.train_step = fails
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        trainer.run()


DIES = """
import os, sys
from lm.cli import entry
from lm.train import Trainer

step = Trainer.train_step

def train_step(self, lr):  # rank 1 dies during step 7, after the checkpoint of step 5
    if self.dist.rank == 1 and self.step == 6:
        os._exit(1)
    return step(self, lr)

Trainer.train_step = train_step
sys.argv = ["lm", *sys.argv[1:]]
entry()
"""


DIES_AT_START = """
import os, sys
import torch
import lm.train.trainer  # noqa: F401 - it reads DDP's signature on import: the real one
from lm.cli import entry

ddp = torch.nn.parallel.DistributedDataParallel

def wrap(*args, **kwargs):  # rank 1 dies before DDP's first broadcast of the weights, inside Trainer()
    if int(os.environ["RANK"]) == 1:
        os._exit(1)
    return ddp(*args, **kwargs)

torch.nn.parallel.DistributedDataParallel = wrap
sys.argv = ["lm", *sys.argv[1:]]
entry()
"""


@pytest.mark.slow
def test_a_rank_dead_while_the_run_starts_is_one_line(tmp_path):
    """A peer that died while DDP wrapped the model (inside Trainer's constructor) gave rank 0 a gloo
    traceback: only the loop mapped a lost peer to one line. The two ranks are started as torchrun
    would (its environment), without torchrun, which would SIGTERM rank 0 once rank 1 failed."""
    from lm.serve.process import free_port

    script = tmp_path / "dies.py"
    script.write_text(DIES_AT_START)
    raw = _raw_config(tmp_path, train={"max_steps": 4}, log={"interval": 100})
    toml = _write_toml(tmp_path / "c.toml", raw)
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank)}
        procs.append(subprocess.Popen([sys.executable, str(script), "train", "--config", str(toml), "--quiet"],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out, err = procs[0].communicate(timeout=300)
    procs[1].communicate(timeout=60)
    assert procs[1].returncode == 1
    assert procs[0].returncode == 1 and err.count("\n") == 1, err[-6000:]
    assert err.startswith("lm train: error: another process of the run stopped (gloo: connection "), err
    assert err.endswith(" while the run was starting; no step was taken\n"), err
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())


@pytest.mark.slow
def test_under_torchrun_the_survivor_of_a_dead_rank_says_one_line(tmp_path):
    script = tmp_path / "dies.py"
    script.write_text(DIES)
    raw = _raw_config(tmp_path, train={"max_steps": 20}, log={"interval": 100}, checkpoint={"interval": 5})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script), "train", "--config", str(_write_toml(tmp_path / "c.toml", raw)), "--quiet"],
                          env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000005.pt"
    lines = [line for line in done.stderr.splitlines() if line.startswith(("lm train", "[rank"))]
    assert done.returncode != 0 and len(lines) == 1, done.stderr[-6000:]
    assert lines[0].startswith("lm train: error: another process of the run stopped (gloo: connection "), lines
    assert lines[0].endswith(f"peer); the last good checkpoint is {ckpt}; --resume continues from it"), lines
