#!/usr/bin/env bash
# First contact with a GPU (issue 26): what to run first on a machine with one CUDA GPU, from this repository
# with posbench installed and its environment active:
#
#     bash scripts/gpu_check.sh 2>&1 | tee gpu_check.txt
#
# One line per check, PASS / FAIL / SKIP / INFO with its numbers, a summary line, and exit status 1 if any check
# failed. docs/gpu.md says what each check runs and its target. About 8-10 minutes on a cold machine (an
# estimate, compilation dominating: no GPU has run it yet); every check has its own timeout, so it stops within
# about 21 minutes.
#
#   versions   torch, CUDA, triton, the device (FAIL without a CUDA device or without triton)
#   zoo.<s>    every registered scheme trains 10 steps (model=small, L=512, 16 × 512 tokens a step, bf16
#              autocast, train.compile=true, Flex for the bias schemes) and evaluates at L and 2L: tokens/s, and
#              FAIL on a recompile-limit or fall-back-to-eager line in the run's log or output
#   nccl       a one-process torchrun NCCL group and an all_reduce
#   resume     torchrun --nproc_per_node=1: SIGTERM to the worker mid-run (checkpoint, exit 75), the same command
#              again resumes from that step and finishes; metrics.jsonl holds every step once
#   bench.*    scripts/benchmark.py at model=small, L=512, --compile, bf16: every case compiled; each bias scheme's
#              train step <= 1.3x RoPE's; at 16L (8192) its evaluation <= 1.5x causal SDPA's time, <= 2x its memory;
#              the same limits for three cases through Flex's windowed BlockMask (W = L/4): sliding-window RoPE
#              layers, Llama 4's layers, GPT-OSS's (sinks)
#   mfu        scripts/benchmark.py at model=base (12 x 768), L=1024, bf16, --compile: RoPE's training >= 40% of the
#              device's datasheet bf16 peak (SKIP for a device not in the benchmark's PEAKS table)
#
# The zoo runs side by side (GPU_CHECK_JOBS at a time, default 8), beside the NCCL and resume checks; the benchmarks
# run after them, alone on the GPU (GPU_CHECK_BENCH_SCHEMES: the model=small benchmark's schemes; GPU_CHECK_T_ZOO,
# _T_SMALL, ...: each check's timeout in seconds). GPU_CHECK_DEVICE=cpu is a dry run of the same plumbing on CPU at tiny sizes (no
# speed target means anything there). GPU_CHECK_KEEP=1 keeps the temporary folder (its path is printed first).
set -u
cd "$(dirname "$0")/.." || exit 2
export WANDB_MODE=disabled HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
STEPS=10 RESUME_STEPS=400  # the zoo's steps; the resumed run's (enough to be stopped mid-run)

if [[ $DEVICE == cuda ]]; then
    JOBS=${GPU_CHECK_JOBS:-8}
    export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-2}  # (the zoo's runs compile side by side)
    ZOO=(data=shakespeare model=small train.seq_len=512 train.batch_size=16 train.compile=true
         'eval.lengths=[512,1024]' eval.max_tokens=16384)
    RESUME=(scheme=rope data=shakespeare model=small train.seq_len=256 train.batch_size=8 train.compile=false
            'eval.lengths=[256]' eval.max_tokens=4096)
    SMALL=(--d-model 512 --layers 6 --heads 8 --vocab 4096 --seq-len 512 --batch 16 --lengths 2048 8192
           --dtype bf16 --compile --steps 10 --warmup 2 --repeats 3)
    BASE=(--d-model 768 --layers 12 --heads 12 --vocab 16384 --seq-len 1024 --batch 16 --lengths 1024
          --dtype bf16 --compile --steps 10 --warmup 2 --repeats 1)
    T_VERSIONS=60 T_ZOO=240 T_NCCL=120 T_RESUME=180 T_SMALL=420 T_BASE=300  # seconds (the zoo: each run)
else  # the dry run: tiny sizes, fp32, Dynamo's capture without code generation
    JOBS=${GPU_CHECK_JOBS:-2} RESUME_STEPS=60
    ZOO=(data=shakespeare model=tiny train.seq_len=32 train.batch_size=4 train.compile=false 'eval.lengths=[32,64]'
         eval.max_tokens=256)
    RESUME=(scheme=rope data=shakespeare model=tiny train.seq_len=32 train.batch_size=4 train.compile=false
            'eval.lengths=[32]' eval.max_tokens=256)
    SMALL=(--d-model 16 --layers 1 --heads 2 --vocab 64 --seq-len 8 --batch 2 --lengths 32 128 --threads 1
           --compile --compile-backend eager --steps 2 --warmup 1 --repeats 1)
    BASE=(--d-model 32 --layers 2 --heads 2 --vocab 64 --seq-len 16 --batch 2 --lengths 16 --threads 1
          --compile --compile-backend eager --steps 2 --warmup 1 --repeats 1)
    T_VERSIONS=60 T_ZOO=300 T_NCCL=120 T_RESUME=180 T_SMALL=600 T_BASE=300
