"""The GPU probe (issue 38): one standalone run of at most 8 minutes on one GPU whose every section answers a question
decided in advance, in order of decision value, so that a run cut short still answers the first ones.

    python scripts/gpu_probe.py --out probe.jsonl                                    # a CUDA machine, ~7 minutes
    python scripts/gpu_probe.py --out probe.jsonl --checkpoints run1/checkpoint.pt run2/checkpoint.pt --tokens val.pt
    python scripts/gpu_probe.py --device cpu --out probe.jsonl                       # the same plumbing, tiny sizes

One JSON line per measurement, to stdout and to ``--out`` (flushed line by line): ``{"section", "case", ...}``; a
failure is a line with ``"error"`` (the section goes on with its next case), a section out of its time budget a line
with ``"skipped"``, and each section ends with its ``"decision"`` lines, computed by the rule written beside it below.
It needs torch (with triton on CUDA) and posbench importable (``PYTHONPATH=.``); S4 also omegaconf (checkpoints are
read with posbench.model.build). docs/gpu.md says how to run it on a lent device and what to run after it.

Sections (budgets in seconds on CUDA; the CPU mode runs each at tiny sizes, Flex uncompiled):

S0 (15)  versions, the device, and which kernel SDPA runs in fp32 and in bf16 (the profiler's kernel names, and which
         backends accept fp32 at all).
S1 (180) evaluation forward of one attention call at T = 8192 (B = 1, model=small's 8 heads of 64): causal SDPA in fp32
         and bf16; Flex causal and each bias scheme's score_mod (ALiBi, FIRE, T5, KERPLE-log, Sandwich) in IEEE fp32,
         ``tf32x3`` and bf16; FIRE's unrolled MLP against its piecewise fold. Time (median of CUDA-event timings),
         peak memory growth, and the largest error against a float64 reference.
         Rule: fp32 evaluation adopts ``tf32x3`` where, for every scheme, its error is within 2× SDPA fp32's own and it
         runs ≥ 1.5× faster than IEEE; FIRE's fold is adopted where its error is within 2× the MLP's and it is faster.
S2 (75)  the training step (forward + backward, bf16 autocast) of one attention call of a per-distance-table scheme
         (T5, KERPLE-log) at L = 512, B = 16, in each table gradient layout (``flex.TABLE_LAYOUTS``); each layout's
         table gradient against the per-pair layout's.
         Rule: adopt the fastest layout whose gradient is within 2 % (relative, largest entry) of the per-pair one's.
S3 (15)  the causal BlockMask built densely (``create_block_mask``) against directly (``flex.causal_block_mask``) at
         T = 8192 … 131072: time, peak memory, equality. Rule: the direct one stays when equal.
S4 (45)  evaluation NLL of CPU-trained checkpoints (``--checkpoints``, tokens ``--tokens``) at L … 16L in fp32 (IEEE),
         fp32 with ``tf32x3`` and bf16 autocast. Rule: offer bf16 evaluation only where |ΔNLL| ≤ 1e-3 nats for every
         scheme and length; the same for ``tf32x3``.
S5 (150) model=base (12 × 768, 12 heads, V = 16384) training at L = 1024, bf16, compiled: batch 16 and 32, with the
         chunked head-and-loss off and on; MFU against the datasheet peak; a profile of one step (the kernels that
         take the time, by family). Rule: the fastest configuration becomes the default where it is ≥ 5 % faster;
         MFU ≥ 40 % is the target, and the profile says where the time goes when it is missed.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import platform
import re
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # posbench from this checkout (no install needed)

from posbench.attention import choice, dispatch, flex  # noqa: E402
from posbench.model import head
from posbench.runtime import timers  # noqa: E402
from posbench.schemes import build_scheme  # noqa: E402

BUDGETS = {"S0": 15, "S1": 180, "S2": 75, "S3": 15, "S4": 45, "S5": 150}  # seconds on CUDA
SIZES = {  # per device: evaluation length, heads, head size; train length and batch; block-mask lengths; base model
    "cuda": {"T": 8192, "H": 8, "Dh": 64, "L": 512, "B": 16, "masks": (8192, 32768, 131072),
             "base": {"n_layer": 12, "n_head": 12, "d_model": 768, "d_ff": 3072}, "vocab": 16384, "L_base": 1024,
             "batches": (16, 32), "steps": 6, "repeats": 5},
    "cpu": {"T": 256, "H": 2, "Dh": 16, "L": 64, "B": 2, "masks": (256, 1024),
            "base": {"n_layer": 2, "n_head": 2, "d_model": 32, "d_ff": 64}, "vocab": 64, "L_base": 32,
            "batches": (2, 4), "steps": 2, "repeats": 2},
}
BIAS_SCHEMES = ("alibi", "fire", "t5", "kerple_log", "sandwich")  # in order of decision value
TABLE_SCHEMES = ("t5", "kerple_log")
PRECISIONS = ("ieee", "tf32x3", "bf16")
TF32X3_ERR_X, TF32X3_SPEED_X = 2.0, 1.5  # S1's rule
LAYOUT_GRAD_TOL = 0.02  # S2's rule
BF16_NLL_TOL = 1e-3  # S4's rule, nats
CONFIG_GAIN = 1.05  # S5's rule
MFU_TARGET = 0.40
KERNEL_FAMILIES = (("gemm", r"gemm|cutlass|xmma|nvjet|sm90|cublas|matmul"), ("attention", r"flash|fmha|attention|sdpa"),
                   ("triton (fused)", r"triton"), ("optimizer", r"adam|foreach|multi_tensor"),
                   ("copy", r"copy|memcpy|memset|cat|fill"))


class Probe:
    """The run's clock, output and error capture: :meth:`emit` writes one JSON line; :meth:`section` and :meth:`case`
    record an exception as an ``error`` line and go on."""

    def __init__(self, args):
        self.args, self.device, self.start = args, torch.device(args.device), time.perf_counter()
        self.size = SIZES[args.device]
        self.out = open(args.out, "a") if args.out else None
        self.section_name, self.deadline = None, math.inf

    def emit(self, **row) -> dict:
        row = {"section": self.section_name, **row, "t": round(time.perf_counter() - self.start, 2)}
        line = json.dumps(row, default=str)
        print(line, flush=True)
        if self.out:
            self.out.write(line + "\n")
            self.out.flush()
        return row

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    @contextlib.contextmanager
    def section(self, name: str):
        self.section_name = name
        budget = BUDGETS[name] * (self.args.budget_scale if self.device.type == "cuda" else 10)
        self.deadline = time.perf_counter() + budget
        self.emit(event="start", budget_s=budget)
        saved = flex.OPTIONS
        flex.OPTIONS = flex.Options(saved.table_layout, saved.float32_precision)  # (a section's own; restored after)
        try:
            yield
        except Exception as e:  # noqa: BLE001 (a probe records every failure and goes on to the next section)
            self.emit(error=f"{type(e).__name__}: {e}"[:500])
        flex.OPTIONS = saved
        self.emit(event="end")

    @contextlib.contextmanager
    def case(self, name: str, results: dict | None = None):
        """One measurement: skipped (a line) when the section's budget is spent; its exception recorded as a line."""
        if self.left() <= 0:
            self.emit(case=name, skipped="section budget spent")
            yield None
            return
        row = {}
        try:
            yield row
        except Exception as e:  # noqa: BLE001 (recorded, not raised: the next case runs)
            row = {"error": f"{type(e).__name__}: {e}"[:500]}
            _free(self.device)
        if row:
            if results is not None:
                results[name] = row
            self.emit(case=name, **row)


