"""Mutation testing of the modules whose correctness is the product, with mutmut.

    pip install -e ".[mutation]"
    python scripts/mutation.py                          # every target, HEAD's code and tests
    python scripts/mutation.py --targets sampling optim # some of them
    python scripts/mutation.py --tests-rev 2d3fe2d --sample 40 --out before.json  # today's code, older tests
    python scripts/mutation.py --list                   # the targets and the tests each one runs

mutmut changes the code one small edit at a time (a ``<`` made ``<=``, a constant changed, an
argument dropped...) and runs the tests against each such *mutant*: a mutant that no test fails
on has *survived*, and is either a blind spot of the tests or an edit that changes nothing
observable (an *equivalent* mutant). docs/mutation.md lists the survivors and what became of
each.

Nothing here touches the working tree. Each target gets its own copy of the repository at
``--rev`` (``git archive``; ``--rev WORKTREE`` copies the tracked files as they are on disk), a
``[tool.mutmut]`` section naming the file(s) to mutate (``--tests-rev`` takes ``tests/`` from another
revision, to measure what a change of the tests alone did) and a subset of the tests that exercise
them, and its own mutmut run. mutmut forks each mutant's test run from a process that has
already imported torch and collected the tests, and runs only the tests that call the mutated
function, so a mutant costs well under a second to a few seconds. Still, the whole list takes
an hour or more on two cores: it is not part of CI. ``--sample N`` draws N mutants per target
(seeded), ``--time-limit`` caps each target's run, and mutants left unchecked are reported as
such, never as killed.

Every option is checked before a copy is made (a revision that does not exist, a --functions name
defined in none of the targets' files, an existing --out without --overwrite...). The summary is
written via a temporary name; without --workdir the copies and logs are removed at the end, so
their paths are neither printed nor stored.

Exit status: 0, whatever survived (the report is the result); 2 on a usage or setup error.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Target:
    files: list[str]  # the modules to mutate
    tests: list[str]  # pytest arguments that select the tests run against them
    functions: list[str] = field(default_factory=list)  # only these functions' mutants (default: all);
    # a method is Class.method
    note: str = ""
    # (file, old, new) edits of the copy before mutmut reads it: mutmut leaves alone every function
    # with a decorator other than @staticmethod/@classmethod, so those decorators are taken off and,
    # where they matter, re-applied after the class (see UNDECORATE)
    prepare: list[tuple[str, str | None, str]] = field(default_factory=list)  # old None: append new


def _rewrapped(file: str, decorator: str, names: tuple[str, ...], owner: str | None = None) -> list:
    """Edits that take ``@decorator`` off each function of ``names`` in ``file`` (methods of class
    ``owner``) and apply it again at the end of the module, around mutmut's trampoline."""
    indent, prefix = ("    ", f"{owner}.") if owner else ("", "")
    return [(file, f"{indent}@{decorator}\n{indent}def {name}(", f"{indent}def {name}(") for name in names] + [
        (file, None, "\n\n" + "".join(f"{prefix}{n} = {decorator}({prefix}{n})  # for mutmut\n" for n in names))]


# torch.no_grad() on AdamW.step and clip_grad_norm_ is needed (in-place updates of leaves and their
# gradients), so it is applied again to the class attribute and the module's name, i.e. around
# mutmut's trampoline. (The losses' backward passes were once_differentiable, taken off here too, until
# they became differentiable again: api22.)
UNDECORATE = {
    "optim": [("lm/optim/adamw.py", "    @torch.no_grad()\n    def step(", "    def step("),
              ("lm/optim/adamw.py", "\n\ndef param_groups(",
               "\n\nAdamW.step = torch.no_grad()(AdamW.step)  # for mutmut\n\n\ndef param_groups(")]
    + _rewrapped("lm/optim/clip.py", "torch.no_grad()", ("clip_grad_norm_",)),
    # greedy decoding and both beam searches, evaluation and the serving engine's steps
    "beam": _rewrapped("lm/generate/seq2seq.py", "torch.inference_mode()",
                       ("greedy_decode", "beam_search", "beam_search_nbest")),
    "evaluate": _rewrapped("lm/evaluate.py", "torch.no_grad()", ("evaluate_tokens", "evaluate_pairs")),
    "serve_engine": _rewrapped("lm/serve/engine.py", "torch.inference_mode()", ("_invariant_sizes", "step"),
                               owner="Engine"),
    "checkpoint": _rewrapped("lm/checkpoint/io.py", "contextlib.contextmanager", ("safetensors_name",)),
    "io": _rewrapped("lm/io.py", "contextlib.contextmanager",
                     ("atomic_write", "atomic_files", "_naming", "writing_out", "interrupts_deferred",
                      "unchanged_while", "replace_dir", "removing_made_dirs", "claim_dir")),
    # the trainer's setup, data checks, evaluation and logging: evaluation runs without gradients, the
    # signal and step-time reads are properties, and the out_dir errors a context manager
    "train_setup": _rewrapped("lm/train/trainer.py", "torch.no_grad()", ("evaluate", "_compile_evaluation"),
                              owner="Trainer")
    + _rewrapped("lm/train/trainer.py", "property", ("stop_signal",), owner="Trainer")
    + _rewrapped("lm/train/trainer.py", "property", ("step_seconds",), owner="_LogWindow")
    + _rewrapped("lm/train/trainer.py", "contextlib.contextmanager", ("_out_dir_error",)),
    "run_files": _rewrapped("lm/train/run_dir.py", "property", ("held",), owner="RunLock"),
    # the commands' bodies (set_defaults wraps them again all the same)
    "cli_model": [edit for file, name in (("lm/cli/sample.py", "cmd_sample"), ("lm/cli/evaluate.py", "cmd_eval"),
                                          ("lm/cli/translate.py", "cmd_translate"))
                  for edit in _rewrapped(file, "quiet_on_closed_pipe", (name,))],
    "cli_data": _rewrapped("lm/cli/tokenizer.py", "contextlib.contextmanager", ("_out_errors",)),
    "cli_common": _rewrapped("lm/cli/common.py", "contextlib.contextmanager",
                             ("as_flags", "model_fits", "reading_stdin")),
    # the pre-tokenizer's cached builders (caches made around the trampoline: each mutant is a process of
    # its own, forked before any test filled them)
    "pretokenize": _rewrapped("lm/tokenizer/pretokenize.py", "functools.cache", ("_fast_patterns",))
    + _rewrapped("lm/tokenizer/pretokenize.py", "functools.lru_cache(maxsize=16)", ("_special_bytes_regex",)),
    "distributed": _rewrapped("lm/train/distributed.py", "property", ("enabled", "is_main"), owner="Dist"),
    "workers": _rewrapped("lm/tokenizer/workers.py", "contextlib.contextmanager", ("parallel_map",)),
    # generate() has two decorators; both go back on, in their order
    "generate": [("lm/generate/engine.py", "@_in_eval_mode\n@torch.inference_mode()", ""),
                 ("lm/generate/engine.py", None,
                  "\n\ngenerate = _in_eval_mode(torch.inference_mode()(generate))  # for mutmut\n")],
}


