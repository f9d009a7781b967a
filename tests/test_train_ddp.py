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
from helpers.faults import raising
from test_train import REPO, _raw_config, _write_toml

from lm.train import Trainer, config_from_dict
from lm.train.distributed import Dist
from lm.train.trainer import PeerStopped, peer_stopped

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

    other_signal: tuple[int, int] | None = None  # (step, signal): the other rank heard it then

    def agree(self, signal, seconds, device):
        if self.fail_at is not None and self.trainer_of().step >= self.fail_at:
            raise self.error
        if self.other_signal is not None and self.trainer_of().step >= self.other_signal[0]:
            signal = max(signal, self.other_signal[1])  # what the all-reduce over both ranks would give
        return super().agree(signal, seconds, device)


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
    monkeypatch.setattr(trainer_module, "init_distributed", lambda device, timeout: (
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


def test_under_ddp_a_step_reduces_gradients_once_in_its_last_micro_batch(tmp_path, rank_of_two):
    """DDP all-reduces the gradients in every backward outside ``no_sync()``: the trainer reduces once
    a step, in its last micro-batch's backward, and the step's tokens are both ranks' (mutation:
    reducing in every micro-batch but the last, or in none, and the tokens divided by the world size
    survived; one process sees the same gradients either way). A comm hook sees each reduction."""
    raw = _raw_config(tmp_path, train={"max_steps": 2, "grad_accum_steps": 3}, eval={"interval": 0},
                      checkpoint={"interval": 0})
    trainer = Trainer(config_from_dict(raw), print_fn=lambda line: None)
    drawn, next_batch = [], trainer._next_batch
    trainer._next_batch = lambda: drawn.append(next_batch()) or drawn[-1]
    reduced_in = []  # the micro-batch (1, 2, 3) in whose backward each bucket was reduced

    def hook(state, bucket):
        reduced_in.append(len(drawn))
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    trainer.train_model.register_comm_hook(None, hook)
    for _ in range(2):
        drawn.clear()
        reduced_in.clear()
        trainer.train_step(1e-3)
        assert len(drawn) == 3 and reduced_in and set(reduced_in) == {3}
        assert trainer.step_tokens == 2 * sum(b.num_tokens for b in drawn)


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


def test_a_signal_to_another_rank_ends_this_one_with_its_status(tmp_path, monkeypatch, rank_of_two):
    """The ranks agreed only that a signal came, not which: after a SIGINT to rank 1, rank 0 saved and
    exited 143 (SIGTERM's), and torchrun reported the ranks with two statuses (ddp21). The agreement
    carries the signal's number: every rank stops at the same step and exits 128 + SIGINT."""
    import signal

    monkeypatch.setattr(_RankOfTwo, "other_signal", (6, int(signal.SIGINT)))
    raw = _raw_config(tmp_path, train={"max_steps": 50}, log={"interval": 2}, checkpoint={"interval": 0})
    trainer = Trainer(config_from_dict(raw), print_fn=lambda line: None)
    assert trainer.run() == 128 + signal.SIGINT
    assert trainer._signal is None  # this rank heard none
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [f"step_{trainer.step:08d}.pt"]
    assert 6 <= trainer.step < 50


def test_what_rank_zero_refuses_it_raises_itself_and_reads_no_further(tmp_path, rank_of_two):
    """A folder of another tool's files: rank 0 refuses it, tells the others, and raises its own refusal
    (mut31: with its failure dropped, rank 0 went on as the others do, reading and starting a run in
    a folder it had not checked or locked)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    with pytest.raises(ValueError) as refused:
        Trainer(config_from_dict(_raw_config(tmp_path, train={"max_steps": 2})), print_fn=lambda line: None)
    assert str(refused.value) == (f"train.out_dir: {str(run)!r} is not empty ('notes.txt') and holds no run of "
                                  "`lm train` (no config.toml, metrics.jsonl or checkpoints/); choose a new or empty "
                                  "folder")
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]


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
    # ddp8: a frozen peer (SIGSTOP) left the others waiting torch's 30 minutes, then a 30-line traceback
    frozen = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
              "1800000ms for recv operation to complete")
    assert peer_stopped(RuntimeError(frozen)) == ("another process of the run did not answer within 30m00s (gloo: "
                                                  "timed out waiting for a recv; train.dist_timeout sets the wait)")
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


def _two_ranks(script, toml) -> list[subprocess.Popen]:
    """`lm train --config TOML` as ranks 0 and 1 of two, through ``script``, each with the environment
    torchrun gives it, without torchrun (which would SIGTERM rank 0 once rank 1 failed)."""
    from lm.serve.process import free_port

    port = free_port()
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank)}
        procs.append(subprocess.Popen([sys.executable, str(script), "train", "--config", str(toml), "--quiet"],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


@pytest.mark.slow
def test_a_rank_dead_while_the_run_starts_is_one_line(tmp_path):
    """A peer that died while DDP wrapped the model (inside Trainer's constructor) gave rank 0 a gloo
    traceback: only the loop mapped a lost peer to one line. The two ranks are started as torchrun
    would (its environment), without torchrun, which would SIGTERM rank 0 once rank 1 failed."""
    script = tmp_path / "dies.py"
    script.write_text(DIES_AT_START)
    raw = _raw_config(tmp_path, train={"max_steps": 4}, log={"interval": 100})
    toml = _write_toml(tmp_path / "c.toml", raw)
    procs = _two_ranks(script, toml)
    out, err = procs[0].communicate(timeout=300)
    procs[1].communicate(timeout=60)
    assert procs[1].returncode == 1
    assert procs[0].returncode == 1 and err.count("\n") == 1, err[-6000:]
    assert err.startswith("lm train: error: another process of the run stopped (gloo: connection "), err
    assert err.endswith(" while the run was starting; no step was taken\n"), err
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())


FREEZES = """
import os, sys, time
from lm.cli import entry
from lm.train import Trainer

step = Trainer.train_step

def train_step(self, lr):  # rank 1 stops answering during step 7, after the checkpoint of step 5
    if self.dist.rank == 1 and self.step == 6:
        time.sleep(600)
    return step(self, lr)

Trainer.train_step = train_step
sys.argv = ["lm", *sys.argv[1:]]
entry()
"""


@pytest.mark.slow
def test_a_frozen_rank_is_waited_for_train_dist_timeout_then_named(tmp_path):
    """ddp8 checked the frozen peer's message against the text gloo gives after torch's 30 minutes;
    train.dist_timeout shortens the wait, so here it is a real one: 4 s, then one line."""
    script = tmp_path / "freezes.py"
    script.write_text(FREEZES)
    raw = _raw_config(tmp_path, train={"max_steps": 20, "dist_timeout": 4}, log={"interval": 100},
                      checkpoint={"interval": 5})
    toml = _write_toml(tmp_path / "c.toml", raw)
    procs = _two_ranks(script, toml)
    try:
        out, err = procs[0].communicate(timeout=300)
    finally:
        procs[1].kill()
        procs[1].communicate(timeout=60)
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000005.pt"
    assert procs[0].returncode == 1 and err.count("\n") == 1, err[-6000:]
    assert err == ("lm train: error: another process of the run did not answer within 4s (gloo: timed out waiting for "
                   f"a recv; train.dist_timeout sets the wait); the last good checkpoint is {ckpt}; --resume continues "
                   "from it\n"), err


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


# -- each rank's own dropout masks (audit misc4 #1) -----------------------------------------------


@pytest.fixture
def as_rank(tmp_path, monkeypatch):
    """``as_rank(rank, gather=None)``: the next Trainers are that rank of two over a one-process gloo
    group (DDP wraps the model for real); ``gather(value)`` stands for the other rank's side of the
    gather of RNG states at a checkpoint."""
    import itertools

    import lm.train.trainer as trainer_module

    groups = itertools.count()

    class Rank(Dist):
        def __init__(self, rank, gather):
            super().__init__(rank=rank, local_rank=rank, world_size=2)
            self._gather = gather

        def gather(self, value):
            return self._gather(value) if self.is_main else None

    def choose(rank, gather=None):
        if not dist.is_initialized():  # a run shuts its group down
            dist.init_process_group("gloo", init_method=f"file://{tmp_path / f'group{next(groups)}'}", rank=0,
                                    world_size=1)
        monkeypatch.setattr(trainer_module, "init_distributed",
                            lambda device, timeout: (Rank(rank, gather), torch.device("cpu")))

    yield choose
    if dist.is_initialized():
        dist.destroy_process_group()


def _first_dropout_mask(trainer, monkeypatch) -> torch.Tensor:
    """Where the first dropout of a training step (the embeddings') zeroes its input."""
    import lm.model.transformer as transformer

    masks, real = [], transformer.dropout

    def spy(x, p, training=True):
        out = real(x, p, training)
        masks.append(out == 0)
        return out

    monkeypatch.setattr(transformer, "dropout", spy)
    trainer.train_step(1e-3)
    monkeypatch.setattr(transformer, "dropout", real)
    return masks[0]


def test_each_rank_draws_its_own_dropout_masks_and_rank_0_draws_as_one_process(tmp_path, monkeypatch, as_rank):
    """Every rank seeded torch's generator with train.seed and drew from it in the same order, so
    row i of every rank's batch got the same dropout mask: the noise of a global batch was
    correlated across ranks. The model is still built under the shared seed (the same weights on
    every rank); then each rank other than 0 draws from a stream of its own. Rank 0 goes on with
    the shared stream, so one process (and rank 0 of any world) draws as it did."""
    def trainer(name, **kwargs):
        raw = _raw_config(tmp_path, model={"dropout": 0.5}, train={"out_dir": str(tmp_path / name), "max_steps": 2})
        return Trainer(config_from_dict(raw), print_fn=lambda *_: None, **kwargs)

    def built_and_stepped(name):
        t = trainer(name)
        weights, state = {k: v.clone() for k, v in t.model.state_dict().items()}, torch.get_rng_state()
        mask = _first_dropout_mask(t, monkeypatch)
        t._lock.release()
        return weights, state, mask

    one = built_and_stepped("one")  # before as_rank: one process
    as_rank(0, gather=lambda value: [value, value])
    zero = built_and_stepped("zero")
    as_rank(1)
    first = built_and_stepped("first")
    assert all(torch.equal(w, zero[0][k]) and torch.equal(w, first[0][k]) for k, w in one[0].items())  # the same model
    assert torch.equal(one[1], zero[1]) and torch.equal(one[2], zero[2])
    assert not torch.equal(first[1], zero[1]) and not torch.equal(first[2], zero[2])
    assert 0.4 < first[2].float().mean() < 0.6


def test_only_rank_0_measures_how_slowly_the_cpu_multiplies_bfloat16(tmp_path, monkeypatch, as_rank):
    """A bfloat16 run on a CPU without bfloat16 units says at its start how many times float32's time a
    bfloat16 product takes here (test_train_loop). The line is rank 0's, which alone prints; the other
    ranks neither measure (a fifth of a second each, on the cores rank 0 is timing on) nor say it."""
    import lm.device

    measured = []
    monkeypatch.setattr(lm.device, "cpu_has_bfloat16", lambda: False)
    monkeypatch.setattr(lm.device, "bfloat16_matmul_slowdown", lambda: measured.append(1) or 97.0)
    lines = {}
    for rank in (1, 0):
        as_rank(rank)
        raw = _raw_config(tmp_path, train={"out_dir": str(tmp_path / f"rank{rank}"), "dtype": "bfloat16"})
        trainer = Trainer(config_from_dict(raw), print_fn=lambda *_: None)
        trainer._lock.release()
        lines[rank] = trainer._slow_dtype_line
        assert len(measured) == (rank == 0), (rank, measured)  # rank 1 first: nothing measured yet
    assert lines == {1: "", 0: "train.dtype: a bfloat16 matrix product takes 97x the time of a float32 one on "
                               "this CPU (no bfloat16 units): float32 is faster here"}


def test_a_rank_s_seed_follows_train_seed_and_wraps_within_the_generator_s_32_bits():
    """Rank r seeds its generator with train.seed's 32-bit seed plus r: rank 0 keeps the stream of
    train.seed, every seed gives rank 1 a stream of its own, and the sum wraps within 32 bits."""
    from lm.generate.sampling import generator_seed
    from lm.train.trainer import rank_seed

    assert [rank_seed(s, 0) for s in (0, 7, 2**32 - 1)] == [0, 7, 2**32 - 1]
    assert [rank_seed(s, 1) for s in range(8)] == list(range(1, 9))
    assert rank_seed(2**32 - 1, 1) == 0 and rank_seed(2**32 - 2, 3) == 1
    high = 2**40 + 7  # folded first, as the model's own seed is
    assert rank_seed(high, 2) == generator_seed(high) + 2 and generator_seed(high) + 2 < 2**32


def test_a_ddp_checkpoint_holds_every_rank_s_rng_state_and_each_rank_resumes_its_own(tmp_path, monkeypatch,
                                                                                         as_rank):
    """With the ranks' streams apart, rank 0's RNG state alone cannot resume the others: the
    checkpoint holds each rank's (gathered to rank 0) as rng_by_rank, and each rank resumes its
    own. A checkpoint with "rng" alone (one process, or lm before rng_by_rank) gives rank 0 its
    state and leaves the other ranks on the stream of their rank, as a new run's."""
    from lm.checkpoint import read_checkpoint
    from lm.checkpoint.io import write_checkpoint
    from lm.checkpoint.rng import get_rng_state

    torch.manual_seed(12345)
    other = get_rng_state()  # what rank 1 sends at each checkpoint
    raw = _raw_config(tmp_path, model={"dropout": 0.5}, train={"max_steps": 4}, checkpoint={"interval": 2})
    as_rank(0, gather=lambda value: [value, other])
    assert Trainer(config_from_dict(raw), print_fn=lambda *_: None).run() == 0
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000004.pt"
    state = read_checkpoint(ckpt)
    assert [set(s) for s in state["rng_by_rank"]] == [set(state["rng"])] * 2
    assert torch.equal(state["rng_by_rank"][0]["torch"], state["rng"]["torch"])
    assert torch.equal(state["rng_by_rank"][1]["torch"], other["torch"])
    assert state["rng_by_rank"][1]["python"] == other["python"]

    raw["train"]["max_steps"] = 6

    def resumed_state(rank):
        as_rank(rank, gather=lambda value: [value, value])
        trainer = Trainer(config_from_dict(raw), resume=True, print_fn=lambda *_: None)
        trainer._lock.release()
        return torch.get_rng_state()

    assert torch.equal(resumed_state(0), state["rng"]["torch"])
    assert torch.equal(resumed_state(1), other["torch"])

    # an older checkpoint: "rng" alone
    state.pop("rng_by_rank"), state.pop("format"), state.pop("version")
    write_checkpoint(state, ckpt)
    as_rank(1)
    fresh = {**raw, "train": {**raw["train"], "out_dir": str(tmp_path / "fresh")}}
    Trainer(config_from_dict(fresh), print_fn=lambda *_: None)
    rank_1_stream = torch.get_rng_state()
    assert torch.equal(resumed_state(0), state["rng"]["torch"])
    assert torch.equal(resumed_state(1), rank_1_stream)


MASKS = """
import os, sys
import lm.model.transformer as transformer
from lm.cli import entry

real = transformer.dropout

def spy(x, p, training=True):  # the first dropout mask of this rank, written to MASKS/RANK
    out = real(x, p, training)
    path = os.path.join(os.environ["MASKS"], os.environ.get("RANK", "one"))
    if training and not os.path.exists(path):
        with open(path, "w") as f:
            f.write("".join("1" if z else "0" for z in (out == 0).flatten().tolist()))
    return out

transformer.dropout = spy
sys.argv = ["lm", *sys.argv[1:]]
entry()
"""


@pytest.mark.slow
def test_two_gloo_processes_draw_their_own_masks_and_resume_bitwise(tmp_path):
    """Under torchrun, the two ranks' first dropout masks differ (they were equal), rank 0's is one
    process's, and a run stopped at step 3 and resumed (each rank from its own RNG state) ends
    bitwise where the uninterrupted run does."""
    from test_train import _assert_same_run

    script, masks = tmp_path / "masks.py", tmp_path / "masks"
    script.write_text(MASKS)
    masks.mkdir()

    def config(name, steps):
        raw = _raw_config(tmp_path, model={"dropout": 0.5}, train={"out_dir": str(tmp_path / name), "max_steps": steps},
                          optim={"cosine_cycle_iters": 6}, eval={"interval": 3},
                          checkpoint={"interval": 3, "keep_last": 0})  # fmt: skip
        return str(_write_toml(tmp_path / f"{name}.toml", raw))

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "MASKS": str(masks)}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    for cmd in ([sys.executable, str(script), "train", "--config", config("one", 1)],
                [*torchrun, str(script), "train", "--config", config("straight", 6)],
                [*torchrun, "-m", "lm", "train", "--config", config("stopped", 3)],
                [*torchrun, "-m", "lm", "train", "--config", config("stopped", 3), "--resume",
                 "--set", "train.max_steps=6"]):  # fmt: skip
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    one, zero, first = ((masks / name).read_text() for name in ("one", "0", "1"))
    assert zero == one and first != zero and len(first) == len(zero) == 4 * 16 * 32
    _assert_same_run(tmp_path / "straight", tmp_path / "stopped", 6)


# -- the environment torchrun sets (audit misc4 #7) -----------------------------------------------


@pytest.mark.parametrize("env, message", [
    ({"WORLD_SIZE": "2"}, "RANK: not set, but WORLD_SIZE is '2'; "),
    ({"WORLD_SIZE": "x"}, "WORLD_SIZE: 'x' is not a whole number >= 1; "),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE: '0' is not a whole number >= 1; "),
    ({"WORLD_SIZE": "2", "RANK": "5"}, "RANK: '5' is not below WORLD_SIZE 2 (ranks are 0 to 1); "),
    ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK: '2' is not below WORLD_SIZE 2 (ranks are 0 to 1); "),  # (seed 14)
    ({"WORLD_SIZE": "2", "RANK": "one"}, "RANK: 'one' is not a whole number >= 0; "),
    ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "-1"}, "LOCAL_RANK: '-1' is not a whole number >= 0; "),
])  # fmt: skip
def test_a_bad_torchrun_environment_is_one_line_naming_the_variable(tmp_path, capsys, monkeypatch, env, message):
    """WORLD_SIZE without RANK was a KeyError traceback, a garbled one "invalid literal for int()",
    naming nothing, and a RANK outside the world waited in the rendezvous until it timed out."""
    from lm.cli import main

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    toml = _write_toml(tmp_path / "c.toml", _raw_config(tmp_path, train={"max_steps": 2}))
    rc = main(["train", "--config", str(toml), "--quiet"])
    assert (rc, capsys.readouterr().err) == (2, f"lm train: error: {message}start the processes with torchrun (which "
                                                "sets WORLD_SIZE, RANK and LOCAL_RANK), or unset WORLD_SIZE\n")
    assert not (tmp_path / "run").exists()


def test_a_config_error_is_said_once_per_machine_under_torchrun(tmp_path, capsys, monkeypatch):
    """Every process of a torchrun printed the same config error: now the process of local rank 0
    alone says it, the others exit with the same status in silence."""
    from lm.cli import main

    toml = _write_toml(tmp_path / "c.toml", _raw_config(tmp_path))
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, err in ((1, ""), (0, "lm train: error: config: train.max_steps must be > 0, got -3\n")):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        assert main(["train", "--config", str(toml), "--set", "train.max_steps=-3"]) == 2
        assert capsys.readouterr().err == err


# -- refusals decided once, by rank 0 (audit ddp8 #4, #6) --------------------------------------------


@pytest.mark.slow
def test_under_torchrun_a_refusal_is_said_once_in_rank_zeros_words(tmp_path):
    """A second torchrun on a folder in use printed two errors, rank 1's first and false ("stopped
    before its first checkpoint; pass --resume", read from a folder rank 0 had not locked for it);
    a missing data file and a run that needs --resume were printed once a process. Rank 0 now
    decides and says it; the others stop with exit 2 and say nothing."""
    from lm.train.run_dir import RunLock

    raw = _raw_config(tmp_path, train={"max_steps": 2})
    toml = str(_write_toml(tmp_path / "c.toml", raw))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                "-m", "lm", "train", "--config", toml, "--quiet"]

    def errors(*extra):
        done = subprocess.run([*torchrun, *extra], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode != 0, done.stderr[-3000:]
        return [line for line in done.stderr.splitlines() if line.startswith(("lm train", "[rank"))]

    (tmp_path / "run").mkdir()
    lock = RunLock(tmp_path / "run")
    lock.acquire(lambda *_: None)  # another `lm train` (this process) holds the folder
    try:
        lines = errors()
    finally:
        lock.release()
    assert len(lines) == 1 and lines[0].startswith(f"lm train: error: train.out_dir: {str(tmp_path / 'run')!r} is in "
                                                    "use by another `lm train` (pid "), lines
    lines = errors("--set", f"data.train='{tmp_path / 'nothing.bin'}'")
    assert len(lines) == 1 and "nothing.bin" in lines[0], lines
    done = subprocess.run(torchrun, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = errors()  # the run is done: again only with --resume
    assert len(lines) == 1 and "already holds a run; pass --resume" in lines[0], lines
    # a diverged run: the gradient norm and losses are all-reduced, the same line on every rank
    lines = errors("--set", f"train.out_dir='{tmp_path / 'diverged'}'", "--set", "optim.max_lr=1e30",
                   "--set", "optim.grad_clip=0", "--set", "train.max_steps=20", "--set", "log.interval=5")
    assert len(lines) == 1 and " became " in lines[0], lines


@pytest.mark.parametrize("name", ["cuda", "auto"])
def test_more_processes_than_gpus_is_said_as_such(monkeypatch, name):
    """ddp8: rank 1 of two on a one-GPU machine said "'cuda' is not available on this machine
    (available: cpu, cuda:0)", contradicting itself ('auto' said the same of a 'cuda' never typed)."""
    from lm.device import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError) as e:
        resolve_device(name, "train.device", local_rank=1)
    assert str(e.value) == (f"train.device: {name!r} is the local rank's GPU, cuda:1 for LOCAL_RANK 1, but this "
                            "machine has 1 (available: cpu, cuda:0); start at most 1 process per machine (torchrun "
                            "--nproc_per_node)")


def test_a_peer_that_never_joins_is_one_line_after_train_dist_timeout(tmp_path):
    """One process of a world of two whose peer never starts (or is frozen before the group forms) waited
    train.dist_timeout, then printed torch's DistStoreError in a 40-line traceback (ddp21), where a peer lost
    later is one line. Now: one line naming the wait, exit 1, no run folder made."""
    import socket

    toml = _write_toml(tmp_path / "c.toml", _raw_config(tmp_path, train={"max_steps": 2, "dist_timeout": 2.0}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "lm", "train", "--config", str(toml), "--quiet"], env=env,
                       capture_output=True, text=True, timeout=120)
    err = "\n".join(line for line in r.stderr.splitlines() if not line.startswith(("[W", "W1")))  # torch's own log
    assert r.returncode == 1, r.stderr
    assert err.startswith("lm train: error: the processes of the run did not all join within 2s (train.dist_timeout; "
                          "DistStoreError: ") and err.endswith("); no step was taken") and "\n" not in err, r.stderr
    assert not (tmp_path / "run").exists()


def _join_config(wait: float | None = None):
    """A config for Trainer._join alone (nothing is read or trained): train.dist_timeout ``wait``."""
    return config_from_dict({"model": dict(vocab_size=300, context_length=16, d_model=32, num_layers=2, num_heads=2,
                                           d_ff=64),
                             "data": dict(train="unused.bin"),
                             "train": {"max_steps": 1, **({} if wait is None else {"dist_timeout": wait})}})


@pytest.mark.parametrize("error, wait, expected", [
    (dist.DistStoreError("Timed out after 3 seconds waiting for clients. 1/2 clients joined.\nmore"), 2.0,
     (PeerStopped, "the processes of the run did not all join within 2s (train.dist_timeout; DistStoreError: Timed "
                   "out after 3 seconds waiting for clients. 1/2 clients joined.); no step was taken")),
    (dist.DistStoreError("w" * 300), 60.0,  # torch's first line, cut at 200 characters
     (PeerStopped, f"the processes of the run did not all join within 1m00s (train.dist_timeout; DistStoreError: "
                   f"{'w' * 200}); no step was taken")),
    (dist.DistStoreError(""), None,
     (PeerStopped, "the processes of the run did not all join within torch's default wait (train.dist_timeout; "
                   "DistStoreError: ); no step was taken")),
    (dist.DistNetworkError("The server socket has failed to listen on any local network address.\nport 29511"), 20.0,
     (ValueError, "MASTER_PORT: the processes of the run cannot meet at 10.0.0.7:29511 (DistNetworkError: The server "
                  "socket has failed to listen on any local network address.); another run may hold the port: give "
                  "torchrun another --master-port (or --rdzv-endpoint)")),
])
def test_a_failed_join_is_one_line_naming_the_wait_or_the_port(monkeypatch, error, wait, expected):
    """The two process tests around this one, in this process (where mutation testing sees them): the
    rendezvous's own errors are one line, the port's naming MASTER_ADDR:MASTER_PORT, the wait's naming
    train.dist_timeout (or torch's default) and the first line of torch's words; any other error is
    raised as it is."""
    import lm.train.trainer as trainer_module

    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")
    monkeypatch.setenv("MASTER_PORT", "29511")
    cfg = _join_config(wait)

    def fails(device, timeout):
        assert timeout == wait
        raise error

    monkeypatch.setattr(trainer_module, "init_distributed", fails)
    kind, message = expected
    with pytest.raises(kind) as raised:
        Trainer._join(cfg)
    assert type(raised.value) is kind and str(raised.value) == message
    for other in (RuntimeError("gloo: something else"), ValueError("WORLD_SIZE: not a number")):
        monkeypatch.setattr(trainer_module, "init_distributed", raising(other))
        with pytest.raises(type(other)) as raised:
            Trainer._join(cfg)
        assert raised.value is other


def test_a_port_that_cannot_be_met_without_master_addr_or_port_says_question_marks(monkeypatch):
    """torchrun sets MASTER_ADDR and MASTER_PORT; a process group started otherwise (an env:// of one's
    own) may lack them, and the port's line then shows ``?:?`` rather than nothing or a stale value."""
    import lm.train.trainer as trainer_module

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.setattr(trainer_module, "init_distributed", raising(dist.DistNetworkError("no listen\nmore")))
    with pytest.raises(ValueError) as e:
        Trainer._join(_join_config())
    assert str(e.value) == ("MASTER_PORT: the processes of the run cannot meet at ?:? (DistNetworkError: no listen); "
                            "another run may hold the port: give torchrun another --master-port (or --rdzv-endpoint)")


def test_a_port_in_use_is_named_not_taken_for_a_peer_that_did_not_join(tmp_path):
    """The port of the rendezvous held by another process fails at once with torch's DistNetworkError,
    which the join's one line had reported as "the processes of the run did not all join within 20s"
    (review21): a frozen peer, where the port is at fault. It names MASTER_PORT, exit 2."""
    import socket

    toml = _write_toml(tmp_path / "c.toml", _raw_config(tmp_path, train={"max_steps": 2, "dist_timeout": 20.0}))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "PYTHONPATH": str(REPO)}
        r = subprocess.run([sys.executable, "-m", "lm", "train", "--config", str(toml), "--quiet"], env=env,
                           capture_output=True, text=True, timeout=120)
    err = "\n".join(line for line in r.stderr.splitlines() if not line.startswith(("[W", "W1")))
    assert r.returncode == 2, r.stderr
    assert err.startswith(f"lm train: error: MASTER_PORT: the processes of the run cannot meet at 127.0.0.1:{port} "
                          "(DistNetworkError: ") and err.endswith("give torchrun another --master-port (or "
                                                                  "--rdzv-endpoint)") and "\n" not in err, r.stderr
    assert not (tmp_path / "run").exists()


