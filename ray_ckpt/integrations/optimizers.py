"""What the framework integrations share about torch optimizers. No framework import here."""
from __future__ import annotations

import torch


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state tensors (``load_into`` fills tensors in place, on the
    optimizer's own mesh when they are DTensors): one step with zero gradients at learning rate 0
    leaves every parameter's bits unchanged (as ``torch.distributed.checkpoint.state_dict`` does
    before loading). An optimizer that has state already is left alone."""
    if optimizer.state:
        return
    lrs = []
    for group in optimizer.param_groups:
        lrs.append(group["lr"])
        group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
