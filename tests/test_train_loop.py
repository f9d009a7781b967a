"""The training loop keeps a GPU busy, shown on the CPU: the host reads the device only at log,
evaluation and checkpoint steps; DDP agrees on signals and time at poll steps only; every matmul
runs in bfloat16 under bfloat16 autocast; the traced forward has no graph breaks."""

import signal

import pytest
import torch
from helpers.host_reads import HostReads
from test_train import _quiet, _raw_config
from torch.utils._python_dispatch import TorchDispatchMode

from lm.data.batch import LMBatch
from lm.train import Trainer, TrainingDiverged, config_from_dict, read_metrics
from lm.train.distributed import Dist
from lm.train.trainer import POLL_STEPS


def test_the_loop_reads_the_device_only_at_log_eval_and_checkpoint_steps(tmp_path):
    raw = _raw_config(tmp_path, train={"max_steps": 24}, log={"interval": 8}, eval={"interval": 12},
                      checkpoint={"interval": 12})  # fmt: skip
    trainer = Trainer(config_from_dict(raw), print_fn=_quiet)
    with HostReads(label=lambda name: trainer.step) as reads:  # the step at which each read happens
        assert trainer.run() == 0
    assert reads.reads and set(reads.reads) <= {8, 12, 16, 24}, sorted(set(reads.reads))


class _CountingDist(Dist):
    """Two ranks as far as the trainer can tell, in one process: each agreement is recorded and
    answers with this process's own values (the other rank agrees with everything); every
    collective is recorded with its step and the device of its tensor."""

    def __init__(self):
        super().__init__(rank=0, local_rank=0, world_size=2)
        self.polls, self.collectives = [], []

    def agree(self, signal, seconds, device):
        self.polls.append((self.trainer.step, bool(signal)))
        self.collectives.append(("agree", self.trainer.step, device))
        return signal, seconds

    def all_mean(self, value):
        self.collectives.append(("all_mean", self.trainer.step, value.device))
        return value

    def gather(self, value):  # an object collective (the RNG states at a checkpoint): the other rank's is ours
        return [value] * self.world_size

    def barrier(self):
        pass


def _poll_trainer(tmp_path, checkpoint: int = 0, **train):
    raw = _raw_config(tmp_path, train={"max_steps": 40, **train}, log={"interval": 25}, eval={"interval": 0},
                      checkpoint={"interval": checkpoint})  # fmt: skip
    trainer = Trainer(config_from_dict(raw), print_fn=_quiet)
    trainer.dist = _CountingDist()
    trainer.dist.trainer = trainer
    return trainer


def test_ddp_agrees_on_signals_and_time_at_poll_steps_only(tmp_path):
    """One agreement (one all-reduce) per POLL_STEPS steps, at the log steps and at the first step
    (which measures a step's time), not per step. (Steps of 10 ms on the trainer's clock: on a loaded
    machine real steps took long enough to poll more often.)"""
    trainer = _poll_trainer(tmp_path)
    ticks = iter(range(1_000_000))
    trainer.clock = lambda: next(ticks) * 0.01
    assert trainer.run() == 0
    assert [s for s, _ in trainer.dist.polls] == sorted({1, *range(POLL_STEPS, 41, POLL_STEPS), 25})


