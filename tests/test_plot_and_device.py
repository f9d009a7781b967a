"""What `lm plot` draws (line styles, the time axis, notes) and how lm.device resolves devices, dtypes
and threads."""

import json
import os

import matplotlib.figure
import pytest
import torch

from lm.train.plot import plot_runs


def _write(folder, records):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


@pytest.fixture
def drawn(monkeypatch) -> list[dict]:
    """What each panel holds when the PNG is written: its x label, its lines (by label: style, marker,
    data) and its texts."""
    panels, savefig = [], matplotlib.figure.Figure.savefig

    def capture(fig, *args, **kwargs):
        for ax in fig.axes:
            panels.append({
                "xlabel": ax.get_xlabel(),
                "lines": {ln.get_label(): dict(linestyle=ln.get_linestyle(), marker=ln.get_marker(),
                                               x=[float(v) for v in ln.get_xdata()],
                                               y=[float(v) for v in ln.get_ydata()]) for ln in ax.lines},
                "texts": [t.get_text() for t in ax.texts],
                # where each text is, and whether in the panel's own coordinates (0 to 1 across it)
                "text_places": [(tuple(t.get_position()), t.get_transform() == ax.transAxes) for t in ax.texts],
                "box": tuple(round(v, 3) for v in ax.get_position().bounds),  # left, bottom, width, height
                "sizes": {ln.get_label(): ln.get_markersize() for ln in ax.lines},
            })
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", capture)
    return panels


# validation loss is a dashed line with markers, train loss a solid one (plot_runs' docstring);
# a split of one record gets a marker (a line through one point draws nothing)
def test_train_is_solid_val_dashed_with_markers_and_a_single_record_is_a_marker(tmp_path, drawn):
    run = _write(tmp_path / "r", [{"step": s, "split": "train", "loss": 3.0 - s / 10, "time": s} for s in (1, 2, 3)]
                 + [{"step": 2, "split": "val", "loss": 2.9, "time": 2.0}, {"step": 3, "split": "val", "loss": 2.8,
                                                                          "time": 3.0}])
    one = _write(tmp_path / "one", [{"step": 1, "split": "train", "loss": 4.0, "time": 1.0}])
    plot_runs([run, one], tmp_path / "p.png")
    by_step = drawn[0]["lines"]
    assert by_step["r train"]["linestyle"] == "-" and by_step["r train"]["marker"] in ("None", "", None)
    assert by_step["r val"]["linestyle"] == "--" and by_step["r val"]["marker"] == "o"
    assert by_step["one train"]["marker"] == "o" and by_step["one train"]["x"] == [1.0]
    # small markers, and the two panels side by side, steps on the left (mutation: the panels stacked,
    # the markers matplotlib's default size, survived)
    assert drawn[0]["sizes"]["r val"] == 3
    (left, bottom, width, _), (left2, bottom2, _, _) = drawn[0]["box"], drawn[1]["box"]
    assert bottom == bottom2 and left + width < left2


def test_a_run_without_loss_records_is_refused_before_anything_is_drawn(tmp_path, drawn):
    """(mutation: the message in capitals survived here; lm plot's process test read its start only)"""
    run = _write(tmp_path / "r", [{"step": 1, "split": "train", "tokens": 10}])
    with pytest.raises(ValueError) as refused:
        plot_runs([run], tmp_path / "p.png")
    assert str(refused.value) == (f"RUN_DIR: {str(run / 'metrics.jsonl')!r} holds no loss records (train or val "
                                  "lines with a step and a loss); nothing to plot")
    assert drawn == [] and not (tmp_path / "p.png").exists()


