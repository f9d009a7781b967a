"""The training config: its checks at their edges, `--set`, and what `--resume` may change."""

from __future__ import annotations

import pytest

from lm.train import config_from_dict
from lm.train.config import RESUME_MAY_CHANGE, parse_override, resume_changes


def _raw(**sections) -> dict:
    """A minimal config: config_from_dict checks values, not that the files exist."""
    raw = {
        "model": dict(vocab_size=64, context_length=16, d_model=32, num_layers=1, num_heads=2, d_ff=64),
        "data": dict(train="train.bin"),
        "train": dict(max_steps=500),
        "optim": dict(warmup_iters=5),
    }
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return raw


def test_a_warm_up_one_step_longer_than_the_cycle_is_refused():
    """The check's edge (mut24a T5: `warmup > cycle + 1` passed test_train's 100-against-50): a warm-up
    of cycle + 1 iterations already climbs past the cycle's end; one as long as the cycle is fine."""
    with pytest.raises(ValueError, match=r"^config: optim\.warmup_iters \(51\) is longer than optim\."
                                         r"cosine_cycle_iters \(50\), and the run goes on past the warm-up"):
        config_from_dict(_raw(optim=dict(warmup_iters=51, cosine_cycle_iters=50)))
    config_from_dict(_raw(optim=dict(warmup_iters=50, cosine_cycle_iters=50)))


@pytest.mark.parametrize("key", ["train.seed", "eval.seed"])
def test_the_largest_seed_is_taken_and_one_past_it_is_refused(key):
    """Seeds are whole numbers in [0, 2**64 - 1] (torch's manual_seed takes 2**64 - 1): the top value is
    taken, one more refused (mut24a T12: `< SEED_MAX` refused the top value, and no test tried it)."""
    section, name = key.split(".")
    assert getattr(getattr(config_from_dict(_raw(**{section: {name: 2**64 - 1}})), section), name) == 2**64 - 1
    with pytest.raises(ValueError, match=rf"^config: {key} must be a whole number in \[0, 2\*\*64-1\], got "
                                         rf"{2**64}$"):
        config_from_dict(_raw(**{section: {name: 2**64}}))


def test_set_keeps_an_equals_sign_in_the_value():
    """`--set key=value` splits at the first "=" only: a path or run name holding "=" is kept whole
    (mut24a T13: splitting at every "=" made train.out_dir=runs/lr=3e-4 the folder runs/lr)."""
    assert parse_override("train.out_dir=runs/lr=3e-4") == ("train", "out_dir", "runs/lr=3e-4")
    assert parse_override("wandb.name=a=b") == ("wandb", "name", "a=b")
    cfg = config_from_dict(_raw(), ["train.out_dir=runs/lr=3e-4"])
    assert cfg.train.out_dir == "runs/lr=3e-4"


def test_inverse_sqrt_without_a_warm_up_is_refused_in_the_config():
    """The inverse square-root schedule divides by warmup_iters^1.5: 0 is refused when the config is
    read, naming the key (mut24a T19: without the check it reached the schedule at the first step)."""
    with pytest.raises(ValueError, match=r"^config: optim\.schedule = inverse_sqrt needs optim\.warmup_iters >= 1, "
                                         r"got 0$"):
        config_from_dict(_raw(optim=dict(schedule="inverse_sqrt", warmup_iters=0)))


def test_max_time_alone_needs_a_cycle_length_except_for_inverse_sqrt():
    """With train.max_time and no max_steps the cosine/wsd schedule has no length: refused when the
    config is read (mut24a T20: without the check the run started with no cycle to decay over);
    inverse_sqrt, which has no end, is taken."""
    raw = _raw(train=dict(max_time=60.0))
    del raw["train"]["max_steps"]
    with pytest.raises(ValueError, match=r"^config: with train\.max_time alone, set optim\.cosine_cycle_iters "
                                         r"\(the schedule's length\)$"):
        config_from_dict(raw)
    raw["optim"]["cosine_cycle_iters"] = 100
    assert config_from_dict(raw).optim.cosine_cycle_iters == 100
    raw["optim"] = dict(schedule="inverse_sqrt", warmup_iters=5)
    assert config_from_dict(raw).optim.schedule == "inverse_sqrt"


def test_model_architecture_decoder_lm_may_be_written_out():
    """`architecture = "decoder_lm"` in [model] is the default said aloud: taken (mut24a T23: kept, it
    reached ModelConfig, which has no such field, as "unknown key model.architecture")."""
    raw = _raw()
    raw["model"]["architecture"] = "decoder_lm"
    assert config_from_dict(raw).model.architecture == "decoder_lm"


