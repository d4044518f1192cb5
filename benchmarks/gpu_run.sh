#!/usr/bin/env bash
# One run on a GPU machine whose Python already has a CUDA torch, triton and transformers but no package registry:
# install the project and the cuda plugin without touching that torch (the other dependencies come as wheels in
# .whl/, made beforehand where a registry answers: `pip wheel --no-deps -w .whl hydra-core omegaconf
# antlr4-python3-runtime==4.9.3 pluggy setuptools`, and carried with the tree), run the GPU tests,
# `kunlun-infer doctor`, and benchmarks/perf_gpu.py. Everything lands in $OUT. Seconds for each part come from the
# environment (0 leaves that part out):
#
#   OUT=/tmp/gpu-out TESTS_S=150 DOCTOR_S=90 BENCH_S=300 bash benchmarks/gpu_run.sh [perf_gpu.py arguments...]
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
log() { echo "== $(date +%T) $*"; }

log install
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . -e ./hooks/kunlun-infer-cuda 2>&1 | tail -3
python3 - <<'PY' 2>&1 | tee "$OUT/stack.txt"
import torch, triton, transformers, kunlun_infer, kunlun_infer_cuda
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__,
      "transformers", transformers.__version__, "gpu", torch.cuda.get_device_name(0))
PY
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee -a "$OUT/stack.txt"

if [ "${TESTS_S:-150}" != 0 ]; then
log "GPU tests: the plugin on the GPU, its conformance suite, its Triton kernels compiled"
T=hooks/kunlun-infer-cuda/tests
timeout "${TESTS_S:-150}" bash -c "python3 -m pytest -q -p no:cacheprovider $T/test_cuda_gpu.py \
  $T/test_cuda_conformance.py --junitxml='$OUT/junit.xml'; echo \"pytest exit \$?\"; \
  python3 -m pytest -q -p no:cacheprovider $T/test_cuda_triton.py -k gpu- --junitxml='$OUT/junit_triton.xml'; \
  echo \"pytest exit \$?\"" > "$OUT/tests.txt" 2>&1
echo "tests exit $?"; grep -E "passed|failed|error|exit" "$OUT/tests.txt" | tail -8; grep -E "^(FAILED|ERROR)" "$OUT/tests.txt" | head -20
fi

if [ "${DOCTOR_S:-90}" != 0 ]; then
log doctor
timeout "${DOCTOR_S:-90}" python3 -m kunlun_infer doctor device=cuda memory=cuda ops=cuda streams=cuda comm=nccl \
  --json > "$OUT/doctor.json" 2> "$OUT/doctor.err"
echo "doctor exit $?"; python3 -c "
import json, sys
r = json.load(open(sys.argv[1]))
print('ok', r.get('ok'), [(s['number'], s['status'], round(s.get('seconds') or 0, 1)) for s in r.get('stages', [])])
" "$OUT/doctor.json" 2>&1 | tail -3; grep -v "^$" "$OUT/doctor.err" | tail -4
fi

log benchmark
timeout "${BENCH_S:-300}" python3 benchmarks/perf_gpu.py --out "$OUT/perf_gpu.json" "$@" 2>&1 \
  | grep -v -E "Warning|warn\(|Loading weights|Writing model|tokenizer.json" | tee "$OUT/bench.txt"
log done
