#!/usr/bin/env bash
# The GPU-only paths in one short run (under 8 minutes on one GPU), for a machine with CUDA; never CI:
#   1. training: `experiment=qwen3_gpu` (bf16-mixed, block 16, 5 drafter layers) for a few optimizer steps,
#      with a tiny random Qwen3 (and its own small tokenizer) standing in for Qwen3-8B;
#   2. `experiments.bench.scale --device cuda --dtype bfloat16` (a Qwen3-0.6B-shaped target, random weights);
#   3. the serving check on that tiny target and the drafter of step 1, when the vLLM environment
#      ($BLOCKDRAFT_VLLM_ENV, default .venv-vllm) has a CUDA build of vLLM; skipped otherwise.
# Writes one JSON (default gpu_check/gpu_check.json): per step its exit code, seconds and what it wrote.
# Usage: bash experiments/gpu_check.sh [OUT_DIR]      (run from anywhere; needs .venv, README's install)
set -uo pipefail
cd "$(dirname "$0")/.."
out="$(realpath -m "${1:-gpu_check}")"
mkdir -p "$out"
py=.venv/bin/python
export PYTHONPATH=. HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
export BLOCKDRAFT_RUNS="$out/runs" BLOCKDRAFT_CACHE="$out/cache"
vllm_env="${BLOCKDRAFT_VLLM_ENV:-.venv-vllm}"

step() {  # step NAME LIMIT_S COMMAND...: run it with a time limit, record rc and seconds in $out/NAME.step
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  printf '{"rc": %d, "seconds": %d, "limit_s": %d}\n' "$rc" $((SECONDS - start)) "$limit" >"$out/$name.step"
  echo "[gpu_check] $name: rc $rc in $((SECONDS - start)) s (log $out/$name.log)"
}

"$py" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))" \
  >"$out/device.txt" 2>&1 || { cat "$out/device.txt"; echo "[gpu_check] needs a CUDA GPU"; exit 1; }

"$py" - "$out/target" <<'EOF'
import sys
sys.path.insert(0, "tests")
from test_train import save_target  # a random Qwen3 with a small BPE tokenizer and chat template
save_target(sys.argv[1], hidden=64, arch="qwen3")
EOF

step train 240 "$py" -m experiments.train experiment=qwen3_gpu target.path="$out/target" trainer.devices=1 \
  suite=[humaneval,gsm_symbolic] data.generation.prompts.per_source=4 data.generation.max_new_tokens=32 \
  data.generation.max_prompt_tokens=256 data.datamodule.batch_size=4 data.datamodule.max_length=192 \
  data.datamodule.val_fraction=0.25 data.datamodule.max_val_samples=2 module.num_anchors=16 \
  train.max_steps=20 train.val_every=20 train.checkpoint_every=20 scheduler.warmup_steps=2 \
  drafter.target_layer_ids=[1] name=gpu_check

step scale 150 "$py" -m experiments.bench.scale --device cuda --dtype bfloat16 --seq-len 1024 \
  --out "$out/bench_scale.json"

if "$vllm_env/bin/python" -c "import torch, vllm; assert torch.cuda.is_available()" >/dev/null 2>&1; then
  step serve 180 "$py" -m experiments.serve_check target=hf target.path="$out/target" \
    drafter.path="$out/runs/train/gpu_check/drafter" suite=[humaneval] suite.humaneval.limit=4 \
    max_new_tokens=32 vllm.dtype=bfloat16 hydra.run.dir="$out/serve_check"
else
  echo '{"skipped": "no CUDA build of vLLM in the vLLM environment"}' >"$out/serve.step"
fi

"$py" - "$out" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
doc = {"device": (out / "device.txt").read_text().strip(), "steps": {}}
for name in ("train", "scale", "serve"):
    step = out / f"{name}.step"
    doc["steps"][name] = json.loads(step.read_text()) if step.is_file() else {"skipped": "not run"}
summary = out / "runs" / "train" / "gpu_check" / "train_summary.json"
extras = {"train": summary, "scale": out / "bench_scale.json", "serve": out / "serve_check" / "serve_check.json"}
for name, path in extras.items():
    if path.is_file():
        doc["steps"][name]["result"] = json.loads(path.read_text())
(out / "gpu_check.json").write_text(json.dumps(doc, indent=2) + "\n")
print(f"[gpu_check] wrote {out / 'gpu_check.json'}")
EOF
