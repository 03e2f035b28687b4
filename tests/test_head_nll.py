"""The training and evaluation loss: ``GPT(idx, targets=...)`` and its fused CPU head (``model.HeadNLL``)
against a naive float64 log-softmax written here, values and gradients, across chunk boundaries."""

import pytest
import torch
from torch.testing import assert_close

from posbench.model.build import build_model
from posbench.model.head import HeadNLL


def naive_nll(h, weight, targets):
    """−log softmax(h·Wᵀ)[target], row by row, in float64 (the definition)."""
    z = h.double() @ weight.double().t()  # (N, V)
    return torch.stack([torch.log(torch.exp(z[i]).sum()) - z[i, targets[i]] for i in range(len(targets))])


@pytest.mark.parametrize("rows", [1, 7, 64, 1000])  # 1000 > N: one chunk; 7 does not divide N
def test_head_nll_values_and_gradients_match_the_definition(rows):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(45, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (45,), generator=g)
    upstream = torch.rand(45, generator=g, dtype=torch.float64)  # a weighting other than the mean
    nll = HeadNLL.apply(h, weight, targets, rows, True)
    (nll.double() * upstream).sum().backward()
    h_ref, w_ref = h.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref = naive_nll(h_ref, w_ref, targets)
    (ref * upstream).sum().backward()
    assert_close(nll.double(), ref.detach(), atol=1e-5, rtol=1e-5)
    assert_close(h.grad.double(), h_ref.grad, atol=1e-5, rtol=1e-5)
    assert_close(weight.grad.double(), w_ref.grad, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # evaluation: no gradient buffer, the same values
        assert_close(HeadNLL.apply(h, weight, targets, rows, False).double(), ref.detach(), atol=1e-5, rtol=1e-5)


def test_model_loss_equals_cross_entropy_of_its_logits_and_trains_the_same():
    torch.manual_seed(0)
    spec = {"vocab_size": 97, "model": {"n_layer": 2, "n_head": 2, "d_model": 16, "d_ff": 32}, "scheme": {"name": "alibi"}}
    model = build_model(spec)
    ref = build_model(spec).double()
    ref.load_state_dict(model.state_dict())
    idx = torch.randint(0, 97, (3, 21))
    x, y = idx[:, :-1], idx[:, 1:]
    nll = model(x, targets=y)  # (B, T): the fused CPU path
    assert nll.shape == y.shape
    z = ref(x)  # float64 logits, then the naive NLL
    naive = torch.log(torch.exp(z).sum(-1)) - z.gather(-1, y[..., None]).squeeze(-1)
    assert_close(nll.double(), naive.detach(), atol=1e-5, rtol=1e-5)
    nll.mean().backward()
    naive.mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p.grad.double(), q.grad, atol=1e-6, rtol=1e-4, msg=name)
