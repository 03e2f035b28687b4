"""Speed and memory of every positional scheme, as ratios to causal SDPA (nope) measured in the same run.

    python scripts/benchmark.py --out bench.json       # model=tiny, L=128, CPU fp32, 2 threads, all schemes
    python scripts/benchmark.py --d-model 512 --layers 6 --heads 8 --seq-len 512 --device cuda --dtype bf16 \
        --compile --lengths 2048 8192        # model=small on a GPU (scripts/gpu_check.sh runs this)

On random tokens, one model per case (``posbench.model.build.build_model``, one seed), it measures, for every registered
scheme and, by default, RoPE and ALiBi with each length-dependent attention scaling (``rope+log_n``, ``alibi+ssmax``:
``model.attn_scale``, a factor on the queries):

* the matmul ceiling, median of loops of 10 matmuls in the benchmark's dtype run in turn with the training steps
  (below), so both see the same machine: on CPU 1024×1024 @ 1024×1024 (2·1024³ FLOPs), timed around each loop;
  on CUDA 8192×8192 @ 8192×8192 (2·8192³ = 1.1 TFLOP, 1–2 ms on an H100), timed with CUDA events around
  each loop, since a 1024³ matmul (2 GFLOP, a few µs) is bound by kernel launches there and would set the ceiling
  several times too low, so every fraction of it several times too high. On CUDA the device's datasheet peak
  (dense, no sparsity; :data:`PEAKS`, NVIDIA's datasheets) is printed too where the device is in the table, and
  training's MFU (model FLOPs utilisation: GFLOP/s below over that peak) beside its fraction of the ceiling;
* the GEMM-shape ceiling: the same loops, in turn with the steps too, of the model's own GEMMs, those of its
  ``nn.Linear`` layers in a training step's forward at batch B and length L (x (B·L, in) · Wᵀ: qkv d→3d, the output
  projection d→d, the MLP's d→d_ff and d_ff→d, the head d→V; read from nope's model), each shape's GFLOP/s and all
  of a step's forward GEMMs together (their FLOPs over the time each would take at its shape's rate): a reference
  for the FLOP/s a model of that width reaches in its forward shapes (backward's transposed GEMMs, two thirds of the
  FLOPs, and the head's chunks are not timed), below the square ceiling where the shapes are thin; training's GFLOP/s over it
  (``gemm_ceiling_fraction``; per shape, ``gemm_ceiling_fractions``) is printed after the table, with no target;
* training: the step of posbench/training/loop.py (forward, cross entropy, backward, clipping, AdamW from
  ``posbench.training.optim.make_optimizer``), median of ``--steps`` steps after ``--warmup``, the schemes taking turns
  step by step. GFLOP/s counts 6·N + 12·n_layer·d_model·L FLOPs per token (N: parameters but the
  position table, tied head once), PaLM's estimate (Chowdhery et al. 2022, App. B; nanoGPT's ``estimate_mfu``):
  one count for every scheme, so GFLOP/s ∝ tokens/s, and causal attention's masked half counted too;
* evaluation: a no-grad forward of batch 1 at each length (default L·2^k up to 64L) in float32 without autocast
  whatever ``--dtype`` (posbench evaluates so: posbench/training/loop.py calls
  ``posbench.evaluation.perplexity.evaluate`` outside the
  bf16 autocast it trains under on CUDA; ``--dtype bf16`` is training's autocast), ``--repeats`` times (and
  ≥ 0.5 s) in turn with nope's at that length, after an untimed one whose peak memory growth is kept: on CPU
  in a fresh process per case, the rise of the resident high-water mark (VmHWM, reset via
  /proc/self/clear_refs) once a 2-token forward took the one-time costs; on CUDA, of
  ``torch.cuda.max_memory_allocated``. The growth includes the (T, V) logits, alike for all schemes. Flex's
  BlockMasks of the length are built before the reset (posbench.attention.flex caches them per length: on CUDA, where the
  cases share a process, the first Flex case at a length would otherwise count them and the later ones not).

``×nope``: a scheme's median step time over nope's; the median of its forward times over nope's, each over the
nope forward run next to it; its memory growth over nope's (growths under 1 MiB count as 1 MiB: allocator noise).
Only ratios compare across machines (machines of
one kind here differ 2× in speed). Targets (CPU fp32, model=tiny, 2 threads), printed ✓/✗ and in the JSON:
every bias scheme's evaluation at 16L and 64L ≤ 1.5× nope's time and ≤ 2× nope's memory growth (a contextual
scheme, CoPE, whose kernel materialises every (query, key) score by definition: ≤ 3× both); every scheme's train
step ≤ 1.10× RoPE's; training ≥ 60% of the matmul ceiling; and on CUDA, where the device's peak is known, an MFU
≥ 40%. The script exits 1 when a target is missed (the JSON is written first), 0 when all are met. Every scheme is built
with its options filled from L (``Config.fill``), as ``posbench train`` builds it (CoPE: npos = L + 1).

**Windowed and hybrid models** (``--hybrids``, or cases ``<scheme>[+scale]/<pattern>[:w<W>|:c<W>][:G=<scheme>][:sink]``,
e.g. ``rope/L:w32``: every layer a sliding window of 32; ``rope/LLLG:c32:G=nope``: Llama 4's layers; ``rope/LG:w32:sink``:
GPT-OSS's): ``model.layer_pattern``, ``model.window``/``window_kind``, ``model.global_scheme``, ``model.attn_sink``
(posbench/model/gpt.py). Targets, beside the others: a model whose every layer is windowed (pattern ``L``) evaluates a
token at 16L within :data:`WINDOW_TOKEN_X` of its own time per token at L, and its memory growth at every length
within 2× nope's (its attention's memory is bounded by the window); and a hybrid's train step within 1.10× RoPE's, as
every case's.

``--compile`` compiles training only (``GPT.forward``, as ``train.compile=true`` does; ``--compile-backend eager``
checks the compile path without generating code). Every case compiles the same code object, of which Dynamo keeps
8 compiled variants by default (``torch._dynamo.config.recompile_limit``) before it runs the next cases eager with
only a log warning: the 9th case on, a compiled step would have been timed against eager ones. So the limit is
raised to :data:`VARIANTS_PER_CASE` per case, and reaching it is made an error (``fail_on_recompile_limit_hit``),
for Flex's compiled kernel too (on CUDA every case's evaluation calls it in this one process). Not a
``torch._dynamo.reset()`` per case: the cases take turns step by step, and a reset drops the compiled code of the
cases before it. The JSON has, for each case, what its compilation added to Dynamo's counts (``train.<case>.dynamo``:
graphs, frames converted and converted without error, graph breaks; a frame not converted stops the run), the
same for the timed steps (``dynamo_in_timed_steps``; graphs there are recompilations timed, and are warned about),
and each evaluation case's graphs (``dynamo_graphs``). A warning follows the table if posbench's source changed
during the run (JSON ``source_changed``): re-run then.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch._dynamo

import posbench
from posbench.attention import choice, flex, remap
from posbench.attention.temperature import ATTN_SCALES, default_length
from posbench.model.build import build_model
from posbench.runtime import timers
from posbench.runtime.device import flush_denormals_from_now
from posbench.schemes import SCHEMES, PositionalScheme

BASELINE = "nope"  # causal SDPA, no positions
EVAL_TIME_X, EVAL_MEM_X, STEP_X_ROPE, CEILING_FRACTION = 1.5, 2.0, 1.10, 0.60
CONTEXTUAL_X = 3.0  # CoPE's evaluation time and memory growth against nope's (it materialises every score)
TARGET_MULTIPLES = (16, 64)  # evaluation targets apply at 16L and 64L
MARK = {True: "✓", False: "✗"}
SCALED = ("rope+log_n", "rope+ssmax", "alibi+log_n", "alibi+ssmax")  # default cases with length-dependent scaling
HYBRIDS = ("rope/L:w32", "rope/L:c32", "alibi/L:w32", "t5/L:w32", "rope/LLLG:w32:G=nope", "rope/LLLG:c32:G=nope",
           "rope/LG:w32:sink")  # --hybrids: windowed models (every layer, L), and hybrids' layers
WINDOW_TOKEN_X = 1.2  # a windowed model's time per token at 16L over its time per token at L
REMAPS = tuple(f"{s}@{m}" for s in ("rope", "alibi") for m in remap.METHODS[1:])  # --remaps: eval.remap's methods
REMAP_TIME_X = {"bias": 1.5, "rotary": 2.5}  # at 16L against nope's (DCA's three rotary regions: reported, no target)
MEM_FLOOR = 1 << 20  # bytes: a smaller growth counts as this much in ratios
N = 1024  # matmul ceiling size on CPU
N_CUDA = 8192  # matmul ceiling size on CUDA: compute-bound (1024³ is launch-bound on a GPU)
MATMULS = 10  # matmuls per timed loop of the ceiling
MFU_TARGET = 0.40  # CUDA: training's model FLOPs over the datasheet peak
VARIANTS_PER_CASE = 4  # Dynamo cache entries one case may add to a code object all cases share (see the docstring)
# Datasheet peak TFLOP/s, dense (the datasheets' "with sparsity" figures halved), by a pattern searched in
# torch.cuda.get_device_name(), first match wins: (pattern, device, bf16 tensor core, fp32 without TF32).
PEAKS = ((r"GH200", "GH200", 989, 67), (r"H200 NVL", "H200 NVL", 835, 60), (r"H200", "H200 SXM", 989, 67),
         (r"H100 NVL", "H100 NVL", 835, 60), (r"H100 PCIe", "H100 PCIe", 756, 51), (r"H100", "H100 SXM", 989, 67),
         (r"A100", "A100", 312, 19.5), (r"L40S", "L40S", 362, 91.6), (r"L40\b", "L40", 181, 90.5),
         (r"L4\b", "L4", 121, 30.3), (r"A10\b", "A10", 125, 31.2))
PEAK_SOURCE = ("NVIDIA datasheets: H100 and H200 Tensor Core GPU, GH200 Grace Hopper Superchip, A100 Tensor Core GPU, "
               "L40S, L40, L4 and A10 GPU (dense figures)")
MIN_EVAL_SECONDS = 0.5  # short forwards are repeated past --repeats until they add up to this


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--d-model", 128), ("--layers", 4), ("--heads", 4), ("--vocab", 4096), ("--batch", 16)):
        p.add_argument(flag, type=int, default=default, help=f"(default {default}, as model=tiny)")
    p.add_argument("--seq-len", type=int, default=128, help="the train length L")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (set and recorded)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: training under bf16 autocast (evaluation stays float32, as posbench evaluates)")
    p.add_argument("--steps", type=int, default=20, help="timed train steps per scheme; the median is kept")
    p.add_argument("--warmup", type=int, default=3, help="untimed train steps per scheme")
    p.add_argument("--lengths", type=int, nargs="+", help="evaluation lengths (default L·2^k up to 64L)")
    p.add_argument("--schemes", nargs="+", default=[*SCHEMES, *SCALED], type=case_name, metavar="SCHEME[+SCALE]",
                   help=f"of {', '.join(SCHEMES)}, each optionally with +{' or +'.join(ATTN_SCALES[1:])} "
                        f"(model.attn_scale); default: all, and {' '.join(SCALED)} (nope, the baseline, is always added)")
    p.add_argument("--hybrids", action="store_true", help=f"add the windowed and hybrid cases {' '.join(HYBRIDS)}")
    p.add_argument("--remaps", nargs="*", type=case_name, metavar="SCHEME@METHOD",
                   help=f"evaluate these training-free extensions (eval.remap; none given: {' '.join(REMAPS)})")
    p.add_argument("--repeats", type=int, default=3, help="timings per evaluation case; the median is kept")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--compile", action="store_true", help="torch.compile the training model")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile's backend with --compile (default inductor; eager: Dynamo's capture alone, "
                        "no code generated, for quick checks of the compile path)")
    p.add_argument("--eval-case", help=argparse.SUPPRESS)  # SCHEME:LENGTH, the child process of one case
    args = p.parse_args(argv)
    args.lengths = args.lengths or [args.seq_len * 2**k for k in range(7)]
    args.schemes = [BASELINE] + [s for s in dict.fromkeys([*args.schemes, *(HYBRIDS if args.hybrids else ())])
                                 if s != BASELINE]
    args.remaps = [] if args.remaps is None else args.remaps or list(REMAPS)
    return args


def case_name(text: str) -> str:
    """A benchmark case: a registered scheme, optionally ``+log_n`` or ``+ssmax``, optionally ``/<layers>``
    (:func:`layers_of`), optionally ``@<method>`` (``eval.remap``, evaluated with its defaults) (argparse's type
    check)."""
    text_, _, method = text.partition("@")
    if method and method not in remap.METHODS[1:]:
        raise argparse.ArgumentTypeError(f"{text!r}: a remap of {', '.join(remap.METHODS[1:])} after @")
    head, _, layers = text_.partition("/")
    scheme, _, scale = head.partition("+")
    if scheme not in SCHEMES or (scale and scale not in ATTN_SCALES[1:]):
        raise argparse.ArgumentTypeError(f"{text!r}: a scheme of {', '.join(SCHEMES)}, optionally "
                                         f"+{' or +'.join(ATTN_SCALES[1:])}, optionally /<pattern>[:w<W>|:c<W>]"
                                         "[:G=<scheme>][:sink]")
    try:
        layers_of(layers)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{text!r}: {err}") from None
    return text


def layers_of(text: str) -> dict:
    """The model options of a case's ``/<layers>`` part: ``L:w32`` → every layer a sliding window of 32;
    ``LLLG:c32:G=nope`` → chunked L layers, NoPE G layers; ``LG:w32:sink`` → with attention sinks. Raises ValueError
    for another part."""
    if not text:
        return {}
    pattern, *parts = text.split(":")
    options = {"layer_pattern": pattern}
    for part in parts:
        if part[:1] in "wc" and part[1:].isdigit():
            options.update(window=int(part[1:]), window_kind="sliding" if part[0] == "w" else "chunked")
        elif part.startswith("G=") and part[2:] in SCHEMES:
            options["global_scheme"] = {"name": part[2:]}
        elif part == "sink":
            options["attn_sink"] = True
        else:
            raise ValueError(f"{part!r} is not w<W>, c<W>, G=<scheme> or sink")
    return options


def make_model(args, case: str) -> torch.nn.Module:
    """The model of a case ``scheme[+scale][/layers][@method]`` (model.attn_scale ``scale``, its length the default
    of the benchmark's L; the layers' options: :func:`layers_of`; the remap ``method`` with its defaults for L and the
    longest length), seed 0."""
    torch.manual_seed(0)
    case, _, method = case.partition("@")
    head, _, layers = case.partition("/")
    scheme, _, scale = head.partition("+")
    length = default_length(scale, args.seq_len) if scale not in ("", "ssmax") else None
    spec = {"vocab_size": args.vocab, "scheme": {"name": scheme},
            "model": {"n_layer": args.layers, "n_head": args.heads, "d_model": args.d_model, "d_ff": 4 * args.d_model,
                      "attn_scale": scale or "none", "scale_length": length, **layers_of(layers)}}
    config = SCHEMES[scheme].make_config()  # with the options posbench train derives from L (CoPE's npos)
    config.fill(args.seq_len)
    spec["scheme"].update(dataclasses.asdict(config))
    if scheme == "learned":  # a table row for every evaluation position
        spec["scheme"]["max_positions"] = max(*args.lengths, args.seq_len)
    model = build_model(spec).to(args.device)
    if method:  # its defaults, checked as posbench eval checks them
        options = remap.Options()
        remap.check(method, options, args.seq_len, max(args.lengths))
        model.remap = remap.of(method, options)
    return model


def scheme_of(case: str) -> str:
    return case.partition("@")[0].partition("/")[0].partition("+")[0]


def has_bias(case: str) -> bool:  # the class attribute; before it existed, an overridden ``bias`` hook
    scheme = scheme_of(case)
    return getattr(SCHEMES[scheme], "has_bias", getattr(SCHEMES[scheme], "bias", 0) is not getattr(PositionalScheme, "bias", 0))


def contextual(case: str) -> bool:  # a content-dependent bias (CoPE): the contextual kernel, no evaluation target
    return getattr(SCHEMES[scheme_of(case)], "contextual", False)


def windowed(case: str) -> bool:  # every layer local with a window: its evaluation's cost per token is flat in T
    layers = layers_of(case.partition("@")[0].partition("/")[2])
    return set(layers.get("layer_pattern", "G")) == {"L"} and "window" in layers


def source_digest() -> str:
    """posbench's source (every case re-imports it: an edit during a run changes the code measured)."""
    files = sorted(Path(posbench.__file__).parent.rglob("*.py"))
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:12]


