"""Flex's settings for a GPU probe, checked on CPU (issue 38): ``flex.OPTIONS`` (validated), the float32 precision
it hands Inductor as a kernel option (pinned to the installed Inductor's source, where it is undocumented), and the
layouts of a trained per-distance table (``flex.layout_table``: shared, residue, pair).

Flex's backward does not run on CPU, so each layout's score_mod is evaluated on full index grids and differentiated
by autograd, against a dense bias gathered here with torch indexing (float64); the context's use of the layouts runs
Flex's eager math backward with the device check lifted, as tests/test_flex_tables.py does.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.attention.flex_attention as torch_flex
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

from posbench.attention import blockwise, choice, dispatch, flex
from posbench.schemes import build_scheme

pytestmark = pytest.mark.skipif(flex.flex_attention is None, reason="FlexAttention needs torch >= 2.5")

H, DH = 4, 8
TABLE_SCHEMES = ["t5", "kerple_log", "kerple_power", "sandwich"]


def scheme_of(name: str):
    torch.manual_seed(0)
    return build_scheme(name, d_model=H * DH, n_head=H)


def positions(kind: str, T: int) -> torch.Tensor:
    """(T,) int64: 0…T−1, a window far from 0, or sorted random positions with gaps (train.random_positions)."""
    if kind == "plain":
        return torch.arange(T)
    if kind == "shifted":
        return torch.arange(1000, 1000 + T)
    return torch.randperm(4 * T, generator=torch.Generator().manual_seed(3))[:T].sort().values


def dense_bias(table: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """table[:, i − j] at every (query, key) pair, future pairs at distance 0 → (H, T, T): the definition."""
    i, j = pos[:, None], pos[None, :]
    return table[:, (i - j).clamp(min=0, max=table.shape[1] - 1)]


def grid_bias(mod, T: int, dtype=torch.float64) -> torch.Tensor:
    """A score_mod at score 0 on the full (head, query index, key index) grid → (H, T, T)."""
    heads, q_idx, kv_idx = torch.arange(H)[:, None, None], torch.arange(T)[None, :, None], torch.arange(T)[None, None, :]
    return mod(torch.zeros(H, T, T, dtype=dtype), torch.zeros((), dtype=torch.int64), heads, q_idx, kv_idx)


def attention_loss(bias: torch.Tensor, q, k, v, g) -> torch.Tensor:
    """Σ g · softmax(q·kᵀ/√Dh + bias, causal) · v, float64."""
    T = q.shape[2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v * g).sum()


# ---- Options and the float32 precision ------------------------------------------------------------------------------
def test_options_default_to_the_gpu_probes_choices_and_refuse_unknown_values():
    assert flex.Options() == flex.Options("pair", "tf32x3") and flex.OPTIONS.table_layout == "pair"
    for kind in flex.TABLE_LAYOUTS:
        for precision in flex.FLOAT32_PRECISIONS:
            assert flex.Options(kind, precision).table_layout == kind
    with pytest.raises(ValueError, match=r"'stripes'.*'shared', 'residue', 'pair'"):
        flex.Options(table_layout="stripes")
    with pytest.raises(ValueError, match=r"'fp16'.*None, 'ieee', 'tf32', 'tf32x3'"):
        flex.Options(float32_precision="fp16")
    options = flex.Options()
    with pytest.raises(ValueError, match="'tf32x9'"):  # setting a field is checked too (a probe sets OPTIONS' fields)
        options.float32_precision = "tf32x9"
    assert options.float32_precision == "tf32x3"


def inductor_file(*parts: str) -> str:
    import torch._inductor.kernel.flex.flex_attention as inductor_flex

    return Path(inductor_flex.__file__).parent.joinpath(*parts).read_text()


def test_the_float32_precision_option_still_exists_in_inductor():
    """The undocumented kernel option: Inductor defaults ``FLOAT32_PRECISION`` from ``get_float32_precision`` (a quoted
    string) and pastes it into the Triton templates as tl.dot's ``input_precision``."""
    from torch._inductor.kernel.flex.flex_attention import get_float32_precision

    assert 'kernel_options.setdefault("FLOAT32_PRECISION", get_float32_precision())' in inductor_file("flex_attention.py")
    assert "input_precision=FLOAT32_PRECISION" in inductor_file("templates", "common.py.jinja")
    default = get_float32_precision()
    assert default in ("'ieee'", "'tf32'"), default  # the form kernel_options gives
    for precision in ("ieee", "tf32", "tf32x3"):
        with flex_options(float32_precision=precision):
            options = flex.kernel_options(torch.device("cuda"), None, torch.float32)
        assert options["FLOAT32_PRECISION"] == f"'{precision}'"


