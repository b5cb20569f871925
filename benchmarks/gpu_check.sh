#!/usr/bin/env bash
# The GPU checks, in one run of at most 8 minutes, for when a GPU machine is lent (the `device` tool).
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]            # on the GPU machine, from the repository root
#   DEVICE=cpu QUICK=1 bash benchmarks/gpu_check.sh   # the same steps on the CPU, tiny model (a smoke test)
#
# 1. the edge table on CUDA: PyTorch fp32 and fp16 autocast, ONNX Runtime CUDA fp32/fp16, TensorRT fp16
#    (python -m benchmarks --only edge --device cuda --model ViT-B-16)
# 2. the edge LoRA step's peak GPU memory at batch 8 and 32, with and without activation checkpointing
#    (goal: <= 2 GB on ViT-B-16 with checkpointing at batch 32)
# 3. `edge-client train --batch-size auto --max-memory-gb 1` on a ViT-B-16 bundle: the batch it picks
# 4. one federated demo round on CUDA (`fedmvp train --config demo --rounds 1 --device cuda`)
# Every step has its own time limit and the script goes on when one fails; each step's output is kept in
# OUT_DIR (default $OUT, else gpu-check-<time>): results.json/results.md of the suite, autofit.json,
# demo-round.json, and log.txt. Never guess a GPU number: only what this script printed goes in docs/benchmarks.md.
set -u
DEVICE="${DEVICE:-cuda}"
QUICK="${QUICK:-0}"
MODEL="${MODEL:-ViT-B-16}"
DEST="${1:-${OUT:-gpu-check-$(date +%Y%m%d-%H%M%S)}}"
mkdir -p "$DEST"
LOG="$DEST/log.txt"
: > "$LOG"
PY="${PYTHON:-python3}"
QUICK_FLAG=()
if [ "$QUICK" = "1" ]; then QUICK_FLAG=(--quick); MODEL="fedmvp-tiny"; fi
START=$(date +%s)
FAILED=0

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log it, never stop the script
  local name="$1" limit="$2"; shift 2
  echo "== $name (limit ${limit}s, $(( $(date +%s) - START ))s elapsed)" | tee -a "$LOG"
  timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "== $name: exit $rc" | tee -a "$LOG"
  [ "$rc" -eq 0 ] || FAILED=$((FAILED + 1))
}

{
  echo "machine: $(uname -a)"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$PY" -c "import torch, onnxruntime as o; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), \
'| onnxruntime', o.__version__, o.get_available_providers())"
} 2>&1 | tee -a "$LOG"

# 1 + 2: the suite's edge and train sections on the device (one results.json, markdown and plots)
step "edge + train sections on $DEVICE" 300 "$PY" -m benchmarks "${QUICK_FLAG[@]}" --only edge,train \
  --device "$DEVICE" --model "$MODEL" --repeats "${REPEATS:-3}" --out "$DEST/suite"

# 3: --batch-size auto under a 1 GB budget, on a bundle of the model (random init) and a small local folder
step "edge-client train --batch-size auto --max-memory-gb 1" 80 "$PY" - "$DEST" "$MODEL" "$DEVICE" <<'PY'
import json, subprocess, sys, tempfile
from pathlib import Path
dest, model, device = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
from benchmarks.edge_models import class_set, random_bundle, write_image_folder
with tempfile.TemporaryDirectory() as tmp:
    tmp = Path(tmp)
    bundle = random_bundle(tmp, model, 4, 3)
    write_image_folder(tmp / "local", class_set(4, 3).names, 64, size=(256, 256))
    cmd = ["edge-client", "train", "--bundle", str(bundle), "--data", str(tmp / "local"), "--epochs", "1",
           "--batch-size", "auto", "--max-memory-gb", "1", "--device", device, "--out", str(tmp / "update"), "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    print(done.stderr[-2000:])
    result = json.loads(done.stdout) if done.returncode == 0 else {"exit": done.returncode}
    (dest / "autofit.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    sys.exit(done.returncode)
PY

# 4: one federated demo round on the device (Flower simulation engine)
step "one demo round on $DEVICE" 80 "$PY" -m fedmvp_apps.cli train --config demo --rounds 1 --device "$DEVICE" \
  --run-dir "$DEST/demo-run" --json
[ -f "$DEST/demo-run/metrics.jsonl" ] && cp "$DEST/demo-run/metrics.jsonl" "$DEST/demo-round.jsonl"
rm -rf "$DEST/demo-run"

echo "gpu_check: $FAILED step(s) failed, $(( $(date +%s) - START ))s in all; results in $DEST" | tee -a "$LOG"
[ -f "$DEST/suite/results.md" ] && cat "$DEST/suite/results.md"
exit $(( FAILED > 0 ))
