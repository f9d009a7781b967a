"""The Trainer's steps replayed by a loop written with torch itself, the reference its update is
checked against (testq22): torch.optim.AdamW, torch.nn.utils.clip_grad_norm_ and a learning rate
given by the test, on the very batches the Trainer drew."""

import copy
from collections.abc import Callable

import torch


def replay_with_torch(trainer, loss_of: Callable, lr_at: Callable[[int], float], *, weight_decay: float,
                      betas: tuple[float, float], eps: float, grad_clip: float) -> int:
    """Run ``trainer`` (it must finish: status 0), recording its batches; replay them on a copy of
    the model it started from with torch's AdamW (weight decay on the matrices only, not on
    embeddings, norms or biases), ``loss_of(model, batch)`` and ``lr_at(step)``, clipping at
    ``grad_clip``; assert that every weight equals the Trainer's to 1e-6. Returns the steps taken."""
    ref = copy.deepcopy(trainer.model)
    batches, real = [], trainer._next_batch

    def recording():
        b = real()
        batches.append(b)
        return b

    trainer._next_batch = recording
    assert trainer.run() == 0
    decay = [p for n, p in ref.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in ref.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    assert decay and no_decay
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=0.0, betas=betas, eps=eps)
    for step, b in enumerate(batches):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        opt.zero_grad()
        loss_of(ref, b).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), grad_clip)
        opt.step()
    for (name, a), b in zip(trainer.model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)
    return len(batches)