def sync(args) -> None:
    timers.sync(torch.device(args.device))


def autocast(args):
    """Training's autocast: bf16 with ``--dtype bf16`` (posbench/training/loop.py trains so on CUDA), else none."""
    return torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.dtype == "bf16")


def matmul_dtype(args) -> torch.dtype:
    return torch.bfloat16 if args.dtype == "bf16" else torch.float32


def ceiling_size(args) -> int:
    """N of the N×N @ N×N ceiling matmul: :data:`N` on CPU, :data:`N_CUDA` on CUDA."""
    return N_CUDA if args.device == "cuda" else N


def peak(args) -> dict | None:
    """The datasheet peak of this CUDA device in the benchmark's dtype (:data:`PEAKS`): {"device", "dtype", "tflops",
    "source"}; None on CPU, for a device not in the table, or in fp32 with TF32 allowed (no fp32 figure applies)."""
    if args.device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    row = next((r for r in PEAKS if re.search(r[0], name)), None)
    if row is None or (args.dtype == "fp32" and torch.get_float32_matmul_precision() != "highest"):
        return None
    return {"device": row[1], "dtype": "bf16 tensor core" if args.dtype == "bf16" else "fp32 (no TF32)",
            "tflops": row[2] if args.dtype == "bf16" else row[3], "source": PEAK_SOURCE}