def _free(device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def timed(fn, device, repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after one warm-up call (compilation), each timed by
    posbench/runtime/timers.py's ``per_call``: CUDA events on CUDA, the wall clock elsewhere."""
    fn()
    return statistics.median(timers.per_call(fn, device) for _ in range(repeats))


def peak_growth(fn, device) -> int | None:
    """Bytes the peak allocated memory grows by over one call of ``fn`` (CUDA), None on CPU."""
    if device.type != "cuda":
        fn()
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def set_precision(precision: str | None) -> None:
    """Flex's float32 precision for contexts built from now (``flex.OPTIONS``; None: Inductor's default)."""
    flex.OPTIONS.float32_precision = None if precision in (None, "bf16") else precision


# ---- S0 -------------------------------------------------------------------------------------------------------------
def s0_versions(p: Probe) -> None:
    import torch.nn.attention as nn_attention

    with p.case("versions") as row:
        row.update(torch=torch.__version__, cuda=torch.version.cuda, python=platform.python_version(),
                   float32_matmul_precision=torch.get_float32_matmul_precision())
        try:
            import triton
            row["triton"] = triton.__version__
        except ImportError:
            row["triton"] = None
        if p.device.type == "cuda":
            prop = torch.cuda.get_device_properties(p.device)
            row.update(device=prop.name, capability=f"sm_{prop.major}{prop.minor}", memory_gib=prop.total_memory / 2**30,
                       multiprocessors=prop.multi_processor_count)
        else:
            row.update(device=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    s = p.size
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(1, s["H"], s["T"], s["Dh"], device=p.device, dtype=dtype) for _ in range(3))
        with p.case(f"sdpa_kernel.{str(dtype)[6:]}") as row:
            activities = [torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if p.device.type == "cuda" else [])
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
            with torch.profiler.profile(activities=activities) as prof:
                F.scaled_dot_product_attention(q, k, v, is_causal=True)
                torch.cuda.synchronize() if p.device.type == "cuda" else None
            names = [e.key for e in prof.key_averages() if re.search(r"flash|fmha|attention|efficient|cudnn|math|kernel",
                                                                      e.key, re.I)]
            row["kernels"] = names[:8]
            accepted = {}
            for backend in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
                if not hasattr(nn_attention.SDPBackend, backend):
                    continue
                try:
                    with nn_attention.sdpa_kernel(getattr(nn_attention.SDPBackend, backend)):
                        F.scaled_dot_product_attention(q, k, v, is_causal=True)
                    accepted[backend] = True
                except RuntimeError as e:
                    accepted[backend] = str(e).splitlines()[0][:120]
            row["backends"] = accepted


# ---- S1 -------------------------------------------------------------------------------------------------------------
def reference(q, k, v, bias: torch.Tensor | None) -> torch.Tensor:
    """Causal softmax attention in float64, one head at a time: q, k, v (1, H, T, Dh); bias (H, T, T) or None."""
    q, k, v = q.double(), k.double(), v.double()
    T = q.shape[2]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    out = torch.empty_like(q)
    for h in range(q.shape[1]):
        s = q[0, h] @ k[0, h].T / math.sqrt(q.shape[-1])  # (T, T)
        if bias is not None:
            s = s + bias[h]
        out[0, h] = s.masked_fill(~causal, float("-inf")).softmax(-1) @ v[0, h]
    return out


def make_scheme(name: str, H: int, Dh: int) -> torch.nn.Module:
    """A bias scheme of H heads with parameters moved off their initial values (T5's table starts at zero), seed 0."""
    torch.manual_seed(0)
    scheme = build_scheme(name, d_model=H * Dh, n_head=H)
    with torch.no_grad():
        for prm in scheme.parameters():
            if name != "fire":  # (FIRE's default initialisation already gives a bias of many kinks)
                prm.add_(0.3 * torch.randn_like(prm))
    return scheme


def flex_eval(scheme, q, k, v, pos, compiled: bool, mod=None):
    """posbench's evaluation path for one attention call: the flex context (score_mod, BlockMask, kernel options) of
    ``scheme`` (None: causal, no bias), then Flex; ``mod`` replaces the score_mod (FIRE's MLP)."""
    H = q.shape[1]
    if scheme is None:
        scheme = build_scheme("nope", d_model=H * q.shape[-1], n_head=H)
    ctx = dispatch.context(scheme, pos, H, q.dtype, kernel="flex", span=pos.numel())
    score_mod = mod or (ctx.score_mod if scheme.has_bias else None)
    if compiled:
        return lambda: flex.run(q, k, v, score_mod, ctx.block_mask, ctx.kernel_options)
    return lambda: flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=ctx.block_mask)


def s1_evaluation(p: Probe) -> None:
    s, dev, compiled = p.size, p.device, p.device.type == "cuda"
    T, H, Dh = s["T"], s["H"], s["Dh"]
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, H, T, Dh, device=dev) for _ in range(3))
    pos = torch.arange(T, device=dev)
    results = {}

    def measure(name, fn, ref, precision):
        with p.case(name, results) as row:
            if row is None:
                return
            with torch.no_grad():
                out = fn()
                row["max_err"] = float((out.double() - ref).abs().max())
                row["ms"] = timed(fn, dev, s["repeats"]) * 1e3
                row["peak_growth_mib"] = (lambda b: None if b is None else b / 2**20)(peak_growth(fn, dev))
            row["precision"] = precision

    ref = reference(q, k, v, None)
    measure("sdpa.fp32", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), ref, "fp32")
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    measure("sdpa.bf16", lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True), ref, "bf16")
    for name in ("causal",) + BIAS_SCHEMES:
        if p.left() <= 0:
            p.emit(case=name, skipped="section budget spent")
            continue
        scheme = None if name == "causal" else make_scheme(name, H, Dh).to(dev)
        with torch.no_grad():
            exact = None if scheme is None else copy.deepcopy(scheme).double()
            bias = None if exact is None else (exact.mlp_bias(pos, pos) if name == "fire" else  # (FIRE: its MLP, not the
                                               exact.pair_bias(pos, pos, torch.float64))  # fold under test)
            ref = reference(q, k, v, bias)
            del bias
        for precision in PRECISIONS:
            set_precision(precision)
            x = (qb, kb, vb) if precision == "bf16" else (q, k, v)
            with torch.no_grad():
                measure(f"{name}.{precision}", flex_eval(scheme, *x, pos, compiled), ref, precision)
        if name == "fire":  # the unrolled MLP (the fold is the score_mod above)
            for precision in ("ieee", "tf32x3"):
                set_precision(precision)

                def mlp(score, b, h, q_idx, kv_idx, scheme=scheme):
                    return scheme.score_mod_mlp(score, h, pos[q_idx], pos[kv_idx])

                with torch.no_grad():
                    measure(f"fire_mlp.{precision}", flex_eval(scheme, q, k, v, pos, compiled, mod=mlp), ref, precision)
        del ref
        _free(dev)
    sdpa = results.get("sdpa.fp32")
    for name in ("causal",) + BIAS_SCHEMES:
        ieee, x3 = results.get(f"{name}.ieee"), results.get(f"{name}.tf32x3")
        if not (sdpa and ieee and x3) or "error" in ieee or "error" in x3 or "error" in sdpa:
            p.emit(decision=f"tf32x3.{name}", adopt=None, why="missing measurement")
            continue
        err_ok = x3["max_err"] <= TF32X3_ERR_X * sdpa["max_err"]
        speed = ieee["ms"] / x3["ms"]
        p.emit(decision=f"tf32x3.{name}", adopt=err_ok and speed >= TF32X3_SPEED_X, err_x_sdpa=x3["max_err"] / sdpa["max_err"],
               speed_x_ieee=speed, rule=f"err <= {TF32X3_ERR_X}x SDPA fp32's and >= {TF32X3_SPEED_X}x faster than IEEE")
    fold, mlp = results.get("fire.ieee"), results.get("fire_mlp.ieee")
    if fold and mlp and "error" not in fold and "error" not in mlp:
        p.emit(decision="fire_fold", adopt=fold["max_err"] <= 2 * mlp["max_err"] and fold["ms"] < mlp["ms"],
               speed_x_mlp=mlp["ms"] / fold["ms"], err_x_mlp=fold["max_err"] / max(mlp["max_err"], 1e-30),
               rule="error within 2x the MLP's, and faster")