def _resumable(overrides=()):
    return config_from_dict(_raw(train=dict(max_time=60.0, dist_timeout=100.0), data=dict(tokenizer="tok"),
                                 log=dict(peak_tflops=10.0), wandb=dict(name="a")), list(overrides))


def test_resume_may_change_every_key_it_lists_and_nothing_else():
    """resume_changes returns (never refuses) a change of each key RESUME_MAY_CHANGE lists, a key under
    a section wildcard ("log.*") included, and refuses one it does not list. The tests had changed
    only max_steps, log.interval, checkpoint.keep_last and a few keys it refuses: train.max_time left
    out of the list (mut24a T8), or the wildcards ignored (T7), passed them."""
    saved = _resumable().to_dict()
    new = {"train.out_dir": "elsewhere", "train.max_steps": 900, "train.max_time": 120.0, "train.device": "cpu",
           "train.compile": True, "train.dist_timeout": 200.0, "data.tokenizer": "tok2", "eval.interval": 7,
           "checkpoint.interval": 3, "checkpoint.keep_best": False, "log.interval": 2, "log.peak_tflops": 5.0,
           "wandb.name": "b", "wandb.project": "other"}
    assert {k for k in RESUME_MAY_CHANGE if not k.endswith(".*")} <= set(new)
    assert {k.split(".")[0] for k in RESUME_MAY_CHANGE if k.endswith(".*")} == {"checkpoint", "log", "wandb"}
    for key, value in new.items():
        section, name = key.split(".")
        spelled = str(value).lower() if isinstance(value, bool) else value
        changed = _resumable([f"{key}={spelled}"])
        assert getattr(getattr(changed, section), name) == value, key
        assert resume_changes(saved, changed, "ck.pt") == {key: (saved[section][name], value)}, key
    for key, value in (("train.seed", 7), ("optim.max_lr", 0.5), ("eval.batches", 3)):
        with pytest.raises(ValueError, match=rf"^--resume: {key} is .* in ck\.pt but {value} in the config"):
            resume_changes(saved, _resumable([f"{key}={value}"]), "ck.pt")


# (key, the value refused, its message's tail, the edge value taken): every key checked for its sign
SIGNED_KEYS = [
    ("train.max_steps", 0, "must be > 0, got 0 (--set train.max_steps=none leaves it unset)", 1),
    ("train.max_time", 0, "must be > 0, got 0.0 (--set train.max_time=none leaves it unset)", 1e-9),
    ("train.dist_timeout", 0, "must be > 0, got 0.0 (--set train.dist_timeout=none leaves it unset)", 1e-9),
    ("train.batch_size", 0, "must be > 0, got 0", 1),
    ("train.grad_accum_steps", 0, "must be > 0, got 0", 1),
    ("optim.max_lr", 0, "must be > 0, got 0.0", 1e-9),
    ("optim.min_lr", -1, "must be >= 0, got -1.0", 0),
    ("optim.warmup_iters", -1, "must be >= 0, got -1", 0),
    ("optim.cosine_cycle_iters", 0, "must be > 0, got 0 (--set optim.cosine_cycle_iters=none leaves it unset)", 5),
    ("optim.grad_clip", -1, "must be >= 0, got -1.0", 0),
    ("optim.eps", 0, "must be > 0, got 0.0", 1e-30),
    ("optim.weight_decay", -1, "must be >= 0, got -1.0", 0),
    ("eval.interval", -1, "must be >= 0, got -1", 0),
    ("eval.batches", 0, "must be > 0, got 0", 1),
    ("eval.batch_size", 0, "must be > 0, got 0 (--set eval.batch_size=none leaves it unset)", 1),
    ("checkpoint.interval", -1, "must be >= 0, got -1", 0),
    ("checkpoint.keep_last", -1, "must be >= 0, got -1", 0),
    ("log.interval", 0, "must be > 0, got 0", 1),
    ("log.peak_tflops", 0, "must be > 0, got 0.0 (--set log.peak_tflops=none leaves it unset)", 1e-9),
]


@pytest.mark.parametrize("key, bad, message, edge", SIGNED_KEYS, ids=[k[0] for k in SIGNED_KEYS])
def test_every_signed_key_is_named_in_its_error_and_its_edge_value_is_taken(key, bad, message, edge):
    """Each check names its own key (mut30: "eval.batch_size" and "checkpoint.keep_last" misspelled in
    their checks survived: no test in this process read those messages), refuses the first value past
    its edge, and takes the edge (0 where zero means "none": no clipping, no warm-up, keep every
    checkpoint...)."""
    section, name = key.split(".")
    with pytest.raises(ValueError) as refused:
        config_from_dict(_raw(**{section: {name: bad}}))
    assert str(refused.value) == f"config: {key} {message}"
    edges = _raw(**{section: {name: edge}})
    if key == "optim.max_lr":  # the floor must not be over the peak
        edges["optim"]["min_lr"] = 0.0
    assert getattr(getattr(config_from_dict(edges), section), name) == edge


