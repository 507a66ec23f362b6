#!/usr/bin/env bash
# The SmolLM2 ablation's trainings (experiment=l2r_ablation) and budget curve (experiment=l2r_budget) as one
# resumable background queue, with the drafter's depth (experiment=l2r_layers), in the order that answers the open
# questions soonest: l2r_all and uniform at 2x steps and with 2 layers; every loss at seed 0; every loss at seed 1;
# decay at 2x; every loss at seed 2; the 4x runs; the ablation's drafters at T=1; the baselines at T=0 and T=1; the
# loss sweeps (experiment=l2r_sweep_{gamma,focal,chain}, 2 seeds).
# A run whose train_summary.json exists is not trained again; a killed one resumes from its checkpoints/last.ckpt; a
# failed one is logged and retried at the next launch. Run dirs: <runs>/multirun/l2r_ablation/<loss>-s<seed>,
# <runs>/multirun/l2r_budget/<loss>-x<budget>-s<seed>, <runs>/multirun/l2r_layers/<loss>-L<layers>-s<seed> and
# <runs>/multirun/l2r_sweep_<name>/<key><value>-s<seed>; each run's output goes to
# <runs>/queue_logs/<experiment>-<run>.log. One queue at a time (<runs>/.ablation_queue.lock).
# WORKERS=2 runs two jobs side by side, each taking the next run no other worker holds (a lock per run); with
# THREADS=1 (torch threads per job, default 2) that is ~15% more trainings per hour on 2 cores than one job on 2.
# Usage, from anywhere, relaunching the same command after a stop:
#   BLOCKDRAFT_RUNS=<runs> BLOCKDRAFT_CACHE=<cache> PYTHON=.venv/bin/python [WORKERS=2 THREADS=1] \
#     nohup bash experiments/ablation_queue.sh > <runs>/queue.log 2>&1 &
# After each training the drafter is evaluated into <run>/eval (T=0 replayed; TEMPERATURES='[0.0,1.0]' adds T=1 for
# every run, the ablation's get it in their own pass). The baselines (untrained drafters, K=BASELINE_K, default 2 as
# the main job chose) go to <runs>/baselines/<name>: prompt_lookup, and ar_assistant when ASSISTANT=<the main job's
# <run>/assistant/export> is given.
# QUEUE=long runs the long-budget ablation instead (experiment=ablation_long: 6 losses x 2 seeds, 10K steps each on
# all the recorded answers, then dpace and soft_all), each drafter evaluated at T=0 and T=1 as a chain of CHAIN_W and a
# tree of TREE_N nodes (long_evaluate below); report: python -m experiments.ablation_report --runs <runs> --long.
# Every report, from whatever runs exist: python -m experiments.ablation_report --runs <runs>
# Stop it with `kill $(cat <runs>/.ablation_queue.pid)`: every worker and the jobs under way stop too. NICE (default 19) is the jobs' niceness;
# extra arguments go to every training (e.g. train.val_every=700).
set -uo pipefail
# Its own process group, so that stopping it stops every worker's job.
[[ "$(ps -o pgid= $$ | tr -d ' ')" == "$$" ]] || exec setsid bash "$0" "$@"
cd "$(dirname "$0")/.."
py="${PYTHON:-python}"
runs="${BLOCKDRAFT_RUNS:-runs}"
export PYTHONPATH=. HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
export BLOCKDRAFT_RUNS="$runs"
mkdir -p "$runs/queue_logs"
exec 9>"$runs/.ablation_queue.lock"
flock -n 9 || { echo "[queue] another queue holds $runs/.ablation_queue.lock: not starting"; exit 1; }
echo $$ > "$runs/.ablation_queue.pid"
LOSSES=(uniform decay focal chain decay_focal l2r_all dpace soft_all)

train() {  # train EXPERIMENT RUN_SUBDIR OVERRIDES...: one training unless it finished; its log per run
  local experiment=$1 run=$2; shift 2
  local dir="$runs/multirun/$experiment/$run" log="$runs/queue_logs/$experiment-$run.log"
  [[ -s "$dir/train_summary.json" ]] && return 0
  local start=$SECONDS
  echo "[queue $worker] $(date -u +%FT%TZ) $experiment/$run: training (log $log)"
  nice -n "${NICE:-19}" "$py" -m experiments.train "experiment=$experiment" launch=run "num_threads=$threads" "$@" \
    "${EXTRA[@]}" >>"$log" 2>&1
  echo "[queue $worker] $(date -u +%FT%TZ) $experiment/$run: rc $? in $((SECONDS - start)) s"
}