# the training tests that run `lm train` in processes they signal, kill or restrict, torchrun's, one in a
# folder of its own, and the rendezvous's two: left out of the targets below (mutmut cannot run them; see
# "io"). test_train_ddp's others are rank 0 of two over a one-process gloo group, in this process.
TRAIN_PROCESSES = ("not closed_stdout_pipe and not read_only_parent_of_out_dir and not gloo and not sigkill"
                   " and not signal_saves_a_checkpoint_and_resume and not pair_data_errors_name_the_config_key"
                   " and not a_peer_that_never_joins and not a_port_in_use")
# the tests that start `lm serve` as a process
SERVE_PROCESSES = ("not failing_model_fails_its_requests_and_the_server_exits and not second_signal_exits_at_once"
                   " and not lm_serve_dtype_bfloat16 and not lm_serve_quiet_on_port_0"
                   " and not serve_refuses_bad_arguments and not sigterm_finishes_requests"
                   " and not start_server_fails_naming and not serves_a_translation_checkpoint")
# test_api_docs's --check, run as a process (its in-process test of docs/cli.md is the one that matters)
DOCS_PROCESS = "not the_reference_is_what_the_generator_writes"
# the tokenizer commands' tests that start `lm` in a folder of their own (drawn by recording each test's
# subprocesses and their cwd)
TOKENIZE_PROCESSES = "not sigterm_stops_like_ctrl_c and not workers_die_with_a_killed_parent"
# those, the other command test that does, and compiled runs (slow)
CLI_PROCESSES = ("not compile and not help_and_version_that_cannot_be_written_are_an_error"
                 f" and {TOKENIZE_PROCESSES} and {DOCS_PROCESS}")
RUN_PROCESSES = (f"{TRAIN_PROCESSES} and {SERVE_PROCESSES} and {DOCS_PROCESS}"
                 " and not help_and_version_that_cannot_be_written_are_an_error")


