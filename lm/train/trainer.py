"""The training loop: one :class:`Trainer` owns the model, optimizer, data, run directory and clock.

Order of work in ``Trainer(cfg)`` is chosen so that a bad input fails before anything is
written: config → token files (checked) → model and optimizer → the checkpoint to resume
(checked against the model) → only then the run directory.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import os
import re
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from lm.checkpoint import CheckpointManager, export_safetensors, read_checkpoint
from lm.checkpoint.background import BackgroundWriter
from lm.checkpoint.export import exported_step
from lm.checkpoint.io import CheckpointWriteError, check_state_dict_fits, saved_iteration, unwrap
from lm.checkpoint.rng import get_rng_state, set_rng_state
from lm.data import TokenDataset
from lm.data.batch import LMBatch
from lm.device import autocast, configure_matmul_precision, resolve_dtype, slow_bfloat16_line
from lm.evaluate import bits_per_byte, perplexity
from lm.generate.sampling import generator_seed
from lm.io import atomic_write, missing_dirs, remove_made_dirs, silence_stdout
from lm.model import build_model
from lm.optim import (
    AdamW,
    clip_grad_norm_,
    cosine_lr_schedule,
    inverse_sqrt_lr_schedule,
    inverse_sqrt_scale,
    param_groups,
    wsd_lr_schedule,
)
from lm.tokenizer import check_tokenizer_checksum
from lm.train.config import Config, check_config, resume_changes, spelled
from lm.train.data_identity import data_fingerprint, same_data_file
from lm.train.determinism import configure_determinism, deterministic_ddp
from lm.train.distributed import Dist, init_distributed, shutdown_distributed
from lm.train.flops import peak_flops, peak_line
from lm.train.memory import check_step_memory
from lm.train.metrics import MetricsLog, MetricsWriteError, format_duration
from lm.train.run_dir import SET_ASIDE_BEST, RunLock, check_run_folder, holds_run, set_aside

# Under DDP, the most steps between two agreements on signals and the time, and the training
# seconds aimed at between two (see Trainer._agree): slow steps are polled more often, so that a
# stop's checkpoint is written well inside a launcher's grace period (torchrun's: 30 s).
POLL_STEPS = 10
POLL_SECONDS = 2.0
# A signal of the other kind (SIGTERM after SIGINT) this soon after the first is the same stop, passed
# on by a launcher (torchrun escalates at once when it gets two SIGINTs), not a second request.
SAME_STOP_SECONDS = 1.0

# The model's buffers (RoPE and position tables) are constants, the same on every rank: nothing to
# broadcast before each forward. torch 2.13 deprecates broadcast_buffers (a FutureWarning per rank)
# for forward_sync_buffers, which still syncs the buffers once when DDP wraps the model (a copy of
# the same values); older torch has broadcast_buffers alone.
NO_BUFFER_SYNC_PER_FORWARD = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters
    else {"broadcast_buffers": False}
)


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm became NaN or infinite."""


class TrainingInterrupted(KeyboardInterrupt):
    """For a caller that stops with the run: the :class:`Trainer` stopped for a signal (it saved a
    checkpoint and :meth:`Trainer.run` returned ``status``, 128 + the signal's number). A
    KeyboardInterrupt, so that what undoes a Ctrl-C (``lm.io.claim_dir`` putting back an earlier
    output) undoes it too; ``lm demo`` and the recipe scripts raise it."""

    def __init__(self, status: int):
        super().__init__(f"training stopped with status {status}")
        self.status = status


class RefusedOnRankZero(ValueError):
    """Under DDP, rank 0 refused the run (a folder in use, a run to resume or not, a data file):
    the other ranks stop with its words, which rank 0 says (``lm train`` prints them once)."""


class PeerStopped(RuntimeError):
    """Under DDP, a collective failed because another process of the run stopped (crashed or was killed)."""


# gloo's words when the process at the other end of a connection is gone (a plain RuntimeError)
_GLOO_PEER_GONE = ("Connection closed by peer", "Connection reset by peer")


def plural_steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


def peer_stopped(error: BaseException) -> str | None:
    """What to tell the user when ``error``, raised in a run of several processes, says that another
    of them is gone: gloo's lost connection, or one of torch.distributed's own errors (nccl's among
    them); None for any other error, which keeps its traceback."""
    text = str(error).strip()
    if isinstance(error, RuntimeError) and "gloo" in text:
        gone = next((words for words in _GLOO_PEER_GONE if words in text), None)
        if gone is not None:
            return f"another process of the run stopped (gloo: {gone.lower()})"
        waited = re.search(r"Timed out waiting (\d+)ms for (\w+)", text)
        if waited:  # a peer alive but not answering (frozen, stopped, swapping): torch's default wait is 30 min
            return (f"another process of the run did not answer within {format_duration(int(waited[1]) / 1000)} "
                    f"(gloo: timed out waiting for a {waited[2]}; train.dist_timeout sets the wait)")
    words = _dist_error_words(error)
    if words is not None:
        return f"another process of the run stopped or cannot be reached ({words})"
    return None


def _dist_error_words(error: BaseException) -> str | None:
    """``"DistStoreError: <its first line>"`` for one of torch.distributed's own errors (torch >= 2.1
    names them), None for any other error."""
    dist_error = getattr(torch.distributed, "DistError", None)
    if dist_error is None or not isinstance(error, dist_error):
        return None
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:200] if text else ''}"


# what a run keeps of data.tokenizer in RUN_DIR/tokenizer/ (what lm sample, serve and eval load)
RUN_TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank ``rank``'s generators once the model is built under ``train.seed`` (see
    :meth:`Trainer._build_model_and_optimizer`): the generator's 32-bit seed of ``seed``, plus the
    rank (rank 0 keeps the stream of ``seed`` itself)."""
    return (generator_seed(seed) + rank) % 2**32


def autocast_dtype(dtype: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for ``train.dtype``: ``auto`` is bfloat16 on CUDA devices that support it."""
    return resolve_dtype(dtype, device, "train.dtype")


def check_resume(resume) -> None:
    """``resume`` is False (start), True (continue the run in ``train.out_dir``) or a checkpoint's
    path. An empty path (an unset variable, ``resume=os.environ.get(...)``) was taken for False (a
    run to continue refused as one "to continue with --resume", a folder with none started fresh);
    ``1`` or ``None`` are refused as not meaning either."""
    if isinstance(resume, bool):
        return
    if not isinstance(resume, (str, os.PathLike)):
        raise ValueError(f"resume: must be True, False or a checkpoint's path, got {resume!r}")
    if not os.fspath(resume):
        raise ValueError("resume: must not be empty; pass resume=True to continue the run in train.out_dir, "
                         "or a checkpoint's path")


