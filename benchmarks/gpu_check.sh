#!/usr/bin/env bash
# Issue 33's GPU measurements in one call, for a machine with one CUDA GPU (H100 or H200) and torch, but not
# medfed's other dependencies: run from the repository root with the wheels of the team's tools/device-wheels.sh (carried as .whl/)
# in .whl/ (carried), in two calls of under ten minutes each (a device call's limit):
#     bash benchmarks/gpu_check.sh throughput      (parts 1; about 6 minutes on an H100, most of it compilation)
#     bash benchmarks/gpu_check.sh rest            (parts 2-5; about 7 minutes)
# (no argument: both). OUT: where the results go (default a temporary folder). Extends the team's tools/gpu-check.sh.
# Every part is time-boxed and appends to at most six files under $OUT: parts.txt (one line per part: exit status,
# seconds), throughput.txt, profile.txt, main.txt, grid.txt and tests.txt. The parts, most important first:
#   1. throughput, U-Net 64 x 64, batch 16 a site, N = 5 20 50: sequential, batched, batched compiled (CUDA graphs),
#      central eager, central compiled (CUDA graphs) in one process: the table and its ratios; DenseNet eager;
#   2. the step profile at N = 5: kernels per step, GPU busy time, dispatch against compute, per executor; a stacked
#      convolution vmapped against grouped (HFTA) and in turn;
#   3. the main job (brats_lack0) on cuda, cold and warm, eager batched and compiled: timing splits from results.json;
#   4. benchmarks/grid_speed.py --quick on cuda (fused, compiled: --compare-args);
#   5. the GPU tests of the compiled step and a dense strategy.
set -u
OUT=${OUT:-$(mktemp -d)}; mkdir -p "$OUT"
SITE=$(mktemp -d)  # the wheels' packages, for this check only
RUNS=$(mktemp -d)  # the main job's run folders
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    || { echo "wheels did not install" | tee -a "$OUT/parts.txt"; exit 1; }
fi
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 WANDB_MODE=disabled MPLBACKEND=Agg
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$OUT/parts.txt" 2>&1
part() { local name=$1 file=$2 limit=$3; shift 3; local s=$SECONDS
  echo "===== $name: $*" >> "$OUT/$file"; timeout "$limit" "$@" >> "$OUT/$file" 2>&1; local rc=$?
  echo "$name rc=$rc $((SECONDS - s)) s" | tee -a "$OUT/parts.txt"; }
splits() { for r in "$@"; do python3 -c "import json,sys; d=json.load(open(sys.argv[1])); t=d['timing']; print(sys.argv[2], d['executor'], {k: round(v, 2) for k, v in t.items() if isinstance(v, (int, float))})" $RUNS/$r/results.json $r >> "$OUT/main.txt" 2>&1; done; }

WHICH=${1:-all}
if [ "$WHICH" = throughput ] || [ "$WHICH" = all ]; then
  part throughput_unet throughput.txt 300 python3 benchmarks/throughput.py --devices cuda --models unet --sites 5 20 50 --min-seconds 0.5
  part throughput_densenet throughput.txt 60 python3 benchmarks/throughput.py --devices cuda --models densenet --sites 5 20 50 --columns sequential batched central --min-seconds 0.5
fi
if [ "$WHICH" = rest ] || [ "$WHICH" = all ]; then
  part profile profile.txt 120 python3 benchmarks/step_profile.py --device cuda --model unet --sites 5
  part stacked_conv profile.txt 30 python3 benchmarks/stacked_conv.py --device cuda --side 64
  main=(python3 -m medfed fit --config configs/brats_lack0.yaml --quiet trainer.device=cuda logger.wandb=disabled)
  part main_cold main.txt 80 "${main[@]}" output_dir=$RUNS/cold
  part main_warm main.txt 50 "${main[@]}" output_dir=$RUNS/warm
  part main_compiled main.txt 100 "${main[@]}" trainer.executor=batched trainer.compile=true output_dir=$RUNS/compiled
  splits cold warm compiled
  part grid_quick grid.txt 90 python3 benchmarks/grid_speed.py --quick --device cuda
  part gpu_tests tests.txt 60 python3 -m pytest -q -m gpu tests/test_gpu.py -k "compiled or (dense and fedavg)" -p no:cacheprovider
fi
cat "$OUT/parts.txt"