fi
for t in T_VERSIONS T_ZOO T_NCCL T_RESUME T_SMALL T_BASE; do  # GPU_CHECK_T_ZOO=120 etc.: a shorter timeout
    v=GPU_CHECK_$t
    [[ -n ${!v:-} ]] && declare "$t=${!v}"
done
read -r -a BENCH_SCHEMES <<<"${GPU_CHECK_BENCH_SCHEMES:-nope rope alibi t5 kerple_log fire sandwich rope/L:w128 \
rope/LLLG:c128:G=nope rope/LG:w128:sink}"  # (the last three: windowed and hybrid layers, Flex with a window's BlockMask)
COMMON=(train.device="$DEVICE" train.warmup_steps=2 train.sync_every=5 train.log_every=5 wandb.enabled=false)

if [[ ${GPU_CHECK_PRINT_CONFIG:-0} == 1 ]]; then  # the overrides and flags below, one a line (tests/test_gpu_check.py)
    for name in COMMON ZOO RESUME SMALL BASE STEPS RESUME_STEPS; do
        declare -n values=$name
        echo "== $name"
        printf '%s\n' "${values[@]}"
    done
    exit 0
fi
TMP=$(mktemp -d "${TMPDIR:-/tmp}/posbench-gpu-check.XXXXXX") || exit 2
[[ ${GPU_CHECK_KEEP:-0} == 1 ]] || trap 'rm -rf "$TMP"' EXIT

PASSED=0 FAILED=0 SKIPPED=0
report() {  # STATUS NAME TEXT...: one line of the check's result, counted
    printf '%-4s %-18s %s\n' "$1" "$2" "${*:3}"
    case $1 in PASS) PASSED=$((PASSED + 1)) ;; FAIL) FAILED=$((FAILED + 1)) ;; SKIP) SKIPPED=$((SKIPPED + 1)) ;; esac
}
emit() {  # NAME RC FILE: report the "STATUS NAME TEXT" lines a checker printed into FILE; FAIL if it printed none
    local name=$1 rc=$2 file=$3 status check text any=0
    while read -r status check text; do
        case $status in PASS | FAIL | SKIP | INFO) report "$status" "$check" "$text"; any=1 ;; esac
    done <"$file"
    ((any)) || report FAIL "$name" "exit status $rc$( ((rc == 124)) && echo ' (timed out)'): $(tail -n 1 "$file")"
}
ctail() {  # FILE: the last error-looking line of FILE, else its last line (for one-line failure reasons)
    { grep -E 'Error|error:|Exception|FAIL|Traceback' "$1" | tail -n 1; tail -n 1 "$1"; } | head -n 1 | cut -c1-300
}

commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
[[ -n $(git status --porcelain --untracked-files=no 2>/dev/null) ]] && commit="$commit + uncommitted changes"
echo "posbench GPU check: commit $commit, $(date -u '+%Y-%m-%d %H:%M UTC'), device $DEVICE, temp folder $TMP"

# ---- versions ---------------------------------------------------------------------------------------------------
timeout $T_VERSIONS "$PY" - "$DEVICE" >"$TMP/versions.txt" 2>&1 <<'EOF'
import sys

import torch

device = sys.argv[1]
try:
    import triton
    triton_version = triton.__version__
except ImportError:
    triton_version = None
parts = [f"torch {torch.__version__}", f"CUDA {torch.version.cuda}", f"triton {triton_version or 'absent'}"]
if device == "cuda":
    ok = torch.cuda.is_available() and triton_version is not None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        parts += [torch.cuda.get_device_name(0), f"sm_{p.major}{p.minor}", f"{p.total_memory / 2**30:.0f} GiB",
                  f"{torch.cuda.device_count()} device(s) visible"]
    else:
        parts.append("no CUDA device visible")
else:
    ok = True
    parts.append("CPU dry run")
print("PASS" if ok else "FAIL", "versions", ", ".join(parts))
EOF
emit versions $? "$TMP/versions.txt"
if ((FAILED)); then
    echo "summary: no usable CUDA device or no triton; nothing else checked"
    exit 1