TARGETS: dict[str, Target] = {
    # test_seq2seq: label smoothing and ignore_index of the losses, cross-attention and its cache
    # test_func: the losses and the embedding under torch.func transforms (their own paths)
    "functional": Target(["lm/nn/functional.py"],
                         ["tests/test_nn.py", "tests/test_seq2seq.py", "tests/test_func.py", "-k", "not compile"],
                         note="softmax, activations, attention, dropout and the losses (hand-written backwards)"),
    "layers": Target(["lm/nn/norm.py", "lm/nn/rope.py", "lm/nn/attention.py", "lm/nn/ffn.py", "lm/nn/linear.py"],
                     ["tests/test_nn.py", "tests/test_model.py", "tests/test_seq2seq.py", "tests/test_func.py", "-k",
                      "not compile"]),
    "optim": Target(["lm/optim/adamw.py", "lm/optim/clip.py", "lm/optim/schedule.py"],
                    ["tests/test_optim.py", "-k", "not overfits"]),
    "sampling": Target(["lm/generate/sampling.py"], ["tests/test_generate.py"]),
    "bpe": Target(["lm/tokenizer/train.py"],
                  ["tests/test_tokenizer_train.py", "-k", "brute_force or sennrich or order or merge_bar"],
                  functions=["merge_counts"], note="the BPE merge loop"),
    # with the pair weights (test_seq2seq_train) and DDP's once-a-step reduction (test_train_ddp's rank of two)
    "train_step": Target(["lm/train/trainer.py"],
                         ["tests/test_train.py", "tests/test_seq2seq_train.py", "tests/test_train_ddp.py", "-k",
                          "(accumulation or training_run_writes or bfloat16_autocast or diverging or torch_adamw_clip"
                          " or accumulated_pair or pair_training_step_never_waits or reduces_gradients_once)"
                          " and not two_gloo_processes"],
                         functions=["Trainer.train_step"], note="the trainer's optimizer step"),
    "transformer": Target(["lm/model/transformer.py"], ["tests/test_model.py", "tests/test_seq2seq.py", "-k",
                                                        "not compile"],
                          note="the decoder-only model: positions, its input checks, parameter and FLOP counts"),
    "seq2seq": Target(["lm/model/seq2seq.py"], ["tests/test_seq2seq.py", "tests/test_translate.py"],
                      note="the encoder-decoder: against torch.nn.Transformer and an independent reference"),
    # (not the peak-memory test: the fresh process it measures imports mutmut's rewritten copy of lm, whose
    # peak measured 166-192 MB where lm's is 270-291 MB, under the test's floor of 200 MB: mutmut's stats failed)
    "beam": Target(["lm/generate/seq2seq.py"], ["tests/test_translate.py", "tests/test_seq2seq.py", "-k",
                                                "not decoding_bytes_is_not_below_the_memory_decoding_takes"],
                   note="greedy decoding, beam search (against brute force) and the seq2seq cache"),
    "static": Target(["lm/generate/static.py"],
                     ["tests/test_generate.py", "tests/test_seq2seq.py",
                      "tests/test_server.py::test_the_counted_cache_is_the_one_the_engine_makes", "-k", "not compile"],
                     note="the fixed-shape decode step and its cache (eager; compiled steps are slow tests)"),
    "tokenizer": Target(["lm/tokenizer/tokenizer.py", "lm/tokenizer/vectorized.py"],
                        ["tests/test_tokenizer.py", "tests/test_tokenizer_vectorized.py"],
                        note="encoding and decoding (against tiktoken and the textbook merge loop)"),
    "pairs": Target(["lm/data/pairs.py"], ["tests/test_pairs.py"],
                    note="parallel corpora: pair files, length filtering, padded batches"),
    "evaluate": Target(["lm/evaluate.py"], ["tests/test_eval.py"], note="perplexity and BLEU/chrF (against sacrebleu)"),
    # one test checks that a failed engine is freed without the cyclic collector; under mutmut's
    # trampolines (a frame more per call) it is not, so mutmut's first, unmutated run would fail
    # (and the /metrics histogram's tests of Stats, which test_server holds)
    "serve_engine": Target(["lm/serve/engine.py"],
                           ["tests/test_serve.py", "tests/test_serve_translation.py",
                            "tests/test_server.py::test_metrics_print_a_float_in_full",
                            "tests/test_server.py::test_a_first_token_slower_than_the_last_bucket_is_counted_in_inf_only",
                            "-k", "not a_failed_engine_is_freed_without_the_collector"],
                           note="continuous batching: admission, per-row sampling, stops, cancellation"),
    "checkpoint": Target(["lm/checkpoint/io.py", "lm/checkpoint/manager.py"],
                         ["tests/test_checkpoint.py", "tests/test_checkpoint_files.py",
                          "tests/test_checkpoint_integrity.py", "tests/test_train_resume.py", "tests/test_sample.py",
                          "tests/test_inference.py"],
                         note="checkpoint files: checksums, damaged and mismatched files, rotation, atomic writes"),
    "protocol": Target(["lm/serve/protocol.py"],
                       ["tests/test_serve_protocol.py", "tests/test_server.py", "tests/test_serve_fuzz.py"],
                       note="the OpenAI request fields, their errors, stop strings and response bodies"),
    # generate(compile=True)'s static rows: a test runs them with torch.compile as the identity
    "generate": Target(["lm/generate/engine.py", "lm/generate/kv_cache.py"],
                       ["tests/test_generate.py", "tests/test_sample.py", "-k", "not compile"],
                       note="generate(): prompts, padded and static rows, the KV cache"),
    "data": Target(["lm/data/batch.py", "lm/data/token_file.py"], ["tests/test_data.py"],
                   note="token files and their sidecars, random and fixed batches"),
    # the commands run in this process; those that run `python -m lm` in a folder of their own are left
    # out (there the mutant's trampoline finds no [tool.mutmut] section: every one fails, mutated or not)
    "io": Target(["lm/io.py"],
                 ["tests/test_io_claim_dir.py", "tests/test_data.py", "tests/test_checkpoint.py",
                  "tests/test_checkpoint_files.py", "tests/test_cli_common.py", "tests/test_tokenizer_cli.py", "-k",
                  f"not cannot_be_written and {TOKENIZE_PROCESSES}"],
                 note="nothing is lost: atomic writes, claimed and replaced folders, inputs unchanged while read"),
    # the HTTP layer over a server in this process; the tests that start `lm serve` are left out (as for io)
    "serve_app": Target(["lm/serve/app.py"],
                        ["tests/test_server.py", "tests/test_serve_fuzz.py", "tests/test_serve_translation.py", "-k",
                         SERVE_PROCESSES],
                        note="lm serve's HTTP layer: routes, streaming, errors, body limits, metrics, origins"),
    # what keeps a run reproducible and its checkpoints whole across stops and resumes; left out: the tests
    # that run `lm train` in processes they signal, kill or restrict, torchrun's, and one in a folder of its own
    "train_run": Target(["lm/train/trainer.py"],
                        ["tests/test_train.py", "tests/test_train_resume.py", "tests/test_train_loop.py",
                         "tests/test_train_bookkeeping.py", "tests/test_train_claims.py", "tests/test_determinism.py",
                         "tests/test_seq2seq_train.py", "tests/test_train_ddp.py", "-k", TRAIN_PROCESSES],
                        functions=[f"Trainer.{f}" for f in (
                            "_open_run", "_read_for_resume", "_load", "_load_rng", "_same_data", "_check_same_data",
                            "_check_world_size", "_check_max_steps", "_check_tokenizer", "_undo_fresh_start",
                            "_prepare_run_dir", "schedule_position", "learning_rate", "budget_spent",
                            "training_state", "save_checkpoint", "_check_weights_finite", "run", "_finish_writing",
                            "_last_good_checkpoint", "_loop", "_due", "_stop_for_signal", "_finish")]
                        + ["_saved_step", "check_resume", "rank_seed"],
                        note="the run around the step: resume checks, the schedule's position, checkpoints, stops"),
    # the rest of trainer.py (train_step and train_run have the step and the run around it), with train_run's tests
    "train_setup": Target(["lm/train/trainer.py"],
                          ["tests/test_train.py", "tests/test_train_resume.py", "tests/test_train_loop.py",
                           "tests/test_train_bookkeeping.py", "tests/test_train_claims.py", "tests/test_determinism.py",
                           "tests/test_seq2seq_train.py", "tests/test_train_ddp.py", "-k", TRAIN_PROCESSES],
                          functions=["plural_steps", "peer_stopped", "_dist_error_words", "autocast_dtype", "train",
                                     "_named", "_none_hint", "_out_dir_error", "TrainingInterrupted.__init__"]
                          + [f"Trainer.{f}" for f in (
                              "__init__", "_check_data", "_check_pair_budgets", "_build_model_and_optimizer",
                              "_take_run_folder", "_give_back_run_folder", "_decided_by_rank_zero",
                              "_wrap_for_devices", "_plan_steps_and_evaluation", "_open_data", "_unreadable_hint",
                              "_join", "_next_batch", "_pair_weights", "evaluate", "_pair_val_loss", "_val_loss",
                              "_compile_evaluation", "_synchronize", "_gather_rng", "stop_signal", "_on_signal",
                              "_log", "_time_step", "_log_window", "_agree", "_report_compile", "_log_start",
                              "_export", "_exported", "_check_finite", "_diverged", "_report_train", "_run_eval")]
                          + [f"_LogWindow.{f}" for f in ("__init__", "add", "step_seconds", "reset")],
                          note="the run's setup, data checks, evaluation and logs (all of trainer.py but the above)"),
    # the run folder (what may be started in it, its lock) and metrics.jsonl
    "run_files": Target(["lm/train/run_dir.py", "lm/train/metrics.py"],
                        ["tests/test_train_claims.py", "tests/test_train_bookkeeping.py", "tests/test_train_resume.py",
                         "tests/test_train.py", "tests/test_train_loop.py", "tests/test_plot.py",
                         "tests/test_io_claim_dir.py", "-k", TRAIN_PROCESSES],
                        note="run folders: what holds a run, the lock, records and their truncation on resume"),
    # the commands that load a model, and those that make data, run in this process by main([...]) (with the
    # docstring examples and test_cli_common's checks of every command's options); left out: compiled runs
    # (slow), and the three tests that start `lm` in a folder of their own
    "cli_model": Target(["lm/cli/sample.py", "lm/cli/evaluate.py", "lm/cli/translate.py", "lm/cli/export.py"],
                        ["tests/test_sample.py", "tests/test_eval.py", "tests/test_translate.py",
                         "tests/test_export_hf.py", "tests/test_doctests.py", "tests/test_cli_common.py",
                         "tests/test_api_docs.py", "-k",
                         "not compile and not help_and_version_that_cannot_be_written_are_an_error"
                         # cmd_sample is wrapped here around mutmut's trampoline, itself a wrapper
                         " and not wrapped_for_a_closed_pipe_once"
                         f" and {DOCS_PROCESS}"],
                        note="lm sample, eval, translate and export: their options, inputs, outputs and refusals"),
    "cli_data": Target(["lm/cli/tokenizer.py", "lm/cli/data.py"],
                       ["tests/test_tokenizer_cli.py", "tests/test_download.py", "tests/test_download_multi30k.py",
                        "tests/test_pairs.py", "tests/test_cli_common.py", "tests/test_doctests.py",
                        "tests/test_api_docs.py", "-k",
                        f"{TOKENIZE_PROCESSES} and not help_and_version_that_cannot_be_written_are_an_error"
                        f" and {DOCS_PROCESS}"],
                       note="lm tokenizer train, lm tokenize and lm data download: inputs, outputs, refusals"),
    # what every command shares (lm.cli.common: the grammar, errors in the command line's words, a closed
    # pipe) and `lm` itself (its parser, main, standard streams), with the commands' in-process tests
    "cli_common": Target(["lm/cli/common.py", "lm/cli/__init__.py"],
                         ["tests/test_cli_common.py", "tests/test_doctests.py", "tests/test_sample.py",
                          "tests/test_eval.py", "tests/test_tokenizer_cli.py", "tests/test_export_hf.py",
                          "tests/test_plot.py", "tests/test_translate.py", "tests/test_api_docs.py", "-k",
                          CLI_PROCESSES],
                         note="the grammar every command shares, its errors, lm's parser and standard streams"),
    # lm train, lm plot, lm serve (its checks and start; the server itself is serve_app's) and lm demo
    "cli_run": Target(["lm/cli/train.py", "lm/cli/serve.py", "lm/cli/demo.py"],
                      ["tests/test_train.py", "tests/test_train_resume.py", "tests/test_train_claims.py",
                       "tests/test_train_ddp.py", "tests/test_seq2seq_train.py", "tests/test_plot.py",
                       "tests/test_demo.py", "tests/test_server.py", "tests/test_serve_translation.py",
                       "tests/test_cli_common.py",
                       "tests/test_doctests.py", "tests/test_api_docs.py", "-k", RUN_PROCESSES],
                      note="lm train, plot, serve and demo: their options, checks and exits"),
    # the modules no target above mutates (sampled first on 2026-12-06)
    "blocks": Target(["lm/nn/block.py", "lm/nn/embedding.py"],
                     ["tests/test_nn.py", "tests/test_model.py", "tests/test_seq2seq.py", "tests/test_func.py", "-k",
                      "not compile"],
                     note="the pre-norm and post-norm blocks, norms by name, the embedding and its backward"),
    "model_config": Target(["lm/model/config.py", "lm/tomlio.py"],
                           ["tests/test_tomlio.py", "tests/test_model.py", "tests/test_seq2seq.py",
                            "tests/test_train_config.py",
                            "tests/test_checkpoint_integrity.py", "tests/test_export_hf.py", "-k", "not compile"],
                           note="model configs: sizes checked, JSON and TOML round trips, TOML written by hand"),
    "train_aux": Target(["lm/train/flops.py", "lm/train/memory.py", "lm/train/determinism.py",
                         "lm/train/data_identity.py"],
                        ["tests/test_model.py", "tests/test_determinism.py", "tests/test_train.py",
                         "tests/test_train_bookkeeping.py", "tests/test_train_resume.py", "tests/test_train_ddp.py",
                         "tests/test_cli_common.py", "-k", f"{TRAIN_PROCESSES} and {CLI_PROCESSES}"],
                        note="peak FLOPs and MFU, step memory, deterministic runs, which data a run read"),
    "checkpoint_aux": Target(["lm/checkpoint/background.py", "lm/checkpoint/rng.py", "lm/checkpoint/export.py",
                              "lm/generate/load.py", "lm/generate/text.py"],
                             ["tests/test_checkpoint.py", "tests/test_checkpoint_files.py", "tests/test_inference.py",
                              "tests/test_sample.py", "tests/test_train_loop.py", "tests/test_train_ddp.py",
                              "tests/test_serve_fuzz.py", "-k", f"{TRAIN_PROCESSES} and not compile"],
                             note="checkpoints written in the background, RNG states, exported weights, loading"
                                  " a model by path, text streamed token by token"),
    "checks": Target(["lm/checks.py", "lm/device.py"],
                     ["tests/test_plot_and_device.py", "tests/test_train_config.py", "tests/test_nn.py",
                      "tests/test_generate.py", "tests/test_train.py", "tests/test_train_claims.py",
                      "tests/test_serve.py", "-k",
                      f"{TRAIN_PROCESSES} and not compile and not a_failed_engine_is_freed_without_the_collector"],
                     note="the argument checks every public function shares, devices, dtypes and threads"),
    "pretokenize": Target(["lm/tokenizer/pretokenize.py", "lm/tokenizer/byte_unicode.py", "lm/tokenizer/files.py"],
                          ["tests/test_tokenizer.py", "tests/test_tokenizer_train.py",
                           "tests/test_tokenizer_vectorized.py", "tests/test_tokenizer_cli.py", "-k",
                           TOKENIZE_PROCESSES],
                          note="pre-tokenization (GPT-2's pattern, special tokens), byte-to-unicode, vocab files"),
    "hf_export": Target(["lm/export/hf.py"], ["tests/test_export_hf.py"],
                        note="export to Hugging Face transformers (against LlamaForCausalLM)"),
    # (left out: two tests that set tokenize_file's keyword defaults, which mutmut's trampoline has none of)
    "dataset": Target(["lm/data/dataset.py", "lm/data/tokenize.py"],
                      ["tests/test_data.py", "tests/test_generate.py", "tests/test_train_bookkeeping.py",
                       "tests/test_tokenizer_cli.py", "-k",
                       f"{TRAIN_PROCESSES} and not compile and {TOKENIZE_PROCESSES}"
                       " and not an_input_changed_while_it_is_tokenized"
                       " and not told_at_its_callers_line"  # a warning's stacklevel: mutmut's trampoline calls
                       " and not a_worker_that_dies_is_one_line"],
                      note="a token file as a dataset (windows, fixed evaluation batches) and lm tokenize's encoder"),
    "serve_translation": Target(["lm/serve/translation.py"],
                                ["tests/test_serve_translation.py", "tests/test_serve_fuzz.py", "-k", SERVE_PROCESSES],
                                note="the serving engine of an encoder-decoder: source lengths, its cache, banned ids"),
    "plot": Target(["lm/train/plot.py", "lm/nn/choices.py"],
                   ["tests/test_plot.py", "tests/test_plot_and_device.py", "tests/test_nn.py", "-k",
                    f"not compile and {DOCS_PROCESS}"],
                   note="lm plot's records, labels and figure; the layers' named choices"),
    # (sampled first on 2026-12-06, late) downloads against a local HTTP server in this process, and
    # lm demo's data, baseline and report with its synthetic stories (the stories' pronoun properties
    # stay decorated: mutmut leaves them alone)
    "download": Target(["lm/data/download.py"], ["tests/test_download.py", "tests/test_download_multi30k.py"],
                       note="resumable downloads: probes, retries, sizes and checksums, partial files held"),
    "demo": Target(["lm/demo/pipeline.py", "lm/demo/stories.py"], ["tests/test_demo.py", "tests/test_stories.py"],
                   note="lm demo's corpus, split, unigram baseline and report; the synthetic stories"),
    # the tokenizer's worker processes (forked: a mutant runs in them too); left out, the two tests that
    # start `lm` in a folder of their own
    "workers": Target(["lm/tokenizer/workers.py"],
                      ["tests/test_tokenizer_cli.py", "tests/test_tokenizer_train.py", "tests/test_pairs.py", "-k",
                       TOKENIZE_PROCESSES],
                      note="the tokenizer's worker pool: task order, failures, Ctrl-C, closing, a dead worker"),
    # torchrun's variables and the process group, with the tests of rank 0 of two over a one-process gloo
    # group in this process and the resumes of other world sizes (the training process tests left out)
    "distributed": Target(["lm/train/distributed.py"],
                          ["tests/test_train_ddp.py", "tests/test_train_resume.py",
                           "tests/test_train.py::test_under_torchrun_only_local_rank_0_says_why_a_run_cannot_start",
                           "-k", TRAIN_PROCESSES],
                          note="torchrun's environment, the process group, reductions and the ranks' agreement"),
    # how tests and benchmarks start `lm serve`, against a stand-in for it that the test's process starts
    "serve_process": Target(["lm/serve/process.py"], ["tests/test_serve_process.py"],
                            note="starting lm serve as a process: its own /health, errors naming the port"),
    "train_config": Target(["lm/train/config.py"],
                           ["tests/test_train_config.py", "tests/test_train.py", "tests/test_train_claims.py",
                            "tests/test_train_bookkeeping.py", "tests/test_train_loop.py"],
                           note="training configs: types, values, overrides, what a resume may change"),
}