class Trainer:
    """Train a :class:`TransformerLM` or an :class:`EncoderDecoder` as ``cfg`` says; ``run()`` returns the
    process exit status (a diverged run raises :class:`TrainingDiverged`).

    Checkpoints are written by a background thread from a copy on the host (the next one waits
    for the previous one, the run's end for the last); ``on_checkpoint(step, path)`` is called
    once a checkpoint is on disk (tests use it to kill the process at a known point).

    SIGINT or SIGTERM stops the run after the step, with a checkpoint that ``--resume`` continues
    from; ``checkpoint_on_signal=False`` is for a caller that throws an interrupted run away (the
    ``lm demo`` folder, a script's ``--out``): it stops without one, and its lines do not offer a
    resume. :attr:`stop_signal` is the signal heard, if any.
    """

    def __init__(
        self,
        cfg: Config,
        *,
        resume: bool | str | os.PathLike = False,
        on_checkpoint: Callable[[int, Path], None] | None = None,
        print_fn: Callable[[str], None] = print,
        quiet: bool = False,
        checkpoint_on_signal: bool = True,
    ):
        check_resume(resume)  # before anything starts
        if not isinstance(checkpoint_on_signal, bool):
            raise ValueError(f"checkpoint_on_signal: must be True or False, got {checkpoint_on_signal!r}")
        self.checkpoint_on_signal = checkpoint_on_signal
        cfg = check_config(cfg)  # a Config built or changed in Python: the checks of one read from TOML
        self.cfg = cfg
        self.on_checkpoint = on_checkpoint
        self._print = print_fn
        self._quiet = quiet
        self.dist, self.device = self._join(cfg)
        self._determinism = configure_determinism(cfg.train.deterministic, self.device,  # before any CUDA work
                                                  max_time=cfg.train.max_time, max_steps=cfg.train.max_steps,
                                                  schedule=cfg.optim.schedule)
        self._precision = configure_matmul_precision(self.device)
        self.run_dir = Path(cfg.train.out_dir)
        self.ckpts = CheckpointManager(self.run_dir, cfg.checkpoint.keep_last)
        self._writer = BackgroundWriter(self.ckpts)
        taken = False
        try:
            self._decided_by_rank_zero(self._check_data, self._check_data)  # before any output: a refusal costs nothing
            self._build_model_and_optimizer()
            self._take_run_folder(resume)
            taken = True
            self._wrap_for_devices()
            self._plan_steps_and_evaluation()
        except BaseException as e:  # a peer that died while the run started (DDP's first broadcast): as in run()
            if taken:  # the folder locked, maybe made, nothing written in it yet: left as it was found
                self._give_back_run_folder()
            reason = peer_stopped(e) if self.dist.enabled and isinstance(e, Exception) else None
            if reason is None:
                raise
            raise PeerStopped(f"{reason} while the run was starting; no step was taken") from e
        self.metrics: MetricsLog | None = None
        if self.dist.is_main:
            try:
                self._prepare_run_dir()
            except BaseException:
                self._undo_fresh_start()
                raise

    # -- setup ---------------------------------------------------------------------------
    def _check_data(self) -> None:
        """Open both files and check them (sidecar, dtype, size, ids < vocab, length, tokenizer),
        and that a step fits in memory."""
        cfg = self.cfg
        self.train_data, self.val_data = self._open_data()
        if self.val_data is not None:
            check_tokenizer_checksum(self.val_data.tokenizer_sha256, self.train_data.tokenizer_sha256,
                                     argument="data.val", what=f"the tokenizer of {cfg.data.val!r}",
                                     against=f"data.train {cfg.data.train!r}")
        self.tokenizer_sha256 = self.train_data.tokenizer_sha256
        # recorded in checkpoints: --resume accepts these files by another path, or moved
        self._data_fingerprints = {key: data_fingerprint(data.path, data.meta) for key, data in
                                   (("data.train", self.train_data), ("data.val", self.val_data)) if data is not None}
        if cfg.data.tokenizer:
            try:
                self._check_tokenizer(cfg.data.tokenizer)
            except ValueError as e:
                raise ValueError(f"{e}{_none_hint('data.tokenizer', cfg.data.tokenizer)}") from None
        if cfg.model.architecture == "encoder_decoder":
            for key, data in (("data.train", self.train_data), ("data.val", self.val_data)):
                specials = data.meta.get("special_tokens") if data is not None else None
                problem = specials is not None and cfg.model.special_ids_problem(
                    specials, "model.", f"the tokenizer of {str(data.path)!r}")
                if problem:  # pair files of `lm tokenize --target` record them
                    raise ValueError(f"{key}: {problem}")
            self._check_pair_budgets()
        check_step_memory(cfg, self.device)

    def _check_pair_budgets(self) -> None:
        """Every kept pair fits one batch, said in the settings' names (the dataset's own error
        names its parameter, max_tokens, which no config has)."""
        t, e = self.cfg.train, self.cfg.eval
        budgets = [(self.train_data, t.batch_tokens, "train.batch_tokens")]
        if self.val_data is not None:
            budgets.append((self.val_data, e.batch_tokens or t.batch_tokens,
                            "eval.batch_tokens" if e.batch_tokens else "train.batch_tokens"))
        for data, budget, key in budgets:
            if budget < data.longest:
                raise ValueError(f"{key}: {budget} is less than the longest pair kept in {data.name} "
                                 f"({data.longest} tokens with <bos>/<eos>); raise it to at least {data.longest}, "
                                 "or lower model.context_length")

    def _build_model_and_optimizer(self) -> None:
        """The model and AdamW; the same seed gives every rank the same initial weights, then each
        rank its own stream for what is drawn while training (dropout's masks)."""
        cfg = self.cfg
        # the CPU generator keeps 32 bits of a seed: train.seed from 2**32 on is hashed (lower ones are kept)
        torch.manual_seed(generator_seed(cfg.train.seed))
        self.model = build_model(cfg.model).to(self.device)
        if self.dist.rank > 0:
            # one stream on every rank gave row i of each rank's batch the same dropout mask; rank 0
            # goes on with the shared one, so that one process draws as it always did
            torch.manual_seed(rank_seed(cfg.train.seed, self.dist.rank))
        if hasattr(self.model, "validate_ids"):
            self.model.validate_ids = False  # _check_data read every id already: no per-step device sync
        self.optimizer = AdamW(
            param_groups(self.model, cfg.optim.weight_decay, cfg.optim.decay_embeddings),
            lr=cfg.optim.max_lr,
            betas=(cfg.optim.beta1, cfg.optim.beta2),
            eps=cfg.optim.eps,
        )
        self.step = 0
        self.elapsed = 0.0  # training seconds (evaluation, checkpoints, compilation left out), carried across resumes
        self.tokens_seen = 0
        self.best_val_loss = math.inf
        self._resumed_from: Path | None = None
        self._restarted = False
        self._last_eval = -1  # the last step evaluated (carried by checkpoints: a resume does not repeat it)
        self._config_changes: dict[str, tuple[Any, Any]] = {}  # key: (the checkpoint's value, this run's)

    def _take_run_folder(self, resume) -> None:
        """The run folder: locked first (rank 0), then checked, then (if resuming) read. On a
        failure the lock is released and the folders this run made (still empty) are removed: the
        run folder and the parents made for it. ``--resume`` with no folder is refused before any is made."""
        self._lock = RunLock(self.run_dir)
        with _out_dir_error(self.run_dir, "cannot read"):
            # the folder and the parents of it that this run makes: removed (where empty) if it fails to start
            self._made_dirs = missing_dirs(self.run_dir)
            made_dir = bool(self._made_dirs)
            self._held_run = not made_dir and holds_run(self.run_dir)  # else all in it is this run's doing
        if made_dir and resume is True:  # before anything is made
            raise ValueError(f"--resume: {str(self.run_dir)!r} holds no run to resume (there is no such folder)")
        def lock_and_open() -> None:
            with _out_dir_error(self.run_dir, "cannot read"):
                check_run_folder(self.run_dir)
            with _out_dir_error(self.run_dir, "cannot create"):
                self.run_dir.mkdir(parents=True, exist_ok=True)
            with _out_dir_error(self.run_dir, "cannot write in"):
                self._lock.acquire(self._print)
            self._open_run(resume)

        try:
            # rank 0 locks the folder and reads it; the others read it only once it is locked (a
            # folder in use was "in use" on rank 0 and "stopped before its first checkpoint" on rank 1)
            self._decided_by_rank_zero(lock_and_open, lambda: self._open_run(resume))
            if self.dist.is_main:  # the lock is ours: no other lm train is writing in this folder
                for tmp in self.ckpts.remove_partial_writes():
                    self._log(f"removed {tmp}, a file left half-written by a killed run", always=True)
        except BaseException:
            self._give_back_run_folder()
            raise

    def _give_back_run_folder(self) -> None:
        """A start that failed once the run folder was (or was being) taken: the lock released, and
        the folders this run made removed where still empty (one that could not be made is not
        there; a folder that was there before, a run's own included, is not among them)."""
        self._lock.release()
        if self.dist.is_main:
            remove_made_dirs(self._made_dirs)

    def _decided_by_rank_zero(self, main: Callable[[], None], others: Callable[[], None]) -> None:
        """Under DDP, ``main`` on rank 0 first, its outcome then told to the others: where it refused,
        they raise :class:`RefusedOnRankZero` with its words (``lm train`` prints the refusal once,
        not once a process, and never another rank's reading of what rank 0 refused); else they run
        ``others``. One process: ``main``."""
        if not self.dist.enabled:
            return main()
        failed = None
        if self.dist.is_main:
            try:
                main()
            except Exception as e:  # any: the others wait for word of it
                failed = e
        said = self.dist.broadcast_object(None if failed is None else str(failed))
        if failed is not None:
            try:
                raise failed
            finally:
                del failed  # this frame, on its traceback, would hold it: a cycle with the half-made trainer
        if said is not None:
            raise RefusedOnRankZero(said)
        others()

    def _wrap_for_devices(self) -> None:
        """DDP across processes, torch.compile, autocast: what the training step runs through."""
        t = self.cfg.train
        self.train_model: torch.nn.Module = self.model
        if self.dist.enabled:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.train_model = torch.nn.parallel.DistributedDataParallel(self.model, device_ids=ids,
                                                                         **NO_BUFFER_SYNC_PER_FORWARD)
            if t.deterministic:
                deterministic_ddp(self.train_model, self.dist.world_size)
        if t.compile:
            # pair batches change shape at every step: one graph with symbolic sizes, compiled once,
            # instead of a static one per shape (token windows are one shape: the static graph)
            dynamic = True if self.cfg.model.architecture == "encoder_decoder" else None
            self.train_model = torch.compile(self.train_model, dynamic=dynamic)
        # a partial, not a lambda over self: a trainer that refers to itself is freed only by a full
        # collection, and a sweep of them had held several runs' weights and moments at once (cyc25)
        self._autocast = functools.partial(autocast, self.device, autocast_dtype(t.dtype, self.device))

    def _plan_steps_and_evaluation(self) -> None:
        """Tokens per step, the MFU yardstick, the clock, and the fixed validation batches."""
        cfg, t, m = self.cfg, self.cfg.train, self.cfg.model
        self.pairs = m.architecture == "encoder_decoder"
        per_rank = t.batch_tokens if self.pairs else t.batch_size * m.context_length  # nominal for pairs
        self.tokens_per_step = per_rank * t.grad_accum_steps * self.dist.world_size
        dtype = autocast_dtype(t.dtype, self.device)
        self._peak_flops = peak_flops(self.device, cfg.log.peak_tflops, dtype)
        self._peak_line = peak_line(self.device, self._peak_flops, dtype, cfg.log.peak_tflops is not None)
        # '' unless bfloat16 is slow on this CPU (measured once, by the rank that logs)
        self._slow_dtype_line = slow_bfloat16_line(self.device, dtype, "train.dtype") if self.dist.is_main else ""
        self._flops_per_token = 3 * unwrap(self.model).flops_per_token()  # forward and backward
        self._signal: int | None = None
        self._agreed_signal = 0  # the signal of the run's processes (under DDP: the largest any rank heard)
        self._signal_at = 0.0  # when it came (time.monotonic)
        self._unagreed_seconds = 0.0  # this rank's training seconds not yet agreed on (DDP, see _agree)
        self._unagreed_steps = 0
        self._poll_every = POLL_STEPS  # steps between agreements, from the agreed step time
        self._next_poll = 0  # the step of the next agreement: the run's first (it measures a step's time)
        self.clock: Callable[[], float] = time.perf_counter  # seconds; what max_time is measured with
        self._said_behind_clock = False  # the line that the learning rates now follow the clock: once
        self._val_starts = []  # token windows' starts, or pair batches' indices (a rank may have none)
        if self.val_data is not None and self.pairs:
            self._val_starts = self.val_data.fixed_batches(cfg.eval.batch_tokens or t.batch_tokens, cfg.eval.batches)
        elif self.val_data is not None:
            self._val_starts = self.val_data.fixed_batches(cfg.eval.batches, cfg.eval.batch_size or t.batch_size,
                                                           seed=cfg.eval.seed)

    def _open_data(self):
        """The training and validation datasets: token windows, or sentence pairs for an encoder–decoder."""
        cfg, t, m = self.cfg, self.cfg.train, self.cfg.model
        ranks = dict(rank=self.dist.rank, world_size=self.dist.world_size)
        if m.architecture == "encoder_decoder":
            from lm.data.pairs import PairDataset

            say = self._print if self.dist.is_main else (lambda *_: None)
            kw = dict(max_len=m.context_length, vocab_size=m.vocab_size, pad_id=m.pad_id, bos_id=m.bos_id,
                      eos_id=m.eos_id, print_fn=say, **ranks)
            train = _named("data.train", PairDataset, cfg.data.train, seed=t.seed, name="data.train", **kw)
            val = _named("data.val", PairDataset, cfg.data.val, name="data.val", **kw) if cfg.data.val else None
            return train, val
        train = _named("data.train", TokenDataset, cfg.data.train, m.context_length, vocab_size=m.vocab_size,
                       seed=t.seed, **ranks)
        val = _named("data.val", TokenDataset, cfg.data.val, m.context_length, vocab_size=m.vocab_size,
                     **ranks) if cfg.data.val else None
        return train, val

    def _open_run(self, resume: bool | str | os.PathLike) -> None:
        """Decide from the folder and ``resume`` whether the run starts, restarts or continues."""
        has_run = holds_run(self.run_dir)
        latest = self.ckpts.latest()
        if not resume:
            if latest is not None:
                raise ValueError(
                    f"train.out_dir: {str(self.run_dir)!r} already holds a run; pass --resume to continue it, "
                    "or choose another train.out_dir"
                )
            if has_run:
                best = self.ckpts.best_path
                if not best.is_file():
                    raise ValueError(
                        f"train.out_dir: {str(self.run_dir)!r} holds a run that stopped before its first checkpoint; "
                        "pass --resume to start it again from step 0 (its metrics.jsonl and model.safetensors are "
                        "kept aside as NAME.1, or the next free number), or choose another train.out_dir"
                    )
                step = _saved_step(best)
                of_step = "" if step is None else f", of step {step}"
                raise ValueError(
                    f"train.out_dir: {str(self.run_dir)!r} holds a run that stopped before its first checkpoint "
                    f"(it has only checkpoints/best.pt{of_step}); pass --resume to start it again "
                    "from step 0 (its metrics.jsonl, model.safetensors and checkpoints/best.pt are kept aside as "
                    f"NAME.1, or the next free number), or --resume {shlex.quote(str(best))} to continue it from "
                    "there, or choose another train.out_dir"
                )
            return
        if resume is True:
            if latest is None:
                if not has_run:
                    raise ValueError(f"--resume: {str(self.run_dir)!r} holds no run to resume")
                self._restarted = True
                return
            self._load(latest)
            return
        path = Path(resume)
        if path.is_dir():  # a run folder (or its checkpoints/), as --checkpoint takes: its latest checkpoint
            run = path.parent if path.name == "checkpoints" and not (path / "checkpoints").is_dir() else path
            if run.resolve() == self.run_dir.resolve():  # this run's own folder: as --resume alone
                return self._open_run(True)
            path = CheckpointManager(run).latest()
            if path is None:
                raise ValueError(f"--resume: {str(resume)!r} is a folder with no checkpoints/step_*.pt; pass a "
                                 "checkpoint file (--resume RUN/checkpoints/step_N.pt), or --resume alone to "
                                 "continue the run in train.out_dir")
        if not path.is_file():
            raise ValueError(f"--resume: checkpoint not found: {str(path)!r}")
        same_run = path.resolve().parent == self.ckpts.dir.resolve()
        if same_run and SET_ASIDE_BEST.match(path.name):
            raise ValueError(
                f"--resume: {str(path)!r} is a best checkpoint that the run in {str(self.run_dir)!r} set aside "
                "(of a history it left when it started again from step 0, or went back to an earlier step); "
                "continuing it there would mix two histories in one folder: set train.out_dir to a new folder"
            )
        if not same_run and has_run:
            raise ValueError(
                f"--resume: {str(path)!r} is not a checkpoint of the run in {str(self.run_dir)!r}; to continue it "
                "in a new run, set train.out_dir to a new folder"
            )
        state = self._read_for_resume(path)
        # best.pt, or an older step_*.pt, of this run: its later checkpoints (kept as the highest steps)
        # and metrics belong to the history that went on from it
        if same_run and latest is not None and int(state["iteration"]) < self.ckpts.steps()[-1]:
            raise ValueError(
                f"--resume: {str(path)!r} (step {int(state['iteration'])}) is older than the run's latest "
                f"checkpoint {latest.name!r}; continuing from it would mix two histories in one folder: set "
                "train.out_dir to a new folder"
            )
        self._load(path, state)

    def _read_for_resume(self, path: Path) -> dict[str, Any]:
        """The checkpoint at ``path``, which must record the step it was saved at: one without (written
        by :func:`lm.checkpoint.write_checkpoint` from a dict of its own) had been a ``KeyError``
        traceback as the latest checkpoint, and "(step 0) is older than the run's latest" as an older one."""
        try:
            state = read_checkpoint(path)
            saved_iteration(state, repr(str(path)), "a training checkpoint")
        except ValueError as e:
            raise ValueError(f"--resume: {e}{self._unreadable_hint(path)}") from None
        return state

    def _unreadable_hint(self, path: Path) -> str:
        """What to do when the run's latest checkpoint cannot be read: move it to a name that is no
        checkpoint's and resume again, from the checkpoint before it (an older checkpoint of the run
        cannot be resumed while a later one is there: see _open_run)."""
        latest = self.ckpts.latest()
        # (a folder or a broken link named as the latest checkpoint is moved aside the same way)
        if latest is None or not os.path.lexists(path) or path.resolve() != latest.resolve():
            return ""
        aside, n = latest.with_name(f"{latest.name}.unreadable"), 1
        while aside.exists():
            aside, n = latest.with_name(f"{latest.name}.unreadable{n}"), n + 1
        older = self.ckpts.steps()[:-1]
        then = (f"it continues from step {older[-1]}" if older
                else "with no older checkpoint, the run starts again from step 0")
        return (f"; move it aside (mv {shlex.quote(str(latest))} {shlex.quote(str(aside))}) and run again with "
                f"--resume alone: {then}")

    def _load(self, path: Path, state: dict[str, Any] | None = None) -> None:
        if state is None:
            state = self._read_for_resume(path)
        saved_model = (state.get("config") or {}).get("model")
        if saved_model is not None and saved_model != self.cfg.model.to_dict():
            diff = next(
                f"model.{k} is {spelled(saved_model.get(k))} in the checkpoint but {spelled(v)} in the config"
                for k, v in self.cfg.model.to_dict().items()
                if saved_model.get(k) != v
            )
            raise ValueError(f"--resume: {str(path)!r} is another model: {diff}")
        self._config_changes = resume_changes(state.get("config") or {}, self.cfg, repr(str(path)),
                                              same=self._same_data(state))
        self._check_same_data(state, path)
        check_state_dict_fits(self.model, state["model"], repr(str(path)))
        check_tokenizer_checksum(self.tokenizer_sha256, state.get("tokenizer_sha256", ""), argument="--resume",
                                 what=f"the tokenizer of data.train {self.cfg.data.train!r}",
                                 against=f"the checkpoint {str(path)!r}")
        for key in ("optimizer", "rng", "data", "schedule"):
            if key not in state:
                raise ValueError(f"--resume: {str(path)!r} holds no {key} state; it is not a training checkpoint")
        self._check_world_size(state, path)
        self._check_max_steps(state, path)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.train_data.load_state_dict(state["data"])
        self._load_rng(state, path)
        self.step = int(state["iteration"])
        self.elapsed = float(state["schedule"]["elapsed"])
        self.tokens_seen = int(state.get("tokens_seen", 0))
        self.best_val_loss = float(state.get("best_val_loss", math.inf))
        self._last_eval = int(state.get("last_eval_step", -1))
        self._resumed_from = path

    def _load_rng(self, state: dict[str, Any], path: Path) -> None:
        """This rank's RNG state. A checkpoint of one process, or of several written before each
        rank's was kept ("rng" alone: rank 0's, which every rank's equalled then), gives rank 0 its
        state; the other ranks keep the stream of their rank (see _build_model_and_optimizer), as a
        new run's, so such a resume under DDP is not bitwise the run it continues when dropout is on."""
        by_rank = state.get("rng_by_rank")
        if by_rank is None:
            if self.dist.is_main:
                set_rng_state(state["rng"])
            return
        if not isinstance(by_rank, list) or len(by_rank) != self.dist.world_size:
            raise ValueError(f"--resume: {str(path)!r} holds no RNG state for each of this run's "
                             f"{self.dist.world_size} processes (rng_by_rank); it is not a checkpoint of lm train")
        set_rng_state(by_rank[self.dist.rank])

    def _same_data(self, state: dict[str, Any]) -> Callable[[str, Any, Any], bool]:
        """For :func:`resume_changes`: whether data.train or data.val, named by another path than the
        checkpoint's, is the same file, or one with the fingerprint the checkpoint recorded (moved)."""
        saved = state.get("data_files") or {}

        def same(key: str, old: Any, new: Any) -> bool:
            if key not in self._data_fingerprints or not isinstance(old, str):
                return False
            return same_data_file(old, new, saved.get(key), self._data_fingerprints[key])

        return same

    @staticmethod
    def _join(cfg: Config) -> tuple[Dist, torch.device]:
        """:func:`init_distributed`; a process group the others did not all join within
        ``train.dist_timeout`` (one frozen, or never started) is :class:`PeerStopped`'s one line,
        where torch's DistStoreError had been a traceback of forty (ddp21)."""
        try:
            return init_distributed(cfg.train.device, cfg.train.dist_timeout)
        except Exception as e:
            words = _dist_error_words(e)
            if words is None:
                raise
            if isinstance(e, getattr(torch.distributed, "DistNetworkError", ())):  # at once: no waiting was done
                where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
                raise ValueError(f"MASTER_PORT: the processes of the run cannot meet at {where} ({words}); another "
                                 "run may hold the port: give torchrun another --master-port (or --rdzv-endpoint)"
                                 ) from None
            wait = cfg.train.dist_timeout
            within = "torch's default wait" if wait is None else format_duration(wait)
            raise PeerStopped(f"the processes of the run did not all join within {within} (train.dist_timeout; "
                              f"{words}); no step was taken") from e

    def _check_same_data(self, state: dict[str, Any], path: Path) -> None:
        """data.train and data.val hold what the checkpoint recorded of them, whatever their path: a file
        rewritten in place (another text tokenized to it, --overwrite), or a relative path that names
        another file from another working folder, had resumed on other data with no word (ddp21); the
        path was compared, the fingerprint only for a path that differed. Older checkpoints record none."""
        saved = state.get("data_files") or {}
        for key, fingerprint in self._data_fingerprints.items():
            then = saved.get(key)
            if not isinstance(then, dict) or then == fingerprint:
                continue
            what = next((f"{field} {spelled(then.get(field))} then, {spelled(fingerprint.get(field))} now"
                         # no "dtype": the sidecar's dtype is that of its vocab_size (checked on reading)
                         for field in ("num_tokens", "num_pairs", "size", "tokenizer_sha256", "vocab_size")
                         if then.get(field) != fingerprint.get(field)), "the same size, other bytes")
            current = self.cfg.data.train if key == "data.train" else self.cfg.data.val
            raise ValueError(f"--resume: {key} {current!r} is not the file {str(path)!r} trained on ({what}); a "
                             "resumed run keeps its data: give the file it trained on")

    def _check_world_size(self, state: dict[str, Any], path: Path) -> None:
        """The processes of the checkpoint's run: another number would change the global batch (each
        process draws its own rows) and the validation batches. Older checkpoints do not say."""
        saved, world = state.get("world_size"), self.dist.world_size
        if saved is None or int(saved) == world:
            return
        saved = int(saved)
        t, m = self.cfg.train, self.cfg.model
        per_rank = (t.batch_tokens if m.architecture == "encoder_decoder" else t.batch_size * m.context_length)
        per_rank *= t.grad_accum_steps

        def processes(n: int) -> str:
            return f"{n} process{'es' if n != 1 else ''} ({per_rank * n:,} tokens per step)"

        how = "in one process (without torchrun)" if saved == 1 else f"with torchrun --nproc_per_node {saved}"
        raise ValueError(f"--resume: {str(path)!r} was trained by {processes(saved)} but this run has "
                         f"{processes(world)}; a resumed run keeps its global batch: resume it {how}")

    def _check_max_steps(self, state: dict[str, Any], path: Path) -> None:
        """A budget below the checkpoint's step cannot be met (a run does not go back)."""
        step, max_steps = int(state["iteration"]), self.cfg.train.max_steps
        if max_steps is not None and max_steps < step:
            raise ValueError(f"--resume: train.max_steps {max_steps} is below the step of {str(path)!r}, {step}; "
                             f"set train.max_steps to {step} or more (at {step} there is nothing left to train)")

    def _check_tokenizer(self, directory: str) -> None:
        """The tokenizer copied into the run must be the one that wrote the token files."""
        from lm.tokenizer import load_tokenizer_dir

        tok = load_tokenizer_dir(directory, argument="data.tokenizer")
        if tok.vocab_size > self.cfg.model.vocab_size:
            raise ValueError(
                f"data.tokenizer {directory!r} has {tok.vocab_size} tokens, more than model.vocab_size "
                f"{self.cfg.model.vocab_size}"
            )
        check_tokenizer_checksum(tok.checksum(), self.tokenizer_sha256, argument="data.tokenizer",
                                 what=repr(directory), against=f"data.train {self.cfg.data.train!r}")
        if self.cfg.model.architecture == "encoder_decoder":
            problem = self.cfg.model.special_ids_problem(tok.special_ids, "model.", repr(directory))
            if problem:
                raise ValueError(f"data.tokenizer: {problem}")

    def _undo_fresh_start(self) -> None:
        """A run that failed to start (wandb refused it, say) in a folder that held no run before (a
        fresh one, or one resumed from another run's checkpoint): remove what it wrote there and
        release the lock, so that the same command can simply be run again. A run resumed or
        restarted in its own folder keeps the folder as it is."""
        if self.metrics is not None:
            with contextlib.suppress(OSError):  # what failed may have been its write (a full disk)
                self.metrics.close()
        if self._held_run:
            self._lock.release()
            return
        for name in ("config.toml", "metrics.jsonl", "wandb_id.txt"):
            (self.run_dir / name).unlink(missing_ok=True)
        tok = self.run_dir / "tokenizer"
        for name in RUN_TOKENIZER_FILES:
            (tok / name).unlink(missing_ok=True)
        if tok.is_dir() and not any(tok.iterdir()):
            tok.rmdir()
        shutil.rmtree(self.run_dir / "wandb", ignore_errors=True)  # what wandb.init made of its run before failing
        self._give_back_run_folder()  # the folder and the parents made for it, where empty

    def _prepare_run_dir(self) -> None:
        # a full disk here had been a bare "[Errno 28] No space left on device: 'r/config.toml'" (faults20)
        with _out_dir_error(self.run_dir, "cannot write in"):
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with atomic_write(self.run_dir / "config.toml") as f:
                f.write(self.cfg.to_toml())
        tok = self.cfg.data.tokenizer
        if tok:
            for name in RUN_TOKENIZER_FILES:
                src, dst = Path(tok) / name, self.run_dir / "tokenizer" / name
                if src.is_file() and not (dst.exists() and os.path.samefile(src, dst)):
                    data = src.read_bytes()
                    with _out_dir_error(self.run_dir, "cannot write in"), atomic_write(dst, "wb") as f:
                        f.write(data)
        if self._restarted:
            # the earlier history's metrics, exported weights and best checkpoint: kept, out of this
            # history's way (`--checkpoint RUN` would serve the old weights, and the end of this run
            # replace them; this run's first evaluation would replace best.pt)
            best_step = _saved_step(self.ckpts.best_path)  # None when there is none
            metrics, weights = set_aside(self.run_dir / "metrics.jsonl"), set_aside(self.run_dir / "model.safetensors")
            best = set_aside(self.ckpts.best_path)
            kept = [f"the earlier {what} are in {path.name}"
                    for what, path in (("metrics", metrics), ("weights", weights)) if path is not None]
            if best is not None:
                kept.append(f"the earlier best checkpoint{'' if best_step is None else f' (step {best_step})'} is "
                            f"in checkpoints/{best.name}: --resume {shlex.quote(str(best))} with another "
                            "train.out_dir continues that history")
            self._log(f"no checkpoint in {str(self.run_dir)!r}: starting again from step 0"
                      + (f" ({', '.join(kept)})" if kept else ""), always=True)
        if self._resumed_from is not None:
            best_step = _saved_step(self.ckpts.best_path)  # None when there is none
            if best_step is not None and best_step > self.step:
                # of the steps after this one that the run discards (it was killed after best.pt was
                # written, or resumed from an older checkpoint): not this history's best
                best = set_aside(self.ckpts.best_path)
                self._log(f"checkpoints/best.pt (step {best_step}) is past step {self.step}, where the run goes on: "
                          f"it belongs to the steps it trains again, and is kept aside as checkpoints/{best.name}",
                          always=True)
            MetricsLog.truncate(self.run_dir, self.step)
        self.metrics = MetricsLog(
            self.run_dir, self.cfg.wandb, self.cfg.to_dict(), resume=self._resumed_from is not None, quiet=self._quiet
        )
        if self._config_changes:  # config.toml now says what the run uses; what it used before is kept here
            self.metrics.write({"step": self.step, "split": "config",
                                "changed": {k: {"was": a, "now": b} for k, (a, b) in self._config_changes.items()}})
            self._log("resumed with " + ", ".join(f"{k} {spelled(a)} -> {spelled(b)}"
                                                 for k, (a, b) in self._config_changes.items()),
                      always=True)

    # -- schedule --------------------------------------------------------------------------
    def schedule_position(self) -> float:
        """Where the run is on the learning-rate schedule, in iterations.

        With ``max_steps`` alone it is the step. With ``max_time`` it is the elapsed fraction of
        that time scaled to the schedule's length, or the step if that is further along: the
        schedule follows whichever limit will stop the run first.
        """
        t = self.cfg.train
        if t.max_time is None or self.cfg.optim.schedule == "inverse_sqrt":  # inverse_sqrt runs by step
            return float(self.step)
        length = t.max_steps or self.cfg.optim.cosine_cycle_iters
        return max(float(self.step), self.elapsed / t.max_time * length)

    def learning_rate(self) -> float:
        o, t = self.cfg.optim, self.cfg.train
        if o.schedule == "inverse_sqrt":  # by step, whatever stops the run
            d = self.cfg.model.d_model
            scale = inverse_sqrt_scale(o.max_lr, d, o.warmup_iters)
            return inverse_sqrt_lr_schedule(self.step, d, o.warmup_iters, scale)
        cycle = o.cosine_cycle_iters or t.max_steps
        if o.schedule == "wsd":
            return wsd_lr_schedule(self.schedule_position(), o.max_lr, o.min_lr, o.warmup_iters, cycle,
                                   o.decay_fraction)
        return cosine_lr_schedule(self.schedule_position(), o.max_lr, o.min_lr, o.warmup_iters, cycle)

    def budget_spent(self) -> bool:
        """Whether the run has reached train.max_steps or train.max_time."""
        t = self.cfg.train
        if t.max_steps is not None and self.step >= t.max_steps:
            return True
        return t.max_time is not None and self.elapsed >= t.max_time

    # -- steps -------------------------------------------------------------------------------
    def _next_batch(self):
        """The next training batch: an :class:`LMBatch` of windows, or a :class:`PairBatch` under the token budget."""
        t = self.cfg.train
        if self.pairs:
            return self.train_data.sample(t.batch_tokens, self.device)
        return LMBatch(*self.train_data.sample(t.batch_size, self.device))

    def train_step(self, lr: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One optimizer step over ``grad_accum_steps`` micro-batches; returns (mean loss, grad norm),
        both 0-d tensors on the device: nothing here waits for it (their finiteness is checked at the
        log interval and before every checkpoint, see :meth:`_check_finite`).

        Token windows: each micro-batch's loss counts 1 / ``grad_accum_steps`` (they hold equal
        tokens). Sentence pairs: each counts its share of the real target tokens of the whole step,
        every rank's (see :meth:`_pair_weights`), so that every target token weighs the same, as
        one batch of the same pairs would (fairseq's normalisation); the loss returned is then this
        rank's part of the step's token mean times the world size, whose mean over ranks (taken at
        the log interval) is the step's."""
        t = self.cfg.train
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total = torch.zeros((), device=self.device)
        self.step_tokens = 0
        weights = self._pair_weights() if self.pairs else None
        for micro in range(t.grad_accum_steps):
            batch = self._next_batch()
            if weights is None:
                self.step_tokens += batch.num_tokens * self.dist.world_size
            # DDP all-reduces gradients on the last micro-batch only.
            last = micro == t.grad_accum_steps - 1
            sync = contextlib.nullcontext() if last or not self.dist.enabled else self.train_model.no_sync()
            with sync:
                with self._autocast():
                    # the model's loss of the batch (the fused lm_head + cross-entropy: never holds the
                    # batch x seq x vocab logits), through forward so that DDP sees it
                    loss = self.train_model(batch=batch)
                if weights is None:
                    (loss / t.grad_accum_steps).backward()
                else:
                    (loss * weights[micro]).backward()
            total += loss.detach() if weights is None else loss.detach() * weights[micro]
        norm = None
        if self.cfg.optim.grad_clip > 0:
            norm = clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip, return_tensor=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return (total / t.grad_accum_steps if weights is None else total), norm

    def _pair_weights(self) -> list[float]:
        """The factor of each of this rank's pair micro-batch losses in the coming step, and the
        step's real target tokens (every rank's) in ``step_tokens``.

        The loss of a micro-batch is its mean over its real target tokens ``n``; the step's, the
        mean over all ``N`` of them. DDP averages the ranks' gradients, so a rank scales its loss by
        ``world_size * n / N``. The sampler knows the step's batches before they are drawn, the same
        on every rank (:meth:`PairDataset.upcoming_tokens`), so this costs no collective and no read
        of the device."""
        world = self.dist.world_size
        tokens = self.train_data.upcoming_tokens(self.cfg.train.grad_accum_steps * world, self.cfg.train.batch_tokens)
        self.step_tokens = sum(tokens)
        return [world * n / self.step_tokens for n in tokens[self.dist.rank :: world]]

    @torch.no_grad()
    def evaluate(self) -> dict[str, float] | None:
        """Mean loss over the fixed validation batches (all ranks), perplexity and bits per byte."""
        if self.val_data is None:
            return None
        self.train_model.eval()
        if self.pairs:
            loss = self._pair_val_loss()
        else:
            total = torch.zeros((), device=self.device)
            for starts in self._val_starts:
                total += self._val_loss(starts)
            loss = float(self.dist.all_mean(total / len(self._val_starts)).item())
        self.train_model.train()
        return {"loss": loss, "ppl": perplexity(loss), "bpb": bits_per_byte(loss, self.val_data.bytes_per_token)}

    def _pair_val_loss(self) -> float:
        """The plain loss (no label smoothing) per real target token over every rank's validation
        pairs: the ranks' summed losses and token counts, added in one all-reduce and divided once,
        so N ranks report what one process does (a rank may hold no batch). Not compiled: pair
        batches change shape."""
        total = torch.zeros((), device=self.device)
        tokens = 0
        for indices in self._val_starts:
            batch = self.val_data.batch(indices, self.device)
            n = self.val_data.target_tokens(indices)
            with self._autocast():
                total += self.model.loss(batch, label_smoothing=0.0) * n
            tokens += n
        sums = self.dist.all_sum(torch.stack([total, torch.tensor(float(tokens), device=self.device)]))
        loss_sum, count = sums.tolist()
        return loss_sum / count

    def _val_loss(self, starts) -> torch.Tensor:
        """The loss of one validation batch of token windows, through the compiled model when there is one."""
        x, y = self.val_data.batch(starts, self.device)
        with self._autocast():
            return self.train_model(x, targets=y)

    @torch.no_grad()
    def _compile_evaluation(self) -> None:
        """Compile the evaluation graph (no grad, eval mode) before training starts, so that no
        evaluation during training compiles. Nothing of the run changes: the batch is a fixed
        validation batch and dropout is off in eval mode."""
        if not (self.cfg.train.compile and self.cfg.eval.interval and self._val_starts and not self.pairs):
            return
        self.train_model.eval()
        self._val_loss(self._val_starts[0])
        self.train_model.train()

    def _synchronize(self) -> None:
        """Wait for the device's queue: what the step clock does at log, evaluation and checkpoint
        boundaries only (on a GPU the host runs ahead of the kernels it launched)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- checkpoints ------------------------------------------------------------------------
    def training_state(self, rng_by_rank: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """What a checkpoint holds; ``rng_by_rank``: every rank's RNG state, from :meth:`_gather_rng`
        (under DDP, where the ranks' streams differ; "rng" is this process's)."""
        state = {
            "iteration": self.step,
            "model": unwrap(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "config": self.cfg.to_dict(),
            "schedule": {
                "position": self.schedule_position(),
                "elapsed": self.elapsed,
                "lr": self.learning_rate(),
            },
            "rng": get_rng_state(),
            "data": self.train_data.state_dict(),
            "tokenizer_sha256": self.tokenizer_sha256,
            "tokens_seen": self.tokens_seen,
            "best_val_loss": self.best_val_loss,
            "last_eval_step": self._last_eval,
            "world_size": self.dist.world_size,
            "data_files": self._data_fingerprints,
        }
        if rng_by_rank is not None:
            state["rng_by_rank"] = rng_by_rank
        return state

    def _gather_rng(self) -> list[dict[str, Any]] | None:
        """Every rank's RNG state, on rank 0 (None elsewhere, and with one process): a collective,
        which every rank calls at the same step."""
        if not self.dist.enabled:
            return None
        return self.dist.gather(get_rng_state())

    def save_checkpoint(self) -> Path | None:
        self._check_weights_finite()  # on every rank (the weights are the same): they stop together
        rng_by_rank = self._gather_rng()
        if not self.dist.is_main:
            return None
        path = self._writer.save(self.training_state(rng_by_rank), self.step)
        if self.on_checkpoint is not None:
            self._writer.wait()
            self.on_checkpoint(self.step, path)
        return path

    def _check_weights_finite(self) -> None:
        """TrainingDiverged if a weight is NaN or infinite: a checkpoint holding one is not a good one.
        One read of the device, at checkpoint time only."""
        params = [p.detach() for p in unwrap(self.model).parameters()]
        if params and not bool(torch.stack([torch.isfinite(p).all() for p in params]).all()):
            raise self._diverged(f"a weight became NaN or infinite by step {self.step}")

    # -- the loop ------------------------------------------------------------------------
    def run(self) -> int:
        """Train until ``max_steps``/``max_time`` or a signal; return 0, or 128 + the signal number."""
        handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            status = self._loop()
            self._writer.wait()
            if self.metrics is not None:
                self.metrics.close()  # its last write's error, if any, is the run's
            # Rank 0 may still be writing its last checkpoint: tearing the process group down
            # under it makes gloo abort the other ranks ("terminate called without an active exception").
            self.dist.barrier()
            return status
        except (CheckpointWriteError, MetricsWriteError) as e:
            with contextlib.suppress(Exception):  # a checkpoint being written, if any, is good: named if on disk
                self._writer.wait()
            raise type(e)(f"{e}; {self._last_good_checkpoint()}") from None
        except Exception as e:
            reason = peer_stopped(e) if self.dist.enabled else None
            if reason is None:
                raise
            with contextlib.suppress(Exception):  # the checkpoint being written, if any, was good: keep it
                self._writer.wait()
            then = "; --resume continues from it" if self.ckpts.latest() else ""
            raise PeerStopped(f"{reason}; {self._last_good_checkpoint()}{then}") from e
        finally:
            self._finish_writing()  # an error on the way out, more Ctrl-Cs: the file being written is finished
            if self.metrics is not None:
                # closed on the way out of an error (a full disk may fail it again): the lock, the
                # process group and the signal handlers are released all the same
                with contextlib.suppress(OSError):
                    self.metrics.close()
            self._lock.release()
            shutdown_distributed()
            # last: under torchrun a SIGTERM follows the failure of another process, and the default
            # handler would end this one before it says why
            for s, h in handlers.items():
                signal.signal(s, h)

    def _finish_writing(self) -> None:
        """Wait for the checkpoint being written, if any, through an error and any further signal: a
        third Ctrl-C during a slow write left the wait, and ``lm``'s exit then cut the file short
        (only its temporary file left, the run's steps lost) and the lock was never released. Where
        a signal cut the run short, say that the checkpoint was finished, and where."""
        was_writing = self._writer.writing
        while True:
            try:
                self._writer.wait()
                break
            except (KeyboardInterrupt, SystemExit):  # the stop is on its way already: finish the file first
                continue
            except Exception:  # the write failed: its error is the run's (raised where the run waits)
                break
        latest = self.ckpts.latest() if was_writing and self._signal is not None and self.dist.is_main else None
        if latest is not None:
            print(f"lm train: the checkpoint being written was finished: {latest}", file=sys.stderr)

    def _last_good_checkpoint(self) -> str:
        latest = self.ckpts.latest()
        return f"the last good checkpoint is {latest}" if latest else "no checkpoint was written"

    @property
    def stop_signal(self) -> int | None:
        """The signal (SIGINT or SIGTERM) that stops or stopped this run, or None: heard by this
        process (under DDP another rank's stops this one as well, and :meth:`run` returns 128 + it)."""
        return self._signal

    def _on_signal(self, signum: int, frame: Any) -> None:
        soon = time.monotonic() - self._signal_at < SAME_STOP_SECONDS
        if self._signal is not None and signum != self._signal and soon:
            return  # a launcher passing one stop on as SIGINT then SIGTERM (torchrun under `timeout`, 1 ms apart)
        if self._signal is not None:  # a second signal: stop now, without a checkpoint
            if signum == signal.SIGINT:  # run()'s finally still waits for a checkpoint being written
                raise KeyboardInterrupt
            then = ("without a new checkpoint (the one being written is finished first)" if self._writer.writing
                    else "without a checkpoint")
            print(f"lm train: {signal.Signals(signum).name} again: stopped {then}", file=sys.stderr)
            raise SystemExit(128 + signum)  # a second SIGTERM: terminated, as the first would have been
        self._signal, self._signal_at = signum, time.monotonic()
        when = "after this step" if not self.dist.enabled else \
            f"once every process has heard, within {plural_steps(self._poll_every)}"
        what = "saving a checkpoint" if self.checkpoint_on_signal else "stopping"
        self._log(f"{signal.Signals(signum).name}: {what} {when} (again to abort)", always=True)

    def _log(self, line: str, always: bool = False) -> None:
        """A console line from rank 0; with ``quiet`` only the ``always`` ones (start, stop, end)."""
        if self.dist.is_main and (always or not self._quiet):
            try:
                self._print(line)
            except BrokenPipeError:  # `lm train ... | head`: the reader is gone; train on, silently
                silence_stdout()  # nothing fails on it again, the interpreter's last flush included
                self._print = lambda *_: None

    def _loop(self) -> int:
        cfg = self.cfg
        self._log_start()
        # a resume from this run's own checkpoint has this step saved (one from another run's
        # folder does not: a stop before the first step saves here, where --resume will look), unless
        # it changed a setting: its "config" record is written, so the checkpoint must say the same, or
        # every later resume would record the change again
        own = self._resumed_from is not None and self._resumed_from.resolve().parent == self.ckpts.dir.resolve()
        last_saved = self.step if own and not self._config_changes else -1
        saved_path = self._resumed_from if own else None  # the checkpoint of step last_saved
        last_eval = self._last_eval  # a resume at a step that was evaluated does not evaluate it again
        first_step = self.step
        window = _LogWindow(torch.zeros((), device=self.device))
        compiling = cfg.train.compile  # this process's first step compiles the training graph
        clock = self.clock()
        self._compile_evaluation()
        agreed_stop = False  # under DDP: a signal somewhere, as of the last poll
        lr, norm = self.learning_rate(), None  # the last step's, for a record of the steps before a stop
        while True:
            # the budget first: a signal during the last step's evaluation had made a finished run a stopped one
            # (exit 143, "continue with --resume", no model.safetensors; train20)
            if self.budget_spent():
                break
            if agreed_stop if self.dist.enabled else self._signal is not None:
                if window.steps:  # the steps since the last record: logged, or a resume would never report them
                    self._log_window(window, lr, norm)
                return self._stop_for_signal(window, saved=self.step == last_saved, path=saved_path)
            lr = self.learning_rate()
            loss, norm = self.train_step(lr)
            self.step += 1
            self.tokens_seen += self.step_tokens
            due = self._due()
            agreed_stop = self._time_step(window, loss, norm, clock, due, compiling)
            compiling = False
            final = self.budget_spent()
            if due.log or final:  # maybe log
                self._log_window(window, lr, norm)
            if cfg.eval.interval and (due.eval or final):  # maybe evaluate
                self._run_eval()
                last_eval = self.step
            if due.save and not final:  # maybe save
                self._check_finite(window)
                saved_path = self.save_checkpoint()
                last_saved = self.step
            clock = self.clock()  # evaluation and checkpoints are not training time
        self._finish(window, evaluated=last_eval == self.step, saved=last_saved == self.step,
                     trained=self.step > first_step, path=saved_path)
        return 0

    def _due(self) -> _Due:
        """What the step just taken is due for (by its number: the same on every rank)."""
        cfg, step = self.cfg, self.step
        return _Due(log=step % cfg.log.interval == 0,
                    eval=bool(cfg.eval.interval) and step % cfg.eval.interval == 0,
                    save=bool(cfg.checkpoint.interval) and step % cfg.checkpoint.interval == 0,
                    end=cfg.train.max_steps is not None and step >= cfg.train.max_steps)  # fmt: skip

    def _time_step(self, window: _LogWindow, loss, norm, clock: float, due: _Due, compiling: bool) -> bool:
        """Add the step to the log window and its time to the run's; whether the ranks agreed to stop.

        The device is synchronized (on a GPU) only at a step due for something, or one that
        compiled, so that the clock is true there and the queue is never drained elsewhere. A
        step that compiled is reported as compile time and not counted as training time."""
        boundary = due.log or due.eval or due.save or due.end or compiling
        if boundary:
            self._synchronize()
        seconds = self.clock() - clock
        window.add(loss, norm, self.step_tokens, seconds, timed=not compiling)
        if compiling:
            self._report_compile(seconds)
            return self._agree(0.0, poll=True)
        return self._agree(seconds, poll=boundary or self.step >= self._next_poll)

    def _log_window(self, window: _LogWindow, lr: float, norm: torch.Tensor | None) -> None:
        """The train line and record of the steps since the last: mean loss (checked finite), tokens/s, MFU."""
        mean = self._check_finite(window) / window.steps
        tok_s = window.tokens / window.seconds if window.seconds > 0 else None
        mfu = None if tok_s is None or self._peak_flops is None else \
            self._flops_per_token * tok_s / self.dist.world_size / self._peak_flops
        self._report_train(mean, lr, None if norm is None else float(norm), tok_s, mfu, window.step_seconds)
        window.reset()

    def _agree(self, seconds: float, poll: bool) -> bool:
        """Add a step's ``seconds`` to the training time; whether to stop for a signal.

        Under DDP every rank must take the same decision at the same step (ranks that disagreed
        would wait forever in different collectives), and asking the others costs a collective
        and a host–device sync. So a rank counts its seconds aside, and only at poll steps (the
        same steps on every rank: log, evaluation and checkpoint steps, the run's first step and
        its last by ``train.max_steps``, and the polls in between) one all-reduce tells everyone
        whether a signal arrived anywhere and the slowest rank's time, which is then added to
        ``elapsed``. The polls in between come at the multiples of ``POLL_STEPS``, or of fewer
        steps, about ``POLL_SECONDS`` of training, when steps are slower (decided from the agreed
        time: the same on every rank), so a signal is acted on within a few seconds even when a
        step takes seconds. One process adds
        its time at every step and reads its own signal flag before each step, for free.
        """
        self._unagreed_seconds += seconds
        self._unagreed_steps += 1
        if self.dist.enabled and not poll:
            return False
        signalled, seconds = self.dist.agree(int(self._signal or 0), self._unagreed_seconds, self.device)
        self._agreed_signal = signalled  # a rank that heard none exits as the one that did (ddp21: 143 for 130)
        self.elapsed += seconds
        if seconds > 0:  # (a compiling step's time is not training time: it decides nothing)
            per_step = seconds / self._unagreed_steps
            self._poll_every = max(1, min(POLL_STEPS, int(POLL_SECONDS / per_step)))
        self._next_poll = (self.step // self._poll_every + 1) * self._poll_every  # the next multiple
        self._unagreed_seconds, self._unagreed_steps = 0.0, 0
        return signalled > 0

    def _report_compile(self, seconds: float) -> None:
        """The first step's time with compile on (and the evaluation graph's, compiled before it)."""
        what = "the first step" if self.pairs else "the first step and an evaluation batch"
        self._log(f"compiled in {seconds:.1f} s ({what}; not counted as training time)")
        if self.metrics is not None:
            self.metrics.write({"step": self.step, "split": "compile", "seconds": round(seconds, 3)})

    def _log_start(self) -> None:
        if self._resumed_from is not None:
            self._log(f"resumed from {self._resumed_from} at step {self.step}", always=True)
        n_params = unwrap(self.model).num_parameters()
        self._log(
            f"model {n_params / 1e6:.2f}M parameters | {self.tokens_per_step:,} tokens/step | "
            f"device {self.device} | world {self.dist.world_size} | run dir {self.run_dir}"
        )
        self._log(self._determinism)
        if self._precision:
            self._log(self._precision)
        if self._peak_line:
            self._log(self._peak_line)
        if self._slow_dtype_line:
            self._log(f"warning: {self._slow_dtype_line}")
        if self.val_data is None and self.cfg.eval.interval:  # eval.interval alone evaluates nothing: said
            self._log(f"no evaluation: eval.interval is {self.cfg.eval.interval} but data.val is not set "
                      "(no val records, no checkpoints/best.pt)")

    def _stop_for_signal(self, window: _LogWindow, saved: bool, path: Path | None) -> int:
        """SIGINT/SIGTERM: save (unless this step is saved already, at ``path``), say where the run
        stopped (also when it was saved: the user was told a checkpoint would be), and return 128 +
        the signal. With ``checkpoint_on_signal=False``: no checkpoint, and no word of a resume."""
        if self.checkpoint_on_signal and not saved:
            self._check_finite(window)
            path = self.save_checkpoint()
        self._writer.wait()  # the line says it is on disk: a write that fails says so instead
        then = f"; checkpoint {path}; continue with --resume" if self.checkpoint_on_signal else ""
        self._log(f"stopped at step {self.step}{then}", always=True)
        return 128 + int(self._signal or self._agreed_signal or signal.SIGTERM)

    def _finish(self, window: _LogWindow, evaluated: bool, saved: bool, trained: bool = True,
                path: Path | None = None) -> None:
        """The end of the budget: a last evaluation and checkpoint if this step has none, and the
        exported weights (unless a resume at the budget's end found them exported already).
        ``saved``: this step's checkpoint is on disk already, at ``path``."""
        cfg = self.cfg
        if not trained:  # resumed at the end of its budget
            t = cfg.train
            limit = (f"train.max_steps {t.max_steps}" if t.max_steps is not None and self.step >= t.max_steps
                     else f"train.max_time {t.max_time:g} s")
            self._log(f"nothing left to train: step {self.step} has reached {limit}", always=True)
        if self.val_data is not None and not evaluated and cfg.eval.interval:
            self._run_eval()
            # a resume that trained nothing but evaluated its step (a record, and maybe best.pt): the
            # step's checkpoint is written again, with last_eval_step and best_val_loss of now, or every
            # later --resume would evaluate it again
            saved = False
        if not saved:
            self._check_finite(window)
            path = self.save_checkpoint()
        # the checkpoint (and best.pt) on disk before the export: weights exported beside a checkpoint
        # that failed would be newer than any checkpoint of the run
        self._writer.wait()
        done = f"done: step {self.step}, checkpoint {path}"
        if cfg.checkpoint.export_safetensors:  # what lm sample/eval --checkpoint RUN load: named (audit train8)
            if self.dist.is_main and (trained or not self._exported()):
                self._export()
            done += f"; weights {self.run_dir / 'model.safetensors'}"
        if cfg.checkpoint.keep_best and math.isfinite(self.best_val_loss) and self.ckpts.best_path.is_file():
            done += f"; best val loss {self.best_val_loss:.4f} in {self.ckpts.best_path}"
        self._log(done, always=True)

    def _export(self) -> None:
        """``model.safetensors`` of this step; a write that fails (the disk full) is one line naming it
        and the reason: the checkpoint of this step is on disk, and ``--resume`` exports it again."""
        path = self.run_dir / "model.safetensors"
        try:
            export_safetensors(self.model, path, {"step": str(self.step), "tokenizer_sha256": self.tokenizer_sha256})
        except OSError as e:
            reason = e.strerror or str(e)
            raise OSError(f"could not write {str(path)!r}: {reason[:1].lower() + reason[1:]}; the checkpoint of "
                          f"step {self.step} is written: `lm train --resume` exports it again") from None

    def _exported(self) -> bool:
        """``model.safetensors`` holds the weights of this step already."""
        try:
            return exported_step(self.run_dir / "model.safetensors") == self.step
        except ValueError:  # missing or unreadable: export again
            return False

    def _check_finite(self, window: _LogWindow) -> float:
        """The window's summed loss as a float (over ranks); TrainingDiverged (before anything is
        saved) if it, or a gradient norm of the window, is not finite. The one place the host waits
        for the device between log lines: the steps themselves never do."""
        loss, norms = self.dist.all_mean(torch.stack([window.loss_sum, window.norm_sum])).tolist()
        if not math.isfinite(norms):
            raise self._diverged(f"the gradient norm became {norms} by step {self.step}")
        if not math.isfinite(loss):
            raise self._diverged(f"the loss became {loss} by step {self.step}")
        return loss

    def _diverged(self, what: str) -> TrainingDiverged:
        with contextlib.suppress(Exception):  # the checkpoint being written, if any, was good: keep it
            self._writer.wait()
        return TrainingDiverged(f"{what}; {self._last_good_checkpoint()}. Lower optim.max_lr, raise "
                                "optim.warmup_iters or set optim.grad_clip")

    def _report_train(self, loss: float, lr: float, norm: float | None, tok_s: float | None, mfu: float | None,
                      step_s: float | None):
        t = self.cfg.train
        remaining = []
        if t.max_steps is not None and step_s is not None:
            remaining.append((t.max_steps - self.step) * step_s)
        if t.max_time is not None:
            remaining.append(t.max_time - self.elapsed)
        eta = format_duration(max(0.0, min(remaining))) if remaining else "?"  # ? after a compile step alone
        total = f"/{t.max_steps}" if t.max_steps is not None else ""
        speed = "compile step" if tok_s is None else f"{tok_s:,.0f} tok/s | MFU " + \
            ("?" if mfu is None else f"{100 * mfu:.1f}%")  # ?: a GPU of no known peak (see peak_line)
        self._log(f"step {self.step}{total} | loss {loss:.4f} | lr {lr:.2e} | {speed} | ETA {eta}")
        if (not self._said_behind_clock and t.max_time is not None and t.max_steps is not None
                and self.schedule_position() > self.step):  # the startup line said when; this says it happened
            self._said_behind_clock = True
            self._log(f"step {self.step}: the steps fell behind train.max_steps {t.max_steps} in train.max_time "
                      f"{t.max_time:g} s; the learning rates follow the clock from here, so a rerun or --resume may "
                      "not be bitwise the same", always=True)
        if self.metrics is not None:
            self.metrics.write(
                {
                    "step": self.step,
                    "split": "train",
                    "loss": loss,
                    "lr": lr,
                    "grad_norm": norm,
                    "tokens": self.tokens_seen,
                    "time": round(self.elapsed, 3),
                    "tok_per_s": tok_s,
                    "mfu": mfu,
                }
            )

    def _run_eval(self) -> None:
        result = self.evaluate()
        if result is None:
            return
        if not math.isfinite(result["loss"]):
            # already the mean over ranks: every rank stops here, with no collective on a CPU
            # tensor (which nccl refuses)
            raise self._diverged(f"the validation loss became {result['loss']} at step {self.step}")
        bpb = f" | bpb {result['bpb']:.4f}" if result["bpb"] is not None else ""
        self._log(f"eval step {self.step} | val loss {result['loss']:.4f} | ppl {result['ppl']:.2f}{bpb}")
        if self.metrics is not None:
            self.metrics.write(
                {
                    "step": self.step,
                    "split": "val",
                    **result,
                    "tokens": self.tokens_seen,
                    "time": round(self.elapsed, 3),
                }
            )
        self._last_eval = self.step
        if result["loss"] < self.best_val_loss:
            self.best_val_loss = result["loss"]
            if self.cfg.checkpoint.keep_best:
                self._check_weights_finite()
                rng_by_rank = self._gather_rng()
                if self.dist.is_main:
                    self._writer.save_best(self.training_state(rng_by_rank))


def train(cfg: Config, *, resume: bool | str | os.PathLike = False) -> int:
    """Build a :class:`Trainer` and run it; the exit status (0, or 128 + a signal number). A loss that
    stops being finite raises :class:`TrainingDiverged` (``lm train`` exits 3)."""
    return Trainer(cfg, resume=resume).run()


def _named(key: str, open_data: Callable[..., Any], path, *args, **kwargs) -> Any:
    """``open_data(path, *args, **kwargs)``, its one-line errors prefixed with the config key of the
    file (unless they name it already); a relative path that is not there is said to be read from
    the working directory (a config's paths are not relative to the config file)."""
    try:
        return open_data(path, *args, **kwargs)
    except (ValueError, OSError) as e:
        # a pair file's errors name it already, as "data.train ('PATH'): ..."
        message = str(e) if str(e).startswith((f"{key}:", f"{key} (")) else f"{key}: {e}"
        if not Path(path).is_absolute() and not Path(path).exists():
            message += f" (a config's paths are read from the working directory, {os.getcwd()!r})"
        raise ValueError(message + _none_hint(key, path)) from None


def _none_hint(key: str, path) -> str:
    """For a path spelled ``none`` or ``null`` that is not there (``val = "none"`` in a config file,
    where TOML has no null): how to go without the key (train20)."""
    if str(path).strip().lower() not in ("none", "null") or Path(path).exists():
        return ""
    return (f"; a config file's \"none\" is a file name: to go without {key}, take its line out or pass "
            f"--set {key}=none")


def _saved_step(path: Path) -> int | None:
    """The step (``iteration``) a training checkpoint was written at, read without loading its
    tensors; None for a file that is not there, cannot be read so, or holds none."""
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - truncated, another format, garbage: no step to tell
        return None
    step = state.get("iteration") if isinstance(state, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


@contextlib.contextmanager
def _out_dir_error(run_dir: Path, what: str):
    """An OSError on the run folder as one line naming train.out_dir, the folder, the reason, and
    the file it was about when that is another (a parent being made, the lock)."""
    try:
        yield
    except OSError as e:
        reason = e.strerror or str(e)
        reason = reason[:1].lower() + reason[1:]
        about = f" ({str(e.filename)!r})" if e.filename and Path(e.filename) != run_dir else ""
        raise ValueError(f"train.out_dir: {what} {str(run_dir)!r}: {reason}{about}") from None


class _Due(NamedTuple):
    """What a step is due for: a train log line, an evaluation, a checkpoint; whether it is the
    run's last by ``train.max_steps`` (its time must be agreed on before the last record)."""

    log: bool
    eval: bool
    save: bool
    end: bool = False


class _LogWindow:
    """The steps since the last train log line: their summed loss and gradient norms (on the
    device: NaN or inf stays in a sum), and the tokens and seconds of the timed ones (a step that
    compiled is not)."""

    def __init__(self, loss_sum: torch.Tensor):
        self.loss_sum = loss_sum
        self.norm_sum = torch.zeros_like(loss_sum)
        self.reset()

    def add(self, loss: torch.Tensor, norm: torch.Tensor | None, tokens: int, seconds: float,
            timed: bool = True) -> None:
        self.loss_sum += loss
        if norm is not None:
            self.norm_sum += norm
        self.steps += 1
        if timed:
            self.timed_steps += 1
            self.tokens += tokens
            self.seconds += seconds

    @property
    def step_seconds(self) -> float | None:
        """Seconds per timed step; None when every step of the window compiled."""
        return self.seconds / self.timed_steps if self.timed_steps else None

    def reset(self) -> None:
        self.loss_sum.zero_()
        self.norm_sum.zero_()
        self.steps, self.timed_steps, self.tokens, self.seconds = 0, 0, 0, 0.0
