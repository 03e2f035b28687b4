"""FlexAttention's GPU path, checked on CPU: the bias tables the kernels index (per distance for T5, KERPLE and
Sandwich; per (query, key) pair for FIRE when training), the gradients Flex's backward passes through them,
Inductor's own check of that backward graph (the one that refused FIRE on CUDA), and a compile that shares its
kernels between schemes and raises rather than fall back to Flex's eager form.

Flex has no backward on CPU in torch, which refuses inputs that need gradients: the backward tests lift that refusal
(``choice.flex_backward`` and torch's device check) and run Flex's eager math backward through ``aot_autograd``,
which also hands over the backward graph that Inductor would lower on a GPU.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.attention.flex_attention as torch_flex
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters

from posbench.attention import blockwise, choice, dense, dispatch, flex
from posbench.model.gpt import GPT
from posbench.schemes import build_scheme

pytestmark = pytest.mark.skipif(flex.flex_attention is None, reason="FlexAttention needs torch >= 2.5")

H, DH = 4, 8
TABLE_SCHEMES = ["t5", "kerple_log", "kerple_power", "sandwich"]


def scheme_of(name: str, **options):
    torch.manual_seed(0)
    return build_scheme(name, d_model=H * DH, n_head=H, **options)


def naive_bias(scheme, pos: torch.Tensor) -> torch.Tensor:
    """The scheme's own pointwise score_mod at score 0 on every (query, key) pair, one pair at a time → (H, T, T)."""
    T = pos.numel()
    out = torch.empty(H, T, T, dtype=torch.float64)
    zero = torch.zeros((), dtype=torch.float64)
    for h in range(H):
        for i in range(T):
            for j in range(i + 1):
                out[h, i, j] = scheme.score_mod(zero, torch.tensor(h), pos[i], pos[j]).item()
    return out


@pytest.mark.parametrize("name", TABLE_SCHEMES)
@pytest.mark.parametrize("positions", ["shifted", "random"])
def test_the_distance_table_gives_every_pair_its_bias(name, positions):
    """A window far from 0, or sorted random positions (train.random_positions): indexing the (H, N) table by i − j
    gives each causal pair the bias that score_mod gives it alone."""
    s, T = scheme_of(name), 24
    g = torch.Generator().manual_seed(3)
    pos = torch.arange(1000, 1000 + T) if positions == "shifted" else torch.randperm(400, generator=g)[:T].sort().values
    with torch.no_grad():
        got = blockwise.dense_mask(s, pos, H, 0, T, torch.float64)  # (H, T, T), −inf above the diagonal
    want = naive_bias(s, pos)
    lower = torch.ones(T, T, dtype=torch.bool).tril()
    torch.testing.assert_close(got[:, lower], want[:, lower], rtol=1e-6, atol=1e-6)
    assert torch.isneginf(got[:, ~lower]).all()
    assert blockwise.distance_table(s, pos, torch.float32).shape == (H, int(pos[-1] - pos[0]) + 1)


def test_fires_matmul_bias_is_its_unrolled_score_mod(monkeypatch):
    """FIRE's ``pair_bias`` (the MLP as matmuls, in row chunks without gradients) against its unrolled score_mod, with
    queries past the threshold (where the bias depends on i as well as on i − j)."""
    s, T = scheme_of("fire", threshold=8), 24
    pos = torch.arange(T)
    monkeypatch.setattr(type(s), "HIDDEN_ELEMENTS", 3 * T * s.config.mlp_width)  # chunks of 3 rows
    with torch.no_grad():
        got = s.pair_bias(pos, pos)  # (H, T, T)
    want = naive_bias(s, pos)
    lower = torch.ones(T, T, dtype=torch.bool).tril()
    torch.testing.assert_close(got[:, lower].double(), want[:, lower], rtol=1e-5, atol=1e-6)


