"""Bitwise reproducibility of the training path at more than one thread (the whole-run tests,
two runs and SIGKILL + --resume, are in test_train.py)."""

import contextlib
import os

import pytest
import torch

from lm.model import TransformerLM
from lm.nn import Embedding
from lm.optim import AdamW, clip_grad_norm_, param_groups
from lm.train.determinism import CUBLAS_WORKSPACE_CONFIG, configure_determinism


@contextlib.contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)



def _cpu_threads() -> str:
    n = torch.get_num_threads()
    return f"{n} CPU thread{'' if n == 1 else 's'}"

def test_embedding_gradient_is_the_in_order_sum_at_any_thread_count():
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (16, 128))  # every id about 40 times
    upstream = torch.randn(16, 128, 64)
    # Adding each token's gradient into its row one token after the other, in order.
    expected = torch.zeros(50, 64).index_add_(0, ids.reshape(-1), upstream.reshape(-1, 64))
    for n in (1, 2, 4):
        with _threads(n):
            emb = Embedding(50, 64)
            emb(ids).backward(upstream)
        assert torch.equal(emb.weight.grad, expected), n
    emb = Embedding(50, 64)
    torch.testing.assert_close(emb(ids), emb.weight[ids])
    emb(ids.to(torch.uint8)).backward(upstream)  # uint8 ids are ids, not a mask
    assert torch.equal(emb.weight.grad, expected)
    with torch.no_grad():
        assert torch.equal(emb(ids.to(torch.int16)), emb.weight[ids])


VARIANTS = {
    "einsum-float32-learned-positions-tied": dict(attn_impl="einsum", positions="learned", tie_embeddings=True),
    "sdpa-float32-dropout": dict(attn_impl="sdpa", dropout=0.1),
    "einsum-bfloat16-dropout": dict(attn_impl="einsum", dropout=0.1, autocast=True),
    "sdpa-bfloat16": dict(attn_impl="sdpa", autocast=True),
}


@pytest.mark.parametrize("name", VARIANTS)
def test_whole_model_gradients_are_bitwise_stable_over_repeated_backward_passes(name):
    """The test that would have caught autograd's embedding backward: at two threads it changed
    the gradient of token_embeddings.weight from one backward pass to the next. Large enough
    (16 x 32 tokens x 64 dims) for torch's CPU kernels to split their work across the threads."""
    variant = dict(VARIANTS[name])
    autocast = variant.pop("autocast", False)
    with _threads(2):
        torch.manual_seed(0)
        model = TransformerLM(64, 32, 64, 2, 4, None, **variant)
        ids = torch.randint(0, 64, (16, 33))
        first = None
        for _ in range(5):  # autograd's embedding backward differed on the second pass (10 of 10 tries)
            model.zero_grad(set_to_none=True)
            torch.manual_seed(1)  # the same dropout masks each time
            ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
            with ctx:
                loss = model(ids[:, :-1], targets=ids[:, 1:])
            loss.backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            if first is None:
                first = grads
            unstable = [n for n in grads if not torch.equal(grads[n], first[n])]
            assert not unstable, unstable


def test_training_steps_with_clipping_and_adamw_are_bitwise_repeatable():
    def three_steps():
        torch.manual_seed(0)
        model = TransformerLM(64, 32, 64, 2, 4, None, dropout=0.1)
        opt = AdamW(param_groups(model, 0.1), lr=1e-2)
        data = torch.Generator().manual_seed(2)
        norms = []
        for _ in range(3):
            ids = torch.randint(0, 64, (16, 33), generator=data)
            model(ids[:, :-1], targets=ids[:, 1:]).backward()
            norms.append(clip_grad_norm_(model.parameters(), 0.5))  # clips: the norm is above 0.5
            opt.step()
            opt.zero_grad(set_to_none=True)
        return norms, model.state_dict(), opt.state_dict()

    with _threads(2):
        norms, weights, opt_state = three_steps()
        for _ in range(2):
            norms2, weights2, opt_state2 = three_steps()
            assert norms2 == norms and min(norms) > 0.5
            for k in weights:
                assert torch.equal(weights[k], weights2[k]), k
            for s1, s2 in zip(opt_state["state"].values(), opt_state2["state"].values()):
                assert torch.equal(s1["exp_avg_sq"], s2["exp_avg_sq"])