evaluated() {  # evaluated RESULTS_JSON [KEY=VALUE...]: it holds every suite at every temperature asked for, and its
  # drafter's config has each KEY (dotted: tree_policy.budget) at VALUE; a differing one is named (then decode, given
  # redo_if_changed, moves the old results aside and evaluates again)
  python3 - "$@" "${TEMPERATURES:-[0.0]}" <<'PY'
import json, sys
path, *settings, temperatures = sys.argv[1:]
try:
    doc = json.load(open(path))
except (OSError, ValueError):
    sys.exit(1)
want = {f"t{float(t):g}" for t in json.loads(temperatures)}  # experiments.pipeline.records' keys
for key, value in (s.split("=", 1) for s in settings):
    found = doc.get("drafter", {}).get("config", {})
    for part in key.split("."):
        found = found.get(part) if isinstance(found, dict) else None
    if str(found) != value:
        print(f"[queue] {path}: its drafter's {key} is {found}, this queue asks {value}: evaluating again", flush=True)
        sys.exit(1)
results = doc.get("results") or {}
sys.exit(0 if len(results) == 3 and all(want <= set(r) for r in results.values()) else 1)
PY
}

decode() {  # decode OUT_DIR LOG OVERRIDES...: a drafter on the main job's suites (conf/main.yaml's
  # evaluate_overrides) into OUT_DIR: T=0 replayed from the target's greedy answers (about a minute), and T=1 decoded
  # when TEMPERATURES='[0.0,1.0]' (minutes). A finished (suite, temperature) is skipped on relaunch.
  local out=$1 log=$2; shift 2
  nice -n "${NICE:-19}" "$py" -m experiments.evaluate target=smollm2 "$@" progress=false \
    batch_size=8 measure_target_only=false "num_threads=$threads" replay_greedy=true \
    "temperatures=${TEMPERATURES:-[0.0]}" suite.humaneval.limit=16 suite.gsm_symbolic.limit=16 \
    suite.mtbench.limit=8 +redo_if_changed=true "hydra.run.dir=$out" >>"$log" 2>&1 \
    || echo "[queue $worker] $out: evaluation failed (rc $?), see $log"
}

evaluate() {  # evaluate EXPERIMENT RUN_SUBDIR: the trained drafter into <run>/eval
  local dir="$runs/multirun/$1/$2"
  [[ -f "$dir/train_summary.json" ]] || return 0
  evaluated "$dir/eval/results.json" && return 0
  decode "$dir/eval" "$runs/queue_logs/$1-$2.log" "drafter.path=$dir/drafter" ${EVAL_NAME:+"drafter.name=$EVAL_NAME"}
}

baseline() {  # baseline NAME OVERRIDES...: the untrained drafter=NAME at T=0 and T=1 into <runs>/baselines/NAME
  local name=$1; shift
  ( flock -n 8 || exit 0
    export TEMPERATURES='[0.0,1.0]'
    evaluated "$runs/baselines/$name/results.json" "num_draft_tokens=${BASELINE_K:-2}" && exit 0
    decode "$runs/baselines/$name" "$runs/queue_logs/baseline-$name.log" "drafter=$name" \
      "drafter.num_draft_tokens=${BASELINE_K:-2}" "$@" ) 8>"$runs/queue_logs/.baseline-$name.lock"
}

job() {  # job EXPERIMENT RUN_SUBDIR OVERRIDES...: train, then evaluate, unless another worker holds the run
  ( flock -n 8 || exit 0
    train "$@"; evaluate "$1" "$2" ) 8>"$runs/queue_logs/.$1-$2.lock"
}
ablation() { for loss in "${LOSSES[@]}"; do job l2r_ablation "$loss-s$1" "loss=$loss" "seed=$1"; done; }
budget() { job l2r_budget "$1-x$2-s0" "loss=$1" "budget=$2" seed=0; }
layers() { job l2r_layers "$1-L$2-s0" "loss=$1" "layers=$2" seed=0; }
sweep() {  # sweep NAME KEY SEED VALUES...: experiment=l2r_sweep_NAME, run dirs <key><value>-s<seed>, rows named so
  local name=$1 key=$2 seed=$3; shift 3
  for value in "$@"; do EVAL_NAME="$key$value" job "l2r_sweep_$name" "$key$value-s$seed" "loss.$key=$value" "seed=$seed"
  done
}

LONG_VOCAB=(drafter.draft_vocab_size=4096 'drafter.draft_vocab_from=${asset:sharegpt_answers}')  # the main job's candidates

long_evaluate() {  # long_evaluate RUN_SUBDIR: an ablation_long drafter as a chain of CHAIN_W (default 3, the main
  # job's W) and as a best-first tree of TREE_N nodes (default 4, the main job's N) over the 4,096 most frequent answer
  # tokens, at T=0 (replayed) and T=1 into <run>/eval and <run>/eval_tree; its 5K-step snapshot at T=0 into
  # <run>/eval_5k and <run>/eval_tree_5k
  local dir="$runs/multirun/ablation_long/$1" log="$runs/queue_logs/ablation_long-$1.log"
  [[ -f "$dir/train_summary.json" ]] || return 0
  local both='[0.0,1.0]' name
  name=$(sed 's/-s[0-9]*$//' <<<"$1")
  for at in "" _5k; do
    local path="$dir/drafter" temps="$both"
    [[ -z "$at" ]] || { path="$dir/snapshots/step-5000"; temps='[0.0]'; }
    [[ -d "$path" ]] || continue
    TEMPERATURES="$temps" evaluated "$dir/eval$at/results.json" "max_draft_tokens=${CHAIN_W:-3}" \
      || TEMPERATURES="$temps" decode "$dir/eval$at" "$log" \
      "drafter.path=$path" "drafter.name=$name" "drafter.max_draft_tokens=${CHAIN_W:-3}" "${LONG_VOCAB[@]}"
    TEMPERATURES="$temps" evaluated "$dir/eval_tree$at/results.json" "tree_policy.budget=${TREE_N:-4}" \
      || TEMPERATURES="$temps" decode "$dir/eval_tree$at" \
      "$log" drafter=tree "drafter.path=$path" "drafter.name=${name}_tree" "drafter.budget=${TREE_N:-4}" "${LONG_VOCAB[@]}"
  done
}

