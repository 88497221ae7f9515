#!/usr/bin/env bash
# The GPU checks of issue 5 in one go, for a session that has a GPU machine:
#   bash scripts/device_check.sh            (logs into $OUT, else ./device_check_out)
# Installs wheels carried in wheels/ (the machine reaches no package registry), then runs
# what is installed: nvidia-smi, the CUDA tests (pytest -m cuda) and benchmarks/bench_cuda.py.
set -uo pipefail
OUT="${OUT:-device_check_out}"
mkdir -p "$OUT"
exec > >(tee "$OUT/device_check.log") 2>&1

echo "== machine"; date -u; nvidia-smi || true
if compgen -G "wheels/*.whl" > /dev/null; then
    echo "== installing carried wheels"
    python -m pip install --no-index --find-links wheels wheels/*.whl
fi
python -m pip install --no-deps --no-build-isolation -e . > "$OUT/pip_install.log" 2>&1 \
    || echo "editable install failed (see pip_install.log); using PYTHONPATH"
export PYTHONPATH="$PWD/client:$PWD/server${PYTHONPATH:+:$PYTHONPATH}"
echo "== what is missing"
python - <<'PY'
import importlib.util
for name in ("cupy", "torch", "grpc", "google.protobuf", "numpy", "ml_dtypes", "pytest",
             "hypothesis", "grpc_health", "grpc_reflection"):
    print(f"{name:16} {'ok' if importlib.util.find_spec(name) else 'MISSING'}")
import cupy
print("cupy", cupy.__version__, "devices:", cupy.cuda.runtime.getDeviceCount())
PY
echo "== CUDA IPC: two processes share a Storage through torch.from_dlpack"
timeout 120 python -m pytest -m cuda -v -p no:cacheprovider \
    -W "ignore::UserWarning:cupy" -W "ignore::FutureWarning:cupy" \
    tests/test_cuda.py -k from_dlpack 2>&1 | tee "$OUT/pytest_cuda_ipc.log"
echo "pytest exit: ${PIPESTATUS[0]}"
echo "== pytest -m cuda"
# pytest turns warnings into errors: CuPy's own import-time warnings are not ours to fail on
timeout 420 python -m pytest -m cuda -v -p no:cacheprovider \
    -W "ignore::UserWarning:cupy" -W "ignore::FutureWarning:cupy" \
    tests/test_cuda.py 2>&1 | tee "$OUT/pytest_cuda.log"
echo "pytest exit: ${PIPESTATUS[0]}"
echo "== the CUDA unit tests (fake CuPy) with the real one installed"
timeout 120 python -m pytest -q -p no:cacheprovider tests/test_cuda_units.py 2>&1 | tee "$OUT/pytest_cuda_units.log"
echo "pytest exit: ${PIPESTATUS[0]}"
echo "== benchmarks/bench_cuda.py"
timeout 240 python benchmarks/bench_cuda.py --repeats 5 2>&1 | tee "$OUT/bench_cuda.log"
echo "bench exit: ${PIPESTATUS[0]}"
