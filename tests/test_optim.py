import copy
import math

import pytest
import torch
from helpers.aten_ops import AtenOps
from torch import nn

from lm.model import TransformerLM
from lm.optim import AdamW, clip_grad_norm_, cosine_lr_schedule, inverse_sqrt_lr_schedule, param_groups, wsd_lr_schedule


class _Tiny(nn.Module):
    """A stand-in LM: embedding, a norm gain, a biased linear layer and an output matrix."""

    def __init__(self, vocab=17, d=8):
        super().__init__()
        self.token_embeddings = nn.Embedding(vocab, d)
        self.norm_weight = nn.Parameter(torch.ones(d))
        self.hidden = nn.Linear(d, d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        h = self.token_embeddings(ids) * self.norm_weight
        return self.lm_head(torch.tanh(self.hidden(h)))


def _loss(model, ids):
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


@pytest.mark.parametrize("fused", [False, True])  # foreach kernels, or torch's fused AdamW kernel (CUDA's default)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1, 1.0])  # 1.0: scripts/shakespeare.py's setting
def test_adamw_matches_torch_over_100_steps(weight_decay, fused):
    torch.manual_seed(0)
    ours, ref = _Tiny(), _Tiny()
    ref.load_state_dict(ours.state_dict())
    kwargs = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    opt_ours = AdamW(param_groups(ours, weight_decay), **kwargs, fused=fused)
    opt_ref = torch.optim.AdamW(param_groups(ref, weight_decay), **kwargs, foreach=False)
    gen = torch.Generator().manual_seed(1)
    for step in range(100):
        ids = torch.randint(0, 17, (4, 9), generator=gen)
        for model, opt in ((ours, opt_ours), (ref, opt_ref)):
            for g in opt.param_groups:
                g["lr"] = 3e-3 * (1 - step / 200)  # per-step lr changes, as the schedule makes
            opt.zero_grad()
            _loss(model, ids).backward()
            opt.step()
    # measured over 3 seeds and the 3 weight decays: bitwise equal with the foreach kernels (1e-7 leaves
    # room for a torch that orders its arithmetic otherwise); the fused kernel at most 2.4e-7 away after
    # 100 steps (an ulp or two a step, weights of about 1)
    atol = 1e-6 if fused else 1e-7
    for (name, a), b in zip(ours.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=atol, msg=name)
    # The weights moved well away from where they started, so the comparison means something.
    assert (ours.lm_head.weight - _Tiny().lm_head.weight).abs().max() > 0.05


@pytest.mark.parametrize(("first", "second"), [("ours", "torch"), ("torch", "ours"), ("ours-fused", "torch"),
                                               ("torch-fused", "ours-fused"), ("ours", "ours-fused")])  # fmt: skip
def test_adamw_state_dict_interchanges_with_torch(first, second):
    """Train 3 steps with one optimizer, load its state into the other, and step both on: torch
    accepts a state_dict with foreign or missing keys and only fails (or silently differs) at
    step(), so the steps after loading are what is compared, in both directions."""
    torch.manual_seed(0)
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    make = {"ours": lambda groups: AdamW(groups, **kwargs, fused=False),
            "ours-fused": lambda groups: AdamW(groups, **kwargs, fused=True),
            "torch": lambda groups: torch.optim.AdamW(groups, **kwargs, foreach=False),
            "torch-fused": lambda groups: torch.optim.AdamW(groups, **kwargs, fused=True)}  # fmt: skip
    model = _Tiny()
    opt = make[first](param_groups(model, 0.1))
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 17, (4, 9), generator=gen) for _ in range(6)]
    for ids in batches[:3]:
        opt.zero_grad()
        _loss(model, ids).backward()
        opt.step()
    other = _Tiny()
    other.load_state_dict(model.state_dict())
    handed_over = model.lm_head.weight.detach().clone()
    loaded = make[second](param_groups(other, 0.1))
    # a deep copy, as a checkpoint file gives: load_state_dict keeps the very tensors it is handed
    loaded.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert float(loaded.state_dict()["state"][0]["step"]) == 3.0
    for ids in batches[3:]:
        for m, o in ((model, opt), (other, loaded)):
            o.zero_grad()
            _loss(m, ids).backward()
            o.step()
    # the same kind of kernel on both sides: measured bitwise equal over 5 seeds (1e-7 leaves room for a
    # torch that orders its arithmetic otherwise); the fused kernel against the plain one: an ulp or two
    rtol = 0 if first.endswith("fused") == second.endswith("fused") else 4e-7
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=rtol, atol=1e-7, msg=name)
    for sa, sb in zip(opt.state_dict()["state"].values(), loaded.state_dict()["state"].values()):
        assert float(sa["step"]) == float(sb["step"]) == 6.0
        torch.testing.assert_close(sb["exp_avg"], sa["exp_avg"], rtol=0, atol=1e-7)
        torch.testing.assert_close(sb["exp_avg_sq"], sa["exp_avg_sq"], rtol=0, atol=1e-7)
    # the steps after the hand-over moved the weights well beyond the tolerance
    assert (model.lm_head.weight - handed_over).abs().max() > 0.01