def test_a_warm_up_past_the_cycle_is_taken_when_the_run_ends_with_it():
    """A warm-up longer than the cycle is refused only when the run goes on past it (numerics20): a run
    of exactly the warm-up's steps never reaches the drop (mut30: `max_steps >= warmup` survived)."""
    config_from_dict(_raw(train=dict(max_steps=51), optim=dict(warmup_iters=51, cosine_cycle_iters=50)))
    with pytest.raises(ValueError, match=r"^config: optim\.warmup_iters \(51\) is longer than"):
        config_from_dict(_raw(train=dict(max_steps=52), optim=dict(warmup_iters=51, cosine_cycle_iters=50)))
    # with max_time alone the run may go on past the warm-up: refused
    with pytest.raises(ValueError, match=r"^config: optim\.warmup_iters \(51\) is longer than"):
        raw = _raw(train=dict(max_time=60.0), optim=dict(warmup_iters=51, cosine_cycle_iters=50))
        del raw["train"]["max_steps"]
        config_from_dict(raw)


def test_an_unknown_section_names_the_closest_one():
    """mut30: the section's suggestion searched over no names survived."""
    for section, hint in (("optimm", " (did you mean 'optim'?)"), ("traning", " (did you mean 'train'?)"),
                          ("lr", "")):  # nothing close: no hint, not a wrong one
        with pytest.raises(ValueError) as refused:
            config_from_dict({**_raw(), section: {}})
        assert str(refused.value) == f"config: unknown section [{section}]{hint}"


def test_a_key_above_the_first_table_names_where_it_belongs():
    """A key written above every table (TOML puts it at the top level): the table it belongs in, a
    name from another trainer, or the closest key (mut30: that last search given no keys survived)."""
    for key, hint in (("max_steps", " (did you mean 'train.max_steps', under [train]?)"),
                      ("lr", " (did you mean 'optim.max_lr'?)"),
                      ("max_stepz", " (did you mean 'train.max_steps'?)"),
                      ("zzz", "")):
        with pytest.raises(ValueError) as refused:
            config_from_dict({**_raw(), key: 5})
        assert str(refused.value) == f"config: {key} = 5 is outside any table{hint}"


def _pairs_raw(**sections) -> dict:
    """A minimal encoder-decoder config, batched by a token budget."""
    raw = _raw(**sections)
    raw["train"].setdefault("batch_tokens", 128)
    raw["model"] = dict(architecture="encoder_decoder", vocab_size=64, context_length=16, d_model=32,
                        encoder_layers=1, decoder_layers=1, num_heads=2, d_ff=64)
    return raw


@pytest.mark.parametrize("key", ["train.batch_tokens", "eval.batch_tokens"])
def test_a_token_budget_is_named_when_not_positive_and_one_token_is_taken(key):
    """mut30: the budget's check naming ``None`` for its key survived (the budgets apply to an
    encoder-decoder only; no test in this process gave one of 0)."""
    section, name = key.split(".")
    with pytest.raises(ValueError) as refused:
        config_from_dict(_pairs_raw(**{section: {name: 0}}))
    assert str(refused.value) == f"config: {key} must be > 0, got 0 (--set {key}=none leaves it unset)"
    assert getattr(getattr(config_from_dict(_pairs_raw(**{section: {name: 1}})), section), name) == 1


def test_adam_betas_are_in_zero_to_one():
    """Each beta in [0, 1): 1 never forgets (the moment estimates' bias correction divides by zero),
    and past it they grow without bound (mut30: the range check joined by `or` to `isfinite` took 2)."""
    for key in ("optim.beta1", "optim.beta2"):
        name = key.split(".")[1]
        for beta in (1.0, 2.0, -0.1, float("nan"), float("inf")):
            with pytest.raises(ValueError) as refused:
                config_from_dict(_raw(optim={name: beta}))
            assert str(refused.value) == f"config: {key} must be in [0, 1), got {beta}"
        for beta in (0.0, 0.999999):
            assert getattr(config_from_dict(_raw(optim={name: beta})).optim, name) == beta