def test_the_process_group_is_joined_with_the_devices_backend_and_the_ranks_torchrun_gives(monkeypatch):
    """Under torchrun (WORLD_SIZE 4, RANK 3, LOCAL_RANK 1 here) the process joins with gloo on a CPU
    and nccl on a GPU, within train.dist_timeout when given, and its Dist holds the three numbers in
    their places; a device that cannot be used is named as train.device. (Mutation: the backend
    left to torch or chosen for every device alike, the rank dropped or None, and the device's
    argument name, survived: the tests in this process replace init_distributed whole.)"""
    import datetime

    import lm.train.distributed as distributed

    # one process (no torchrun): the device's errors name train.device too (seed 14: misnamed there survived)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError) as e:
        distributed.init_distributed("cpu:1")
    assert str(e.value).startswith("train.device: unknown device 'cpu:1'; use auto, cpu, cuda, cuda:N or mps (here: ")
    for name, value in {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    joined = []
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda **kwargs: joined.append(kwargs))
    assert distributed.torchrun_env() == Dist(rank=3, local_rank=1, world_size=4)
    assert distributed.init_distributed("cpu", 20.0) == (Dist(3, 1, 4), torch.device("cpu"))
    assert joined == [{"backend": "gloo", "timeout": datetime.timedelta(seconds=20)}]
    with pytest.raises(ValueError) as e:
        distributed.init_distributed("cpu:1")
    assert str(e.value).startswith("train.device: unknown device 'cpu:1'; use auto, cpu, cuda, cuda:N or mps (here: ")
    picked = []
    monkeypatch.setattr(distributed, "resolve_device", lambda name, argument, local_rank=0: picked.append(
        (name, argument, local_rank)) or torch.device("cuda", local_rank))
    joined.clear()
    assert distributed.init_distributed("cuda") == (Dist(3, 1, 4), torch.device("cuda", 1))
    assert joined == [{"backend": "nccl"}] and picked == [("cuda", "train.device", 1)]
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)  # joined already: not again
    assert distributed.init_distributed("cuda") == (Dist(3, 1, 4), torch.device("cuda", 1)) and len(joined) == 1