@pytest.mark.parametrize("step_seconds, polls", [
    (0.05, [1, 10, 20, 25, 30, 37]),  # 10 steps are 0.5 s: every POLL_STEPS (and the last step, 37)
    (0.5, [1, 4, 8, 12, 16, 20, 24, 25, 28, 32, 36, 37]),  # POLL_SECONDS is 4 steps
    (4.0, list(range(1, 38))),  # every step
])
def test_ddp_polls_slow_steps_within_seconds_and_at_the_last_step(tmp_path, step_seconds, polls):
    """ddp8: with steps of 4 s a SIGTERM waited up to 10 steps (40 s) for the next agreement, and
    torchrun kills its workers 30 s after its own SIGTERM: the stop's checkpoint was never written.
    Polls now come about every POLL_SECONDS of agreed training time. And the last step by
    max_steps (37, no multiple of anything) agreed on nothing: the time of the steps after the
    last poll was missing from the final record and checkpoint (a 7-step run logged 2.1 s where
    one process logged 3.6 s)."""
    trainer = _poll_trainer(tmp_path, max_steps=37)
    ticks = iter(range(1_000_000))
    trainer.clock = lambda: next(ticks) * step_seconds  # read once a step
    assert trainer.run() == 0
    assert [s for s, _ in trainer.dist.polls] == polls
    assert trainer.elapsed == pytest.approx(37 * step_seconds)
    last = [r for r in read_metrics(tmp_path / "run") if r.get("split") == "train"][-1]
    assert last["step"] == 37 and last["time"] == pytest.approx(37 * step_seconds, abs=1e-3)


def test_ddp_signal_stops_every_rank_at_the_next_poll(tmp_path):
    """A signal on some rank is acted on at the next poll step, where every rank learns of it."""
    trainer = _poll_trainer(tmp_path / "a")
    ticks = iter(range(1_000_000))
    trainer.clock = lambda: next(ticks) * 0.01  # steps of 10 ms: polls every POLL_STEPS
    train_step = trainer.train_step

    def signalled_at_step_3(lr):
        if trainer.step == 2:
            signal.raise_signal(signal.SIGTERM)  # the run's own handler: stop at the next agreement
        return train_step(lr)

    trainer.train_step = signalled_at_step_3
    assert trainer.run() == 128 + signal.SIGTERM
    assert trainer.step == POLL_STEPS and trainer.dist.polls == [(1, False), (POLL_STEPS, True)]
    assert (tmp_path / "a" / "run" / "checkpoints" / f"step_{POLL_STEPS:08d}.pt").is_file()


def test_ddp_time_budget_is_checked_at_poll_steps_with_the_agreed_clock(tmp_path):
    """Under DDP a rank's time is added at poll steps only, so every rank sees the same
    ``elapsed`` and the same last step; one process adds it at every step."""
    for ddp in (True, False):
        folder = tmp_path / str(ddp)
        folder.mkdir()
        raw = _raw_config(folder, train={"max_time": 1.0}, optim={"cosine_cycle_iters": 32}, log={"interval": 25},
                          eval={"interval": 0}, checkpoint={"interval": 0})  # fmt: skip
        del raw["train"]["max_steps"]
        trainer = Trainer(config_from_dict(raw), print_fn=_quiet)
        if ddp:
            trainer.dist = _CountingDist()
            trainer.dist.trainer = trainer
        ticks = iter(range(1_000_000))
        trainer.clock = lambda ticks=ticks: next(ticks) / 16  # each step 1/16 s: the budget ends after step 16
        assert trainer.run() == 0
        assert trainer.step == (20 if ddp else 16) and trainer.elapsed == trainer.step / 16


def test_a_non_finite_validation_loss_stops_every_rank_with_no_collective_on_a_host_tensor(tmp_path):
    """The validation loss is averaged over ranks on the device, then each rank, holding the same
    mean, stops with TrainingDiverged: no further collective (under nccl one on a tensor of the
    host fails with a RuntimeError instead of exit 3; gloo would accept it, so the devices of the
    collectives are what is checked), and the last good checkpoint kept."""
    raw = _raw_config(tmp_path, train={"max_steps": 40}, log={"interval": 5}, eval={"interval": 10},
                      checkpoint={"interval": 10})  # fmt: skip
    trainer = Trainer(config_from_dict(raw), print_fn=_quiet)
    trainer.dist = _CountingDist()
    trainer.dist.trainer = trainer
    forward = trainer.model.forward

    def nan_when_evaluating_from_step_20(*args, **kwargs):
        loss = forward(*args, **kwargs)
        return loss * float("nan") if not trainer.model.training and trainer.step >= 20 else loss

    trainer.model.forward = nan_when_evaluating_from_step_20
    with pytest.raises(TrainingDiverged, match="the validation loss became nan at step 20; the last good checkpoint"):
        trainer.run()
    assert trainer.dist.collectives[-1] == ("all_mean", 20, trainer.device)  # the evaluation's own mean
    assert {device for _, _, device in trainer.dist.collectives} == {trainer.device}
    assert (tmp_path / "run" / "checkpoints" / "step_00000010.pt").is_file()


