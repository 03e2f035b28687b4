"""The chunked head and loss on CUDA (issue 38), checked on CPU: ``model.head_dtype`` chooses the path from (device,
dtype, setting, autocast) alone, so its CUDA choice is tested with a ``torch.device("cuda")`` object; the path itself
(``HeadNLL`` with bfloat16 chunk matmuls) runs on CPU tensors, with and without CPU bf16 autocast, against plain
``cross_entropy(h @ Wᵀ)`` written here: in float32, and from bf16 logits as autocast computes them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from posbench.model import head
from posbench.model.build import build_model
from posbench.model.head import HeadNLL, head_dtype, head_rows

N, D, V = 45, 32, 300


def operands(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g).requires_grad_()
    weight = (torch.randn(V, D, generator=g) * 0.3).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    upstream = torch.rand(N, generator=g)  # a weighting other than the mean
    return h, weight, targets, upstream


def reference(h, weight, targets, upstream, logits_dtype=torch.float32):
    """cross_entropy of h·Wᵀ computed in ``logits_dtype`` and upcast (bf16: as autocast's linear and the model's
    ``.float()``), its value and gradients w.r.t. h and W."""
    z = (h.to(logits_dtype) @ weight.to(logits_dtype).t()).float()  # (N, V)
    nll = F.cross_entropy(z, targets, reduction="none")
    return (nll.detach(), *torch.autograd.grad((nll * upstream).sum(), [h, weight]))


def chunked(h, weight, targets, upstream, rows, mm_dtype, need_grad=True):
    nll = HeadNLL.apply(h, weight, targets, rows, need_grad, mm_dtype)
    if not need_grad:
        return (nll,)
    return (nll.detach(), *torch.autograd.grad((nll * upstream).sum(), [h, weight]))


def test_the_path_is_chosen_from_device_dtype_setting_and_autocast():
    cuda, cpu, bf16, f32 = torch.device("cuda"), torch.device("cpu"), torch.bfloat16, torch.float32
    assert head_dtype(cpu, f32, False) == f32 and head_dtype(cpu, f32, True, bf16) == f32  # CPU: as before
    assert head_dtype(cpu, bf16, True) is None and head_dtype(cpu, torch.float64, False) is None
    assert head_dtype(cuda, f32, False, bf16) is None  # the default: logits + cross_entropy on CUDA
    assert head_dtype(cuda, f32, True, bf16) == bf16  # the switch on, under autocast: bf16 chunk matmuls
    assert head_dtype(cuda, f32, True) == f32  # … without autocast: float32 ones
    assert head_dtype(cuda, bf16, True, bf16) is None  # (activations not float32: logits)
    assert head.CHUNKED_HEAD_CUDA is False  # off until a GPU probe has measured it
    assert head_rows(cpu, 1000) == 2**20 // 1000 and head_rows(cuda, 1000) == 2**24 // 1000 and head_rows(cpu, 2**21) == 1


@pytest.mark.parametrize("rows", [7, 64, 1000])  # 7 does not divide N; 1000 > N: one chunk
def test_float32_chunks_match_cross_entropy(rows):
    h, weight, targets, upstream = operands()
    got, want = chunked(h, weight, targets, upstream, rows, torch.float32), reference(h, weight, targets, upstream)
    for a, b in zip(got, want):
        assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [7, 1000])
@pytest.mark.parametrize("amp", [False, True])
def test_bf16_chunks_match_cross_entropy_of_bf16_logits(rows, amp):
    """bf16 chunk matmuls, float32 softmax: the NLL of the bf16 logits autocast makes (to float32 rounding), its
    gradients to bf16's (the softmax gradient is rounded to bf16 in both, before or after the per-token weight); and
    the same with CPU bf16 autocast on or off (the op turns it off inside). Far from float32 logits' gradients."""
    h, weight, targets, upstream = operands(1)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        got = chunked(h, weight, targets, upstream, rows, torch.bfloat16)
    want = reference(h, weight, targets, upstream, torch.bfloat16)
    assert got[0].dtype == got[1].dtype == got[2].dtype == torch.float32
    assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(got[1:], want[1:]):
        assert_close(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item())
    exact = reference(h, weight, targets, upstream)
    assert (got[0] - exact[0]).abs().max() > 1e-4  # the bf16 logits' rounding shows: the path really is bf16
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):  # evaluation: no gradient buffer
        assert_close(chunked(h, weight, targets, upstream, rows, torch.bfloat16, need_grad=False)[0], want[0],
                     rtol=1e-5, atol=1e-5)


def test_the_model_takes_the_cuda_path_when_chosen(monkeypatch):
    """GPT.forward with targets under CPU bf16 autocast and ``head_dtype`` forced to the CUDA choice: HeadNLL in bf16
    chunks of ``head_rows`` rows, equal to the plain path's bf16 logits + cross_entropy, values and every gradient."""
    torch.manual_seed(0)
    spec = {"vocab_size": 97, "model": {"n_layer": 2, "n_head": 2, "d_model": 16, "d_ff": 32}, "scheme": {"name": "rope"}}
    net, plain = build_model(spec), build_model(spec)
    plain.load_state_dict(net.state_dict())
    idx = torch.randint(0, 97, (3, 21))
    x, y = idx[:, :-1], idx[:, 1:]
    calls = []
    real = HeadNLL.apply
    monkeypatch.setattr(head, "head_rows", lambda device, vocab: 8)  # several chunks
    monkeypatch.setattr(HeadNLL, "apply", lambda *args: calls.append(args[3:]) or real(*args))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        monkeypatch.setattr(head, "head_dtype", lambda device, dtype, chunked_cuda, autocast: autocast)
        got = net(x, targets=y)
        monkeypatch.setattr(head, "head_dtype", lambda *args: None)  # logits + cross_entropy
        want = plain(x, targets=y)
    assert calls == [(8, True, torch.bfloat16)] and got.dtype == want.dtype == torch.float32
    assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.mean().backward()
    want.mean().backward()
    for (name, p), q in zip(net.named_parameters(), plain.parameters()):
        assert_close(p.grad, q.grad, rtol=2e-2, atol=2e-2 * q.grad.abs().max().item(), msg=name)


def test_the_cuda_path_compiles_whole(monkeypatch):
    """train.compile traces the bf16 path without a graph break (autocast turned off inside HeadNLL), forward and
    backward (aot_eager: the joint graph), with the eager model's NLL."""
    torch.manual_seed(0)
    spec = {"vocab_size": 97, "model": {"n_layer": 1, "n_head": 2, "d_model": 16, "d_ff": 32}, "scheme": {"name": "rope"}}
    net = build_model(spec)
    monkeypatch.setattr(head, "head_dtype", lambda device, dtype, chunked_cuda, autocast: autocast)
    idx = torch.randint(0, 97, (2, 17))
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = torch.compile(net, backend="aot_eager", fullgraph=True)(idx[:, :-1], targets=idx[:, 1:])
        want = net(idx[:, :-1], targets=idx[:, 1:])
    got.mean().backward()
    assert_close(got.detach(), want.detach())
    assert all(p.grad is not None for p in net.parameters())
    torch._dynamo.reset()
