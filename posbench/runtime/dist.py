"""torch.distributed for one run on many processes: set-up from torchrun's environment, and small helpers.

``torchrun --nproc_per_node=N -m posbench train ...`` starts N processes with RANK / WORLD_SIZE /
LOCAL_RANK set; :func:`init` joins them (NCCL on CUDA, gloo on CPU). Without torchrun every helper
acts as for a single process (rank 0 of 1), so callers need no branches.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np
import torch
import torch.distributed as dist


def world() -> int:
    """Processes in the run (WORLD_SIZE; 1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    """This process's rank (RANK; 0 without torchrun)."""
    return int(os.environ.get("RANK", "0"))


def init() -> None:
    """Join the process group when launched by torchrun (idempotent): NCCL when CUDA is available, else gloo.

    With CUDA, each process takes GPU LOCAL_RANK."""
    if world() == 1 or dist.is_initialized():
        return
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")


def device_of(name: str) -> str:
    """The device string this rank uses for ``name`` (``cuda`` → ``cuda:<LOCAL_RANK>`` under torchrun)."""
    if name == "cuda" and world() > 1:
        return f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    return name


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over all ranks in place (a no-op for one process); returns ``t``."""
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def broadcast(value):
    """Rank 0's ``value`` on every rank (any picklable object)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(value) -> list:
    """Every rank's ``value``, in rank order, on every rank."""
    if not dist.is_initialized():
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def main_only(fn):
    """Call ``fn()`` on rank 0 alone and return its result there (None elsewhere); if it raises, every rank
    raises that exception, so no rank is left waiting in a collective for one that has stopped.

    A sync point for every rank (a broadcast of rank 0's exception or None), like :func:`barrier`.
    """
    error, result = None, None
    if rank() == 0:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - handed to every rank, then raised
            error = e
    error = broadcast(error)
    if error is not None:
        raise error
    return result


LEAVE_TIMEOUT_S = 60.0  # seconds a rank may take to leave the group and exit before it exits anyway (see finish)


def finish(together: bool = True, status: int = 0) -> None:
    """Leave the process group (a no-op without one). ``together``: all ranks reach this point on the same
    path (a finished, failed or preempted run: a barrier first, so none leaves while another still needs it);
    else leave at once, as a rank stopped by an unforeseen error must (the others may never get here).

    The last step of a rank: its results and checkpoints are written before it. torch.distributed's teardown
    can hang after every rank has left the barrier (rarely; pytorch/pytorch#75097, and seen once in posbench's
    own tests on gloo), so a rank still alive :data:`LEAVE_TIMEOUT_S` seconds after it began to leave says so on
    stderr and exits with ``status``, the status it was leaving with."""
    if dist.is_initialized():
        if together:
            dist.barrier()
        threading.Thread(target=_exit_after, args=(LEAVE_TIMEOUT_S, status), daemon=True,
                         name="posbench-leave-watchdog").start()
        dist.destroy_process_group()


def _exit_after(seconds: float, status: int) -> None:
    """The watchdog of :func:`finish`: a daemon thread, so a process that exits in time ends it unseen."""
    time.sleep(seconds)
    print(f"posbench: warning: rank {rank()} was still leaving the process group {seconds:.0f} s after it began "
          f"(torch.distributed's teardown hung); it exits with status {status} without waiting further",
          file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(status)


def seed_rank(seed: int, rank: int) -> None:
    """Give torch's global generator (dropout) a stream of its own on each rank, as nanoGPT offsets its seed by
    rank; rank 0 keeps the stream of a single-process run. Call it after the model is built, so the weights are
    the same on every rank. Rank r > 0 is seeded with a 63-bit number drawn from SeedSequence([seed, r])."""
    if rank:
        torch.manual_seed(int(np.random.SeedSequence([seed, rank]).generate_state(1, np.uint64)[0] >> 1))


def sync_steps(losses: list[torch.Tensor], norms: list[torch.Tensor], stop: bool) -> tuple[list[float], list[float], bool]:
    """The one host sync of a window of steps: each step's loss averaged over ranks, each step's gradient norm
    (the same on every rank after DDP's all-reduce), and whether any rank asked to stop. One all-reduce of
    k + 1 numbers for k steps, where checking each step would cost two all-reduces and several syncs a step."""
    flag = torch.tensor([float(stop)], device=losses[0].device)
    summed = all_reduce_sum(torch.cat([torch.stack(losses).float(), flag])).cpu()  # (k + 1,)
    return (summed[:-1] / world()).tolist(), torch.stack(norms).float().cpu().tolist(), bool(summed[-1])