_MATMULS = {
    "mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_", "matmul", "linear", "addmv", "mv", "dot",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_attention_math",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
}  # fmt: skip


class _MatmulDtypes(TorchDispatchMode):
    """The dtypes of the tensor inputs of every matrix product dispatched (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _MATMULS or name.startswith("_scaled_dot_product") and "backward" in name:
            # flash attention's saved logsumexp is float32 by design: not an operand of a product
            names = [a.name for a in func._schema.arguments]
            dtypes = {a.dtype for n, a in zip(names, args) if isinstance(a, torch.Tensor) and a.is_floating_point()
                      and n != "logsumexp"}  # fmt: skip
            self.seen.append((name, dtypes))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("attn_impl", ["sdpa", "einsum"])
def test_every_matmul_of_a_bfloat16_training_step_is_in_bfloat16(tmp_path, attn_impl):
    """Under bfloat16 autocast no matrix product of the step runs in float32: attention, the
    MLP, and the fused loss's three (logits, the input's and lm_head's weight gradients)."""
    raw = _raw_config(tmp_path, train={"dtype": "bfloat16"}, model={"attn_impl": attn_impl})
    trainer = Trainer(config_from_dict(raw), print_fn=_quiet)
    trainer.train_step(1e-3)
    with _MatmulDtypes() as log:
        trainer.train_step(1e-3)
    assert len(log.seen) > 10
    in_float32 = [(name, dtypes) for name, dtypes in log.seen if dtypes != {torch.bfloat16}]
    assert not in_float32


def test_the_training_and_evaluation_forwards_trace_without_graph_breaks(tmp_path):
    """torch._dynamo.explain of what the trainer compiles: the training forward (the batch's fused
    loss) and the evaluation forward (no grad, eval mode) are one graph each."""
    raw = _raw_config(tmp_path, model={"dropout": 0.1})
    trainer = Trainer(config_from_dict(raw), print_fn=_quiet)
    x, y = trainer.train_data.sample(4, trainer.device)
    torch._dynamo.reset()
    train = torch._dynamo.explain(trainer.model)(batch=LMBatch(x, y))
    assert (train.graph_count, train.graph_break_count) == (1, 0), train.break_reasons
    trainer.model.eval()
    with torch.no_grad():
        evaluation = torch._dynamo.explain(trainer.model)(x, targets=y)
    assert (evaluation.graph_count, evaluation.graph_break_count) == (1, 0), evaluation.break_reasons


@pytest.mark.slow
def test_compile_is_reported_apart_and_no_evaluation_compiles(tmp_path):
    """With train.compile the evaluation graph is compiled before the first step, and that step's
    time is reported as compile time (a "compile" record) and left out of the training time and
    tokens/s; no step or evaluation after it compiles anything."""
    import torch._dynamo.utils as dynamo_utils

    raw = _raw_config(tmp_path, train={"compile": True, "max_steps": 4}, eval={"interval": 2})
    trainer = Trainer(config_from_dict(raw), print_fn=_quiet)
    graphs = []
    train_step = trainer.train_step

    def counted(lr):
        graphs.append(dynamo_utils.counters["stats"]["unique_graphs"])
        return train_step(lr)

    trainer.train_step = counted
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    assert trainer.run() == 0
    graphs.append(dynamo_utils.counters["stats"]["unique_graphs"])
    assert graphs[0] == 1 and graphs[1] == 2 and len(set(graphs[1:])) == 1, graphs  # eval, then train; no more
    records = read_metrics(tmp_path / "run")
    compiles = [r for r in records if r["split"] == "compile"]
    assert len(compiles) == 1 and compiles[0]["step"] == 1 and compiles[0]["seconds"] > 0
    train = {r["step"]: r for r in records if r["split"] == "train"}
    assert train[1]["tok_per_s"] is None and train[2]["tok_per_s"] > 0
    assert trainer.elapsed < compiles[0]["seconds"]