def bound_recompiles(cases: int) -> None:
    """Let Dynamo keep :data:`VARIANTS_PER_CASE` compiled variants of a code object per case, and make reaching that
    an error (``FailOnRecompileLimitHit``) instead of a silent fall back to eager. The keys' names before torch 2.7
    were ``cache_size_limit``, ``accumulated_cache_size_limit``, ``fail_on_cache_limit_hit``."""
    cfg = torch._dynamo.config
    new = hasattr(cfg, "recompile_limit")
    limit, total, fail = (("recompile_limit", "accumulated_recompile_limit", "fail_on_recompile_limit_hit") if new else
                          ("cache_size_limit", "accumulated_cache_size_limit", "fail_on_cache_limit_hit"))
    setattr(cfg, limit, max(getattr(cfg, limit), VARIANTS_PER_CASE * cases))
    setattr(cfg, total, max(getattr(cfg, total), 4 * getattr(cfg, limit)))
    setattr(cfg, fail, True)


def dynamo_counts() -> dict:
    """Dynamo's counts in this process so far: graphs compiled, frames converted (and of those, without error),
    graph breaks."""
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"], "frames": counters["frames"]["total"],
            "frames_ok": counters["frames"]["ok"], "graph_breaks": sum(counters["graph_break"].values())}