fi

# ---- nccl and resume (background), the zoo (side by side) ------------------------------------------------------
cat >"$TMP/nccl.py" <<'EOF'
import os

import torch
import torch.distributed as dist

cuda = os.environ["GPU_CHECK_DEVICE"] == "cuda"
if cuda:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
dist.init_process_group("nccl" if cuda else "gloo")
t = torch.full((1 << 20,), 2.0, device="cuda" if cuda else "cpu")
dist.all_reduce(t)
ok = bool((t == 2.0 * dist.get_world_size()).all())
print("PASS" if ok else "FAIL", "nccl", f"{dist.get_backend()} all_reduce of 4 MiB over {dist.get_world_size()} "
      f"process: {'sum right' if ok else 'wrong sum'}")
dist.destroy_process_group()
EOF

resume_check() {  # torchrun, SIGTERM to the worker once it trains, then the same command again: it must resume
    local run=$TMP/resume/run first=$TMP/resume/first.txt second=$TMP/resume/second.txt out=$TMP/resume/report.txt
    local cmd=(torchrun --standalone --nproc_per_node=1 -m posbench train "${RESUME[@]}" "${COMMON[@]}"
               train.steps=$RESUME_STEPS hydra.run.dir="$run")
    mkdir -p "$TMP/resume"
    "${cmd[@]}" >"$first" 2>&1 &
    local pid=$! worker="" deadline=$((SECONDS + T_RESUME / 2))
    until [[ -s $run/metrics.jsonl ]] || ! kill -0 $pid 2>/dev/null || ((SECONDS > deadline)); do sleep 0.1; done
    worker=$(pgrep -P $pid | head -n 1)
    if [[ -s $run/metrics.jsonl && -n $worker ]]; then kill -TERM "$worker"; fi
    local t0=$SECONDS
    while kill -0 $pid 2>/dev/null && ((SECONDS - t0 < 60)); do sleep 0.2; done
    kill -0 $pid 2>/dev/null && kill -TERM $pid  # (torchrun still up a minute after its worker's signal)
    wait $pid
    local rc1=$?
    timeout $T_RESUME "${cmd[@]}" >"$second" 2>&1
    local rc2=$?
    "$PY" - "$run" "$first" "$second" "$rc1" "$rc2" "$RESUME_STEPS" "$worker" >"$out" 2>&1 <<'EOF'
import json
import re
import sys
from pathlib import Path

run, first, second = map(Path, sys.argv[1:4])
rc1, rc2, total, worker = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
saved = re.search(r"SIGTERM at step (\d+): checkpoint saved", first.read_text(errors="replace"))
resumed = re.search(r"resumed from the checkpoint at step (\d+)", second.read_text(errors="replace"))
rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
        if line.strip()] if (run / "metrics.jsonl").exists() else []
steps = [r["step"] for r in rows if "loss" in r]
problems = []
if not worker:
    problems.append("no worker to signal (the run ended, or never logged a step, first: exit %d)" % rc1)
if not saved:
    problems.append(f"the first run (exit {rc1}) did not report 'SIGTERM at step N: checkpoint saved'")
if rc2 != 0:
    problems.append(f"the second run exited {rc2}")
if not resumed:
    problems.append("the second run's log does not say 'resumed from the checkpoint at step N'")
elif saved and resumed.group(1) != saved.group(1):
    problems.append(f"saved at step {saved.group(1)} but resumed from {resumed.group(1)}")
if steps != list(range(1, total + 1)):
    problems.append(f"metrics.jsonl's steps are not 1…{total} once each ({len(steps)} rows, "
                    f"last {steps[-1] if steps else None})")
if problems:
    print("FAIL resume", "; ".join(problems))
else:
    print("PASS resume", f"stopped by SIGTERM at step {saved.group(1)} (first torchrun exit {rc1}), resumed from "
          f"it, finished {total} steps, metrics.jsonl steps 1…{total} once each")
EOF
}

zoo_run() {  # SCHEME: 10 steps and an evaluation in its own folder; the exit status into rc
    local dir=$TMP/zoo/$1
    mkdir -p "$dir"
    timeout $T_ZOO "$PY" -m posbench train scheme="$1" "${ZOO[@]}" "${COMMON[@]}" train.steps=$STEPS \
        hydra.run.dir="$dir/run" >"$dir/out.txt" 2>&1
    echo $? >"$dir/rc"
}