long_job() {  # long_job LOSS SEED: one ablation_long run, trained then evaluated, unless another worker holds it
  ( flock -n 8 || exit 0
    train ablation_long "$1-s$2" "loss=$1" "seed=$2"; long_evaluate "$1-s$2" ) 8>"$runs/queue_logs/.ablation_long-$1-s$2.lock"
}

precision_job() {  # precision_job PRECISION SEED: l2r_all for 5K steps in trainer.precision=PRECISION (32, bf16-mixed),
  # the same initialisation and data order in each, into ablation_long/precision-<PRECISION>-s<SEED>; T=0 as a chain
  local run="precision-$1-s$2" dir="$runs/multirun/ablation_long/precision-$1-s$2"
  ( flock -n 8 || exit 0
    train ablation_long "$run" loss=l2r_all "seed=$2" "trainer.precision=$1" train.max_steps=5000 \
      "train.snapshot_steps=[]" "hydra.sweep.subdir=$run" "name=ablation_long-$run"
    [[ -f "$dir/train_summary.json" ]] || exit 0
    TEMPERATURES='[0.0]' evaluated "$dir/eval/results.json" "max_draft_tokens=${CHAIN_W:-3}" \
      || TEMPERATURES='[0.0]' decode "$dir/eval" \
      "$runs/queue_logs/ablation_long-$run.log" "drafter.path=$dir/drafter" "drafter.name=l2r_all_$1" \
      "drafter.max_draft_tokens=${CHAIN_W:-3}" "${LONG_VOCAB[@]}"
  ) 8>"$runs/queue_logs/.ablation_long-$run.lock"
}

long_queue() {  # QUEUE=long: the paper's ablation at the long budget (issue 75), the pair with the earliest answer first,
  # then bfloat16's quality check (float32 against bfloat16, 5K steps, 2 seeds) where the CPU has bfloat16
  long_job uniform 0; long_job l2r_all 0
  local auto
  if ! auto=$("$py" -c "from experiments.pipeline.trainer import resolve_precision as r; print(r('auto'))" 2>&1 | tail -1); then
    echo "[queue $worker] the precision probe failed, so no bfloat16 quality check: $auto"
  elif [[ "$auto" != bf16-mixed ]]; then
    echo "[queue $worker] trainer.precision=auto is $auto on this CPU: no bfloat16 quality check"
  else for seed in 0 1; do precision_job 32 "$seed"; precision_job bf16-mixed "$seed"; done; fi
  # the single terms and their baseline at both seeds first (5 configurations x 2 seeds answer the issue, with the
  # composition ratio), then the composition decay_focal, then dpace and soft_all
  for seed in 0 1; do
    for loss in uniform l2r_all decay focal chain; do long_job "$loss" "$seed"; done
  done
  for seed in 0 1; do long_job decay_focal "$seed"; done
  for seed in 0 1; do for loss in dpace soft_all; do long_job "$loss" "$seed"; done; done
}

queue() {  # one worker's pass over the whole order
  budget l2r_all 2; layers l2r_all 2
  budget uniform 2; layers uniform 2
  ablation 0
  ablation 1
  budget decay 2
  ablation 2
  budget uniform 4; budget decay 4; budget l2r_all 4
  for seed in 0 1 2; do TEMPERATURES='[0.0,1.0]' ablation "$seed"; done  # T=1 too (online, ~5 min per drafter)
  baseline prompt_lookup; [[ -z "${ASSISTANT:-}" ]] || baseline ar_assistant "drafter.path=$ASSISTANT"
  for seed in 0 1; do sweep gamma gamma "$seed" 0.5 7; sweep focal focal_gamma "$seed" 0 4
                      sweep chain chain_weight "$seed" 10 160; done
}

EXTRA=("$@")
threads="${THREADS:-2}"
# Stopping the queue stops every worker and the jobs under way (they resume from last.ckpt at the next launch).
trap 'trap - TERM INT; echo "[queue] stopped"; kill -- -$$ 2>/dev/null; exit 143' TERM INT
for worker in $(seq 1 "${WORKERS:-1}"); do
  if [[ "${QUEUE:-short}" == long ]]; then long_queue & else queue & fi
  sleep 5  # the first worker takes the first run
done
wait
echo "[queue] $(date -u +%FT%TZ) done"