for _name, _edits in UNDECORATE.items():
    TARGETS[_name].prepare = _edits

# mutmut's verdict for a mutant's test-run exit code (mutmut.stats.status_by_exit_code, 3.x)
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped", 36: "timeout",
          37: "caught by type check", -24: "timeout", 24: "timeout", 152: "timeout", 255: "timeout",
          -11: "segfault", -9: "segfault", None: "not checked"}

ALSO_COPY = ["README.md", "docs/", "configs/", "scripts/", "notebooks/", "data/"]
PYTEST_ARGS = ["-x", "-q", "-p", "no:cacheprovider", "-m", "not slow"]


class SetupError(Exception):
    """A usage or setup error: one line, exit status 2."""


def resolve(rev: str | None, argument: str) -> str | None:
    """``rev`` as a short commit id (WORKTREE and None as they are), or a SetupError naming ``argument``."""
    if rev in (None, "WORKTREE"):
        return rev
    r = subprocess.run(["git", "rev-parse", "--verify", "--quiet", "--short", f"{rev}^{{commit}}"], cwd=REPO,
                       capture_output=True, text=True)  # fmt: skip
    if r.returncode != 0:
        raise SetupError(f"{argument}: {rev!r} is not a revision of this repository")
    return r.stdout.strip()


def functions_in(rev: str, files: list[str]) -> set[str]:
    """The functions and methods (``Class.method``) defined at the top of ``files`` at ``rev``."""
    names = set()
    for name in files:
        if rev == "WORKTREE":
            text = (REPO / name).read_text()
        else:
            text = subprocess.run(["git", "show", f"{rev}:{name}"], cwd=REPO, capture_output=True, text=True,
                                  check=True).stdout  # fmt: skip
        for node in ast.parse(text).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, ast.ClassDef):
                names.update(f"{node.name}.{f.name}" for f in node.body
                             if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)))  # fmt: skip
    return names