# the time axis is in minutes when any record, train or val, is past two minutes (a run
# without validation records, or with its last one early, was drawn in seconds up to 600)
def test_the_time_axis_counts_minutes_from_the_train_records_too(tmp_path, drawn):
    run = _write(tmp_path / "r", [{"step": s, "split": "train", "loss": 5.0 - s / 10, "time": 60.0 * s}
                                  for s in range(1, 11)] + [{"step": 1, "split": "val", "loss": 4.9, "time": 60.0}])
    plot_runs([run], tmp_path / "p.png")
    (_, by_time) = drawn
    assert by_time["xlabel"] == "training time (minutes)"
    assert by_time["lines"]["r train"]["x"] == [float(s) for s in range(1, 11)]
    assert by_time["lines"]["r val"]["x"] == [1.0]


# a run whose records have no time says so in the empty time panel
# a loss of true/false (JSON booleans) is not a number to draw, like any damaged line
def test_records_without_a_time_leave_a_note_and_boolean_losses_are_skipped(tmp_path, drawn):
    run = _write(tmp_path / "r", [{"step": 1, "split": "train", "loss": 2.0},
                                  {"step": 2, "split": "train", "loss": 1.5},
                                  {"step": 3, "split": "train", "loss": True},
                                  {"step": 4, "split": "val", "loss": False}])
    plot_runs([run], tmp_path / "p.png")
    by_step, by_time = drawn
    assert by_step["lines"]["r train"]["x"] == [1.0, 2.0] and by_step["lines"]["r train"]["y"] == [2.0, 1.5]
    assert "r val" not in by_step["lines"]
    assert by_time["lines"] == {} and by_time["texts"] == ["no records with a time"]
    assert by_time["text_places"] == [((0.5, 0.5), True)]  # in the middle of the empty panel


# --dtype bfloat16 is bfloat16 autocast on any device; float32 is none; auto is bfloat16 on a CUDA
# device that supports it and none elsewhere
def test_resolve_dtype_by_name(monkeypatch):
    from lm.device import resolve_dtype

    cpu = torch.device("cpu")
    assert resolve_dtype("bfloat16", cpu) is torch.bfloat16
    assert resolve_dtype("float32", cpu) is None and resolve_dtype("auto", cpu) is None
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", torch.device("cuda", 0)) is torch.bfloat16
    assert resolve_dtype("auto", cpu) is None
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype("auto", torch.device("cuda", 0)) is None
    # another name is refused naming the argument: --dtype unless told (serve and train name theirs)
    for argument, given in (("--dtype", {}), ("train.dtype", {"argument": "train.dtype"})):
        with pytest.raises(ValueError) as e:
            resolve_dtype("fp16", cpu, **given)
        assert str(e.value) == f"{argument}: must be one of auto, float32, bfloat16, got 'fp16'"


def test_autocast_is_to_the_dtype_given_and_none_is_no_autocast():
    """lm.device.autocast(device, dtype): float16 on a CPU too, whose autocast would otherwise be
    bfloat16 (mutation: the dtype not passed on, survived: every test asked for bfloat16)."""
    from lm.device import autocast

    a = torch.randn(4, 4)
    for dtype in (torch.float16, torch.bfloat16):
        with autocast(torch.device("cpu"), dtype):
            assert (a @ a).dtype == dtype
    with autocast(torch.device("cpu"), None):
        assert (a @ a).dtype == torch.float32


# "cuda" (and "auto") under torchrun is the local rank's GPU, not cuda:0 for every process
def test_cuda_without_an_index_is_the_local_ranks_gpu(monkeypatch):
    from lm.device import resolve_device

    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    assert resolve_device("cuda", local_rank=2) == torch.device("cuda", 2)
    assert resolve_device("auto", local_rank=3) == torch.device("cuda", 3)
    assert resolve_device("cuda:1", local_rank=3) == torch.device("cuda", 1)  # an index given is kept
    assert chosen == [torch.device("cuda", 2), torch.device("cuda", 3), torch.device("cuda", 1)]