def test_param_groups_put_norms_biases_embeddings_in_no_decay():
    model = _Tiny()
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert sorted(names[id(p)] for p in decay["params"]) == ["hidden.weight", "lm_head.weight"]
    assert sorted(names[id(p)] for p in no_decay["params"]) == [
        "hidden.bias",
        "norm_weight",
        "token_embeddings.weight",
    ]


class _Unnamed(nn.Module):
    """Embeddings under names without "embed", a table class named like one, a frozen parameter."""

    class PositionEmbedding(nn.Module):  # not an nn.Embedding: found by its class name
        def __init__(self):
            super().__init__()
            self.table = nn.Parameter(torch.randn(16, 8))

    def __init__(self):
        super().__init__()
        self.frozen = nn.Parameter(torch.randn(8, 8), requires_grad=False)  # first: nothing after it is lost
        self.wte = nn.Embedding(17, 8)  # found by its type
        self.wpe = self.PositionEmbedding()
        self.proj = nn.Linear(8, 8, bias=False)
        self.block = nn.Sequential(nn.Linear(8, 8))
        self.scale_embed = nn.Parameter(torch.ones(8, 8))  # a matrix found by its name


def test_param_groups_find_embeddings_by_type_class_name_and_name_and_skip_frozen():
    model = _Unnamed()
    names = {id(p): n for n, p in model.named_parameters()}
    decay, no_decay = param_groups(model, 0.1)
    assert sorted(names[id(p)] for p in decay["params"]) == ["block.0.weight", "proj.weight"]
    no_decay_names = sorted(names[id(p)] for p in no_decay["params"])
    assert no_decay_names == ["block.0.bias", "scale_embed", "wpe.table", "wte.weight"]  # frozen: in neither
    decay, no_decay = param_groups(model, 0.1, decay_embeddings=True)
    assert sorted(names[id(p)] for p in decay["params"]) == [
        "block.0.weight", "proj.weight", "scale_embed", "wpe.table", "wte.weight"]  # fmt: skip
    assert [names[id(p)] for p in no_decay["params"]] == ["block.0.bias"]


def test_adamw_step_closure_missing_and_sparse_gradients():
    """step(closure) returns the closure's loss; a parameter without a gradient is skipped and
    the ones after it still move; sparse gradients are refused by name."""
    a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    opt = AdamW([a, b], lr=0.1, weight_decay=0.0)

    def closure():
        opt.zero_grad()
        loss = (b**2).sum()  # a gets no gradient
        loss.backward()
        return loss

    assert opt.step(closure).item() == 3.0
    assert torch.equal(a, torch.ones(3)) and (b < 1).all()
    assert opt.step() is None  # no closure, no loss
    emb = nn.Embedding(5, 2, sparse=True)
    emb(torch.tensor([1])).sum().backward()
    with pytest.raises(RuntimeError, match="^AdamW does not support sparse gradients$"):
        AdamW(emb.parameters()).step()


def test_adamw_defaults_and_argument_checks():
    params = [nn.Parameter(torch.zeros(3))]
    assert AdamW(params).defaults == {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    for ok in (dict(lr=0.0), dict(betas=(0.0, 0.0)), dict(eps=0.0), dict(weight_decay=0.0)):
        AdamW(params, **ok)  # the edges of each range are allowed
    nan = float("nan")  # fails `< 0` as every comparison, so it was accepted and made every parameter NaN
    bad = [
        (dict(lr=-1e-3), "lr must be a finite number >= 0, got lr=-0.001"),
        (dict(lr=nan), "lr must be a finite number >= 0, got lr=nan"),
        (dict(betas=(1.0, 0.9)), r"betas must be two numbers in \[0, 1\), got betas=\(1.0, 0.9\)"),
        (dict(betas=(0.9, 1.0)), r"betas must be two numbers in \[0, 1\), got betas=\(0.9, 1.0\)"),
        (dict(betas=(-0.1, 0.9)), r"betas must be two numbers in \[0, 1\), got betas=\(-0.1, 0.9\)"),
        (dict(betas=(0.9, -0.1)), r"betas must be two numbers in \[0, 1\), got betas=\(0.9, -0.1\)"),
        (dict(betas=(nan, 0.999)), r"betas must be two numbers in \[0, 1\), got betas=\(nan, 0.999\)"),
        (dict(betas=(0.9, nan)), r"betas must be two numbers in \[0, 1\), got betas=\(0.9, nan\)"),
        (dict(eps=-1e-8), "eps must be a finite number >= 0, got eps=-1e-08"),
        (dict(eps=nan), "eps must be a finite number >= 0, got eps=nan"),
        (dict(weight_decay=-0.1), "weight_decay must be a finite number >= 0, got weight_decay=-0.1"),
        (dict(weight_decay=nan), "weight_decay must be a finite number >= 0, got weight_decay=nan"),
    ]
    for kwargs, match in bad:
        with pytest.raises(ValueError, match=f"^{match}$"):
            AdamW(params, **kwargs)
        with pytest.raises(ValueError):  # torch refuses the same
            torch.optim.AdamW(params, **kwargs)
    with pytest.raises(ValueError, match=r"^lr must be a finite number >= 0, got lr=inf$"):
        AdamW(params, lr=float("inf"))  # torch accepts it: the first step makes every weight inf or NaN


@pytest.mark.parametrize("fused", [None, False])  # the default (fused on CPU), and the foreach kernels
def test_adamw_weight_decay_from_the_constructor_matches_torch(fused):
    """Plain parameters (no groups): the constructor's weight_decay is the one applied; against
    torch's AdamW with the same kind of kernel."""
    torch.manual_seed(0)
    ours, ref = _Tiny(), _Tiny()
    ref.load_state_dict(ours.state_dict())
    opt_ours = AdamW(ours.parameters(), lr=1e-2, weight_decay=0.5, fused=fused)
    kind = dict(fused=True) if fused is None else dict(foreach=False)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.5, **kind)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        ids = torch.randint(0, 17, (4, 9), generator=gen)
        for model, opt in ((ours, opt_ours), (ref, opt_ref)):
            opt.zero_grad()
            _loss(model, ids).backward()
            opt.step()
    for (name, a), b in zip(ours.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7, msg=name)  # measured bitwise equal