def flex_training(monkeypatch):
    """Flex with gradients on CPU, its backward graph kept: ``graphs`` collects the graphs aot_autograd builds."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(choice, "flex_backward", lambda device: True)
    monkeypatch.setattr(torch_flex, "_validate_device", lambda *tensors: None)
    monkeypatch.setattr(flex, "_compiled", torch.compile(torch_flex.flex_attention,
                                                                   backend=aot_autograd(fw_compiler=keep, bw_compiler=keep)))
    return graphs


def joint_graph_errors(graphs) -> list[str]:
    """Inductor's pre-lowering check of each Flex backward (``validate_joint_graph``) on every joint graph."""
    from torch._inductor.kernel.flex.flex_attention import validate_joint_graph

    joints = [mod for gm in graphs for name, mod in gm.named_modules() if "joint_graph" in name]
    assert joints, "no Flex backward graph was built"
    errors = []
    for joint in joints:
        try:
            validate_joint_graph(joint.graph)
        except NotImplementedError as err:
            errors.append(str(err).splitlines()[0])
    return errors


def naive_attention(q, k, v, scheme, pos):
    """softmax(q·kᵀ/√Dh + score_mod's bias, causal) · v in float64, with autograd: the reference."""
    T = pos.numel()
    heads = torch.arange(H)[:, None, None]
    bias = scheme.score_mod(torch.zeros((), dtype=torch.float64), heads, pos[None, :, None], pos[None, None, :])
    scores = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias.double()
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v.double()


@pytest.mark.parametrize("name, options", [("fire", {}), ("fire", {"per_layer": False, "threshold": 16})]
                         + [(n, {}) for n in TABLE_SCHEMES])
def test_flex_trains_every_learned_bias_through_one_indexing_op(monkeypatch, name, options):
    """Flex with gradients: the backward graph passes Inductor's check (each tensor needing gradients indexed once),
    and the gradients of q, k, v and of the scheme's parameters equal a float64 attention's."""
    graphs = flex_training(monkeypatch)
    s, T = scheme_of(name, **options), 48
    pos = torch.arange(T)
    q, k, v = (torch.randn(2, H, T, DH, requires_grad=True) for _ in range(3))
    ctx = dispatch.context(s, pos, H, kernel="flex")
    laid_out = {"shared": (H, T), "residue": (H, flex.RESIDUES, T), "pair": (H, T, T)}[flex.OPTIONS.table_layout]
    learned = any(p.requires_grad for p in s.parameters())  # (Sandwich's table has no parameters: kept shared)
    want = (laid_out if learned else (H, T)) if s.distance_table else (H, T, T)
    assert ctx.table is not None and ctx.table.shape == want
    g = torch.randn(2, H, T, DH)
    got = torch.autograd.grad((dispatch.attend(q, k, v, ctx) * g).sum(), [q, k, v, *s.parameters()])
    assert joint_graph_errors(graphs) == []
    want = torch.autograd.grad((naive_attention(q, k, v, s, pos) * g).sum(), [q, k, v, *s.parameters()])
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-5)


def test_fires_own_score_mod_is_what_inductor_refuses(monkeypatch):
    """The control: FIRE's pointwise score_mod (its MLP's weights indexed once per hidden unit) fails the check
    that the table passes, so the test above would catch a regression to it."""
    graphs = flex_training(monkeypatch)
    s, T = scheme_of("fire", mlp_width=4), 16
    pos = torch.arange(T)
    ctx = dispatch.context(s, pos, H, kernel="flex")
    ctx.score_mod = flex.score_mod(s, pos, None)
    q, k, v = (torch.randn(1, H, T, DH, requires_grad=True) for _ in range(3))
    try:
        dispatch.attend(q, k, v, ctx).sum().backward()
    except Exception:  # noqa: BLE001 - the eager backward may or may not run this graph; the graph is what we check
        pass
    assert any("multiple indexing" in e for e in joint_graph_errors(graphs))


def model(name: str) -> GPT:
    torch.manual_seed(0)
    layers = 2
    scheme = [scheme_of(name) for _ in range(layers)] if name == "fire" else scheme_of(name)
    return GPT(64, layers, H, H * DH, 64, scheme).eval()


