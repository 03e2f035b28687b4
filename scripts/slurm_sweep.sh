#!/usr/bin/env bash
# Sweeps over many GPUs: copy the command you need, or run this file.
#   scripts/slurm_sweep.sh local    # this machine: one job per GPU at a time, the other jobs queue
#   scripts/slurm_sweep.sh slurm    # a SLURM cluster: one array task per run, requeued on preemption/timeout
# Both sweep 4 schemes x 3 seeds = 12 runs into $SWEEP/<num>_<scheme>_seed<seed>/, then write $SWEEP/report.md.
# A fixed sweep folder (not Hydra's default multirun/<date>/<time>) means the same command, run again,
# finds the same run folders, and each run resumes from the checkpoint it left there.
set -euo pipefail

SWEEP=${SWEEP:-multirun/extrapolation}
RUNS=(scheme=sinusoidal,learned,rope,alibi seed=0,1,2 train.seq_len=128)

case "${1:-}" in
local)
  # As many jobs at a time as visible GPUs (CUDA_VISIBLE_DEVICES, else every GPU); each job locks one GPU
  # for its whole life and sees only that GPU. Variants:
  #   CUDA_VISIBLE_DEVICES=2,3 scripts/slurm_sweep.sh local      # only GPUs 2 and 3: 2 jobs at a time
  #   ... hydra.launcher.n_jobs=2                                 # fewer jobs at a time than GPUs
  # With no GPU the jobs run one after another on the CPU (override n_jobs to run more, sharing the cores).
  posbench train -m hydra/launcher=joblib "${RUNS[@]}" hydra.sweep.dir="$SWEEP"
  ;;
slurm)
  # Run from a login node inside tmux/screen: this command submits one job array, then waits for it to
  # print the comparison table. The tasks run, and are requeued, without it.
  #   hydra.launcher.partition    --partition (null: the cluster's default)
  #   hydra.launcher.timeout_min  --time, minutes per run; a run cut by it is requeued up to max_num_timeout times
  #   hydra.launcher.gpus_per_node, cpus_per_task, mem_gb, account, qos, constraint: the sbatch options
  #   'hydra.launcher.setup=["module load cuda/12.4"]'  shell lines before the run (python is this one)
  # SLURM logs and sbatch scripts: $SWEEP/.submitit/<job id>/
  posbench train -m hydra/launcher=slurm "${RUNS[@]}" hydra.sweep.dir="$SWEEP" \
    hydra.launcher.partition="${PARTITION:-gpu}" \
    hydra.launcher.timeout_min=240 \
    hydra.launcher.gpus_per_node=1 \
    hydra.launcher.cpus_per_task=8
  ;;
*)
  echo "usage: $0 local|slurm   (environment: SWEEP=folder, PARTITION=name)" >&2
  exit 2
  ;;
esac