def test_param_groups_count_tied_weights_once():
    model = _Tiny(vocab=17, d=8)
    model.lm_head.weight = model.token_embeddings.weight
    groups = param_groups(model, 0.1)
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))


def test_cosine_schedule_values():
    args = dict(max_learning_rate=1.0, min_learning_rate=0.1, warmup_iters=10, cosine_cycle_iters=110)
    assert cosine_lr_schedule(0, **args) == 0.0
    assert cosine_lr_schedule(5, **args) == pytest.approx(0.5)
    assert cosine_lr_schedule(10, **args) == pytest.approx(1.0)
    assert cosine_lr_schedule(60, **args) == pytest.approx(0.55)  # half-way down the cosine
    assert cosine_lr_schedule(35, **args) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 4)))
    assert cosine_lr_schedule(110, **args) == pytest.approx(0.1)
    assert cosine_lr_schedule(1000, **args) == 0.1
    lrs = [cosine_lr_schedule(i, **args) for i in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_wsd_schedule_values():
    args = dict(max_learning_rate=1.0, min_learning_rate=0.1, warmup_iters=10, total_iters=110, decay_fraction=0.5)
    assert wsd_lr_schedule(0, **args) == 0.0
    assert wsd_lr_schedule(5, **args) == pytest.approx(0.5)
    assert wsd_lr_schedule(10, **args) == 1.0 and wsd_lr_schedule(55, **args) == 1.0  # stable
    assert wsd_lr_schedule(82.5, **args) == pytest.approx(0.55)  # half-way down the linear decay
    assert wsd_lr_schedule(110, **args) == pytest.approx(0.1) and wsd_lr_schedule(500, **args) == 0.1
    lrs = [wsd_lr_schedule(i, **args) for i in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    # a decay longer than what follows the warm-up starts right after it
    assert wsd_lr_schedule(10, 1.0, 0.0, 10, 20, 1.0) == 1.0 and wsd_lr_schedule(15, 1.0, 0.0, 10, 20, 1.0) == 0.5


def test_schedule_edges():
    # no warm-up: the peak from iteration 0 (and no division by zero)
    assert cosine_lr_schedule(0, 1.0, 0.1, 0, 100) == 1.0 and wsd_lr_schedule(0, 1.0, 0.1, 0, 100) == 1.0
    # a cycle no longer than the warm-up: the peak at its end, then the floor
    assert cosine_lr_schedule(10, 1.0, 0.1, 10, 10) == 1.0 and cosine_lr_schedule(10.5, 1.0, 0.1, 10, 10) == 0.1
    # the end of the decay is the floor exactly, not max + (min - max), which rounds (0.0007000000000000001)
    assert wsd_lr_schedule(100, 0.007, 0.0007, 10, 100, 0.2) == 0.0007
    assert cosine_lr_schedule(100, 0.007, 0.0007, 10, 100) == 0.0007
    # wsd's default decays over the last 20%
    assert wsd_lr_schedule(80, 1.0, 0.0, 10, 100) == 1.0 and wsd_lr_schedule(90, 1.0, 0.0, 10, 100) == 0.5
    # a warm-up longer than the cycle climbs until the warm-up ends (as nanoGPT's get_lr), then the floor
    assert [cosine_lr_schedule(it, 1.0, 0.1, 100, 10) for it in (5, 50, 99, 100, 101)] == [0.05, 0.5, 0.99, 0.1, 0.1]
    # a float from integer rates at every point, as the signature says (the peak and floor had come back as ints)
    for it in (0, 5, 10, 11, 20, 95, 100, 200):
        assert type(cosine_lr_schedule(it, 1, 0, 10, 10)) is float
        assert type(cosine_lr_schedule(it, 1, 0, 5, 100)) is float
        assert type(wsd_lr_schedule(it, 1, 0, 10, 100)) is float


@pytest.mark.parametrize("call, message", [
    (lambda: cosine_lr_schedule(-1, 1.0, 0.1, 0, 100), "cosine_lr_schedule: it must be a finite number >= 0, got -1"),
    (lambda: cosine_lr_schedule(5, 1.0, 0.1, -10, 100),
     "cosine_lr_schedule: warmup_iters must be a finite number >= 0, got -10"),
    (lambda: cosine_lr_schedule(5, float("nan"), 0.1, 10, 100),
     "cosine_lr_schedule: max_learning_rate must be a finite number >= 0, got nan"),
    (lambda: cosine_lr_schedule(50, 0.1, 1.0, 10, 100),
     "cosine_lr_schedule: min_learning_rate (1.0) must not exceed max_learning_rate (0.1)"),
    (lambda: cosine_lr_schedule("5", 1.0, 0.1, 10, 100), "cosine_lr_schedule: it must be a number, got '5'"),
    (lambda: wsd_lr_schedule(5, 1.0, 0.1, 10, float("inf")),
     "wsd_lr_schedule: total_iters must be a finite number >= 0, got inf"),
    # (mutation: wsd's own iteration left unchecked, survived: -1 gave a rate of -0.1)
    (lambda: wsd_lr_schedule(-1, 1.0, 0.1, 10, 100), "wsd_lr_schedule: it must be a finite number >= 0, got -1"),
    (lambda: wsd_lr_schedule(5, 1.0, 0.1, 10, 100, 0.0), "wsd_lr_schedule: decay_fraction must be in (0, 1], got 0.0"),
    (lambda: wsd_lr_schedule(5, 1.0, 0.1, 10, 100, 1.5), "wsd_lr_schedule: decay_fraction must be in (0, 1], got 1.5"),
    # an infinite warm-up passes "> 0" and gives a rate of 0 for ever
    (lambda: inverse_sqrt_lr_schedule(10, 512, float("inf")),
     "inverse_sqrt_lr_schedule: warmup_iters must be a finite number >= 0, got inf"),
])
def test_schedules_refuse_arguments_that_give_no_rate(call, message):
    """Before, a negative iteration with no warm-up was a ZeroDivisionError, a NaN rate or an inverted
    min/max came back as a plausible learning rate, and decay_fraction 0 divided by zero at the end."""
    with pytest.raises(ValueError) as e:
        call()
    assert str(e.value) == message


def test_inverse_sqrt_schedule_refuses_a_zero_warmup_or_width():
    from lm.optim import inverse_sqrt_lr_schedule, inverse_sqrt_scale

    with pytest.raises(ValueError, match=r"^inverse_sqrt_lr_schedule: d_model and warmup_iters must be > 0, "
                                         r"got 512 and 0$"):
        inverse_sqrt_lr_schedule(10, 512, 0)  # was ZeroDivisionError (0 ** -1.5)
    with pytest.raises(ValueError, match=r"^inverse_sqrt_lr_schedule: it must be a finite number >= 0, got nan$"):
        inverse_sqrt_lr_schedule(float("nan"), 512, 4000)
    with pytest.raises(ValueError, match=r"^inverse_sqrt_scale: peak must be a finite number >= 0, got -0.001$"):
        inverse_sqrt_scale(-1e-3, 512, 4000)
    # a warm-up of one step (or part of one) is a warm-up > 0 (mutation: `<= 1` for `<= 0`, survived)
    for warmup in (1, 0.5):
        assert inverse_sqrt_lr_schedule(4, 16, warmup) == 16**-0.5 * min(4**-0.5, 4 * warmup**-1.5)
        assert inverse_sqrt_scale(1e-3, 512, warmup) == 1e-3 * math.sqrt(512 * warmup)


@pytest.mark.parametrize("d_model, warmup_iters", [(0, 10), (512, 0), (0.5, 10)])
def test_inverse_sqrt_scale_refuses_a_zero_width_or_warmup_as_the_schedule_does(d_model, warmup_iters):
    """inverse_sqrt_scale(1e-3, 0, 10) returned a scale of 0 (a run that never learns), where the
    schedule itself refuses d_model 0."""
    from lm.optim import inverse_sqrt_lr_schedule, inverse_sqrt_scale

    for function, call in (("inverse_sqrt_scale", lambda: inverse_sqrt_scale(1e-3, d_model, warmup_iters)),
                           ("inverse_sqrt_lr_schedule", lambda: inverse_sqrt_lr_schedule(10, d_model, warmup_iters))):
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value) == f"{function}: d_model and warmup_iters must be > 0, got {d_model!r} and {warmup_iters!r}"
    assert inverse_sqrt_scale(1e-3, 512, 4000) == pytest.approx(1e-3 * math.sqrt(512 * 4000))


def test_cosine_schedule_matches_cs336_reference_values():
    # The CS336 assignment's expected values for max=1, min=0.1, warm-up 7, cycle 21.
    expected = [0, 0.14285714285714285, 0.2857142857142857, 0.42857142857142855, 0.5714285714285714,
                0.7142857142857143, 0.8571428571428571, 1.0, 0.9887175604818206, 0.9554359905560885,
                0.9018241671106134, 0.8305704108364301, 0.7452476826029011, 0.6501344202803414,
                0.55, 0.44986557971965857, 0.3547523173970989, 0.26942958916356996, 0.19817583288938662,
                0.14456400944391146, 0.11128243951817937, 0.1, 0.1, 0.1, 0.1]  # fmt: skip
    got = [cosine_lr_schedule(it, 1, 0.1, 7, 21) for it in range(25)]
    assert got == pytest.approx(expected)


@pytest.mark.parametrize("max_norm", [1e-2, 1.0, 1e3])
def test_clip_grad_norm_matches_torch(max_norm):
    torch.manual_seed(0)
    params = [torch.randn(5, 3, requires_grad=True), torch.randn(4, requires_grad=True),
              torch.randn(2, requires_grad=True)]  # fmt: skip
    (params[0].sum() * 3 + (params[1] ** 2).sum()).backward()  # params[2] gets no gradient
    ref = [p.detach().clone().requires_grad_() for p in params]
    for p, r in zip(params, ref):
        r.grad = None if p.grad is None else p.grad.clone()
    norm = clip_grad_norm_(params, max_norm)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm)
    assert norm == pytest.approx(float(ref_norm), rel=1e-6)
    for p, r in zip(params, ref):
        if p.grad is None:
            assert r.grad is None
        else:
            torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-7)
    if max_norm < norm:
        total = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params if p.grad is not None]))
        assert float(total) == pytest.approx(max_norm, rel=1e-4)


