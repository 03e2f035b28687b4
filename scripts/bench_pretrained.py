"""A pretrained checkpoint evaluated by posbench and by transformers on the same ids, and the Llama block's train step
against the GPT block's, as ratios measured in one run.

    python scripts/bench_pretrained.py --checkpoint SmolLM2-135M-Instruct.Q4_1.gguf --lengths 8192 16384 \
        --threads 2 --out bench_pretrained.json

Evaluation: for each length T, a no-grad forward of one window of T random token ids that gives every target's NLL:
posbench's model of the checkpoint (``posbench.model.pretrained.load``; ``model(x, targets=y)``, the call
``posbench.evaluation.perplexity.evaluate`` makes) and transformers' own (``AutoModelForCausalLM``, SDPA attention,
logits then cross entropy), both float32. Each (model, length) runs in a fresh process: it reads the checkpoint, takes
a 2-token forward (one-time costs), resets the resident high-water mark (VmHWM via /proc/self/clear_refs), then runs
``--repeats`` forwards; kept are the median time and the growth of the high-water mark over the first forward (its
peak memory beyond the weights) and the process's whole peak. Ratios: posbench over transformers; the target is
≤ 1.2× in time and in peak growth at every length.

Training: a train step (forward, cross entropy, backward, clipping, AdamW: posbench's optimizer) at model=tiny
(4 layers, width 128, 4 heads, d_ff 512), L=128, batch 16, RoPE, of the GPT block and of the Llama block (with 2
key/value heads), taking turns step by step; the median of ``--steps``. The Llama block has 3/2 the MLP weights of the
GPT block at the same d_ff (SwiGLU's three matrices) and fewer k/v weights: its ratio is reported, with no target.

Prints the CPU (``lscpu``'s model name) and the thread count; exits 1 when an evaluation target is missed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import subprocess
import sys
import time

import torch

TIME_X = MEMORY_X = 1.2  # posbench's evaluation over transformers', at most


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="a HF model folder, a Hub id in the local cache or a .gguf file")
    p.add_argument("--lengths", type=int, nargs="*", default=[8192, 16384], help="(none: the train step only)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2, help="forwards per (model, length); the median is kept")
    p.add_argument("--steps", type=int, default=20, help="timed train steps per block")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--case", help=argparse.SUPPRESS)  # IMPL:LENGTH, the child process of one evaluation case
    return p.parse_args(argv)


def hwm() -> int:
    """This process's peak resident memory so far, in bytes (VmHWM)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def cpu_name() -> str:
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "")
    return platform.processor()


def forward(args, impl: str):
    """(a function of (1, T) ids and targets that scores them, in nats) of ``impl``: posbench or transformers."""
    if impl == "posbench":
        from posbench.model import pretrained

        model = pretrained.load(args.checkpoint)
        return lambda x, y: model(x, targets=y)
    import transformers

    from posbench.model.pretrained import _where

    hf = transformers.AutoModelForCausalLM.from_pretrained(**_where(args.checkpoint), dtype=torch.float32,
                                                           attn_implementation="sdpa").eval()
    return lambda x, y: torch.nn.functional.cross_entropy(hf(x).logits[0], y[0], reduction="none")


def case(args) -> dict:
    """One (model, length) case, in this process (see the module docstring)."""
    impl, length = args.case.split(":")
    torch.set_num_threads(args.threads)
    score = forward(args, impl)
    ids = torch.randint(0, 49152, (1, int(length) + 1), generator=torch.Generator().manual_seed(0))
    x, y = ids[:, :-1], ids[:, 1:]  # (1, T) each
    with torch.inference_mode():
        score(x[:, :2], y[:, :2])
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the high-water mark back to the current resident memory
        before, seconds = hwm(), []
        for i in range(args.repeats):
            start = time.perf_counter()
            nll = score(x, y)
            seconds.append(time.perf_counter() - start)
            if i == 0:
                growth = hwm() - before
    return {"seconds": statistics.median(seconds), "seconds_all": seconds, "peak_growth_bytes": growth,
            "peak_bytes": hwm(), "mean_nll": nll.mean().item()}