def test_more_processes_than_gpus_are_told_how_many_to_start(monkeypatch):
    """torchrun with more processes per machine than GPUs: the local rank's GPU does not exist, and the
    error lists the devices and says how many processes to start (mutation: the list's separator and
    the plural in capitals, survived: no test had a machine with GPUs)."""
    from lm.device import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    for count, processes in ((2, "processes"), (1, "process")):
        monkeypatch.setattr(torch.cuda, "device_count", lambda count=count: count)
        have = ", ".join(["cpu"] + [f"cuda:{i}" for i in range(count)])
        with pytest.raises(ValueError) as refused:
            resolve_device("cuda", "train.device", local_rank=3)
        assert str(refused.value) == (
            f"train.device: 'cuda' is the local rank's GPU, cuda:3 for LOCAL_RANK 3, but this machine has {count} "
            f"(available: {have}); start at most {count} {processes} per machine (torchrun --nproc_per_node)")
        with pytest.raises(ValueError, match=rf"^--device: 'cuda:7' is not available on this machine "
                                             rf"\(available: {have}\)$"):
            resolve_device("cuda:7")


def test_a_rank_and_a_dtype_are_refused_naming_what_was_given():
    """check_rank: a rank in [0, world_size) (mutation: `and` for `or`, survived: ranks 2 of 2 and -1 went
    through); check_dtype: a dtype's name is told to be passed as the dtype, any other string refused
    the same way (mutation: getattr without its default, survived: "bogus" raised AttributeError)."""
    from lm.checks import check_rank
    from lm.device import check_dtype

    check_rank(1, 2)
    for rank in (2, -1, 1.5, True, "0"):
        with pytest.raises(ValueError) as refused:
            check_rank(rank, 2)
        assert str(refused.value) == f"rank must be an integer in [0, world_size=2), got rank={rank!r}"
    check_dtype("dtype", torch.bfloat16)
    kind = "a torch floating dtype such as torch.bfloat16 or None"
    for dtype, hint in (("bfloat16", " (pass torch.bfloat16, not its name)"), ("bogus", ""), ("int64", ""),
                        (torch.int64, "")):
        with pytest.raises(ValueError) as refused:
            check_dtype("dtype", dtype)
        assert str(refused.value) == f"dtype must be {kind}, got dtype={dtype!r}{hint}"


# "mps" on a machine without it is a one-line refusal, not a device that fails later
def test_mps_without_mps_is_refused_naming_the_argument(monkeypatch):
    import lm.device

    monkeypatch.setattr(lm.device, "_mps_available", lambda: False)
    with pytest.raises(ValueError, match=r"^train\.device: 'mps' is not available on this machine \(available: "):
        lm.device.resolve_device("mps", "train.device")


# either AVX512-BF16 or AMX-BF16 in /proc/cpuinfo's flags is native bfloat16
@pytest.mark.parametrize("flags, native", [("fpu avx2 avx512_bf16", True), ("fpu avx2 amx_bf16 amx_tile", True),
                                           ("fpu avx2 avx512f", False)])
def test_cpu_has_bfloat16_reads_either_flag(monkeypatch, tmp_path, flags, native):
    import builtins

    import lm.device

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    real_open = builtins.open
    monkeypatch.setattr(lm.device, "open", lambda path, *a, **k: real_open(cpuinfo if path == "/proc/cpuinfo"
                                                                           else path, *a, **k), raising=False)
    assert lm.device.cpu_has_bfloat16() is native


# --threads is capped at 4 per CPU (at least 1024), and a count taken is the count torch uses
def test_set_threads_sets_torchs_count_and_the_cap_is_four_per_cpu():
    from lm.device import max_threads, set_threads

    assert max_threads() == max(1024, 4 * (os.cpu_count() or 1))
    before = torch.get_num_threads()
    try:
        set_threads(1)
        assert torch.get_num_threads() == 1
        with pytest.raises(ValueError, match="^--threads: must be at most "):
            set_threads(max_threads() + 1)
    finally:
        torch.set_num_threads(before)