@pytest.mark.parametrize("dtypes", [(torch.float64, torch.float64), (torch.float32, torch.float64)],
                         ids=["float64", "mixed"])
def test_clip_grad_norm_of_float64_gradients_matches_torch(dtypes):
    """A float64 model's gradients (numerics20): their norm had been asked for in float32, which
    torch refuses ("should be convertible without narrowing"); torch clips them, so does this, in float64."""
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(7, 3, generator=gen, dtype=dtypes[0]) * 3, torch.randn(5, generator=gen, dtype=dtypes[1])]
    ours = [torch.zeros_like(g, requires_grad=True) for g in grads]
    ref = [torch.zeros_like(g, requires_grad=True) for g in grads]
    for o, r, g in zip(ours, ref, grads):
        o.grad, r.grad = g.clone(), g.clone()
    norm = clip_grad_norm_(ours, 1.0, return_tensor=True)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    exact = torch.cat([g.double().flatten() for g in grads]).norm()
    assert norm.dtype == torch.float64 and float(norm) == pytest.approx(float(exact), rel=1e-15)
    assert float(norm) == pytest.approx(float(ref_norm), rel=1e-7)
    for o, r in zip(ours, ref):
        assert o.grad.dtype == r.grad.dtype
        torch.testing.assert_close(o.grad, r.grad, rtol=1e-6, atol=0)
    assert float(torch.cat([o.grad.double().flatten() for o in ours]).norm()) == pytest.approx(1.0, rel=1e-6)