def test_configure_determinism_on_cpu_switches_nothing_global():
    before = torch.are_deterministic_algorithms_enabled()
    line = configure_determinism(True, torch.device("cpu"))
    assert line.startswith("deterministic: yes at ") and f"{_cpu_threads()}" in line
    assert torch.are_deterministic_algorithms_enabled() == before
    assert "off" in configure_determinism(False, torch.device("cpu"))


def test_the_line_says_when_max_time_makes_the_schedule_follow_the_clock(tmp_path):
    """With train.max_time the schedule position is max(step, elapsed / max_time x length): two runs
    of one config, or a run and its --resume, take other learning rates once the steps fall behind
    that pace. The line said "deterministic: yes" all the same (audit readme1 #2)."""
    from test_train import _raw_config

    from lm.train import Trainer, config_from_dict, read_metrics

    cpu = torch.device("cpu")
    paced = configure_determinism(True, cpu, max_time=600.0, max_steps=600)
    assert paced == (f"deterministic: the steps yes at {_cpu_threads()} (another thread count "
                     "may change the last bits), but the schedule follows the clock (train.max_time): runs and "
                     "--resume are bitwise the same only while the steps keep up with train.max_steps 600 in 600 s "
                     "(1 s a step on average)"), paced
    by_time = configure_determinism(True, cpu, max_time=6.0)
    assert by_time.endswith("but the schedule follows the clock (train.max_time): runs and --resume are not "
                            "bitwise the same"), by_time
    by_step = configure_determinism(True, cpu, max_time=6.0, max_steps=60, schedule="inverse_sqrt")
    assert "follows the clock" not in by_step, by_step
    assert "train.max_time may end a run, or its --resume, at another step" in by_step, by_step
    assert configure_determinism(True, cpu, max_steps=60).startswith("deterministic: yes at ")
    assert configure_determinism(False, cpu, max_time=6.0).startswith("deterministic: off")
    before = torch.get_num_threads()
    try:  # one thread, not "1 CPU threads" (audit train8)
        torch.set_num_threads(1)
        assert configure_determinism(True, cpu, max_steps=60).startswith("deterministic: yes at 1 CPU thread (")
        assert configure_determinism(False, cpu).endswith("deterministic at 1 CPU thread anyway")
    finally:
        torch.set_num_threads(before)

    # the run's own line, and what it warns of: steps slower than max_time's pace take other lrs
    raw = _raw_config(tmp_path, train={"max_steps": 4, "max_time": 4.0}, eval={"interval": 0})
    lrs = []
    for seconds in (0.0, 1.5):  # each step takes no time / longer than the pace of 4 steps in 4 s
        lines, ticks = [], iter(range(1000))
        raw["train"]["out_dir"] = str(tmp_path / f"run{seconds}")
        trainer = Trainer(config_from_dict(raw), print_fn=lines.append)
        trainer.clock = lambda s=seconds, t=ticks: s * next(t)
        assert trainer.run() == 0
        assert [line for line in lines if line.startswith("deterministic:")] == [
            f"deterministic: the steps yes at {_cpu_threads()} (another thread count may change "
            "the last bits), but the schedule follows the clock (train.max_time): runs and --resume are bitwise the "
            "same only while the steps keep up with train.max_steps 4 in 4 s (1 s a step on average)"], lines
        lrs.append([r["lr"] for r in read_metrics(tmp_path / f"run{seconds}") if r["split"] == "train"])
        behind = [line for line in lines if "fell behind" in line]  # said once, where it happened (audit train8)
        assert behind == ([] if seconds == 0 else [
            "step 1: the steps fell behind train.max_steps 4 in train.max_time 4 s; the learning rates follow the "
            "clock from here, so a rerun or --resume may not be bitwise the same"]), lines
    # the slow run's lrs run ahead of its steps, and it ends where the time is up, at step 3
    assert len(lrs[0]) == 4 and len(lrs[1]) == 3 and lrs[0][0] == lrs[1][0] and lrs[0][1] < lrs[1][1], lrs
    # the trainer says it for its own schedule: inverse_sqrt's rates follow the steps (mut31: the schedule not
    # passed, its line said they follow the clock)
    raw["optim"].update(schedule="inverse_sqrt", warmup_iters=2)
    raw["train"]["out_dir"] = str(tmp_path / "inverse_sqrt")
    trainer = Trainer(config_from_dict(raw), print_fn=lambda line: None)
    trainer._lock.release()
    assert trainer._determinism == (f"deterministic: the steps yes at {_cpu_threads()} (another thread count may "
                                    "change the last bits), but train.max_time may end a run, or its --resume, at "
                                    "another step (the learning rates follow the steps)")


