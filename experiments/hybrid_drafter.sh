#!/usr/bin/env bash
# Issue 74, item 6: a drafter for the hybrid. The hybrid drafts by prompt lookup wherever the row's last m tokens
# recur, so its trained drafter only drafts elsewhere. Two continuations of the shipped l2r_all_long, the same in all
# but one setting (same data order, anchors' seed, schedule: STEPS at a peak of LR), on all the recorded answers
# (experiment=ablation_long's data, so its feature cache):
#   plain     module.lookup_anchor_weight=1       every anchor alike
#   weighted  module.lookup_anchor_weight=WEIGHT  anchors the hybrid serves by lookup (m = 2) drawn WEIGHT as often
# then both, and the shipped drafter, replayed on the held-out answers (experiments.pipeline.choose_k on 128 rows:
# the best-first tree of N = 4 and the hybrid N = 4, m = 2, K = 10, session 75's choice) into <runs>/choose.json, and
# <runs>/summary.json without machine paths (committed as experiments/results/tree_hybrid/hybrid_drafter.json).
# Resumable: run it again. Usage, from the repository root:
#   RUNS=<dir> [STEPS=2000 LR=1e-4 WEIGHT=0.1 PYTHON=.venv/bin/python] bash experiments/hybrid_drafter.sh
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python}" runs="${RUNS:?RUNS=<a folder for the two runs>}"
export BLOCKDRAFT_RUNS="$runs" PYTHONPATH=. HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
mkdir -p "$runs"
for run in plain weighted; do
  weight=1.0; [[ $run == weighted ]] && weight="${WEIGHT:-0.1}"
  [[ -f "$runs/$run/train_summary.json" ]] && continue
  echo "[hybrid_drafter] $(date -u +%FT%TZ) $run: training (module.lookup_anchor_weight=$weight)"
  "$py" -m experiments.train experiment=ablation_long launch=run loss=l2r_all loss.gamma=1.0 seed=0 \
    "name=hybrid_drafter-$run" "hydra.run.dir=$runs/$run" 'drafter.init_from=${asset:l2r_all_long}' \
    "train.max_steps=${STEPS:-2000}" "train.val_every=${STEPS:-2000}" 'train.snapshot_steps=[]' \
    "optimizer.lr=${LR:-1e-4}" "module.lookup_anchor_weight=$weight" module.lookup_min_match=2 \
    evaluate.enabled=false >>"$runs/$run.log" 2>&1
done
data_dir=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["data_dir"])' "$runs/plain/train_summary.json")
[[ -f "$runs/choose.json" ]] || "$py" -m experiments.pipeline.choose_k --data-dir "$data_dir" \
  --target "$("$py" -m experiments.data.smollm2)" \
  --ks 5 --weight-layouts onednn_packed --rows 128 --tree-budgets 4 --hybrid-matches 2 --hybrid-depths 10 \
  --tree-vocab-size 4096 --draft-vocab-from experiments/assets/sharegpt_answers \
  --tree shipped=experiments/assets/l2r_all_long --tree "plain=$runs/plain/drafter" \
  --tree "weighted=$runs/weighted/drafter" --out "$runs/choose.json"
"$py" - "$runs" <<'PY'  # <runs>/summary.json: τ per drafter and setting, the runs' held-out metrics, paths portable
import json, sys
from pathlib import Path
from experiments.pipeline.records import portable_argument  # paths as committed records write them

runs = Path(sys.argv[1])
choose = json.loads((runs / "choose.json").read_text())
summary = {"rows": choose["rows"], "machine": choose["machine"], "config": choose["config"],
           "tau": {name: {s: r["tau"] for s, r in result["by_setting"].items()} for name, result in choose["tree"].items()},
           "by_setting": {name: result["by_setting"] for name, result in choose["tree"].items()},
           "training": {run: {k: v for k, v in json.loads((runs / run / "train_summary.json").read_text()).items()
                              if k in ("steps", "train_seconds", "val", "overrides", "precision")}
                        for run in ("plain", "weighted")}}
(runs / "summary.json").write_text(json.dumps(portable_argument(summary), indent=1) + "\n")
for name, taus in summary["tau"].items():
    print(name, taus)
PY