def test_clip_grad_norm_takes_a_single_tensor_as_torch_does():
    """One tensor is one parameter, not an iterable of its rows (which have no gradient)."""
    ours, ref = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    ours.grad, ref.grad = torch.tensor([30.0, 40.0]), torch.tensor([30.0, 40.0])
    norm = clip_grad_norm_(ours, 1.0)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    assert norm == float(ref_norm) == 50.0
    assert torch.equal(ours.grad, ref.grad)
    torch.testing.assert_close(ours.grad, torch.tensor([0.6, 0.8]))
    tensor_norm = clip_grad_norm_(ours, 0.5, return_tensor=True)
    assert isinstance(tensor_norm, torch.Tensor) and tensor_norm.ndim == 0


@pytest.mark.parametrize("foreach", [None, True, False])
def test_clip_grad_norm_scales_each_dtype_as_torch_does(foreach):
    """Every gradient is multiplied by the float32 scale, as torch does whatever the gradient's dtype
    (a bfloat16 gradient in float32, rounded once); the scale rounded to the first gradient's dtype
    gave a float32 gradient [0.059766, 0.079687] for torch's [0.059702, 0.079603]. The norm is taken
    in float32 here (torch's is rounded to a bfloat16 gradient's dtype), so torch clips with ours."""
    from torch.nn.utils.clip_grad import _clip_grads_with_norm_

    def params():
        g = torch.Generator().manual_seed(0)
        grads = [torch.tensor([3.0, 4.0], dtype=torch.bfloat16), torch.tensor([0.3, 0.4]),
                 torch.randn(64, generator=g).bfloat16(), torch.randn(5, 3, generator=g)]
        out = [torch.zeros_like(t, requires_grad=True) for t in grads]
        for p, grad in zip(out, grads):
            p.grad = grad
        return out

    ours, ref = params(), params()
    norm = clip_grad_norm_(ours, 1.0, return_tensor=True)
    _clip_grads_with_norm_(ref, 1.0, norm, foreach=foreach)
    for p, r in zip(ours, ref):
        assert p.grad.dtype == r.grad.dtype and torch.equal(p.grad, r.grad), (p.grad, r.grad)
    torch.testing.assert_close(ours[1].grad, torch.tensor([0.3, 0.4]) / float(norm), rtol=1e-6, atol=0)
    # float32 gradients alone: the whole of torch's clip_grad_norm_, norm and all, bit for bit
    ours, ref = params()[1::2], params()[1::2]
    assert clip_grad_norm_(ours, 0.5) == float(torch.nn.utils.clip_grad_norm_(ref, 0.5, foreach=foreach))
    assert all(torch.equal(p.grad, r.grad) for p, r in zip(ours, ref))