SCHEMES=$("$PY" -c "from posbench.schemes import SCHEMES; print(*SCHEMES)" 2>"$TMP/schemes.txt")
[[ -n $SCHEMES ]] || report FAIL zoo "the scheme list did not load: $(ctail "$TMP/schemes.txt")"
export GPU_CHECK_DEVICE=$DEVICE
(timeout $T_NCCL torchrun --standalone --nproc_per_node=1 "$TMP/nccl.py" >"$TMP/nccl.txt" 2>&1
 echo $? >"$TMP/nccl.rc") &
resume_check &
for s in $SCHEMES; do
    while (($(jobs -rp | wc -l) >= JOBS + 2)); do wait -n; done  # (+2: the nccl and resume checks)
    zoo_run "$s" &
done
wait

for s in $SCHEMES; do
    "$PY" - "$TMP/zoo/$s" "$s" "$(cat "$TMP/zoo/$s/rc" 2>/dev/null || echo 1)" >"$TMP/zoo/$s/report.txt" 2>&1 <<'EOF'
import json
import re
import sys
from pathlib import Path

folder, scheme, rc = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
run, name = folder / "run", f"zoo.{scheme}"
text = (folder / "out.txt").read_text(errors="replace")
text += (run / "train.log").read_text(errors="replace") if (run / "train.log").exists() else ""
# Dynamo's recompile-limit warning or error, posbench's fall back to eager (train.compile), Flex run uncompiled (its
# unfused form), posbench's CPU Flex that did not compile
warn = re.compile(r"recompil|training in eager mode|without torch\.compile|does not compile", re.I)
warnings = [line.strip() for line in text.splitlines() if warn.search(line)]
breaks = sum(1 for line in text.splitlines() if "Graph break" in line)
rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
        if line.strip()] if (run / "metrics.jsonl").exists() else []
rows = [r for r in rows if "loss" in r]
result = json.loads((run / "results.json").read_text()) if (run / "results.json").exists() else {}
if rc != 0 or result.get("status") != "complete" or not rows:
    last = [line for line in text.splitlines() if line.strip()][-1:] or ["no output"]
    print("FAIL", name, f"exit {rc}{' (timed out)' if rc == 124 else ''}: {last[0][:300]}")
    sys.exit()
by_step = {r["step"]: r for r in rows}
tokens = result.get("train_tokens", 0) / max(1, rows[-1]["step"])  # per step
speed = f"{rows[-1]['tokens_per_s']:,.0f} tok/s over all {rows[-1]['step']} steps (compilation included)"
if 5 in by_step and 10 in by_step:  # the rate of steps 6-10 from the two windows' cumulative rates
    t5, t10 = 5 * tokens / by_step[5]["tokens_per_s"], 10 * tokens / by_step[10]["tokens_per_s"]
    speed = f"{5 * tokens / (t10 - t5):,.0f} tok/s in steps 6-10, " + speed
ppl = {r["length"]: r["ppl"] for r in result.get("results", [])}
loss = f"loss {rows[0]['loss']:.2f} -> {rows[-1]['loss']:.2f}, ppl " + ", ".join(f"{k}: {v:.0f}" for k, v in ppl.items())
note = (f"{len(warnings)} recompile/fallback line(s), first: {warnings[0][:200]}" if warnings
        else "no recompile/fallback line")
print("FAIL" if warnings else "PASS", name, f"{speed}; {loss}; {note}; {breaks} graph-break line(s)")
EOF
    emit "zoo.$s" $? "$TMP/zoo/$s/report.txt"
done
emit nccl "$(cat "$TMP/nccl.rc" 2>/dev/null || echo 1)" "$TMP/nccl.txt"
emit resume 1 "$TMP/resume/report.txt"

# ---- the benchmarks, alone on the device ------------------------------------------------------------------------
timeout $T_SMALL "$PY" scripts/benchmark.py --device "$DEVICE" "${SMALL[@]}" \
    --schemes "${BENCH_SCHEMES[@]}" --out "$TMP/small.json" >"$TMP/small.txt" 2>&1
rc=$?  # (1: a target of the benchmark's own missed; the checks below judge the JSON)
if ((rc > 1)) || [[ ! -s $TMP/small.json ]]; then
    report FAIL bench "scripts/benchmark.py (model=small) exit $rc$( ((rc == 124)) && echo ' (timed out)'):" \
        "$(ctail "$TMP/small.txt")"
else
    "$PY" - "$TMP/small.json" >"$TMP/small_report.txt" 2>&1 <<'EOF'