def is_summary(path: Path) -> bool:
    """Whether ``path`` holds a summary this script wrote."""
    try:
        return {"rev", "targets", "total"} <= set(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return False


def export_tree(rev: str, dest: Path, tests_rev: str | None = None) -> None:
    """The repository at ``rev`` (or the tracked files on disk for WORKTREE) into ``dest``, with
    ``tests/`` from ``tests_rev`` when it is given."""
    _export(rev, dest)
    if tests_rev is not None:
        shutil.rmtree(dest / "tests")
        _export(tests_rev, dest, ["tests"])


def _export(rev: str, dest: Path, paths: list[str] | None = None) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    if rev == "WORKTREE":
        files = subprocess.run(["git", "ls-files", "-z", *(paths or [])], cwd=REPO, check=True,
                               capture_output=True).stdout  # fmt: skip
        for name in filter(None, files.decode().split("\0")):
            src = REPO / name
            if src.is_file():
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / name)
        return
    archive = subprocess.run(["git", "archive", "--format=tar", rev, *(paths or [])], cwd=REPO, check=True,
                             capture_output=True)  # fmt: skip
    with tempfile.TemporaryFile() as f:
        f.write(archive.stdout)
        f.seek(0)
        with tarfile.open(fileobj=f) as tar:
            tar.extractall(dest, filter="data")


