#!/usr/bin/env bash
# One call on the GPU machine: versions, CUDA tests, gpu zoo build, demo on CUDA.
# Everything it learns is written under $OUT (the device tool brings that folder back).
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/versions.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python3 -m pytest -q -m cuda -p no:cacheprovider 2>&1 | tail -5 | tee "$OUT/cuda_tests.log"
fi
export SPECDEC_ZOO_DIR=/tmp/zoo
timeout "${BUILD_TIMEOUT:-480}" python3 -m specdec zoo build --preset gpu --device cuda 2>&1 | tr '\r' '\n' | grep -v -E "Writing model|Loading weights" | awk 'NR%40==1 || !/it\/s/' | tee "$OUT/zoo_build.log"
cp /tmp/zoo/gpu/manifest.json "$OUT/zoo_gpu_manifest.json" 2>/dev/null
python3 -m specdec demo --preset gpu --device cuda --json "$OUT/demo_gpu.json" 2>&1 | grep -v -i "warn\|Loading weights" | tee "$OUT/demo_gpu.log"