def test_clip_grad_norm_returns_a_float_and_zero_without_gradients():
    """Found by mutmut once clip_grad_norm_ was mutated at all (its decorator hid it): the norm of no
    gradient (1.0 passed), the float returned by default (a tensor passed) and the 0-d tensor with
    ``return_tensor`` when there is no gradient were untested."""
    p = torch.zeros(3, requires_grad=True)
    norm = clip_grad_norm_([p], 1.0)
    assert type(norm) is float and norm == 0.0 == float(torch.nn.utils.clip_grad_norm_([p], 1.0))
    none = clip_grad_norm_([p], 1.0, return_tensor=True)
    assert isinstance(none, torch.Tensor) and none.shape == () and float(none) == 0.0
    p.grad = torch.tensor([3.0, 4.0, 0.0])
    norm = clip_grad_norm_(p, 10.0)
    assert type(norm) is float and norm == 5.0 and torch.equal(p.grad, torch.tensor([3.0, 4.0, 0.0]))


def test_clip_grad_norm_of_bfloat16_gradients_is_taken_in_float32():
    """Each gradient's norm is accumulated and returned in float32: a norm rounded to bfloat16 (as
    torch's is for bfloat16 gradients) is off by up to 2**-9 relative, and so is the clipping."""
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(4096, generator=g).bfloat16(), torch.randn(333, generator=g).bfloat16()]
    params = [torch.zeros_like(t, requires_grad=True) for t in grads]
    for p, grad in zip(params, grads):
        p.grad = grad.clone()
    exact = float(torch.linalg.vector_norm(torch.cat([t.double() for t in grads])))
    norm = clip_grad_norm_(params, 1e9)
    assert abs(norm - exact) / exact < 1e-6, (norm, exact)
    rounded = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))))  # in bfloat16
    assert abs(rounded - exact) / exact > 1e-4  # what the test tells apart


class _TinyWithPositions(_Tiny):
    """Token + position embeddings: enough context to memorise one batch of random ids."""

    def __init__(self, vocab=17, d=64, seq=16):
        super().__init__(vocab, d)
        self.position_embeddings = nn.Embedding(seq, d)

    def forward(self, ids):
        h = (self.token_embeddings(ids) + self.position_embeddings.weight[: ids.shape[1]]) * self.norm_weight
        return self.lm_head(torch.tanh(self.hidden(h)))


def test_single_batch_overfits():
    torch.manual_seed(0)
    model = _TinyWithPositions()
    opt = AdamW(param_groups(model, 0.01), lr=1e-2)
    # Rows differ at every position, so (token, position) determines the target: memorisable.
    ids = torch.stack([torch.randperm(17)[:4] for _ in range(17)], dim=1)
    first = _loss(model, ids).item()
    for _ in range(300):
        opt.zero_grad()
        loss = _loss(model, ids)
        loss.backward()
        clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    assert first > 2.5
    assert loss.item() < 0.05


def test_inverse_sqrt_schedule_is_the_papers_formula():
    import math

    from lm.optim import inverse_sqrt_lr_schedule, inverse_sqrt_scale

    d, warmup = 512, 4000
    for step in (1, 10, 1000, 3999, 4000, 4001, 10_000, 100_000):
        paper = d**-0.5 * min(step**-0.5, step * warmup**-1.5)  # Vaswani et al., eq. (3)
        assert inverse_sqrt_lr_schedule(step, d, warmup) == pytest.approx(paper, rel=1e-12)
        assert inverse_sqrt_lr_schedule(step, d, warmup, scale=2.0) == pytest.approx(2 * paper, rel=1e-12)
    assert inverse_sqrt_lr_schedule(0, d, warmup) == 0.0
    # linear up to the peak, then 1/sqrt(step): the peak is at the end of the warm-up
    peak = inverse_sqrt_lr_schedule(warmup, d, warmup)
    assert inverse_sqrt_lr_schedule(warmup / 2, d, warmup) == pytest.approx(peak / 2)
    assert inverse_sqrt_lr_schedule(4 * warmup, d, warmup) == pytest.approx(peak / 2)
    assert max(inverse_sqrt_lr_schedule(s, d, warmup) for s in range(1, 20_000)) == pytest.approx(peak)
    scale = inverse_sqrt_scale(2e-3, 256, 200)
    assert inverse_sqrt_lr_schedule(200, 256, 200, scale) == pytest.approx(2e-3)
    assert scale == pytest.approx(2e-3 * math.sqrt(256 * 200))


def test_param_groups_of_the_transformer():
    model = TransformerLM(50, 16, 32, 2, 2, 64)
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    norms = {f"layers.{i}.{n}.weight" for i in (0, 1) for n in ("ln1", "ln2")}
    assert {names[id(p)] for p in no_decay["params"]} == {"token_embeddings.weight", "ln_final.weight", *norms}
    assert "lm_head.weight" in {names[id(p)] for p in decay["params"]}
    assert len(decay["params"]) == 1 + 2 * 7  # lm_head and 7 matrices per block
    decay, no_decay = param_groups(model, 0.1, decay_embeddings=True)  # as nanoGPT: every matrix
    assert {names[id(p)] for p in no_decay["params"]} == {"ln_final.weight", *norms}
    assert "token_embeddings.weight" in {names[id(p)] for p in decay["params"]}


