"""Where posbench's training step and evaluation forward spend their time, as shares of the wall time.

    python scripts/profile_step.py --scheme rope                     # model=tiny, L=128, batch 16, eval at 2048
    python scripts/profile_step.py --scheme t5 --eval-length 8192 --threads 2

The step is posbench/training/loop.py's (``get_batch`` on random tokens, forward with the loss, backward, gradient clipping,
AdamW from ``make_optimizer``) after two untimed steps, under ``torch.profiler`` for ``--steps`` steps; the evaluation
is one no-grad forward of batch 1 at ``--eval-length``; denormals are flushed to zero in both, as posbench's jobs do. Each op's
own CPU time (``self_cpu_time``) is put in a part:

* data: the batch (``get_batch``); optimizer: clipping and ``AdamW.step``;
* attention: SDPA, FlexAttention and everything the attention kernels run (a bias's masks and tables included),
  taken as every op between the ``qkv`` projection's output and the ``proj`` input (``dispatch.attend`` and
  ``dispatch.context`` run inside the ``attention`` marks this script adds around them);
* the matmuls by their shapes: qkv (D → 3D), proj (D → D), MLP (D → F, F → D, and GELU), head and loss (→ V,
  the log-sum-exp and the NLL: posbench's ``HeadNLL``); layer norms; other ops;
* Python: the rest of the wall time, in no op (the interpreter, autograd's bookkeeping, the dispatcher between ops).

The attribution is approximate where names and shapes are: in backward, attention's ops are known by name (SDPA's
and Flex's backward, softmax, bmm, indexing), and an op with several of the shapes counts once.

CPU only (the profiler's CPU times); ``--threads`` sets torch's threads and is printed.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np
import torch
from omegaconf import OmegaConf
from torch.profiler import ProfilerActivity, profile, record_function

from posbench.attention import dispatch
from posbench.config.schema import TrainConfig
from posbench.data.batches import get_batch
from posbench.model.build import build_model
from posbench.runtime.device import flush_denormals_from_now
from posbench.schemes import SCHEMES
from posbench.training.optim import make_optimizer


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scheme", default="rope", choices=sorted(SCHEMES))
    for flag, default in (("--d-model", 128), ("--layers", 4), ("--heads", 4), ("--vocab", 4096), ("--batch", 16),
                          ("--seq-len", 128), ("--eval-length", 2048), ("--threads", 2), ("--steps", 5)):
        p.add_argument(flag, type=int, default=default, help=f"(default {default})")
    return p.parse_args(argv)


def marked(fn, name: str):
    """``fn`` run inside a profiler mark ``name`` (the attention module's entry points)."""
    def wrapper(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)
    return wrapper


ATTENTION_OPS = ("scaled_dot_product", "flash_attention", "flex_attention", "softmax", "bmm", "index", "masked_fill")


def part_of(event, D: int, F: int, V: int) -> str:
    """The part an op belongs to: from its marks (itself and its ancestors), else from its name and input shapes
    (the backward runs outside the forward's marks: attention's backward ops are known by name)."""
    marks, parent = [event.name], event.cpu_parent
    while parent is not None:
        marks.append(parent.name)
        parent = parent.cpu_parent
    for mark in ("data", "optimizer", "attention"):
        if mark in marks:
            return mark
    name, dims = event.name, {d for shape in event.input_shapes or [] for d in shape}
    if name in ("forward", "backward") or name.startswith("autograd::engine"):
        return "Python"  # (a mark's or the autograd engine's own time: no op's)
    if any(op in name for op in ATTENTION_OPS):
        return "attention"
    if V in dims or any(w in name for w in ("logsumexp", "nll", "log_softmax", "cross_entropy", "HeadNLL")):
        return "head and loss"
    if "gelu" in name or F in dims:
        return "MLP"
    if 3 * D in dims:
        return "qkv"
    if "layer_norm" in name:
        return "layer norms"
    if name in ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul"):
        return "proj"  # (the only D → D matmul)
    return "other ops"


def shares(prof, phases: tuple[str, ...], D: int, F: int, V: int) -> tuple[dict, float]:
    """Seconds per part over the events of ``phases`` (marks), Python as the phases' wall time no op took."""
    events = prof.events()
    wall = sum(e.cpu_time_total for e in events if e.name in phases) / 1e6
    parts = defaultdict(float)
    for e in events:
        if e.name in phases or e.name.startswith("ProfilerStep"):
            continue
        parts[part_of(e, D, F, V)] += e.self_cpu_time_total / 1e6
    parts["Python"] += max(0.0, wall - sum(parts.values()))  # (beside the marks' and autograd's own time)
    return dict(parts), wall


def main(argv=None) -> None:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    flush_denormals_from_now("cpu")  # as posbench train and eval (before torch's thread pool starts)
    torch.use_deterministic_algorithms(True)  # as posbench/training/loop.py trains on CPU
    torch.utils.deterministic.fill_uninitialized_memory = False
    D, F, V, L = args.d_model, 4 * args.d_model, args.vocab, args.seq_len
    torch.manual_seed(0)
    config = SCHEMES[args.scheme].make_config()
    config.fill(L)
    options = {**vars(config)}
    if args.scheme == "learned":
        options["max_positions"] = max(args.eval_length, L)
    model = build_model({"vocab_size": V, "scheme": {"name": args.scheme, **options},
                         "model": {"n_layer": args.layers, "n_head": args.heads, "d_model": D, "d_ff": F}})
    t = OmegaConf.structured(TrainConfig(seq_len=L, batch_size=args.batch))
    opt = make_optimizer(model, t, fused=False)
    tokens = np.random.default_rng(0).integers(0, V, 1 << 20).astype(np.uint16)
    dispatch.attend = marked(dispatch.attend, "attention")
    dispatch.context = marked(dispatch.context, "attention")

    def step(i: int) -> None:
        with record_function("data"):
            x, y = get_batch(tokens, i, 0, args.batch, L)
        with record_function("forward"):
            loss = model(x, targets=y).mean()
        opt.zero_grad(set_to_none=True)
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
            opt.step()

    for i in range(2):
        step(i)
    wall0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for i in range(args.steps):
            with record_function("step"):
                step(2 + i)
    per_step = (time.perf_counter() - wall0) / args.steps
    train, train_wall = shares(prof, ("step",), D, F, V)

    model.eval()
    idx = torch.from_numpy(tokens[: args.eval_length + 1].astype(np.int64))[None]
    with torch.no_grad():
        model(idx[:, :-1], targets=idx[:, 1:])  # untimed: one-time costs (and Flex's compilation)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            with record_function("eval"):
                model(idx[:, :-1], targets=idx[:, 1:])
    ev, eval_wall = shares(prof, ("eval",), D, F, V)

    print(f"torch {torch.__version__}, {args.threads} threads; scheme {args.scheme}, d={D} layers={args.layers} "
          f"heads={args.heads} V={V}; train L={L} batch={args.batch}: {per_step * 1e3:.1f} ms a step (profiled); "
          f"eval at {args.eval_length}: {eval_wall * 1e3:.1f} ms")
    print(f"{'part':<15}{'train step':>12}{'evaluation':>12}")
    for part in sorted(set(train) | set(ev), key=lambda p: -train.get(p, 0.0)):
        print(f"{part:<15}{train.get(part, 0.0) / train_wall:>12.1%}{ev.get(part, 0.0) / eval_wall:>12.1%}")


if __name__ == "__main__":
    main()