def dynamo_since(before: dict) -> dict:
    return {k: v - before[k] for k, v in dynamo_counts().items()}


def timed(args, fn, loops: int = 1) -> float:
    """Seconds per call of ``fn``, by the wall clock around a sync (posbench/runtime/timers.py's ``wall``: a whole
    step, the host's work included)."""
    return timers.wall(fn, torch.device(args.device), loops)


def loop_sampler(args, fn):
    """A function timing one loop of :data:`MATMULS` calls of ``fn`` (a matmul), in seconds per call
    (posbench/runtime/timers.py's ``per_call``: CUDA events on CUDA, the wall clock elsewhere); three untimed calls
    first."""
    timed(args, fn, 3)
    return lambda: timers.per_call(fn, torch.device(args.device), MATMULS)


def matmul_sampler(args):
    """A function timing one loop of :data:`MATMULS` n×n @ n×n matmuls in the benchmark's dtype (n:
    :func:`ceiling_size`), in seconds per matmul: on CPU around the loop, on CUDA with CUDA events around it."""
    n = ceiling_size(args)
    a, b = (torch.randn(n, n, device=args.device, dtype=matmul_dtype(args)) for _ in range(2))
    if args.device != "cuda":
        return loop_sampler(args, lambda: a @ b)
    c = torch.empty_like(a)
    return loop_sampler(args, lambda: torch.matmul(a, b, out=c))


def gemm_shapes(args, model: torch.nn.Module) -> dict[str, dict]:
    """The GEMMs of a training step's forward through ``model``'s ``nn.Linear`` layers at batch B and length L: by
    role (the module's name less ``blocks.<i>.``: attn.qkv, attn.proj, mlp.0, mlp.2, head), {"m": B·L, "k": in
    features, "n": out features, "count": layers of that role}; x (B·L, in) · Wᵀ, W (out, in) as nn.Linear keeps
    it. A role whose layers differ in shape gets one entry per shape (``<role> <in>x<out>``)."""
    shapes: dict[str, dict] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            role = re.sub(r"^blocks\.\d+\.", "", name)
            n, k = module.weight.shape
            if role in shapes and (shapes[role]["k"], shapes[role]["n"]) != (k, n):
                role = f"{role} {k}x{n}"
            shapes.setdefault(role, {"m": args.batch * args.seq_len, "k": k, "n": n, "count": 0})["count"] += 1
    return shapes