def test_the_bfloat16_slowdown_is_the_ratio_of_the_fastest_products_on_one_thread(monkeypatch):
    """bfloat16_matmul_slowdown against a clock that says how long each product took: the bfloat16
    products first, then the float32 ones, each until ``seconds`` is spent and at least three are
    made; the ratio of the fastest two. The float32 products' slow start (set-up, a thread that
    waited for a core) is passed over, every product runs on one thread, and torch's count is back
    after. Two of three bfloat16 products over ``seconds``: the third is still made."""
    import types

    import lm.device

    took = [0.5, 0.02, 0.03] + [0.016] * 4 + [0.0003, 0.036]  # bfloat16, then float32 (its first four slow)
    calls, threads = [], []
    now = [0.0]

    def perf_counter():  # called before and after each product
        threads.append(torch.get_num_threads())
        if len(calls) % 2:
            now[0] += took[len(calls) // 2]
        calls.append(now[0])
        return now[0]

    monkeypatch.setattr(lm.device, "time", types.SimpleNamespace(perf_counter=perf_counter))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        slowdown = lm.device.bfloat16_matmul_slowdown.__wrapped__(size=8, seconds=0.1)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert len(calls) == 2 * len(took)  # every product scripted was made, and no more
    assert slowdown == pytest.approx(0.02 / 0.0003)
    assert set(threads) == {1}


@pytest.mark.parametrize("device, dtype, units, slowdown, said", [
    ("cpu", torch.bfloat16, False, 61.6, True),
    ("cpu", torch.bfloat16, False, 1.9, False),  # within 2x: nothing said
    ("cpu", torch.bfloat16, False, 2.0, True),  # 2x is said (mutation: `<= 2`, `< 3` survived)
    ("cpu", torch.bfloat16, False, 2.6, True),
    ("cpu", torch.bfloat16, True, None, False),  # AVX512-BF16 or AMX: not even measured
    ("cpu", None, False, None, False),  # float32
    ("meta", torch.bfloat16, False, None, False),  # not a CPU (cuda: its own units)
])  # fmt: skip
def test_bfloat16_on_a_cpu_that_multiplies_it_slowly_is_said_with_the_measured_ratio(monkeypatch, device, dtype,
                                                                                    units, slowdown, said):
    import lm.device

    measured = []
    monkeypatch.setattr(lm.device, "cpu_has_bfloat16", lambda: units)
    monkeypatch.setattr(lm.device, "bfloat16_matmul_slowdown", lambda: measured.append(1) or slowdown)
    line = lm.device.slow_bfloat16_line(torch.device(device), dtype, "train.dtype")
    assert line == (f"train.dtype: a bfloat16 matrix product takes {slowdown:.0f}x the time of a float32 one on this "
                    "CPU (no bfloat16 units): float32 is faster here" if said else "")
    assert len(measured) == (slowdown is not None)
    # the command line's argument by default
    assert lm.device.slow_bfloat16_line(torch.device(device), dtype) == line.replace("train.dtype: ", "--dtype: ")


def test_fastest_time_makes_exactly_times_calls_under_a_clock_that_does_not_move(monkeypatch):
    """A clock too coarse to see a call (every reading the same) spends nothing: ``times`` calls are
    made and the best is 0, where a loop that ran while ``spent <= seconds`` would never end (the
    clock below runs out, as a test, after the readings the calls need)."""
    import types

    import lm.device

    readings = iter([7.0] * 6)
    monkeypatch.setattr(lm.device, "time", types.SimpleNamespace(perf_counter=lambda: next(readings)))
    calls = []
    assert lm.device.fastest_time(lambda: calls.append(1), times=3) == 0.0
    assert len(calls) == 3


def test_is_meta_names_the_meta_device_given_or_torch_s_default():
    """is_meta is what RoPE, the sinusoidal table and the seq2seq init ask before computing values."""
    from lm.device import is_meta

    assert is_meta("meta") and is_meta(torch.device("meta")) and is_meta("meta:0")
    assert not is_meta("cpu") and not is_meta(torch.device("cpu")) and not is_meta()
    with torch.device("meta"):
        assert is_meta() and not is_meta("cpu")  # a device given wins over the default
    assert not is_meta()