@pytest.mark.parametrize("pairs", [False, True])
def test_compile_bookkeeping_with_torch_compile_as_the_identity(tmp_path, monkeypatch, pairs):
    """What train.compile changes around the compiled model, checked in seconds (the compiled runs
    are slow tests, which mutation testing does not run): torch.compile is asked once, with symbolic
    sizes for pair batches only; token windows' evaluation batch runs once before the first step; the
    first step's time (0.5 s on the trainer's clock) is a "compile" record and line, not training time,
    so neither the run's time nor tokens/s counts it, and the later steps' times are counted."""
    from test_seq2seq_train import _config, _data

    calls = []

    def identity(model, **kwargs):
        calls.append(kwargs)
        return model

    monkeypatch.setattr(torch, "compile", identity)
    if pairs:
        _data(tmp_path)
        raw = _config(tmp_path, "run", max_steps=4, compile=True)
        raw["eval"] = {"interval": 2, "batches": 2}
    else:
        raw = _raw_config(tmp_path, train={"compile": True, "max_steps": 4}, eval={"interval": 2, "batches": 2},
                          checkpoint={"interval": 0})
    lines = []
    trainer = Trainer(config_from_dict(raw), print_fn=lines.append)
    ticks = iter(range(1_000_000))
    trainer.clock = lambda: next(ticks) * 0.5  # read at the loop's start and twice a step: 0.5 s a step
    evaluated_at, val_loss = [], trainer._val_loss
    trainer._val_loss = lambda starts: (evaluated_at.append(trainer.step), val_loss(starts))[1]
    assert trainer.run() == 0
    assert calls == [{"dynamic": True if pairs else None}]
    assert evaluated_at == ([] if pairs else [0, 2, 2, 4, 4])  # windows: one batch before step 1, then 2 at each
    what = "the first step" if pairs else "the first step and an evaluation batch"
    assert f"compiled in 0.5 s ({what}; not counted as training time)" in lines
    records = read_metrics(tmp_path / "run")
    assert [r for r in records if r["split"] == "compile"] == [{"step": 1, "split": "compile", "seconds": 0.5}]
    train = {r["step"]: r for r in records if r["split"] == "train"}
    assert [train[s]["time"] for s in (1, 2, 3, 4)] == [0.0, 0.5, 1.0, 1.5] and trainer.elapsed == 1.5
    assert train[1]["tok_per_s"] is None and train[2]["tok_per_s"] == (train[2]["tokens"] - train[1]["tokens"]) / 0.5
    assert "compile step" in next(line for line in lines if line.startswith("step 1/4"))


@pytest.mark.parametrize("signum, checkpoint_on_signal, ddp, line", [
    (signal.SIGTERM, True, False, "SIGTERM: saving a checkpoint after this step (again to abort)"),
    (signal.SIGINT, False, False, "SIGINT: stopping after this step (again to abort)"),
    (signal.SIGTERM, True, True,
     f"SIGTERM: saving a checkpoint once every process has heard, within {POLL_STEPS} steps (again to abort)"),
])
def test_the_first_signal_says_what_happens_next_even_when_quiet(tmp_path, signum, checkpoint_on_signal, ddp, line):
    """The line a first Ctrl-C or SIGTERM prints (under --quiet too): a checkpoint or a plain stop, after
    the step or, under DDP, at the next agreement; and the way to stop at once."""
    lines = []
    trainer = Trainer(config_from_dict(_raw_config(tmp_path, train={"max_steps": 2})), print_fn=lines.append,
                      quiet=True, checkpoint_on_signal=checkpoint_on_signal)
    if ddp:
        trainer.dist = _CountingDist()
    trainer._on_signal(signum, None)
    trainer._lock.release()
    assert lines == [line] and trainer.stop_signal == signum