def gemm_sampler(args, m: int, k: int, n: int):
    """:func:`loop_sampler` of ``F.linear(x, w)``, x (m, k), w (n, k), in the benchmark's dtype: the model's GEMM."""
    x = torch.randn(m, k, device=args.device, dtype=matmul_dtype(args))  # (m, k)
    w = torch.randn(n, k, device=args.device, dtype=matmul_dtype(args))  # (n, k)
    return loop_sampler(args, lambda: torch.nn.functional.linear(x, w))  # (m, n)


def gemm_ceiling(shapes: dict[str, dict], seconds: dict[str, list]) -> tuple[float, dict[str, float]]:
    """GFLOP/s of each GEMM shape (2·m·k·n FLOPs over its median seconds), and of a step's forward GEMMs together:
    their FLOPs over the time each shape at its own rate would take (a FLOP-weighted harmonic mean, each shape
    counted ``count`` times)."""
    flops = {r: 2 * s["m"] * s["k"] * s["n"] for r, s in shapes.items()}
    rate = {r: flops[r] / statistics.median(seconds[r]) / 1e9 for r in shapes}
    total = sum(flops[r] * s["count"] for r, s in shapes.items())
    return total / sum(flops[r] * s["count"] / rate[r] for r, s in shapes.items()), rate


def train(args, gemms: dict[str, dict] | None = None) -> tuple[dict, list, float, dict, dict]:
    """Median seconds per training step of each scheme over ``--steps`` steps, the schemes, a matmul sample and a
    sample of each of ``gemms`` (:func:`gemm_shapes`) taking turns, and with ``--compile`` what compiling each case
    added to Dynamo's counts (:func:`dynamo_counts`); the matmul samples; the share of ``--threads`` cores this
    process had meanwhile; Dynamo's counts added while the steps were timed; the samples of each GEMM shape
    (seconds per GEMM)."""
    from omegaconf import OmegaConf

    from posbench.config.schema import TrainConfig
    from posbench.training.optim import make_optimizer

    if args.device == "cpu":
        torch.use_deterministic_algorithms(True)  # as posbench/training/loop.py trains on CPU
        torch.utils.deterministic.fill_uninitialized_memory = False
    t = OmegaConf.structured(TrainConfig(seq_len=args.seq_len, batch_size=args.batch))
    x = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=torch.Generator().manual_seed(0)).to(args.device)
    x, y = x[:, :-1].contiguous(), x[:, 1:].contiguous()  # (B, L) each, contiguous as posbench's batches (what a
    # compiled forward is specialised on: the same graph as in ``posbench train``, so Inductor's cache can serve both)
    steps, compiled = {}, {}
    for s in args.schemes:
        model = make_model(args, s).train()
        opt = make_optimizer(model, t, fused=args.device == "cuda")
        fwd = torch.compile(model, backend=args.compile_backend) if args.compile else model
        before = dynamo_counts()

        def step(model=model, opt=opt, fwd=fwd):
            with autocast(args):
                loss = fwd(x, targets=y).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
            opt.step()

        for _ in range(max(1, args.warmup) if args.compile else args.warmup):  # (compiled at the first step)
            step()
        steps[s], compiled[s] = step, dynamo_since(before) if args.compile else None
        if compiled[s] and compiled[s]["frames_ok"] < compiled[s]["frames"]:
            raise SystemExit(f"--compile: Dynamo could not convert {compiled[s]['frames'] - compiled[s]['frames_ok']} "
                             f"frame(s) of case {s}, which would run eager")
    matmul, gemm = matmul_sampler(args), {r: gemm_sampler(args, g["m"], g["k"], g["n"]) for r, g in (gemms or {}).items()}
    cpu, wall, before = time.process_time(), time.perf_counter(), dynamo_counts()
    rounds = [{**{s: timed(args, step) for s, step in steps.items()}, "": matmul(),
               **{("gemm", r): sample() for r, sample in gemm.items()}} for _ in range(args.steps)]
    share = (time.process_time() - cpu) / (time.perf_counter() - wall) / args.threads
    timed_dynamo = dynamo_since(before)
    torch.use_deterministic_algorithms(False)
    return ({s: {"step_seconds": statistics.median(r[s] for r in rounds), "step_seconds_all": [r[s] for r in rounds],
                 "dynamo": compiled[s]} for s in steps}, [r[""] for r in rounds], share, timed_dynamo,
            {g: [r["gemm", g] for r in rounds] for g in gemm})


def hwm() -> int:
    """This process's peak resident memory so far, in bytes (VmHWM; ru_maxrss where there is no /proc)."""
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def build_block_masks(model: torch.nn.Module, n: int, device: torch.device) -> None:
    """Build the Flex BlockMasks a forward of ``model`` over n tokens on ``device`` (a tensor's: ``cuda:0``, as the
    forward's keys are) may ask for, into posbench.attention.flex's cache (per length, device and window), so that
    :func:`eval_case` builds them before it resets the peak memory and no case's measurement holds them, and a later
    case on CUDA (one process) reuses them as every case does. Causal at n (plus ``flex.cpu_padding`` on CPU), from
    block indices (O((n/128)²) integers), always; per window of the model's layers that binds at n: the causal one of
    a chunk (chunks run as a batch), and the window's own (``create_block_mask``, which evaluates all n² pairs) where
    ``choice.choose_kernel`` gives Flex for it."""
    if flex.flex_attention is None:
        return
    pad = flex.cpu_padding if device.type == "cpu" else lambda T: 0
    flex.causal_block_mask(n + pad(n), device)
    sink = model.blocks[0].attn.sink is not None
    for s, window in dict.fromkeys((s, w) for s, w in zip(model.layer_schemes, model.windows) if w and w.binds(n)):
        if window.kind == "chunked":
            flex.causal_block_mask(window.size + pad(window.size), device)
        if choice.choose_kernel(s, device, torch.float32, 0.0, False, None, window, sink) == "flex":
            flex.block_mask(n + pad(n), device, window)


