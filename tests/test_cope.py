"""CoPE (posbench/schemes/cope.py) and the contextual attention kernel (posbench/attention/dispatch.py) against the formula
of Golovneva et al. 2024 ("Contextual Position Encoding", arXiv:2405.18719), written again here, with the choices
of the authors' code that the paper leaves open (the gate on the logit divided by √Dh, q·e scaled like q·k, one table
e (Dh, npos) shared by the heads). For query i, key j ≤ i and head width Dh:

    g_ij = σ(q_i·k_j / √Dh)
    p_ij = min(Σ_{t=j..i} g_it, npos − 1)
    e[p] = (p − ⌊p⌋)·e[⌈p⌉] + (1 − p + ⌊p⌋)·e[⌊p⌋]
    y_i  = Σ_j softmax_j((q_i·k_j + q_i·e[p_ij]) / √Dh) · v_j

once as Python loops over i and j in float64 (each p_ij an explicit sum, ⌊p⌋ and ⌈p⌉ from ``math``), once as float64
tensors whose sums are a product with a triangular matrix (the gradient reference, checked against the loops).

Checked: the attention call and the whole model against the loops at L and 4L, with positions clamped at npos − 1
and not; causality; query blocks (a tiny budget) against one block, values and gradients; gradients of q, k, v and e;
a checkpoint round trip; a CPU training run from the command line; the refusals (npos < 1 or not an integer, and
``train.random_positions``, since CoPE reads no positions); the kernel choice from the class attribute alone;
dtypes (float64, bf16 autocast, CUDA where there is one); dropout; a new CoPE model computing NoPE's logits (e = 0);
and the memory estimate of the contextual kernel.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from torch.testing import assert_close

from helpers import refused, run_into, snapshot, train_here
from posbench.attention import choice, dense, dispatch
from posbench.model import build, memory
from posbench.schemes import SCHEMES, PositionalScheme, build_scheme
from posbench.schemes.cope import UNFILLED_NPOS
from posbench.training import checkpoint

L = 16  # stands for the train length
H, DH = 4, 8
VOCAB = 53
TOL = dict(atol=2e-5, rtol=1e-4)


def make_cope(npos: int = L + 1, seed: int = 3, std: float = 1.0):
    """A CoPE with a random table (a trained one's stand-in: the initial table is zeros)."""
    scheme = build_scheme("cope", H * DH, H, npos=npos)
    with torch.no_grad():
        scheme.table.copy_(std * torch.randn(scheme.table.shape, generator=torch.Generator().manual_seed(seed)))
    return scheme


def qkv(T: int, seed: int = 0, scale: float = 1.5, B: int = 2, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple(scale * torch.randn(B, H, T, DH, generator=g, dtype=dtype) for _ in range(3))


def run(scheme, q, k, v, dropout: float = 0.0) -> torch.Tensor:
    ctx = dispatch.context(scheme, torch.arange(q.shape[2]), H, q.dtype, dropout)
    assert ctx.kernel == "contextual"
    return dispatch.attend(q, k, v, ctx)


# ---- the formula, twice --------------------------------------------------------------------------------------------


def loop_attention(q, k, v, table, npos):
    """The formula as loops over b, h, i, j ≤ i in float64 → (y (B, H, T, Dh) float64, how many pairs were clamped,
    how many had a fractional position)."""
    q, k, v, e = (t.detach().double() for t in (q, k, v, table))
    B, Hs, T, Dh = q.shape
    root = math.sqrt(Dh)
    dots = (q @ k.transpose(-1, -2)).tolist()  # q_i·k_j
    qe = (q @ e).tolist()  # q_i·e[n] for every integer position n (q·e[p] is linear in e[p])
    y = torch.zeros(B, Hs, T, Dh, dtype=torch.float64)
    clamped = fractional = 0
    for b in range(B):
        for h in range(Hs):
            for i in range(T):
                gates = [1.0 / (1.0 + math.exp(-dots[b][h][i][t] / root)) for t in range(i + 1)]
                logits = []
                for j in range(i + 1):
                    p = sum(gates[t] for t in range(j, i + 1))
                    if p > npos - 1:
                        p, clamped = npos - 1, clamped + 1
                    lo, hi = math.floor(p), math.ceil(p)
                    fractional += lo != hi
                    position = (p - lo) * qe[b][h][i][hi] + (1 - p + lo) * qe[b][h][i][lo]
                    logits.append((dots[b][h][i][j] + position) / root)
                top = max(logits)
                weights = torch.tensor([math.exp(x - top) for x in logits], dtype=torch.float64)
                y[b, h, i] = (weights / weights.sum()) @ v[b, h, : i + 1]
    return y, clamped, fractional


def tensor_attention(q, k, v, table, npos):
    """The formula as float64 tensors, differentiable in q, k, v and the table: (B, H, T, Dh)."""
    q, k, v, e = (t.double() for t in (q, k, v, table))
    T, Dh = q.shape[2], q.shape[3]
    causal = torch.ones(T, T, dtype=torch.bool).tril()  # [i, j]: j ≤ i
    dots = q @ k.transpose(-1, -2)  # (B, H, T, T)
    gates = torch.sigmoid(dots / math.sqrt(Dh)) * causal  # g_ij, 0 for j > i
    p = (gates @ torch.ones(T, T, dtype=torch.float64).tril()).clamp(max=npos - 1)  # Σ_t g_it·[j ≤ t]: (B, H, T, T)
    lo, hi = p.detach().floor().long(), p.detach().ceil().long()
    emb = (p - lo)[..., None] * e.T[hi] + (1 - p + lo)[..., None] * e.T[lo]  # (B, H, T, T, Dh): e[p_ij]
    logits = (dots + torch.einsum("bhid,bhijd->bhij", q, emb)) / math.sqrt(Dh)
    return logits.masked_fill(~causal, float("-inf")).softmax(-1) @ v


def test_the_two_references_agree():
    s = make_cope(npos=7)
    q, k, v = qkv(2 * L, seed=11, B=1)
    looped, clamped, fractional = loop_attention(q, k, v, s.table, 7)
    assert clamped > 0 and fractional > 0
    assert_close(tensor_attention(q, k, v, s.table, 7).detach(), looped, atol=1e-12, rtol=1e-12)


# ---- the attention call and the model against the loops -----------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("T, npos", [(L, L + 1), (L, 5), (4 * L, L + 1), (4 * L, 5)],
                         ids=["L-default", "L-clamped", "4L-default", "4L-clamped"])
def test_attention_matches_the_formula(T, npos, dtype):
    """The default npos = L + 1 clamps no position of a train window (p_ij ≤ i + 1 ≤ L) and clamps beyond it."""
    s = make_cope(npos=npos).to(dtype)
    q, k, v = qkv(T, seed=T + npos, dtype=dtype)
    want, clamped, fractional = loop_attention(q, k, v, s.table, npos)
    assert fractional > 0
    assert (clamped == 0) if (T, npos) == (L, L + 1) else (clamped > 0)
    with torch.no_grad():
        got = run(s, q, k, v)
    assert got.dtype == dtype
    assert_close(got.double(), want, **(TOL if dtype == torch.float32 else dict(atol=1e-12, rtol=1e-12)))


def cope_model(per_layer: bool = True, npos: int = L + 1, n_layer: int = 2, seed: int = 0):
    torch.manual_seed(seed)
    spec = {"vocab_size": VOCAB, "model": {"n_layer": n_layer, "n_head": H, "d_model": H * DH, "d_ff": 64},
            "scheme": {"name": "cope", "npos": npos, "per_layer": per_layer}}
    model = build.build_model(spec).eval()
    with torch.no_grad():
        for n, p in enumerate(model.parameters()):  # larger weights than GPT's init, and tables that are not zero
            p.copy_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1000 * seed + n)))
    return model, spec