# ---- S2 -------------------------------------------------------------------------------------------------------------
def cpu_flex_backward():
    """Flex with a backward on CPU, where torch refuses one: its device check lifted and its eager math backward run
    through aot_autograd (the graphs Inductor would lower on a GPU), uncompiled."""
    import torch.nn.attention.flex_attention as torch_flex
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    torch_flex._validate_device = lambda *tensors: None
    boxed = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward),
                         bw_compiler=lambda gm, _: make_boxed_func(gm.forward))
    return torch.compile(torch_flex.flex_attention, backend=boxed)


def s2_layouts(p: Probe) -> None:
    s, dev, compiled = p.size, p.device, p.device.type == "cuda"
    L, B, H, Dh = s["L"], s["B"], s["H"], s["Dh"]
    pos = torch.arange(L, device=dev)
    dtype = torch.bfloat16 if compiled else torch.float32
    if not compiled:  # (Flex's eager math backward on CPU; dispatch.context then allows gradients through Flex)
        flex._compiled, choice.flex_backward = cpu_flex_backward(), lambda device: True
    for name in TABLE_SCHEMES:
        results, grads = {}, {}
        for layout in flex.TABLE_LAYOUTS:
            with p.case(f"{name}.{layout}", results) as row:
                if row is None:
                    continue
                scheme = make_scheme(name, H, Dh).to(dev)
                torch.manual_seed(1)
                q, k, v = (torch.randn(B, H, L, Dh, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
                cot = torch.randn(B, H, L, Dh, device=dev, dtype=dtype)
                flex.OPTIONS.table_layout = layout

                def step(scheme=scheme, q=q, k=k, v=v, cot=cot):  # posbench's training path: the context, then Flex
                    scheme.zero_grad(set_to_none=True)
                    ctx = dispatch.context(scheme, pos, H, dtype, kernel="flex", span=L)
                    flex.run(q, k, v, ctx.score_mod, ctx.block_mask, ctx.kernel_options).backward(cot)

                row["ms"] = timed(step, dev, s["repeats"]) * 1e3
                grads[layout] = torch.cat([prm.grad.flatten().float() for prm in scheme.parameters()])
        ref = grads.get("pair")
        for layout, g in grads.items():
            if ref is not None:
                results[f"{name}.{layout}"]["grad_rel_err"] = float((g - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                p.emit(case=f"{name}.{layout}.grad", grad_rel_err=results[f"{name}.{layout}"]["grad_rel_err"])
        ok = {lay: r["ms"] for lay, r in ((n.split(".")[1], r) for n, r in results.items())
              if "ms" in r and r.get("grad_rel_err", 1) <= LAYOUT_GRAD_TOL}
        p.emit(decision=f"table_layout.{name}", adopt=min(ok, key=ok.get) if ok else None,
               ms={lay: round(ms, 3) for lay, ms in ok.items()},
               rule=f"fastest layout whose table gradient is within {LAYOUT_GRAD_TOL:.0%} of the per-pair one's")


# ---- S3 -------------------------------------------------------------------------------------------------------------
def s3_block_masks(p: Probe) -> None:
    dev = p.device
    for T in p.size["masks"]:
        with p.case(f"block_mask.{T}") as row:
            if row is None:
                continue
            built = {}

            def dense(T=T):
                built["dense"] = flex.create_block_mask(flex._causal, None, None, T, T, device=dev)

            def direct(T=T):
                flex._block_masks.clear()
                built["direct"] = flex.causal_block_mask(T, dev)

            for how, fn in (("direct", direct), ("dense", dense)):  # (the dense one may not fit: 128 GiB at 131072)
                try:
                    row[f"{how}_ms"] = timed(fn, dev, 3) * 1e3
                    growth = peak_growth(fn, dev)
                    row[f"{how}_peak_mib"] = None if growth is None else growth / 2**20
                except torch.OutOfMemoryError as e:
                    row[f"{how}_error"] = f"OutOfMemoryError: {str(e).splitlines()[0][:200]}"
                    _free(dev)
            if "dense" in built:
                a, b = built["dense"], built["direct"]
                row["equal"] = bool(torch.equal(a.kv_num_blocks, b.kv_num_blocks) and torch.equal(a.to_dense(), b.to_dense()))
            flex._block_masks.clear()
    p.emit(decision="block_mask", adopt="direct", rule="the direct causal BlockMask stays where equal to "
                                                      "create_block_mask's (the lines above)")


# ---- S4 -------------------------------------------------------------------------------------------------------------
def s4_nll(p: Probe) -> None:
    from posbench.model.build import build_model

    if not p.args.checkpoints:
        p.emit(skipped="no --checkpoints")
        return
    dev = p.device
    tokens = torch.load(p.args.tokens, weights_only=True).long() if p.args.tokens else None
    worst = {"bf16": 0.0, "tf32x3": 0.0}
    for path in p.args.checkpoints:
        state = torch.load(path, map_location="cpu", weights_only=False)
        model = build_model(state["spec"]).to(dev)
        model.load_state_dict(state["model"])
        model.eval()
        L = state["config"]["train"]["seq_len"]
        name = state["spec"]["scheme"]["name"]
        data = tokens if tokens is not None else torch.randint(0, state["vocab_size"], (16 * L * 4 + 1,))
        for n in (1, 2, 4, 8, 16):
            T = n * L
            rows = min(p.args.eval_rows, (data.numel() - 1) // T)
            if rows < 1:
                continue
            x = data[: rows * T + 1].to(dev)
            idx, tgt = x[:-1].view(rows, T), x[1:].view(rows, T)
            with p.case(f"{name}.{T}") as row:
                if row is None:
                    continue
                nll = {}
                for precision in ("ieee", "tf32x3", "bf16"):
                    set_precision(precision)
                    with torch.no_grad(), torch.autocast(dev.type, torch.bfloat16, enabled=precision == "bf16"):
                        nll[precision] = float(model(idx, targets=tgt).double().mean())
                row.update(nll_fp32=nll["ieee"], d_bf16=nll["bf16"] - nll["ieee"], d_tf32x3=nll["tf32x3"] - nll["ieee"],
                           sequences=rows)
                for key in worst:
                    worst[key] = max(worst[key], abs(row[f"d_{key}"]))
        flex.reset_compiled()
        del model
        _free(dev)
    for key, value in worst.items():
        p.emit(decision=f"{key}_evaluation", adopt=value <= BF16_NLL_TOL, worst_abs_dnll=value,
               rule=f"|dNLL| <= {BF16_NLL_TOL} nats for every scheme and length")


# ---- S5 -------------------------------------------------------------------------------------------------------------
def s5_base(p: Probe) -> None:
    from omegaconf import OmegaConf

    from posbench.config.schema import TrainConfig
    from posbench.model.build import build_model
    from posbench.training.optim import make_optimizer

    s, dev, cuda = p.size, p.device, p.device.type == "cuda"
    L, V = s["L_base"], s["vocab"]
    peak = None
    if cuda:  # the datasheet's dense bf16 peak, from the benchmark's one table of them
        from scripts.benchmark import PEAKS

        row = next((r for r in PEAKS if re.search(r[0], torch.cuda.get_device_name())), None)
        peak = None if row is None else row[2] * 1e12
    configs = [(s["batches"][0], False), (s["batches"][1], False), (s["batches"][0], True)]
    results, steps = {}, {}
    for batch, chunked in configs:
        case = f"base.b{batch}.{'chunked' if chunked else 'plain'}_head"
        with p.case(case, results) as row:
            if row is None:
                continue
            torch.manual_seed(0)
            model = build_model({"vocab_size": V, "scheme": {"name": "rope"}, "model": s["base"]}).to(dev).train()
            n_params = sum(prm.numel() for n, prm in model.named_parameters() if not n.startswith("scheme."))
            per_token = 6 * n_params + 12 * s["base"]["n_layer"] * s["base"]["d_model"] * L
            opt = make_optimizer(model, OmegaConf.structured(TrainConfig(seq_len=L, batch_size=batch)), fused=cuda)
            fwd = torch.compile(model) if cuda else model
            x = torch.randint(0, V, (batch, L + 1), device=dev)
            idx, tgt = x[:, :-1].contiguous(), x[:, 1:].contiguous()

            def step(model=model, opt=opt, fwd=fwd, idx=idx, tgt=tgt, chunked=chunked):
                head.CHUNKED_HEAD_CUDA = chunked
                with torch.autocast(dev.type, torch.bfloat16, enabled=cuda):
                    loss = fwd(idx, targets=tgt).mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()

            step()  # compiles
            seconds = timed(step, dev, s["steps"])
            tps = batch * L / seconds
            row.update(step_ms=seconds * 1e3, tokens_per_s=tps, tflops=tps * per_token / 1e12,
                       mfu=None if peak is None else tps * per_token / peak, n_params=n_params)
            steps[case] = (step, model)
        head.CHUNKED_HEAD_CUDA = False
        _free(dev)
    ok = {c: r["tokens_per_s"] for c, r in results.items() if "tokens_per_s" in r}
    if ok:
        best = max(ok, key=ok.get)
        base = ok.get(f"base.b{s['batches'][0]}.plain_head", ok[best])
        p.emit(decision="base_config", adopt=best if ok[best] >= CONFIG_GAIN * base else "unchanged",
               gain=ok[best] / base, mfu=results[best].get("mfu"), target_mfu=MFU_TARGET,
               rule=f"the fastest configuration where >= {CONFIG_GAIN}x the default's tokens/s")
        with p.case("profile") as row:
            if row is not None:
                step, _ = steps[best]
                activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
                with torch.profiler.profile(activities=activities) as prof:
                    head.CHUNKED_HEAD_CUDA = "chunked" in best
                    step()
                    torch.cuda.synchronize() if cuda else None
                head.CHUNKED_HEAD_CUDA = False
                events = [e for e in prof.key_averages() if (e.self_device_time_total if cuda else e.self_cpu_time_total) > 0]
                total = sum(e.self_device_time_total if cuda else e.self_cpu_time_total for e in events) or 1
                key = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
                top = sorted(events, key=key, reverse=True)[:15]
                row["of"] = best
                row["top"] = [[e.key[:90], round(key(e) / total, 4)] for e in top]
                family = {}
                for e in events:
                    fam = next((f for f, pat in KERNEL_FAMILIES if re.search(pat, e.key, re.I)), "other")
                    family[fam] = family.get(fam, 0) + key(e) / total
                row["families"] = {f: round(v, 4) for f, v in sorted(family.items(), key=lambda kv: -kv[1])}


SECTIONS = {"S0": s0_versions, "S1": s1_evaluation, "S2": s2_layouts, "S3": s3_block_masks, "S4": s4_nll, "S5": s5_base}


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--out", help="append the JSON lines to this file too")
    ap.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    ap.add_argument("--checkpoints", nargs="*", default=[], help="S4: posbench checkpoint.pt files (CPU-trained)")
    ap.add_argument("--tokens", help="S4: a 1-D int64 tensor of evaluation tokens (torch.save); default random tokens")
    ap.add_argument("--eval-rows", type=int, default=8, help="S4: sequences per length")
    ap.add_argument("--budget-scale", type=float, default=1.0, help="multiply every section's CUDA budget")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_probe: --device cuda, but torch sees no CUDA device; --device cpu runs the plumbing", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")  # (the CPU mode's eager Flex)
    p = Probe(args)
    for name in args.sections:
        with p.section(name):
            SECTIONS[name](p)
    p.section_name = None
    p.emit(event="done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