def test_the_optimizer_step_is_a_few_kernels_for_all_parameters_not_a_few_per_parameter():
    """The update runs as torch._foreach_* kernels over each group: the count of aten ops in a step
    barely grows with the number of parameter tensors (on a GPU each op is a kernel launch)."""
    def ops_per_step(num_layers: int, fused: bool = False) -> tuple[int, int]:
        model = TransformerLM(50, 16, 32, num_layers, 2, 64)
        opt = AdamW(param_groups(model, 0.1), lr=1e-3, fused=fused)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        with AtenOps() as count:
            opt.step()
        return count.ops, len(list(model.parameters()))

    small, n_small = ops_per_step(2)
    large, n_large = ops_per_step(8)
    # the kernels: ~10 per group; the per-parameter part is the CPU step counter (add, item)
    assert small < 30 + 3 * n_small and large - small <= 3 * (n_large - n_small)
    assert large < 4 * n_large  # the per-parameter loop took ~10 ops per parameter
    # fused (CUDA's default): the step counts' increment and the fused kernel, per group
    assert ops_per_step(8, fused=True)[0] == 2 * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no cuda (scripts/gpu_check.sh runs this on a GPU)")
def test_adamw_on_cuda_is_torchs_fused_step_and_resumes_from_a_cpu_state():
    """On CUDA the default is the fused kernel: equal to torch.optim.AdamW(fused=True) step for step,
    its step counts on the device; a state_dict mapped to the CPU (as read_checkpoint loads it)
    resumes on the device to the same weights as the run that went on."""
    torch.manual_seed(0)
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ours, ref = _Tiny().cuda(), _Tiny().cuda()
    ref.load_state_dict(ours.state_dict())
    opt, torch_opt = AdamW(param_groups(ours, 0.1), **kwargs), torch.optim.AdamW(param_groups(ref, 0.1), **kwargs,
                                                                                fused=True)  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 17, (4, 9), generator=gen).cuda() for _ in range(8)]
    for ids in batches[:4]:
        for model, o in ((ours, opt), (ref, torch_opt)):
            o.zero_grad()
            _loss(model, ids).backward()
            o.step()
    assert all(s["step"].device.type == "cuda" for s in opt.state.values())
    for (name, a), b in zip(ours.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7, msg=name)
    resumed = _Tiny().cuda()
    resumed.load_state_dict(ours.state_dict())
    loaded = AdamW(param_groups(resumed, 0.1), **kwargs)
    loaded.load_state_dict(copy.deepcopy({**opt.state_dict(), "state": {
        k: {n: t.cpu() for n, t in s.items()} for k, s in opt.state_dict()["state"].items()}}))
    for ids in batches[4:]:
        for model, o in ((ours, opt), (resumed, loaded)):
            o.zero_grad()
            _loss(model, ids).backward()
            o.step()
    for (name, a), b in zip(ours.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_clip_and_adamw_refuse_hyperparameters_that_train_wrongly():
    """clip_grad_norm_ with a negative limit reversed every gradient and with NaN made them NaN; AdamW
    checked only its defaults, so a group with lr=-1 climbed the gradient and param_groups(model, nan)
    gave NaN weights after one step; lr=inf and lr=True were taken (apifuzz19 #7, #8)."""
    import numpy as np

    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.tensor([3.0, 4.0])
    for limit in (-1.0, 0.0, float("nan"), float("inf"), "1", True):
        with pytest.raises(ValueError, match=r"^max_l2_norm must be a positive finite number, got max_l2_norm="):
            clip_grad_norm_([p], limit)
    with pytest.raises(ValueError, match=r"^eps must be a finite number >= 0, got eps=-10$"):
        clip_grad_norm_([p], 1.0, eps=-10)
    assert p.grad.tolist() == [3.0, 4.0]  # nothing scaled by a refused call
    model = TransformerLM(100, 16, 16, 1, 2, 32)
    q = torch.nn.Parameter(torch.ones(3))
    cases = [
        (lambda: param_groups(model, float("nan")),
         r"^weight_decay must be a finite number >= 0, got weight_decay=nan$"),
        (lambda: AdamW([{"params": [p], "lr": -1.0}]), r"^param_groups\[0\]: lr must be a finite number >= 0, got "
                                                       r"lr=-1\.0$"),
        (lambda: AdamW([{"params": [p]}, {"params": [q], "weight_decay": float("nan")}]),
         r"^param_groups\[1\]: weight_decay must be a finite number >= 0, got weight_decay=nan$"),
        (lambda: AdamW([{"params": [p]}, {"params": [q], "betas": (0.9, 1.0)}]),
         r"^param_groups\[1\]: betas must be two numbers in \[0, 1\), got betas=\(0\.9, 1\.0\)$"),
        (lambda: AdamW([p], lr=float("inf")), r"^lr must be a finite number >= 0, got lr=inf$"),
        (lambda: AdamW([p], lr=True), r"^lr must be a finite number >= 0, got lr=True$"),
        (lambda: AdamW([p], lr="1e-3"), r"^lr must be a finite number >= 0, got lr='1e-3'$"),
        (lambda: AdamW([p], betas=(0.9,)), r"^betas must be two numbers in \[0, 1\), got betas=\(0\.9,\)$"),
        (lambda: AdamW([p], betas=0.9), r"^betas must be two numbers in \[0, 1\), got betas=0\.9$"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    opt = AdamW([p], lr=np.float32(1e-3), betas=[0.9, 0.95])  # numpy's numbers and a list of betas: as before
    opt.add_param_group({"params": [q], "lr": 0.1})
    with pytest.raises(ValueError, match=r"^param_groups\[2\]: eps must be a finite number >= 0, got eps=-1$"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(1))], "eps": -1})
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["lr"] == 0.1
    assert [g["betas"] for g in opt.param_groups] == [(0.9, 0.95)] * 2
    assert clip_grad_norm_([p], 1.0) == pytest.approx(5.0) and p.grad.tolist() == pytest.approx([0.6, 0.8])


