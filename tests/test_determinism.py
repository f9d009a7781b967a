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
    assert line.startswith("deterministic: yes at ") and f"{torch.get_num_threads()} CPU threads" in line
    assert torch.are_deterministic_algorithms_enabled() == before
    assert "off" in configure_determinism(False, torch.device("cpu"))


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
    assert "TF32" in configure_matmul_precision(torch.device("cuda", 0)) and calls == ["high"]