def test_configure_determinism_on_cuda_sets_torch_and_cublas(monkeypatch):
    # The CUDA path without a GPU: the calls it makes are recorded, not made.
    calls = []
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    line = configure_determinism(True, torch.device("cuda", 0))
    assert calls == [((True,), {})]  # strict: warn_only would keep flash attention's atomic backward
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE_CONFIG == ":4096:8"
    assert "deterministic algorithms on" in line and "none on the training path" in line

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the other accepted setting is kept
    configure_determinism(True, torch.device("cuda", 0))
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    with pytest.raises(ValueError, match="CUBLAS_WORKSPACE_CONFIG is ':0:0'"):
        configure_determinism(True, torch.device("cuda", 0))

    calls.clear()
    assert configure_determinism(False, torch.device("cuda", 0)).startswith("deterministic: off")
    assert calls == []  # off leaves torch's global switch as it was


def test_float32_matmuls_use_tf32_on_cuda_only(monkeypatch):
    from lm.device import configure_matmul_precision

    calls = []
    monkeypatch.setattr(torch, "set_float32_matmul_precision", lambda mode: calls.append(mode))
    assert configure_matmul_precision(torch.device("cpu")) == "" and calls == []
    line = configure_matmul_precision(torch.device("cuda", 0))  # the run log's line, in full
    assert line == "float32 matmuls: TF32 (torch.set_float32_matmul_precision('high'))" and calls == ["high"]


# T2, T5: rank_ordered_mean is (g0 + g1 + ... ) / world, every rank's gradient summed in rank order
@pytest.mark.parametrize("world", [3, 4])
def test_rank_ordered_mean_is_the_mean_of_every_ranks_gradient(monkeypatch, world):
    import torch.distributed as dist

    from lm.train.determinism import rank_ordered_mean

    torch.manual_seed(0)
    grads = [torch.randn(5) for _ in range(world)]
    groups = []

    def gather(out, inp, group=None, async_op=False):
        # a blocking call (async_op falsy) returns None in torch.distributed: no work, no future
        assert async_op is True
        groups.append(group)
        out.copy_(torch.cat(grads))
        fut = torch.futures.Future()
        fut.set_result([out])

        class Work:
            def get_future(self):
                return fut
        return Work()

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(dist, "all_gather_single", gather, raising=False)
    monkeypatch.setattr(dist, "all_gather_into_tensor", gather)

    class Bucket:
        def buffer(self):
            return grads[0].clone()

    group, default = object(), object()
    monkeypatch.setattr(type(dist.group), "WORLD", default)  # the default group (a property of its metaclass)
    got = rank_ordered_mean(group, Bucket()).wait()
    want = grads[0].clone()
    for g in grads[1:]:
        want += g
    assert torch.equal(got, want / world)
    assert torch.equal(rank_ordered_mean(None, Bucket()).wait(), want / world)  # DDP's default group
    assert groups == [group, default]


# T3: three or more processes get the rank-ordered hook (two need none)
@pytest.mark.parametrize("world, hooked", [(2, False), (3, True), (4, True)])
def test_deterministic_ddp_hooks_three_or_more_processes(world, hooked):
    from lm.train.determinism import deterministic_ddp, rank_ordered_mean

    calls = []

    class FakeDDP:
        def register_comm_hook(self, state, hook):
            calls.append(hook)

    deterministic_ddp(FakeDDP(), world)
    assert calls == ([rank_ordered_mean] if hooked else [])