import json
import sys

r = json.load(open(sys.argv[1]))
L, train, ev = r["settings"]["seq_len"], r["train"], r["eval"]
long = 16 * L
dyn = {s: t["dynamo"] for s, t in train.items()}
timed = r["dynamo_in_timed_steps"]
ok = all(d and d["graphs"] >= 1 and d["frames"] == d["frames_ok"] for d in dyn.values()) and timed["graphs"] == 0
print("PASS" if ok else "FAIL", "bench.compiled", "Dynamo graphs per case: " + ", ".join(
    f"{s} {d['graphs'] if d else 0}" for s, d in dyn.items()) + "; graph breaks: " + ", ".join(
    f"{s} {d['graph_breaks'] if d else 0}" for s, d in dyn.items())
    + f"; graphs compiled while timed: {timed['graphs']}")
top = r["peak"]
print("INFO", "bench.ceiling", f"{r['ceiling_matmul']}: {r['matmul_ceiling_gflops'] / 1e3:.1f} TFLOP/s"
      + (f" = {r['matmul_ceiling_gflops'] / 1e3 / top['tflops']:.0%} of the {top['device']}'s {top['tflops']:g} "
         f"(datasheet, dense)" if top else " (no datasheet peak known)"))


def mib(x):
    return f"{x / 2**20:.0f} MiB"


rope = train["rope"]["step_seconds"]
for s, t in train.items():
    evals = "; ".join(f"eval at {n}: {e['seconds'] * 1e3:.1f} ms = {e['time_x_nope']:.2f}x nope, peak growth "
                      f"{mib(e['peak_growth_bytes'])} = {e['mem_x_nope']:.2f}x" for n, e in ev[s].items())
    head = f"{t['tokens_per_s']:,.0f} tok/s, step {t['step_seconds'] / rope:.2f}x rope's"
    if s in ("nope", "rope"):
        print("INFO", f"bench.{s}", f"{head}; {evals}")
        continue
    at = ev[s].get(str(long))
    fails = [f"step {t['step_seconds'] / rope:.2f}x rope's > 1.3"] if t["step_seconds"] / rope > 1.3 else []
    if at is None:
        fails.append(f"no evaluation at 16L = {long}")
    else:
        fails += [f"eval time at 16L {at['time_x_nope']:.2f}x > 1.5"] if at["time_x_nope"] > 1.5 else []
        fails += [f"eval memory at 16L {at['mem_x_nope']:.2f}x > 2"] if at["mem_x_nope"] > 2 else []
    print("FAIL" if fails else "PASS", f"bench.{s}", ("; ".join(fails) + " | " if fails else "") + f"{head}; {evals}")
EOF
    emit bench $? "$TMP/small_report.txt"
fi

timeout $T_BASE "$PY" scripts/benchmark.py --device "$DEVICE" "${BASE[@]}" --schemes rope --out "$TMP/base.json" \
    >"$TMP/base.txt" 2>&1
rc=$?
if ((rc > 1)) || [[ ! -s $TMP/base.json ]]; then
    report FAIL mfu "scripts/benchmark.py (model=base) exit $rc$( ((rc == 124)) && echo ' (timed out)'):" \
        "$(ctail "$TMP/base.txt")"
else
    "$PY" - "$TMP/base.json" >"$TMP/base_report.txt" 2>&1 <<'EOF'
import json
import sys

r = json.load(open(sys.argv[1]))
rope, nope, top = r["train"]["rope"], r["train"]["nope"], r["peak"]
ceiling = f"ceiling {r['ceiling_matmul']} {r['matmul_ceiling_gflops'] / 1e3:.1f} TFLOP/s"
flops = (f"rope {rope['gflops'] / 1e3:.1f} TFLOP/s ({rope['tokens_per_s']:,.0f} tok/s, "
         f"{rope['ceiling_fraction']:.0%} of the {ceiling})")
if top is None:
    print("SKIP", "mfu", f"no datasheet peak for {r['machine']['device']}: {flops}")
else:
    print("PASS" if rope["mfu"] >= 0.40 else "FAIL", "mfu", f"rope MFU {rope['mfu']:.0%} of the {top['device']}'s "
          f"{top['tflops']:g} TFLOP/s {top['dtype']} (target >= 40%; nope {nope['mfu']:.0%}): {flops}")
EOF
    emit mfu $? "$TMP/base_report.txt"
fi

echo "summary: $PASSED passed, $FAILED failed, $SKIPPED skipped (commit $commit)"
((FAILED == 0))