def toml_list(values: list[str]) -> str:
    return "[" + ", ".join(json.dumps(v) for v in values) + "]"


def configure(copy: Path, target: Target) -> list[str]:
    """Write the ``[tool.mutmut]`` section; returns the test selection (files that this copy's
    tests/ lacks, e.g. with an older --tests-rev, are left out and reported)."""
    tests = [a for a in target.tests if not a.startswith("tests/") or (copy / a.split("::")[0]).exists()]
    if missing := [a for a in target.tests if a not in tests]:
        print(f"   not in this revision's tests, left out: {' '.join(missing)}", flush=True)
    pyproject = copy / "pyproject.toml"
    text = pyproject.read_text()
    if "[tool.mutmut]" in text:
        raise SetupError(f"{pyproject} already has a [tool.mutmut] section; this script writes its own")
    pyproject.write_text(
        text
        + "\n[tool.mutmut]\n"
        + 'source_paths = ["lm"]\n'
        + f"only_mutate = {toml_list(target.files)}\n"
        + f"pytest_add_cli_args_test_selection = {toml_list(tests)}\n"
        + f"pytest_add_cli_args = {toml_list(PYTEST_ARGS)}\n"
        + 'process_isolation = "forkserver"\n'  # torch is not fork-safe once it has run
        # mutmut's mutants/ folder holds lm/ and tests/ only; some tests read these (README snippets, configs)
        + f"also_copy = {toml_list([p for p in ALSO_COPY if (copy / p).exists()])}\n"
        + "use_git_change_detection = false\n"
    )
    return tests