def test_a_wandb_project_is_a_name_of_1_to_128_characters():
    """W&B's limits on a project's name, checked before a run starts (mut30: a one-character name
    refused survived); a disabled run's config keeps whatever it held."""
    for project in ("p", "x" * 128, "lm-tiny_stories.v2"):
        assert config_from_dict(_raw(wandb=dict(mode="offline", project=project))).wandb.project == project
    for project in ("", "x" * 129, "a/b", "a:b", "a#b"):
        with pytest.raises(ValueError) as refused:
            config_from_dict(_raw(wandb=dict(mode="offline", project=project)))
        assert str(refused.value) == ("config: wandb.project must be a name of 1 to 128 characters without any of "
                                      f"/ \\ # ? % :, got {project!r}")
    assert config_from_dict(_raw(wandb=dict(project=""))).wandb.project == ""  # disabled: never read


@pytest.mark.parametrize("section, key, hint", [
    # the start of a known key: this table's own before another's
    ("optim", "grad", "optim.grad_clip"),  # not train.grad_accum_steps, though [train] comes first
    ("optim", "max_", "optim.max_lr"),
    ("checkpoint", "inte", "checkpoint.interval"),  # not eval.interval
    ("log", "inte", "log.interval"),
    ("eval", "batch_s", "eval.batch_size"),
    ("train", "dete", "train.deterministic"),  # too short a part for the closest spelling to find it
    ("data", "max_st", "train.max_steps"),  # the start of no key of [data]: another table's
    # the last of the hints: the closest section.key over every table, not this table's
    ("eval", "max_lrr", "optim.max_lr"),
    ("log", "wandb_proj", "wandb.project"),
    ("eval", "warmupiters", "optim.warmup_iters"),
])
def test_an_unknown_key_names_the_key_it_starts_or_the_closest_one(section, key, hint):
    """A key cut short names the key it starts, this table's own before another's (found while
    reading mut30's `start = None`, which survived: the keys "[optim] grad" and "[log] inte" were
    offered train.grad_accum_steps and eval.interval, keys of other tables, as [train] and [eval]
    come first in the list searched); else the closest key of any table (mut30: that search given
    no keys at all survived; no test in this process reached it)."""
    with pytest.raises(ValueError) as refused:
        config_from_dict(_raw(**{section: {key: 1}}))
    assert str(refused.value) == f"config: unknown key {section}.{key} (did you mean {hint!r}?)"


def test_config_shape_errors_are_named_whole():
    """A config without [model], a table given as a value, and a Config built in Python with a
    section of the wrong type each say so in one line (mut30, seed 3: each message made ``None`` or
    misspelled survived; the commands' fault tests, processes, read some of them)."""
    from dataclasses import replace

    from lm.train.config import check_config

    raw = _raw()
    del raw["model"]
    with pytest.raises(ValueError) as refused:
        config_from_dict(raw)
    assert str(refused.value) == "config: missing section [model]"
    with pytest.raises(ValueError) as refused:
        config_from_dict({**_raw(), "train": 5})
    assert str(refused.value) == "config: train must be a table ([train]), got 5"
    cfg = config_from_dict(_raw())
    with pytest.raises(ValueError) as refused:
        check_config(replace(cfg, train={"max_steps": 5}))
    assert str(refused.value) == "config: [train] must be a TrainConfig, got dict"
    assert check_config(cfg) == cfg


def test_values_are_spelled_as_the_toml_file_spells_them():
    """Messages spell values as a config file does (mut30, seed 3: ``false`` spelled ``true``
    survived)."""
    from lm.train.config import spelled

    assert [spelled(v) for v in (True, False, None, 3, 0.5, "a b")] == ["true", "false", "unset", "3", "0.5",
                                                                        "'a b'"]


def test_name_options_prefixes_a_config_error_with_the_options_that_set_its_keys():
    """The scripts (shakespeare.py, multi30k.py) build configs from options of their own; an error
    names the options as typed, each once, in the order the message names their keys, and a message
    naming none is left as it is. Seen before only by the scripts' process tests."""
    from argparse import Namespace

    from lm.train.config import name_options

    options = {"d_model": "--d-model", "num_heads": "--num-heads", "max_lr": "--lr"}
    args = Namespace(d_model=130, num_heads=4, lr=0.01)
    message = "config: model.d_model (130) must be divisible by model.num_heads (4); d_model 128 would do"
    assert name_options(message, options, args) == f"--d-model 130, --num-heads 4: {message}"
    assert name_options("config: optim.max_lr must be > 0", options, args) == (
        "--lr 0.01: config: optim.max_lr must be > 0")
    assert name_options("config: train.seed must be >= 0", options, args) == "config: train.seed must be >= 0"