def test_a_second_sigterm_says_a_checkpoint_being_written_is_finished_first(tmp_path, capsys):
    """The second SIGTERM said "stopped without a checkpoint" while a checkpoint was being written,
    which the run's `finally` now always finishes (see BackgroundWriter.wait): it says so."""
    import threading

    trainer = Trainer(config_from_dict(_raw_config(tmp_path, train={"max_steps": 2})), print_fn=_quiet)
    release, save = threading.Event(), trainer.ckpts.save
    trainer.ckpts.save = lambda state, step: (release.wait(30), save(state, step))
    trainer._on_signal(signal.SIGTERM, None)  # the first: a checkpoint after this step
    path = trainer._writer.save(trainer.training_state(), 0)
    with pytest.raises(SystemExit) as second:
        trainer._on_signal(signal.SIGTERM, None)
    release.set()
    trainer._writer.wait()
    with pytest.raises(SystemExit) as third:
        trainer._on_signal(signal.SIGTERM, None)
    trainer._lock.release()
    assert second.value.code == third.value.code == 128 + signal.SIGTERM and path.is_file()
    assert capsys.readouterr().err == (
        "lm train: SIGTERM again: stopped without a new checkpoint (the one being written is finished first)\n"
        "lm train: SIGTERM again: stopped without a checkpoint\n")


def test_each_train_record_has_the_gradient_norm_of_its_last_step(tmp_path, monkeypatch):
    """A train record's ``grad_norm`` is the norm the clip measured at the record's own step (the
    last of its window), also for the record written on a signal's way out; without clipping there
    is none (mut30: both records given no norm survived; no test read the field)."""
    import lm.train.trainer as trainer_module

    norms = {}
    real = trainer_module.clip_grad_norm_

    def measured(params, max_norm, **kwargs):
        norm = real(params, max_norm, **kwargs)
        norms[trainer.step + 1] = float(norm)  # the step being taken
        return norm

    monkeypatch.setattr(trainer_module, "clip_grad_norm_", measured)
    for name, clip, stop_at in (("whole", 1.0, None), ("stopped", 1.0, 5), ("unclipped", 0.0, None)):
        raw = _raw_config(tmp_path / name, train={"max_steps": 7}, optim={"grad_clip": clip}, log={"interval": 3},
                          eval={"interval": 0}, checkpoint={"interval": 0})  # fmt: skip
        trainer = Trainer(config_from_dict(raw), print_fn=_quiet)
        if stop_at is not None:
            train_step = trainer.train_step

            def signalled(lr, train_step=train_step, trainer=trainer, stop_at=stop_at):
                if trainer.step == stop_at - 1:
                    signal.raise_signal(signal.SIGTERM)  # the run's handler: stop after this step
                return train_step(lr)

            trainer.train_step = signalled
        norms.clear()
        assert trainer.run() == (0 if stop_at is None else 128 + signal.SIGTERM)
        records = [r for r in read_metrics(tmp_path / name / "run") if r["split"] == "train"]
        want = {"whole": [3, 6, 7], "stopped": [3, 5], "unclipped": [3, 6, 7]}[name]
        assert [r["step"] for r in records] == want, name
        if clip:
            assert [r["grad_norm"] for r in records] == [norms[s] for s in want], name
            assert all(n > 0 for n in norms.values())
        else:
            assert norms == {} and [r["grad_norm"] for r in records] == [None] * 3