class flex_options:
    """``with flex_options(**fields):`` flex.OPTIONS replaced for the block."""

    def __init__(self, **fields):
        self.options = flex.Options(**fields)

    def __enter__(self):
        self.saved, flex.OPTIONS = flex.OPTIONS, self.options

    def __exit__(self, *exc):
        flex.OPTIONS = self.saved


def test_kernel_options_add_the_precision_on_cuda_for_float32_only():
    cuda, cpu, table = torch.device("cuda"), torch.device("cpu"), torch.zeros(H, 8)
    with flex_options(float32_precision="tf32x3"):
        assert flex.kernel_options(cuda, table, torch.float32) == {"num_stages": 2, "FLOAT32_PRECISION": "'tf32x3'"}
        assert flex.kernel_options(cuda, None, torch.float32) == {"FLOAT32_PRECISION": "'tf32x3'"}
        assert flex.kernel_options(cuda, table, torch.bfloat16) == {"num_stages": 2}  # (tl.dot of bf16 ignores it)
        assert flex.kernel_options(cuda, None, torch.bfloat16) is None
        assert flex.kernel_options(cpu, table, torch.float32) is None
        assert flex.kernel_options(cpu, None, torch.float32) is None
    with flex_options(float32_precision=None):  # no precision: Inductor's
        assert flex.kernel_options(cuda, table, torch.float32) == flex.TABLE_OPTIONS
        assert flex.kernel_options(cuda, None, torch.float32) is None
    options = flex.kernel_options(cuda, table, torch.float32)
    options["num_stages"] = 5  # a copy: TABLE_OPTIONS untouched
    assert flex.TABLE_OPTIONS == {"num_stages": 2}


def test_context_passes_the_activations_dtype_to_kernel_options(monkeypatch):
    seen = []
    monkeypatch.setattr(flex, "kernel_options", lambda device, table, dtype: seen.append((device.type, dtype)))
    monkeypatch.setattr(dispatch, "choose_kernel", lambda *args: "flex")
    s, pos = scheme_of("t5"), torch.arange(16)
    with torch.no_grad():
        dispatch.context(s, pos, H, torch.float64)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            dispatch.context(s, pos, H, torch.float32)
    assert seen == [("cpu", torch.float64), ("cpu", torch.bfloat16)]


# ---- table layouts ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", TABLE_SCHEMES)
@pytest.mark.parametrize("kind", flex.TABLE_LAYOUTS)
@pytest.mark.parametrize("where", ["plain", "shifted", "random"])
def test_every_layouts_score_mod_gives_the_dense_bias(name, kind, where):
    """T = 40 > R = 16 and not a multiple of it: the residue copies wrap; random positions leave distances unused."""
    T = 40
    s, pos = scheme_of(name), positions(where, T)
    with torch.no_grad():
        table = blockwise.distance_table(s, pos, torch.float64).double()  # (H, N)
        laid = flex.layout_table(table, pos, kind)
        got = grid_bias(flex.score_mod(s, pos, laid, kind), T)
    assert laid.shape == {"shared": table.shape, "residue": (H, flex.RESIDUES, table.shape[1]), "pair": (H, T, T)}[kind]
    torch.testing.assert_close(got, dense_bias(table, pos), rtol=0, atol=0)


def test_the_residue_layout_is_a_copy_per_residue():
    """A real copy (not an expanded view, whose copies would share one address per entry in Flex's backward), and a
    residue score_mod that reads the copy of q_idx mod R: copies made to differ show up at the right queries."""
    T, pos = 40, torch.arange(40)
    table = torch.randn(H, T, dtype=torch.float64)
    laid = flex.layout_table(table, pos, "residue")
    assert laid._base is None and laid.is_contiguous() and laid.untyped_storage().data_ptr() != table.data_ptr()
    marked = laid + torch.arange(flex.RESIDUES, dtype=torch.float64)[None, :, None] * 1000  # copy r shifted by 1000·r
    got = grid_bias(flex.score_mod(None, pos, marked, "residue"), T)
    want = dense_bias(table, pos) + (torch.arange(T) % flex.RESIDUES).double()[None, :, None] * 1000
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_layouts_refuse_unknown_kinds_and_misshapen_tables():
    table, pos = torch.zeros(H, 8), torch.arange(8)
    with pytest.raises(ValueError, match="'stripes'"):
        flex.layout_table(table, pos, "stripes")
    with pytest.raises(ValueError, match="'stripes'"):
        flex.score_mod(None, pos, table, "stripes")
    with pytest.raises(ValueError, match="residue"):
        flex.score_mod(None, pos, table, "residue")  # (H, N) where (H, R, N) is read
    with pytest.raises(ValueError, match="pair"):
        flex.score_mod(None, pos, table, "pair")