def eval_case(args, scheme: str, n: int) -> dict:
    """Median seconds of a no-grad forward scoring n tokens (what ``posbench.evaluation.perplexity`` runs: per-token NLL, no
    logits kept, float32 without autocast whatever ``--dtype``), its median ratio to nope's timed in turn with it,
    the peak memory growth of the first one (the BlockMasks of n tokens built before: :func:`build_block_masks`), and
    the Dynamo graphs compiled meanwhile (Flex's, on CUDA)."""
    model = make_model(args, scheme).eval()
    idx = torch.randint(0, args.vocab, (1, n + 1), generator=torch.Generator().manual_seed(n)).to(args.device)
    x, y = idx[:, :-1], idx[:, 1:]  # (1, n) each
    cuda, dynamo = args.device == "cuda", dynamo_counts()
    with torch.no_grad():  # no autocast: posbench evaluates in float32 (see the module docstring)
        model(x[:, :2], targets=y[:, :2])  # one-time costs (thread pools, kernel set-up, lazy imports: ~14 MB on CPU) go first
        build_block_masks(model, n, x.device)  # the length's BlockMasks too (on CUDA, cached for the cases after)
        sync(args)
        torch.cuda.reset_peak_memory_stats() if cuda else None
        with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the high-water mark to the current RSS (Linux ≥ 4.0)
        before = torch.cuda.memory_allocated() if cuda else hwm()
        model(x, targets=y)
        sync(args)
        growth = (torch.cuda.max_memory_allocated() if cuda else hwm()) - before
        base = None if scheme == BASELINE else make_model(args, BASELINE).eval()
        base(x, targets=y) if base else None  # untimed, as the scheme's
        own, ref = [], []  # the scheme's and nope's forwards alternate, so both see the same machine
        while len(own) < args.repeats or sum(own) + sum(ref) < MIN_EVAL_SECONDS and len(own) < 100:
            own.append(timed(args, lambda: model(x, targets=y)))
            ref.append(timed(args, lambda: base(x, targets=y)) if base else own[-1])
    return {"seconds": statistics.median(own), "seconds_all": own, "nope_seconds": statistics.median(ref),
            "time_x_nope": statistics.median(a / b for a, b in zip(own, ref)), "peak_growth_bytes": max(0, growth),
            "dynamo_graphs": dynamo_since(dynamo)["graphs"], "source": source_digest()}


def run_case(args, argv, scheme: str, n: int) -> dict:
    """:func:`eval_case` in a fresh Python on CPU (so no earlier case holds the high-water mark), in-process on CUDA."""
    if args.device == "cuda":
        return eval_case(args, scheme, n)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--eval-case", f"{scheme}:{n}"],
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"evaluating {scheme} at {n} tokens failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.splitlines()[-1])


def remap_cases(args, argv, targets: list, nope_growth: dict) -> dict:
    """Each ``--remaps`` case evaluated at every length (its training is its scheme's), timed in turn with nope's, its
    memory growth over nope's (``nope_growth``: bytes by length), its targets at 16L (:data:`REMAP_TIME_X`, memory
    growth :data:`EVAL_MEM_X`; DCA reported only), printed as a table."""
    L, ev = args.seq_len, {s: {} for s in args.remaps}
    for n in args.lengths:
        for s in args.remaps:
            ev[s][n] = run_case(args, argv, s, n)
    if not ev:
        return ev
    w = max(11, 1 + max(map(len, ev)))
    print(f"\n{'remap':<{w}}| eval time ×nope / peak memory growth ×nope at T =\n{'':<{w}}|"
          + "".join(f"{n:>12}" for n in args.lengths))
    for s, by_length in ev.items():
        row = ""
        for n, r in by_length.items():
            r["mem_x_nope"] = max(r["peak_growth_bytes"], MEM_FLOOR) / max(nope_growth[n], MEM_FLOOR)
            cell = f"{r['time_x_nope']:.2f}"
            if n == 16 * L and not s.endswith("@dca"):
                limit = REMAP_TIME_X["bias" if has_bias(s) else "rotary"]
                cell += MARK[check(targets, f"remap eval time at 16L <= {limit}x nope's", s, r["time_x_nope"], limit,
                                   length=n)]
                cell += f"/{r['mem_x_nope']:.2f}" + MARK[check(targets, f"remap eval memory growth at 16L <= "
                                                                 f"{EVAL_MEM_X}x nope's", s, r["mem_x_nope"],
                                                                 EVAL_MEM_X, length=n)]
            else:
                cell += f"/{r['mem_x_nope']:.2f}"
            row += f"{cell:>12}"
        print(f"{s:<{w}}|{row}")
    return ev


def machine(args) -> dict:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    return {"torch": torch.__version__, "python": platform.python_version(), "threads": torch.get_num_threads(),
            "cpu": cpu, "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "dtype": args.dtype,
            "source": source_digest()}