@pytest.mark.parametrize("per_layer", [True, False])
@pytest.mark.parametrize("T", [L, 4 * L], ids=["L", "4L"])
def test_the_model_matches_the_formula(T, per_layer, monkeypatch):
    """Every layer's attention, as the model runs it, against the loops with that layer's scheme (``ctx.scheme``):
    one per layer with ``per_layer`` (each its own table), one for all layers without."""
    model, _ = cope_model(per_layer)
    idx = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(T))
    with torch.no_grad():
        got = model(idx)
        seen, clamps = [], []

        def reference(q, k, v, ctx):
            assert ctx.kernel == "contextual"
            seen.append(ctx.scheme)
            y, clamped, _ = loop_attention(q, k, v, ctx.scheme.table, ctx.scheme.config.npos)
            clamps.append(clamped)
            return y.to(q.dtype)

        monkeypatch.setattr(dispatch, "attend", reference)
        want = model(idx)
    assert len(seen) == 2 and len({id(s) for s in seen}) == (2 if per_layer else 1)
    assert (max(clamps) > 0) == (T > L)
    assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_the_kernel_reads_the_scheme_of_its_context():
    """Two CoPEs, two tables: each context's output is its own scheme's (a model with one CoPE per layer hands each
    layer the context of its own)."""
    a, b = make_cope(seed=1), make_cope(seed=2)
    q, k, v = qkv(2 * L, seed=5, B=1)
    with torch.no_grad():
        ya, yb = run(a, q, k, v), run(b, q, k, v)
    assert_close(ya.double(), loop_attention(q, k, v, a.table, L + 1)[0], **TOL)
    assert_close(yb.double(), loop_attention(q, k, v, b.table, L + 1)[0], **TOL)
    assert not torch.allclose(ya, yb)


