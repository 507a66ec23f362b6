#!/usr/bin/env bash
# The SmolLM2 ablation's trainings (experiment=l2r_ablation) and budget curve (experiment=l2r_budget) as one
# resumable background queue, with the drafter's depth (experiment=l2r_layers): one training per process, one after
# the other, in the order that answers the open questions soonest: l2r_all at 2x steps and with 2 layers, uniform
# likewise; every loss at seed 0; every loss at seed 1; decay at 2x; the 4x runs; every loss at seed 2. A run whose train_summary.json exists is skipped; a killed one resumes from
# its checkpoints/last.ckpt; a failed one is logged and retried at the next launch. Run dirs: the experiments'
# <runs>/multirun/l2r_ablation/<loss>-s<seed>, <runs>/multirun/l2r_budget/<loss>-x<budget>-s<seed> and
# <runs>/multirun/l2r_layers/<loss>-L<layers>-s<seed>; each
# run's output goes to <runs>/queue_logs/<experiment>-<run>.log. One queue at a time
# (<runs>/.ablation_queue.lock).
# Usage, from anywhere, relaunching the same command after a stop:
#   BLOCKDRAFT_RUNS=<runs> BLOCKDRAFT_CACHE=<cache> PYTHON=.venv/bin/python \
#     nohup bash experiments/ablation_queue.sh > <runs>/queue.log 2>&1 &
# After each training the drafter is evaluated into <run>/eval (T=0 replayed; TEMPERATURES='[0.0,1.0]' adds T=1).
# The report, from whatever runs exist:
#   python -m experiments.report <runs>/multirun/l2r_ablation --baseline uniform --paper --out <report dir>
#   python -m experiments.reporting.budget <runs>/multirun/l2r_ablation <runs>/multirun/l2r_budget --out <dir>
# Stop it with `kill <queue pid>` (the training under way stops too). NICE (default 19) is the trainings'
# niceness; extra arguments go to every training (e.g. num_threads=1).
set -uo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python}"
runs="${BLOCKDRAFT_RUNS:-runs}"
export PYTHONPATH=. HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
export BLOCKDRAFT_RUNS="$runs"
mkdir -p "$runs/queue_logs"
exec 9>"$runs/.ablation_queue.lock"
flock -n 9 || { echo "[queue] another queue holds $runs/.ablation_queue.lock: not starting"; exit 1; }
LOSSES=(uniform decay focal chain decay_focal l2r_all dpace soft_all)

train() {  # train EXPERIMENT RUN_SUBDIR OVERRIDES...: one training unless it finished; its log per run
  local experiment=$1 run=$2; shift 2
  local dir="$runs/multirun/$experiment/$run" log="$runs/queue_logs/$experiment-$run.log"
  if [[ -f "$dir/train_summary.json" ]]; then
    echo "[queue] $experiment/$run: finished, skipped"; return 0
  fi
  local start=$SECONDS
  echo "[queue] $(date -u +%FT%TZ) $experiment/$run: training (log $log)"
  nice -n "${NICE:-19}" "$py" -m experiments.train "experiment=$experiment" launch=run "$@" "${EXTRA[@]}" \
    >>"$log" 2>&1 &
  child=$!
  wait "$child"
  local rc=$?
  echo "[queue] $(date -u +%FT%TZ) $experiment/$run: rc $rc in $((SECONDS - start)) s"
}
child=
# Stopping the queue stops the training under way too (it resumes from last.ckpt at the next launch).
trap '[[ -n "$child" ]] && kill "$child" 2>/dev/null; wait; echo "[queue] stopped"; exit 143' TERM INT

evaluate() {  # evaluate EXPERIMENT RUN_SUBDIR: the trained drafter on the main job's suites into <run>/eval
  # (conf/main.yaml's evaluate_overrides): T=0 replayed from the target's greedy answers (about a minute), and T=1
  # decoded when TEMPERATURES='[0.0,1.0]' (minutes). A finished (suite, temperature) is skipped on relaunch.
  local dir="$runs/multirun/$1/$2" log="$runs/queue_logs/$1-$2.log"
  [[ -f "$dir/train_summary.json" ]] || return 0
  nice -n "${NICE:-19}" "$py" -m experiments.evaluate target=smollm2 "drafter.path=$dir/drafter" progress=false \
    batch_size=8 measure_target_only=false num_threads=2 replay_greedy=true "temperatures=${TEMPERATURES:-[0.0]}" \
    suite.humaneval.limit=16 suite.gsm_symbolic.limit=16 suite.mtbench.limit=8 "hydra.run.dir=$dir/eval" >>"$log" 2>&1 &
  child=$!
  wait "$child" || echo "[queue] $1/$2: evaluation failed (rc $?), see $log"
}
ablation() { for loss in "${LOSSES[@]}"; do train l2r_ablation "$loss-s$1" "loss=$loss" "seed=$1"
                                            evaluate l2r_ablation "$loss-s$1"; done; }
budget() { train l2r_budget "$1-x$2-s0" "loss=$1" "budget=$2" seed=0; evaluate l2r_budget "$1-x$2-s0"; }
layers() { train l2r_layers "$1-L$2-s0" "loss=$1" "layers=$2" seed=0; evaluate l2r_layers "$1-L$2-s0"; }

EXTRA=("$@")
budget l2r_all 2; layers l2r_all 2
budget uniform 2; layers uniform 2
ablation 0
ablation 1
budget decay 2
budget uniform 4; budget decay 4; budget l2r_all 4
ablation 2
echo "[queue] $(date -u +%FT%TZ) done"