def check(targets: list, target: str, scheme: str, value: float, limit: float, at_least=False, **where) -> bool:
    met = value >= limit if at_least else value <= limit
    targets.append({"target": target, "scheme": scheme, **where, "value": value, "limit": limit, "met": met})
    return met


def main(argv=None) -> dict | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    torch.set_num_threads(args.threads)
    flush_denormals_from_now(args.device)  # on CPU, training and evaluation alike, as posbench's jobs (before the pool)
    bound_recompiles(len(args.schemes))
    if args.eval_case:  # the child process of one evaluation case
        scheme, n = args.eval_case.rsplit(":", 1)
        print(json.dumps(eval_case(args, scheme, int(n))))
        return None
    L, info, schemes = args.seq_len, machine(args), args.schemes
    print(f"torch {info['torch']}, {info['device']} ({info['cpu']}), {info['threads']} threads, {args.dtype}; "
          f"d={args.d_model} layers={args.layers} heads={args.heads} V={args.vocab} L={L} batch={args.batch}", flush=True)
    baseline = make_model(args, BASELINE)
    n_params = sum(p.numel() for name, p in baseline.named_parameters() if not name.startswith("scheme."))  # tied head once
    per_token = 6 * n_params + 12 * args.layers * args.d_model * L
    shapes = gemm_shapes(args, baseline)
    del baseline
    (tr, matmul, info["cpu_share_in_training"], timed_dynamo, gemm_seconds), targets, marks = train(args, shapes), [], {}
    size, top = ceiling_size(args), peak(args)
    ceiling = 2 * size**3 / statistics.median(matmul) / 1e9
    gemm_total, gemm_rate = gemm_ceiling(shapes, gemm_seconds)
    print(f"matmul ceiling ({size}³ {args.dtype}): {ceiling:.1f} GFLOP/s; model FLOPs/token 6N + 12·n_layer·d·L = "
          f"{per_token / 1e6:.2f} M (N = {n_params / 1e6:.2f} M)", flush=True)
    print(f"GEMM-shape ceiling (the model's linear layers, B·L = {args.batch * L} rows, {args.dtype}; GFLOP/s): "
          + ", ".join(f"{r} {g['k']}→{g['n']} {gemm_rate[r]:.1f}" for r, g in shapes.items())
          + f"; a step's forward GEMMs together {gemm_total:.1f} ({gemm_total / ceiling:.0%} of the {size}³ ceiling)",
          flush=True)
    if top:
        print(f"datasheet peak ({top['device']}, {top['dtype']}, dense; {top['source']}): {top['tflops']:g} TFLOP/s; "
              f"the ceiling is {ceiling / 1e3 / top['tflops']:.0%} of it", flush=True)
    elif args.device == "cuda":
        print(f"datasheet peak: none known for {info['device']} in {args.dtype} (PEAKS in {Path(__file__).name}); "
              "no MFU", flush=True)
    if args.compile:
        print("compiled cases, Dynamo graphs each: " + ", ".join(f"{s} {r['dynamo']['graphs']}" for s, r in tr.items())
              + f"; graphs compiled during the timed steps: {timed_dynamo['graphs']}", flush=True)
        if timed_dynamo["graphs"]:
            print("warning: a case recompiled while its steps were timed: its step time includes compilation",
                  flush=True)
    if args.device == "cpu" and info["cpu_share_in_training"] < 0.8:
        print(f"warning: training had {info['cpu_share_in_training']:.0%} of {args.threads} cores: another process "
              "used the CPU, so ratios are unreliable", flush=True)
    for s, r in tr.items():
        r["tokens_per_s"] = args.batch * L / r["step_seconds"]
        r["gflops"] = per_token * r["tokens_per_s"] / 1e9
        r["ceiling_fraction"] = r["gflops"] / ceiling
        r["gemm_ceiling_fraction"] = r["gflops"] / gemm_total
        r["gemm_ceiling_fractions"] = {g: r["gflops"] / rate for g, rate in gemm_rate.items()}
        r["step_x_nope"] = r["step_seconds"] / tr[BASELINE]["step_seconds"]
        marks[s] = check(targets, f"train >= {CEILING_FRACTION:.0%} of the matmul ceiling", s, r["ceiling_fraction"],
                         CEILING_FRACTION, at_least=True)
        r["mfu"] = r["gflops"] / 1e3 / top["tflops"] if top else None
        if top:
            marks[s, "mfu"] = check(targets, f"train MFU >= {MFU_TARGET:.0%} of the datasheet peak", s, r["mfu"],
                                    MFU_TARGET, at_least=True)
    alibi_x_rope = tr["alibi"]["step_seconds"] / tr["rope"]["step_seconds"] if {"alibi", "rope"} <= set(tr) else None
    for s in (s for s in tr if "rope" in tr and s not in (BASELINE, "rope")):  # every scheme's step against RoPE's
        tr[s]["step_x_rope"] = tr[s]["step_seconds"] / tr["rope"]["step_seconds"]
        marks[s, "rope"] = check(targets, f"train step <= {STEP_X_ROPE}x rope's", s, tr[s]["step_x_rope"], STEP_X_ROPE)
    ev = {s: {} for s in schemes}
    for n in args.lengths:  # length-major: each scheme's case runs next to nope's
        for s in schemes:
            ev[s][n] = run_case(args, argv, s, n)
    for s in schemes:
        for n, r in ev[s].items():
            base = ev[BASELINE][n]
            r["mem_x_nope"] = max(r["peak_growth_bytes"], MEM_FLOOR) / max(base["peak_growth_bytes"], MEM_FLOOR)
            if windowed(s):  # memory bounded by the window at every length; time per token flat from L to 16L
                marks[s, n] = (None, check(targets, f"windowed eval memory growth at {n // L}L <= {EVAL_MEM_X}x nope's",
                                           s, r["mem_x_nope"], EVAL_MEM_X, length=n))
                if n == 16 * L and L in ev[s]:
                    r["token_x_at_L"] = (r["seconds"] / n) / (ev[s][L]["seconds"] / L)
                    marks[s, n] = (check(targets, f"windowed eval time per token at 16L <= {WINDOW_TOKEN_X}x at L", s,
                                         r["token_x_at_L"], WINDOW_TOKEN_X, length=n), marks[s, n][1])
                continue
            if (has_bias(s) or contextual(s)) and n in (k * L for k in TARGET_MULTIPLES):
                x_time, x_mem = (CONTEXTUAL_X, CONTEXTUAL_X) if contextual(s) else (EVAL_TIME_X, EVAL_MEM_X)
                marks[s, n] = (check(targets, f"eval time at {n // L}L <= {x_time}x nope's", s, r["time_x_nope"],
                                     x_time, length=n),
                               check(targets, f"eval memory growth at {n // L}L <= {x_mem}x nope's", s,
                                     r["mem_x_nope"], x_mem, length=n))

    w = max(11, 1 + max(map(len, schemes)))  # the first column
    print(f"\n{'':<{w}}{'train':<53}| eval time ×nope / peak memory growth ×nope at T =")
    print(f"{'scheme':<{w}}{'tok/s':>8}{'step×nope':>11}{'step×rope':>11}{'GFLOP/s':>9}{'ceiling':>10}  "
          + (f"{'MFU':>8}  " if top else "") + "|" + "".join(f"{n:>12}" for n in args.lengths))
    for s in schemes:
        r, row = tr[s], ""
        for n in args.lengths:
            t, m, ok = f"{ev[s][n]['time_x_nope']:.2f}", f"{ev[s][n]['mem_x_nope']:.2f}", marks.get((s, n))
            row += f"{t + MARK.get(ok[0], '') + '/' + m + MARK[ok[1]] if ok else t + '/' + m:>12}"
        mfu = f"{r['mfu']:>6.0%} {MARK[marks[s, 'mfu']]}  " if top else ""
        x_rope = f"{r['step_x_rope']:.2f}{MARK[marks[s, 'rope']]}" if (s, "rope") in marks else "-"
        print(f"{s:<{w}}{r['tokens_per_s']:>8,.0f}{r['step_x_nope']:>11.2f}{x_rope:>11}{r['gflops']:>9.1f}"
              f"{r['ceiling_fraction']:>8.0%} {MARK[marks[s]]}  {mfu}|" + row)
    print(f"training's GFLOP/s over the GEMM-shape ceiling ({gemm_total:.1f} GFLOP/s): "
          + ", ".join(f"{s} {tr[s]['gemm_ceiling_fraction']:.0%}" for s in schemes))
    for s in filter(contextual, schemes):
        print(f"{s}: contextual kernel (every score materialised): evaluation targets {CONTEXTUAL_X}x nope's")
    for s in filter(windowed, schemes):
        x, ok = ev[s].get(16 * L, {}).get("token_x_at_L"), marks.get((s, 16 * L), (None,))[0]
        if x is not None:
            print(f"{s}: time per token at 16L / at L = {x:.2f} {MARK[ok]} (target <= {WINDOW_TOKEN_X})")
    remapped = remap_cases(args, argv, targets, {n: ev[BASELINE][n]["peak_growth_bytes"] for n in args.lengths})
    print("nope eval seconds at T: " + ", ".join(f"{n}: {ev[BASELINE][n]['seconds']:.3g}" for n in args.lengths))
    print(f"targets met: {sum(t['met'] for t in targets)} of {len(targets)}")
    changed = {source_digest(), *(e["source"] for v in ev.values() for e in v.values())} != {info["source"]}
    if changed:
        print("warning: posbench's source changed during the run, so its cases measured different code: re-run")

    result = {"machine": info, "settings": {k: v for k, v in vars(args).items() if k != "eval_case"},
              "matmul_ceiling_gflops": ceiling, "matmul_seconds_all": matmul,
              "ceiling_matmul": f"{size}x{size} @ {size}x{size} {args.dtype}",
              "gemm_ceiling_gflops": gemm_total,
              "gemm_shapes": {r: {**g, "gflops": gemm_rate[r], "seconds_all": gemm_seconds[r]} for r, g in shapes.items()},
              "peak": top, "dynamo_in_timed_steps": timed_dynamo if args.compile else None,
              "flops": {"formula": "6*N + 12*n_layer*d_model*L per token (PaLM App. B; nanoGPT estimate_mfu)",
                        "n_params": n_params, "per_token": per_token},
              "train": tr, "alibi_step_x_rope": alibi_x_rope,
              "eval": {s: {str(n): r for n, r in v.items()} for s, v in ev.items()},
              "remaps": {s: {str(n): r for n, r in v.items()} for s, v in remapped.items()},
              "targets": targets, "all_targets_met": all(t["met"] for t in targets), "source_changed": changed}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    result = main()
    sys.exit(1 if result is not None and not result["all_targets_met"] else 0)  # (a missed target fails the run)