def test_the_collectives_of_rank_0_of_two_over_a_one_process_group(tmp_path):
    """The reductions the trainer takes over its ranks, run by torch over a one-process gloo group
    while the Dist says two: the group's sum is this process's values alone, the mean that sum over
    the world's two; the agreement carries the seconds in float64 (0.1 exactly, not float32's
    0.10000000149); the gather has a slot for each rank. With one process each is the value itself.
    (Mutation: the mean multiplied, the agreement in float32, and the gather's test inverted,
    survived.)"""
    t = torch.tensor([4.0, 6.0])
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    try:
        two = Dist(rank=0, local_rank=0, world_size=2)
        assert two.enabled and two.is_main
        total = two.all_sum(t)
        assert torch.equal(total, t) and total is not t
        assert torch.equal(two.all_mean(t), torch.tensor([2.0, 3.0])) and torch.equal(t, torch.tensor([4.0, 6.0]))
        assert two.agree(15, 0.1, torch.device("cpu")) == (15, 0.1)
        assert two.gather("mine") == ["mine", None]
        assert two.broadcast_object({"step": 7}) == {"step": 7}
        two.barrier()
    finally:
        dist.destroy_process_group()
    one = Dist()
    assert not one.enabled and one.is_main and not Dist(rank=1, world_size=2).is_main
    assert one.all_sum(t) is t and one.all_mean(t) is t and one.agree(2, 0.5, torch.device("cpu")) == (2, 0.5)
    assert one.gather("mine") == ["mine"] and one.broadcast_object(t) is t
    assert two.broadcast_object(t) is t  # no process group now: rank 0's value is this one