def mutmut(copy: Path, args: list[str], timeout: float | None, log) -> int | None:
    """Run ``python -m mutmut ARGS`` in ``copy``; None when it ran out of time (it is then stopped)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": "", "PYTHONHASHSEED": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "mutmut", *args], cwd=copy, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(proc)
        return None
    except BaseException:  # Ctrl-C or SIGTERM: take mutmut and its workers down too
        stop(proc)
        raise


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def read_verdicts(copy: Path, target: Target) -> dict[str, int | None]:
    codes: dict[str, int | None] = {}
    for name in target.files:
        meta = copy / "mutants" / (name + ".meta")
        if meta.exists():
            codes.update(json.loads(meta.read_text())["exit_code_by_key"])
    return codes


def function_of(mutant: str) -> str:
    """``lm.optim.schedule.x_cosine_lr_schedule__mutmut_3`` → ``cosine_lr_schedule``;
    ``lm.nn.functional.xǁ_Softmaxǁbackward__mutmut_2`` → ``_Softmax.backward``."""
    head = mutant.rsplit("__mutmut_", 1)[0].rsplit(".", 1)[-1]
    return ".".join(head.split("ǁ")[1:]) if "ǁ" in head else head.removeprefix("x_")


def show(copy: Path, mutant: str) -> str:
    env = {**os.environ, "PYTHONPATH": ""}
    out = subprocess.run([sys.executable, "-m", "mutmut", "show", mutant], cwd=copy, env=env, capture_output=True,
                         text=True).stdout  # fmt: skip
    return "\n".join(line for line in out.splitlines() if line[:1] in "+-" and line[:3] not in ("---", "+++"))


def mutmut_failure(log_path: Path) -> str:
    """What made mutmut stop early, from its log: its last line, and any FAILED or ERROR lines of
    pytest's output in it (mutmut refuses to go on when its first, unmutated run of the tests fails)."""
    text = log_path.read_text(errors="replace").replace("\r", "\n")
    lines = [line.strip() for line in text.splitlines()  # not its spinner's lines (braille dots)
             if line.strip() and not any("\u2800" <= c <= "\u28ff" for c in line)]
    failed = [line for line in lines if line.startswith(("FAILED ", "ERROR "))]
    last = lines[-1] if lines else "no output"
    return "; ".join([last, *failed[:5]])