def test_a_rank_that_heard_no_signal_exits_as_the_one_that_did(tmp_path):
    """Under DDP the rank that heard nothing learns of another's SIGINT at the poll, saves with the
    others and exits 128 + SIGINT as that rank does, not with SIGTERM's status (ddp21; mut30: the
    agreed signal dropped for SIGTERM survived: only the gloo tests, started as processes, had it)."""
    trainer = _poll_trainer(tmp_path)
    ticks = iter(range(1_000_000))
    trainer.clock = lambda: next(ticks) * 0.01
    agree = trainer.dist.agree

    def another_rank_heard_ctrl_c(heard, seconds, device):
        signalled, seconds = agree(heard, seconds, device)
        return (int(signal.SIGINT) if trainer.step >= 3 else signalled), seconds

    trainer.dist.agree = another_rank_heard_ctrl_c
    assert trainer.run() == 128 + signal.SIGINT
    assert trainer.stop_signal is None and trainer.step == POLL_STEPS  # stopped at the first poll after step 3
    assert (tmp_path / "run" / "checkpoints" / f"step_{POLL_STEPS:08d}.pt").is_file()


def test_a_lost_peer_names_the_last_good_checkpoint_and_how_to_go_on(tmp_path):
    """Under DDP, a collective that fails because another process is gone is one line naming the
    last good checkpoint, with "--resume continues from it" only where there is one (mut30: that
    clause made None survived; only the gloo tests, started as processes, had the message)."""
    from lm.train.trainer import PeerStopped

    gone = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                        "[127.0.0.1]:36721")
    for name, fail_at, then in (("early", 2, "no checkpoint was written"),
                                ("later", 6, "the last good checkpoint is {}; --resume continues from it")):
        trainer = _poll_trainer(tmp_path / name, checkpoint=4, max_steps=8)
        train_step = trainer.train_step

        def failing(lr, train_step=train_step, trainer=trainer, fail_at=fail_at):
            if trainer.step == fail_at - 1:
                raise gone
            return train_step(lr)

        trainer.train_step = failing
        if name == "later":  # a checkpoint write failing meanwhile does not hide why the run stopped
            real_wait = trainer._writer.wait

            def wait(real_wait=real_wait, trainer=trainer):
                real_wait()
                if trainer.step == 5:
                    raise OSError(28, "No space left on device")

            trainer._writer.wait = wait
        with pytest.raises(PeerStopped) as stopped:
            trainer.run()
        latest = tmp_path / name / "run" / "checkpoints" / "step_00000004.pt"
        assert str(stopped.value) == ("another process of the run stopped (gloo: connection closed by peer); "
                                      + then.format(latest))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_bfloat16_run_on_a_cpu_that_multiplies_it_slowly_says_so_at_the_start(tmp_path, monkeypatch, dtype):
    """`train.dtype=bfloat16` on a CPU without bfloat16 units trained 85-125x slower than float32
    (docs/benchmarks.md) and said nothing; the run's first lines say it, with the measured ratio.
    A float32 run measures nothing."""
    import lm.device

    measured = []
    monkeypatch.setattr(lm.device, "cpu_has_bfloat16", lambda: False)
    monkeypatch.setattr(lm.device, "bfloat16_matmul_slowdown", lambda: measured.append(1) or 97.0)
    lines = []
    raw = _raw_config(tmp_path, train={"dtype": dtype, "max_steps": 1})
    assert Trainer(config_from_dict(raw), print_fn=lines.append).run() == 0
    warning = ("warning: train.dtype: a bfloat16 matrix product takes 97x the time of a float32 one on this CPU (no "
               "bfloat16 units): float32 is faster here")
    step = next(i for i, line in enumerate(lines) if line.startswith("step 1"))
    assert (warning in lines[:step]) == (dtype == "bfloat16") and len(measured) == (dtype == "bfloat16"), lines
