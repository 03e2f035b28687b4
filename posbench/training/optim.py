"""The optimizer, its learning-rate schedule, and the training forward pass, compiled or eager:

    optimizer = make_optimizer(model, cfg.train, fused=device.type == "cuda")   # AdamW, decay per parameter group
    lr = cfg.train.lr * lr_factor(step, warmup, steps, min_lr / lr, "cosine")  # the rate of optimizer step ``step``
    forward = Forward(model, compile=True)                                      # torch.compile, eager if it fails
"""

from __future__ import annotations

import logging
import math

import torch
from omegaconf import DictConfig

log = logging.getLogger("posbench")


def lr_factor(step: int, warmup: int, total: int, min_ratio: float, schedule: str = "cosine") -> float:
    """The learning rate of optimizer step ``step`` (0-based) as a fraction of ``train.lr``: a linear warmup over
    ``warmup`` steps, then, for ``cosine``, a cosine decay to ``min_ratio`` at ``total`` (Loshchilov & Hutter 2017),
    or, for ``constant``, 1 to the end (Position Interpolation's fine-tuning: linear warmup, then a constant rate;
    Chen et al. 2023, §3.1)."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, t: DictConfig, fused: bool) -> torch.optim.AdamW:
    """AdamW (Loshchilov & Hutter 2019). Decayed: the model's matrices (dim ≥ 2: embeddings, projections);
    not decayed: biases, LayerNorm and QK-norm gains, SSMax's s and attention sinks. A scheme's parameters
    (``scheme.*``, shared or per layer; a hybrid model's ``global_scheme.*``) are decayed exactly when its class says so
    (``PositionalScheme.weight_decay``), whatever their rank."""
    parts = model.scheme_parts()  # [(state-dict prefix, scheme instance)]

    def decayed(name: str, p: torch.Tensor) -> bool:
        owner = next((s for prefix, s in parts if name.startswith(prefix)), None)
        return owner.weight_decay if owner is not None else p.dim() >= 2

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if decayed(n, p)], "weight_decay": t.weight_decay},
              {"params": [p for n, p in named if not decayed(n, p)], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.lr, betas=tuple(t.betas), fused=fused or None)


class Forward:
    """The training forward pass: ``net`` itself, or ``torch.compile(net)`` (``compile``) falling back to eager, with a
    warning, when compiling fails in the first step, in its forward or in its backward (which Inductor compiles at
    the first ``loss.backward()``). Once a step has succeeded, an error is the step's error and propagates."""

    def __init__(self, net: torch.nn.Module, compile: bool):
        self.net, self.run, self.trying = net, torch.compile(net) if compile else net, compile

    def __call__(self, x, **kwargs):
        if not self.trying:
            return self.run(x, **kwargs)
        try:
            return self.run(x, **kwargs)
        except Exception as err:  # noqa: BLE001 - any compiler failure in the first step falls back the same way
            self._fall_back(err)
        return self.run(x, **kwargs)

    def backward(self, loss: torch.Tensor, redo, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """``loss.backward()``; in the first step of a compiled model, a failure falls back to eager, clears the
        gradients and runs the step's forward again (``redo()`` → loss) and its backward. Returns the loss used."""
        if not self.trying:
            loss.backward()
            return loss
        try:
            loss.backward()
        except Exception as err:  # noqa: BLE001 - as in __call__
            self._fall_back(err)
            optimizer.zero_grad(set_to_none=True)
            loss = redo()
            loss.backward()
        self.trying = False
        return loss

    def _fall_back(self, err: Exception) -> None:
        log.warning("torch.compile failed (%s: %s); training in eager mode", type(err).__name__,
                    str(err).splitlines()[0] if str(err) else "")
        self.run, self.trying = self.net, False