def run_target(name: str, target: Target, args, workdir: Path, keep_logs: bool) -> dict:
    copy = workdir / name
    export_tree(args.rev, copy, args.tests_rev)
    for file, old, new in target.prepare:
        path = copy / file
        text = path.read_text()
        if old is None:
            path.write_text(text + new)
            continue
        if old not in text:
            raise SetupError(f"{name}: {file} no longer contains {old!r}; update UNDECORATE in {__file__}")
        path.write_text(text.replace(old, new))
    tests = configure(copy, target)
    log_path = workdir / f"{name}.log"
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        # 1. generate the mutants (the filter matches none, so nothing runs yet) and list them
        mutmut(copy, ["run", "__list_mutants_only__"], timeout=600, log=log)
        names = sorted(read_verdicts(copy, target))
        wanted = args.functions or target.functions
        if wanted:
            names = [m for m in names if function_of(m) in wanted]
        if not names:
            where = f" (log: {log_path})" if keep_logs else ""
            print(f"   no mutants{' of ' + ', '.join(wanted) if wanted else ''}{where}", flush=True)
        chosen = sorted(random.Random(args.seed).sample(names, args.sample)) if 0 < args.sample < len(names) else names
        # 2. run them
        left = None if args.time_limit is None else max(1.0, args.time_limit - (time.monotonic() - t0))
        rc = mutmut(copy, ["run", "--max-children", str(args.max_children), *chosen], timeout=left, log=log) \
            if chosen else 0
    failure = mutmut_failure(log_path) if rc not in (0, None) else None
    codes = read_verdicts(copy, target)
    verdicts = {m: STATUS.get(codes.get(m), "suspicious") for m in chosen}
    counts: dict[str, int] = {}
    for v in verdicts.values():
        counts[v] = counts.get(v, 0) + 1
    checked = sum(n for v, n in counts.items() if v not in ("not checked", "skipped", "no tests"))
    survived = [m for m, v in verdicts.items() if v == "survived"]
    return {
        "files": target.files,
        "tests": tests,
        "mutants_generated": len(names),
        "mutants_chosen": len(chosen),
        "counts": counts,
        "checked": checked,
        "survival_rate": round(len(survived) / checked, 4) if checked else None,
        "survivors": {m: show(copy, m) for m in survived} if args.show_survivors else survived,
        "timed_out": rc is None,
        "mutmut_failed": failure,  # mutmut's own failure (e.g. a test that fails unmutated), its mutants not checked
        "seconds": round(time.monotonic() - t0, 1),
        "log": str(log_path) if keep_logs else None,  # the temp folder goes when no --workdir was given
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--targets", nargs="+", choices=sorted(TARGETS), default=sorted(TARGETS))
    ap.add_argument("--rev", default="HEAD", help="git revision to test (default HEAD); WORKTREE: the files on disk")
    ap.add_argument("--tests-rev", default=None, help="take tests/ from this revision instead (default: --rev)")
    ap.add_argument("--functions", nargs="+", default=None,
                    help="only the mutants of these functions (a method is Class.method), in every target")
    ap.add_argument("--sample", type=int, default=0, help="draw this many mutants per target (default: all)")
    ap.add_argument("--seed", type=int, default=0, help="seed of --sample")
    ap.add_argument("--max-children", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--time-limit", type=float, default=None, help="seconds per target (unchecked mutants reported)")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="keep the copies and logs here (default: a temp folder, removed at the end with them)")
    ap.add_argument("--out", type=Path, default=None, help="write the summary as JSON here")
    ap.add_argument("--overwrite", action="store_true", help="replace an earlier summary in --out")
    ap.add_argument("--show-survivors", action="store_true", help="include each survivor's diff")
    ap.add_argument("--list", action="store_true", help="list the targets and exit")
    args = ap.parse_args()
    if args.list:
        for name, t in TARGETS.items():
            only = f" (functions: {', '.join(t.functions)})" if t.functions else ""
            print(f"{name:12s} {' '.join(t.files)}{only}\n{'':12s} tests: {' '.join(t.tests)}")
        return 0
    try:
        workdir = check_args(args)
    except SetupError as e:
        print(f"mutation.py: error: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through mutmut(), which stops its group
    keep_logs = workdir is not None
    workdir = workdir or Path(tempfile.mkdtemp(prefix="lm-mutation-"))
    workdir.mkdir(parents=True, exist_ok=True)
    summary = {"rev": args.rev, "tests_rev": args.tests_rev or args.rev, "sample": args.sample, "seed": args.seed,
               "functions": args.functions, "targets": {}}  # fmt: skip
    try:
        for name in args.targets:
            print(f"== {name}: {' '.join(TARGETS[name].files)}", flush=True)
            r = run_target(name, TARGETS[name], args, workdir, keep_logs)
            summary["targets"][name] = r
            rate = "n/a" if r["survival_rate"] is None else f"{100 * r['survival_rate']:.1f}%"
            print(f"   {r['mutants_chosen']} of {r['mutants_generated']} mutants, {r['checked']} checked: "
                  f"{r['counts']}; survival {rate}; {r['seconds']} s" + (" (time limit hit)" if r["timed_out"] else ""),
                  flush=True)  # fmt: skip
            if r["mutmut_failed"]:
                where = f" (log: {r['log']})" if r["log"] else " (--workdir keeps the copy and its log)"
                print(f"   mutmut stopped early: {r['mutmut_failed']}{where}", flush=True)
            for m in r["survivors"]:
                print(f"   survived: {m}")
                if args.show_survivors:
                    print("      " + r["survivors"][m].replace("\n", "\n      "))
    except SetupError as e:
        print(f"mutation.py: error: {e}", file=sys.stderr)
        return 2
    finally:
        if not keep_logs:
            shutil.rmtree(workdir, ignore_errors=True)
    checked = sum(r["checked"] for r in summary["targets"].values())
    survived = sum(r["counts"].get("survived", 0) for r in summary["targets"].values())
    summary["total"] = {"checked": checked, "survived": survived,
                        "survival_rate": round(survived / checked, 4) if checked else None}  # fmt: skip
    print(f"== total: {survived} of {checked} checked mutants survived"
          + (f" ({100 * survived / checked:.1f}%)" if checked else ""))  # fmt: skip
    if args.out is not None:
        from lm.io import atomic_write

        with atomic_write(args.out) as f:
            f.write(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    return 0


def check_args(args) -> Path | None:
    """Every option checked before any copy is made: a SetupError naming the option, else the
    --workdir (None: a temp folder). Fixes --rev and --tests-rev to commit ids, however HEAD moves
    meanwhile."""
    from lm.io import check_output_file

    args.rev, args.tests_rev = resolve(args.rev, "--rev"), resolve(args.tests_rev, "--tests-rev")
    if args.sample < 0:
        raise SetupError(f"--sample: must be >= 0 (0: every mutant), got {args.sample}")
    if args.max_children < 1:
        raise SetupError(f"--max-children: must be >= 1, got {args.max_children}")
    if args.time_limit is not None and not args.time_limit > 0:
        raise SetupError(f"--time-limit: must be > 0 seconds, got {args.time_limit:g}")
    if args.functions:
        files = sorted({f for name in args.targets for f in TARGETS[name].files})
        known = functions_in(args.rev, files)
        if unknown := [f for f in args.functions if f not in known]:
            raise SetupError(f"--functions: {', '.join(map(repr, unknown))} is defined in none of the files of "
                             f"--targets {' '.join(args.targets)} (a method is Class.method)")
    if args.out is not None:
        try:
            check_output_file(args.out, overwrite=args.overwrite, recognise=is_summary,
                              what="a summary of this script")  # fmt: skip
        except ValueError as e:
            raise SetupError(str(e)) from None
    if args.workdir is not None:
        if args.workdir.exists() and not args.workdir.is_dir():
            raise SetupError(f"--workdir: {str(args.workdir)!r} is a file, not a folder")
        if args.workdir.is_dir() and any(args.workdir.iterdir()):
            raise SetupError(f"--workdir: {str(args.workdir)!r} is not empty")
    try:
        import mutmut  # noqa: F401
    except ImportError:
        raise SetupError('mutmut is not installed; pip install -e ".[mutation]"') from None
    return args.workdir


if __name__ == "__main__":
    sys.exit(main())