def test_four_flex_schemes_share_compiled_kernels_and_never_fall_back(monkeypatch):
    """T5, KERPLE, Sandwich and per-layer FIRE evaluated at three lengths in one process, as a sweep's worker does:
    a handful of compiled variants (Dynamo's default limit is 8 per process), never the dense kernel; and once the
    limit is reached, a new variant raises instead of running Flex's eager form."""
    if not flex.cpu_compiles:
        pytest.skip("FlexAttention does not compile on this machine")
    flex.reset_compiled()
    monkeypatch.setattr(dispatch, "dense", lambda *args: pytest.fail("the dense kernel ran instead of Flex"))
    monkeypatch.setattr(dispatch, "choose_kernel", lambda *args: "flex")  # as on CUDA (CPU evaluates the tables banded)
    before = counters["frames"]["ok"]
    with torch.no_grad():
        for name in ("t5", "kerple_log", "sandwich", "fire"):
            net = model(name)
            for T in (64, 128, 192):
                net(torch.randint(0, 64, (1, T)))
        compiled = counters["frames"]["ok"] - before
        # two score_mods (the distance table's, shared by three schemes, and FIRE's own), each compiled for one length,
        # then with a dynamic length, then with a dynamic number of blocks (a size-1 dimension is never made dynamic)
        assert 1 <= compiled <= 6, compiled
        monkeypatch.setattr(flex, "VARIANTS", compiled)
        with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
            model("t5")(torch.randint(0, 64, (3, 64)))  # another batch size: one more variant
    flex.reset_compiled()


def test_a_table_lowers_flexs_pipeline_stages_on_cuda_only(monkeypatch):
    """On CUDA a score_mod that reads a table runs with fewer than Inductor's three pipeline stages (the first H100
    run: no configuration fitted its shared memory); on CPU, or without a table, Inductor's defaults. The options
    reach the flex_attention call."""
    table = torch.zeros(H, 8)
    assert flex.kernel_options(torch.device("cuda"), table)["num_stages"] < 3
    assert flex.kernel_options(torch.device("cuda"), None) is None
    assert flex.kernel_options(torch.device("cpu"), table) is None
    seen = []

    def spy(q, k, v, score_mod, block_mask, kernel_options):
        seen.append(kernel_options)
        return torch.zeros_like(q)

    monkeypatch.setattr(flex, "_compiled", spy)
    monkeypatch.setattr(dispatch, "choose_kernel", lambda *args: "flex")  # as on CUDA
    monkeypatch.setattr(flex, "kernel_options", lambda device, table, dtype=None: {"num_stages": 2, "table": table.shape})
    with torch.no_grad():
        model("t5")(torch.randint(0, 64, (1, 16)))
    assert seen and all(options == {"num_stages": 2, "table": (H, 16)} for options in seen), seen


def test_a_gpu_takes_larger_blocks_of_contextual_scores():
    """CoPE's blocks of scores: the CPU budget on CPU, a 16× larger one on CUDA (CPU-sized blocks leave a GPU
    launch-bound)."""
    B, T = 4, 2048
    cpu, cuda = dense.contextual_blocks(B, H, T, "cpu"), dense.contextual_blocks(B, H, T, "cuda")
    assert max(e - s for s, e in cpu) * B * H * T <= dense.CONTEXT_ELEMENTS
    assert max(e - s for s, e in cuda) * B * H * T <= dense.CONTEXT_ELEMENTS_CUDA
    assert len(cpu) >= 16 * len(cuda) and cpu[-1][1] == cuda[-1][1] == T


@pytest.mark.parametrize("name", ["t5", "kerple_log", "sandwich", "fire", "alibi", "rope", "cope"])
@pytest.mark.parametrize("training", [True, False])
def test_the_model_compiles_whole(name, training):
    """train.compile (on by default on CUDA) traces the model without a graph break (``fullgraph``), training and
    evaluating (then, on CPU, through Flex for the bias schemes that cannot fold): the per-distance table's length
    comes from the window's length, not from reading the positions; the attention contexts are built in a loop
    (Dynamo could not resume a comprehension after a break); inside a compiled model Flex is called as it is, not
    through its own compiled wrapper. Same NLL as eager."""
    torch.manual_seed(0)
    layers = 2
    scheme = [scheme_of(name) for _ in range(layers)] if name in ("fire", "cope") else scheme_of(name)
    net = GPT(64, layers, H, H * DH, 64, scheme).train(training)
    idx = torch.randint(0, 64, (2, 33))
    with torch.set_grad_enabled(training):
        got = torch.compile(net, backend="eager", fullgraph=True)(idx[:, :-1], targets=idx[:, 1:])
        if training:
            got.mean().backward()
        torch.testing.assert_close(got.detach(), net(idx[:, :-1], targets=idx[:, 1:]).detach())
    torch._dynamo.reset()