def test_one_element_tensors_are_numbers_to_the_checks():
    """torch's AdamW takes a tensor lr, and ours did, as clip_grad_norm_ a tensor limit; the checks
    added for apifuzz19 refused them as "must be a finite number >= 0, got lr=tensor(0.0100)" (review19)."""
    p = torch.nn.Parameter(torch.ones(3))
    q = torch.nn.Parameter(torch.ones(3))
    p.grad, q.grad = torch.full((3,), 10.0), torch.full((3,), 10.0)
    AdamW([p], lr=torch.tensor(1e-2), betas=(torch.tensor(0.9), 0.999)).step()
    AdamW([q], lr=1e-2).step()
    assert torch.equal(p, q)
    assert clip_grad_norm_([p], torch.tensor(1.0)) == pytest.approx(3 ** 0.5 * 10)
    assert p.grad.norm().item() == pytest.approx(1.0, rel=1e-5)
    with pytest.raises(ValueError, match=r"^lr must be a finite number >= 0, got lr=tensor\(-1\.\)$"):
        AdamW([p], lr=torch.tensor(-1.0))


def test_the_unfused_step_reads_its_count_from_the_device_only_after_a_load():
    """The step count is kept in the state's tensor and mirrored on the host: a new state's count is
    never read back (on a GPU, a sync a step), a loaded one once for each parameter, at its first step."""
    from helpers.host_reads import HostReads

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = AdamW(model.parameters(), lr=1e-2, fused=False)

    def step():
        opt.zero_grad()
        model(torch.randn(2, 4)).square().sum().backward()
        opt.step()

    with HostReads() as reads:
        for _ in range(3):
            step()
    assert reads.reads == []
    loaded = AdamW(model.parameters(), lr=1e-2, fused=False)
    loaded.load_state_dict(opt.state_dict())
    opt = loaded
    with HostReads() as reads:
        step()
    assert reads.reads == ["item", "item"]  # the weight's count and the bias's
    with HostReads() as reads:
        step()
        step()
    assert reads.reads == [] and [int(s["step"]) for s in opt.state.values()] == [6, 6]


def test_schedules_take_numpys_numbers_as_numbers():
    """numpy's float32 and int64 (an iteration read from an array) are numbers, though not Python's."""
    import numpy as np

    for it in (np.float32(5), np.int64(5)):
        assert cosine_lr_schedule(it, 1.0, 0.1, 10, 100) == cosine_lr_schedule(5, 1.0, 0.1, 10, 100) == 0.5
        assert wsd_lr_schedule(it, np.float32(1.0), 0.1, 10, 100) == wsd_lr_schedule(5, 1.0, 0.1, 10, 100)


def test_a_groups_betas_given_as_a_list_are_kept_as_a_tuple():
    """As torch's AdamW keeps them, for the defaults and for each group's own (state_dicts compare equal)."""
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    opt = AdamW([{"params": [a], "betas": [0.8, 0.9]}], betas=[0.7, 0.95])
    opt.add_param_group({"params": [b], "betas": [0.5, 0.6]})
    assert [g["betas"] for g in opt.param_groups] == [(0.8, 0.9), (0.5, 0.6)]
    assert all(type(g["betas"]) is tuple for g in opt.param_groups)


def test_once_dynamo_is_imported_adamw_s_zero_grad_is_left_out_of_a_traced_function_as_torch_s_is():
    """AdamW calls torch's add_param_group, zero_grad, state_dict and load_state_dict without their
    torch._disable_dynamo guard while torch._dynamo is not imported (whose import, 2.4 s, the guard's
    first call made: test_seq2seq_train's uncompiled lm train). Once it is imported, the guard is
    back: a function that dynamo traces runs zero_grad apart (a graph break), as with torch's own
    optimizers, instead of tracing into it as the unguarded method would (the control)."""
    import torch._dynamo

    model = torch.nn.Linear(4, 4)
    opt = AdamW(model.parameters(), lr=1e-3)
    plain = torch.optim.Optimizer.zero_grad.__wrapped__

    def explain(zero_grad):
        def f(x):
            y = x * 2
            zero_grad(opt)
            return y + 1

        torch._dynamo.reset()
        try:
            return torch._dynamo.explain(f)(torch.randn(3))
        finally:
            torch._dynamo.reset()

    ours, unguarded = explain(AdamW.zero_grad), explain(plain)
    assert ours.graph_break_count == 1 and "skipped" in str(ours.break_reasons[0].reason), ours.break_reasons
    assert unguarded.graph_break_count == 0