@pytest.mark.parametrize("name", TABLE_SCHEMES)
@pytest.mark.parametrize("kind", flex.TABLE_LAYOUTS)
def test_every_layout_passes_the_same_gradient_to_the_distance_table(name, kind):
    """The loss through each layout's score_mod over the full grid, differentiated with autograd w.r.t. the (H, N)
    table (and q, k, v), equals the loss through the dense bias table[:, i − j] gathered here, in float64."""
    T = 40
    s, pos = scheme_of(name), positions("random", T)
    g = torch.Generator().manual_seed(1)
    q, k, v, cot = (torch.randn(2, H, T, DH, generator=g, dtype=torch.float64) for _ in range(4))
    with torch.no_grad():
        base = blockwise.distance_table(s, pos, torch.float64).double()  # (H, N), N > T: some distances unused
    table = base.clone().requires_grad_()
    inputs = [table, *(t.requires_grad_() for t in (q, k, v))]
    mod = flex.score_mod(s, pos, flex.layout_table(table, pos, kind), kind)
    got = torch.autograd.grad(attention_loss(grid_bias(mod, T), q, k, v, cot), inputs)
    want = torch.autograd.grad(attention_loss(dense_bias(table, pos), q, k, v, cot), inputs)
    assert got[0].abs().sum() > 0 and (got[0] == 0).any()  # a gradient, and none at the unused distances
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# ---- the context ------------------------------------------------------------------------------------------------------
def flex_training(monkeypatch):
    """Flex with gradients on CPU (its eager math backward), as tests/test_flex_tables.py runs it."""
    monkeypatch.setattr(choice, "flex_backward", lambda device: True)
    monkeypatch.setattr(torch_flex, "_validate_device", lambda *tensors: None)
    monkeypatch.setattr(flex, "_compiled", torch.compile(torch_flex.flex_attention, backend=aot_autograd(
        fw_compiler=lambda gm, _: make_boxed_func(gm.forward), bw_compiler=lambda gm, _: make_boxed_func(gm.forward))))


@pytest.mark.parametrize("kind", flex.TABLE_LAYOUTS)
def test_context_trains_the_table_in_the_chosen_layout_and_evaluates_it_shared(monkeypatch, kind):
    """With gradients, dispatch.context hands Flex the table in ``flex.OPTIONS.table_layout`` (T = 40: padded to 48
    on CPU, so the pair table covers the padded queries), and the scheme's parameters get the gradient of a float64
    dense attention; without gradients the table stays shared."""
    flex_training(monkeypatch)
    monkeypatch.setattr(flex, "OPTIONS", flex.Options(table_layout=kind))
    s, T = scheme_of("t5"), 40
    pos = torch.arange(T)
    with torch.no_grad():
        assert dispatch.context(s, pos, H, kernel="flex").table.shape == (H, T)
    ctx = dispatch.context(s, pos, H, kernel="flex")
    assert ctx.pad == 8 and ctx.table.shape == {"shared": (H, T), "residue": (H, flex.RESIDUES, T), "pair": (H, 48, 48)}[kind]
    g = torch.Generator().manual_seed(2)
    q, k, v, cot = (torch.randn(2, H, T, DH, generator=g) for _ in range(4))
    params = [*(t.requires_grad_() for t in (q, k, v)), *s.parameters()]
    got = torch.autograd.grad((dispatch.attend(q, k, v, ctx) * cot).sum(), params)
    table = blockwise.distance_table(s, pos, torch.float64).double()
    want = torch.autograd.grad(attention_loss(dense_bias(table, pos), *(t.double() for t in (q, k, v, cot))), params)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-5)