def test_a_new_cope_model_computes_nope_s_logits():
    """The table starts at zeros (the reference's initialisation), so q·e[p] = 0: NoPE's logits, with the same
    weights (the scheme draws no random numbers from the model's stream)."""
    spec = {"vocab_size": VOCAB, "model": {"n_layer": 2, "n_head": H, "d_model": H * DH, "d_ff": 64}}
    torch.manual_seed(0)
    cope = build.build_model({**spec, "scheme": {"name": "cope", "npos": L + 1}}).eval()
    torch.manual_seed(0)
    nope = build.build_model({**spec, "scheme": {"name": "nope"}}).eval()
    tables = [p for n, p in cope.named_parameters() if n.startswith("scheme.")]
    assert tables and all(t.shape == (DH, L + 1) and not t.any() for t in tables)
    idx = torch.randint(0, VOCAB, (2, 3 * L), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_close(cope(idx), nope(idx), atol=1e-5, rtol=1e-5)


# ---- causality and query blocks -----------------------------------------------------------------------------------


@pytest.mark.parametrize("queries_per_block", [None, 1, 5])
def test_a_later_token_does_not_change_earlier_outputs(queries_per_block, monkeypatch):
    T = 4 * L
    if queries_per_block:
        monkeypatch.setattr(dense, "CONTEXT_ELEMENTS", 2 * H * T * queries_per_block)
    s = make_cope()
    q, k, v = qkv(T, seed=1)
    with torch.no_grad():
        base = run(s, q, k, v)
        for t in (0, L - 1, L, T - 2):
            q2, k2, v2 = q.clone(), k.clone(), v.clone()
            q2[:, :, t + 1:] += 1.0
            k2[:, :, t + 1:] -= 1.0
            v2[:, :, t + 1:] *= 2.0
            out = run(s, q2, k2, v2)
            assert torch.equal(out[:, :, : t + 1], base[:, :, : t + 1]), f"index <= {t} saw a later token"
            assert not torch.allclose(out[:, :, t + 1], base[:, :, t + 1])


def test_a_later_token_does_not_change_earlier_logits_of_the_model():
    model, _ = cope_model()
    T = 4 * L
    idx = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        base = model(idx)
        for t in (0, L, T - 2):
            changed = idx.clone()
            changed[:, t + 1] = (idx[:, t + 1] + 1) % VOCAB
            out = model(changed)
            assert_close(out[:, : t + 1], base[:, : t + 1], atol=0, rtol=0)
            assert not torch.allclose(out[:, t + 1], base[:, t + 1])


@pytest.mark.parametrize("queries_per_block", [1, 3, 5, 16])
def test_query_blocks_give_the_one_block_result(queries_per_block, monkeypatch):
    """A budget of a few queries per block: the same output and gradients as one block, one call of the hook per
    block, none of them over the budget."""
    T, B = 2 * L + 3, 2
    s = make_cope(npos=9).double()  # (float64: the blocks' matmuls of other shapes round alike)
    q, k, v = (t.requires_grad_() for t in qkv(T, seed=4, dtype=torch.float64))
    weight = torch.randn(B, H, T, DH, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    tensors = {"q": q, "k": k, "v": v, "table": s.table}

    def output_and_grads():
        for t in tensors.values():
            t.grad = None
        y = run(s, q, k, v)
        (y * weight).sum().backward()
        return y.detach(), {n: t.grad.clone() for n, t in tensors.items()}

    one, one_grads = output_and_grads()
    budget = B * H * T * queries_per_block
    monkeypatch.setattr(dense, "CONTEXT_ELEMENTS", budget)
    sizes, hook = [], s.contextual_bias

    def spy(q_block, scores):
        sizes.append(scores.numel())
        return hook(q_block, scores)

    monkeypatch.setattr(s, "contextual_bias", spy)
    blocked, blocked_grads = output_and_grads()
    assert len(sizes) == math.ceil(T / queries_per_block) and max(sizes) <= budget
    assert_close(blocked, one, atol=1e-12, rtol=1e-12)
    for n in tensors:
        assert_close(blocked_grads[n], one_grads[n], atol=1e-11, rtol=1e-11, msg=lambda m: f"d/d{n}: {m}")


# ---- gradients ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("npos", [L + 1, 5])
def test_gradients_are_the_formula_s(npos):
    """d(loss)/d(q, k, v, e) through the kernel (float32) equal the float64 tensor reference's, and are non-zero:
    the gates pass gradients to q and k, the interpolation to e and, through the positions, to q and k again."""
    T = 2 * L + 3
    s = make_cope(npos=npos)
    q, k, v = (t.requires_grad_() for t in qkv(T, seed=6))
    weight = torch.randn(q.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    (run(s, q, k, v).double() * weight).sum().backward()
    tensors = {"q": q, "k": k, "v": v, "table": s.table}
    got = {n: t.grad.clone() for n, t in tensors.items()}
    for t in tensors.values():
        t.grad = None
    (tensor_attention(q, k, v, s.table, npos) * weight).sum().backward()
    for n, t in tensors.items():
        assert torch.isfinite(got[n]).all() and got[n].abs().sum() > 0, n
        assert_close(got[n].double(), t.grad.double(), atol=1e-4, rtol=1e-4, msg=lambda m: f"d/d{n}: {m}")
    if npos == 5:  # rows past the clamp are never read
        assert (got["table"][:, npos:] == 0).all()


def test_a_model_s_loss_reaches_every_table():
    model, _ = cope_model()
    model.train()
    idx = torch.randint(0, VOCAB, (2, 2 * L + 1), generator=torch.Generator().manual_seed(1))
    model(idx[:, :-1], targets=idx[:, 1:]).mean().backward()
    tables = {n: p for n, p in model.named_parameters() if n.startswith("scheme.")}
    assert len(tables) == 2  # one per layer (per_layer, the default)
    for n, p in tables.items():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, n


# ---- checkpoint, command line, refusals ------------------------------------------------------------------------------


def test_a_checkpoint_round_trip_gives_the_same_logits(tmp_path):
    model, spec = cope_model()
    checkpoint.save(tmp_path / "checkpoint.pt", model, spec, {"scheme": spec["scheme"]}, {}, step=1)
    state = checkpoint.read(tmp_path / "checkpoint.pt")
    rebuilt = build.model_from(state)
    torch.manual_seed(0)
    fresh = build.build_model(spec).eval()  # the same weights but the tables, which start at zeros
    idx = torch.randint(0, VOCAB, (2, 3 * L), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(rebuilt(idx), model(idx))
        assert not torch.allclose(fresh(idx), model(idx))
    assert state["spec"]["scheme"] == {"name": "cope", "npos": L + 1, "per_layer": True}


def test_cpu_training_from_the_command_line(data_cache, tmp_path, torch_state):
    """``posbench train debug=fast scheme=cope train.steps=2``: the job trained in this process."""
    run = tmp_path / "run"
    assert train_here(data_cache, run, "scheme=cope", "train.steps=2")["status"] == "complete"
    rec = json.loads((run / "results.json").read_text())
    seq_len = rec["config"]["train"]["seq_len"]
    assert rec["config"]["scheme"] == {"name": "cope", "npos": seq_len + 1, "per_layer": True}
    assert rec["results"] and all(math.isfinite(r["nll"]) for r in rec["results"])
    state = checkpoint.read(run / "checkpoint.pt")
    tables = [v for key, v in state["model"].items() if key.startswith("scheme.")]
    assert tables and all(t.shape == (rec["config"]["model"]["d_model"] // rec["config"]["model"]["n_head"],
                                      seq_len + 1) for t in tables)
    assert all(t.abs().sum() > 0 for t in tables), "two steps left a table at its zero start: no gradient reached it"


@pytest.mark.parametrize("npos", [0, -1, 2.5, "8", True])
def test_config_refuses_a_bad_npos(npos):
    cfg = SCHEMES["cope"].make_config(npos=npos)
    with pytest.raises(ValueError) as info:
        cfg.resolve(L, 4 * L)
    assert str(info.value).startswith(f"npos={npos!r}: "), str(info.value)
    with pytest.raises(ValueError, match=r"^npos="):
        build_scheme("cope", H * DH, H, npos=npos)


@pytest.mark.parametrize("overrides, message", [
    (["scheme.npos=0"], r"^scheme\.npos=0: CoPE needs an integer number of positions >= 1"),
    (["scheme.npos=-1"], r"^scheme\.npos=-1: "),
    (["scheme.npos=2.5"], r"^scheme\.npos.*2\.5"),
    (["train.random_positions=256"], r"^train\.random_positions=256 but scheme=cope uses no positions"),
], ids=["npos=0", "npos=-1", "npos=2.5", "random_positions"])
def test_the_command_line_refuses_in_one_line_and_writes_nothing(posbench_here, data_cache, tmp_path, overrides, message):
    run = tmp_path / "run"
    run.mkdir()
    before = snapshot(run)
    line = refused(run_into(posbench_here, data_cache, run, "scheme=cope", *overrides), run, before)
    assert re.search(message, line), line


def test_config_defaults():
    cfg = SCHEMES["cope"].Config()
    cfg.resolve(128, 8192)
    assert (cfg.npos, cfg.per_layer) == (129, True)  # L + 1, the reference's block size + 1
    kept = SCHEMES["cope"].Config(npos=64)
    kept.resolve(128, 8192)  # fewer rows than positions is allowed: they are clamped
    assert kept.npos == 64
    s = build_scheme("cope", H * DH, H)  # never filled with L
    assert s.config.npos == UNFILLED_NPOS and s.table.shape == (DH, UNFILLED_NPOS) and not s.table.any()
    assert SCHEMES["cope"].reads_positions() is False and SCHEMES["cope"].weight_decay is False
    assert SCHEMES["cope"].contextual and not SCHEMES["cope"].has_bias
    with pytest.raises(ValueError, match=r"^per_layer="):
        SCHEMES["cope"].Config(per_layer="yes").check()


# ---- kernel choice, dtypes, devices, dropout ----------------------------------------------------------------------


def test_the_kernel_is_chosen_from_the_class_attribute():
    s = make_cope()
    for device in (torch.device("cpu"), torch.device("cuda")):
        for dtype in (torch.float32, torch.bfloat16):
            for dropout in (0.0, 0.1):
                for grad in (False, True):
                    assert choice.choose_kernel(s, device, dtype, dropout, grad) == "contextual"
    for training in (False, True):
        assert memory.kernel_for("cope", "cpu", training) == "contextual"
        assert memory.kernel_for("cope", "cuda", training, dropout=0.1) == "contextual"
    others = [name for name, cls in SCHEMES.items() if name != "cope"]
    assert others and not any(SCHEMES[n].contextual for n in others)


@pytest.mark.parametrize("name", ["nope", "alibi", "t5", "rope"])
def test_other_schemes_never_reach_the_hook(name, monkeypatch):
    monkeypatch.setattr(PositionalScheme, "contextual_bias", lambda *a: pytest.fail("contextual_bias was called"))
    torch.manual_seed(0)
    model = build.build_model({"vocab_size": VOCAB, "model": {"n_layer": 1, "n_head": H, "d_model": H * DH, "d_ff": 64},
                               "scheme": {"name": name}})
    idx = torch.randint(0, VOCAB, (2, 2 * L))
    model(idx, targets=idx).mean().backward()
    with torch.no_grad():
        model.eval()(idx)


def test_bf16_autocast_on_cpu_is_close_to_fp32():
    s = make_cope(std=0.3)
    q, k, v = qkv(4 * L, seed=8, scale=1.0)
    with torch.no_grad():
        full = run(s, q, k, v)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            half = run(s, q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert half.dtype == torch.bfloat16
    assert_close(half.float(), full, atol=0.05, rtol=0.05)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_fp32_and_bf16_match_cpu():
    s = make_cope(std=0.3)
    q, k, v = qkv(4 * L, seed=9, scale=1.0)
    want = loop_attention(q, k, v, s.table, L + 1)[0]
    sc = make_cope(std=0.3).cuda()
    qc, kc, vc = (t.cuda().requires_grad_() for t in (q, k, v))
    y = run(sc, qc, kc, vc)
    assert_close(y.double().cpu(), want, atol=1e-4, rtol=1e-4)
    y.sum().backward()
    assert torch.isfinite(sc.table.grad).all() and sc.table.grad.abs().sum() > 0
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        half = run(sc, qc, kc, vc)
    assert half.dtype == torch.bfloat16
    assert_close(half.double().cpu(), want, atol=0.05, rtol=0.05)


def test_dropout_drops_attention_probabilities():
    s = make_cope()
    q, k, v = (t.requires_grad_() for t in qkv(2 * L, seed=10))
    torch.manual_seed(0)
    a = run(s, q, k, v, dropout=0.5)
    b = run(s, q, k, v, dropout=0.5)
    assert torch.isfinite(a).all() and not torch.allclose(a, b)
    a.sum().backward()
    assert s.table.grad.abs().sum() > 0
    with torch.no_grad():
        assert torch.equal(run(s, q, k, v), run(s, q, k, v))


# ---- memory -------------------------------------------------------------------------------------------------------


def test_the_memory_estimate_knows_the_contextual_kernel():
    spec = {"vocab_size": 4096, "model": {"n_layer": 4, "n_head": 4, "d_model": 128, "d_ff": 512},
            "scheme": {"name": "cope"}}
    B, n_layer = 2, 4
    for T in (512, 1024, 4096):  # one block (the whole T × T square of scores), two, several (towards T²/2)
        train, evaluate = (memory.step_bytes(spec, B, T, "contextual", training=training, device="cpu")["attention"]
                           for training in (True, False))
        kept = train - evaluate  # what training keeps: the training estimate less one block's temporaries
        pairs = B * H * sum((e - s) * e for s, e in dense.contextual_blocks(B, H, T))  # the scores built
        assert pairs >= B * H * T * T / 2
        # 28 bytes for every pair of every layer, and per query two rows of q·e[n] (npos = T + 1 here)
        assert n_layer * 28 * pairs <= kept <= n_layer * (32 * pairs + 2 * 4 * (T + 2) * B * H * T), T
    per_pair, _ = memory._contextual_saved(spec, memory._model_sizes(spec), 1024)
    assert 20 <= per_pair <= 40  # gates, positions, int64 index, weight, term, probabilities: 28 bytes in fp32
    # evaluation: one block at a time, bounded by the budget whatever the length
    spec["scheme"]["npos"] = 129
    for T in (8192, 65536):
        block = memory.CONTEXT_TEMPORARIES * dense.CONTEXT_ELEMENTS * 4
        got = memory.step_bytes(spec, 1, T, "contextual", training=False, device="cpu")["attention"]
        assert block <= got <= 1.1 * block