def evaluation(args) -> dict:
    """Every (length, model) case in a child process of its own, posbench and transformers in turn."""
    out = {}
    for length in args.lengths:
        for impl in ("posbench", "transformers"):
            proc = subprocess.run([sys.executable, __file__, "--checkpoint", args.checkpoint, "--threads",
                                   str(args.threads), "--repeats", str(args.repeats), "--case", f"{impl}:{length}"],
                                  capture_output=True, text=True)
            if proc.returncode:
                raise SystemExit(f"case {impl}:{length} failed:\n{proc.stderr[-3000:]}")
            out.setdefault(length, {})[impl] = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"  {impl:12s} T={length}: {out[length][impl]['seconds']:.1f} s, peak growth "
                  f"{out[length][impl]['peak_growth_bytes'] / 2**20:.0f} MiB", flush=True)
        p, t = out[length]["posbench"], out[length]["transformers"]
        out[length]["time_x"] = p["seconds"] / t["seconds"]
        out[length]["memory_x"] = p["peak_growth_bytes"] / t["peak_growth_bytes"]
    return out


def training(args) -> dict:
    """Median train-step seconds of the GPT and Llama blocks at model=tiny (module docstring), taking turns."""
    from omegaconf import OmegaConf

    from posbench.config.schema import TrainConfig
    from posbench.model.build import build_model
    from posbench.training.optim import make_optimizer

    torch.set_num_threads(args.threads)
    t = OmegaConf.structured(TrainConfig())
    tiny = {"n_layer": 4, "n_head": 4, "d_model": 128, "d_ff": 512}
    blocks = {"gpt": {}, "llama": {"block": "llama", "n_kv_head": 2, "scale_embeddings": False}}
    ids = torch.randint(0, 4096, (t.batch_size, t.seq_len + 1), generator=torch.Generator().manual_seed(0))
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()  # (B, L) each
    steps, params = {}, {}
    for name, extra in blocks.items():
        torch.manual_seed(0)
        model = build_model({"vocab_size": 4096, "scheme": {"name": "rope"}, "model": {**tiny, **extra}}).train()
        opt = make_optimizer(model, t, fused=False)
        params[name] = sum(p.numel() for p in model.parameters())

        def step(model=model, opt=opt):
            loss = model(x, targets=y).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
            opt.step()

        for _ in range(3):
            step()
        steps[name] = step
    times = {name: [] for name in steps}
    for _ in range(args.steps):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    out = {name: {"step_seconds": statistics.median(ts), "parameters": params[name]} for name, ts in times.items()}
    out["llama_x_gpt"] = out["llama"]["step_seconds"] / out["gpt"]["step_seconds"]
    return out


def main(argv=None) -> None:
    args = parse(argv)
    if args.case:
        print(json.dumps(case(args)))
        return
    print(f"CPU: {cpu_name()}; torch {torch.__version__}; {args.threads} threads", flush=True)
    result = {"cpu": cpu_name(), "torch": torch.__version__, "threads": args.threads, "checkpoint": args.checkpoint,
              "evaluation": evaluation(args), "training": training(args)}
    missed = []
    for length, r in result["evaluation"].items():
        ok = r["time_x"] <= TIME_X and r["memory_x"] <= MEMORY_X
        missed += [] if ok else [length]
        print(f"T={length}: posbench/transformers time {r['time_x']:.2f}×, peak growth {r['memory_x']:.2f}× "
              f"(target ≤ {TIME_X}× both) {'✓' if ok else '✗'}")
    tr = result["training"]
    print(f"train step at model=tiny: llama block {tr['llama']['step_seconds'] * 1e3:.1f} ms, gpt block "
          f"{tr['gpt']['step_seconds'] * 1e3:.1f} ms: {tr['llama_x_gpt']:.2f}× (parameters {tr['llama']['parameters']:,} "
          f"vs {tr['gpt']['parameters']:,})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if missed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
