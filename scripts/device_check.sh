#!/usr/bin/env bash
# The GPU checks (CUDA IPC, the cuda tests, bench_cuda, a load test) in one go, on a GPU machine:
#   bash scripts/device_check.sh            (logs into $OUT, else ./device_check_out)
# The machine reaches no package registry: wheels for what its image lacks (grpcio and
# protobuf of the versions the generated code needs, grpcio-health-checking/-reflection,
# Locust and its needs) travel in .whl/ (git-ignored) and are installed into /tmp/site.
# Runs, each under its own timeout so one hang cannot eat the rest: the CUDA IPC test,
# pytest -m cuda, the CUDA unit tests with the real CuPy, benchmarks/bench_cuda.py and a
# short load test on cuda:0.
set -uo pipefail
OUT="${OUT:-device_check_out}"
mkdir -p "$OUT"
exec > >(tee "$OUT/device_check.log") 2>&1
PY=python3

echo "== machine"; date -u; nvidia-smi || true
if compgen -G ".whl/*.whl" > /dev/null; then
    echo "== installing carried wheels into /tmp/site"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || echo "wheel install failed"
    export PYTHONPATH="/tmp/site"
fi
export PYTHONPATH="$PWD/client:$PWD/server${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
echo "== versions"
$PY - <<'PY'
import importlib.util
for name in ("cupy", "torch", "grpc", "google.protobuf", "numpy", "ml_dtypes", "pytest",
             "hypothesis", "grpc_health", "grpc_reflection", "locust", "anyio"):
    print(f"{name:16} {'ok' if importlib.util.find_spec(name) else 'MISSING'}")
import cupy, grpc, google.protobuf, torch
print("cupy", cupy.__version__, "devices:", cupy.cuda.runtime.getDeviceCount(),
      "grpc", grpc.__version__, "protobuf", google.protobuf.__version__, "torch", torch.__version__)
import tensord, tensord_server
print("tensord imports from", tensord.__file__)
tiny = cupy.asarray([1e-40], dtype=cupy.float64)
print("GPU float64 -> float32 of 1e-40, bits:", int(tiny.astype(cupy.float32).view(cupy.uint32)[0]),
      "(CPU: 71362; 0 = flushed to zero)")
PY
PYTEST=($PY -m pytest -p no:cacheprovider -W "ignore::UserWarning:cupy"
        -W "ignore::FutureWarning:cupy" -W "ignore::DeprecationWarning")
echo "== pytest -m cuda (tests/cuda/test_cuda.py)"
timeout 200 "${PYTEST[@]}" -m cuda -v --durations=5 tests/cuda/test_cuda.py 2>&1 | tee "$OUT/pytest_cuda.log"
echo "pytest exit: ${PIPESTATUS[0]}"
echo "== the CUDA unit tests (fake CuPy) with the real one installed"
timeout 60 "${PYTEST[@]}" -q tests/cuda/test_cuda_units.py 2>&1 | tail -15
echo "pytest exit: ${PIPESTATUS[0]}"
echo "== benchmarks/bench_cuda.py"
timeout 120 $PY benchmarks/bench_cuda.py --repeats 3 2>&1 | tee "$OUT/bench_cuda.log"
echo "bench exit: ${PIPESTATUS[0]}"
echo "== tensord loadtest on cuda:0 (30 s, 20 users, 8 GiB)"
timeout 100 $PY -m tensord_server loadtest -u 20 -t 30s --device cuda:0=8GiB \
    --out "$OUT/loadtest" --no-plot 2>&1 | tail -40 | tee "$OUT/loadtest.log"
echo "loadtest exit: ${PIPESTATUS[0]}"
ls "$OUT/loadtest"
for f in summary.json summary.md; do
    [ -f "$OUT/loadtest/$f" ] && cp "$OUT/loadtest/$f" "$OUT/loadtest_$f"
done
for f in "$OUT"/loadtest/*failures*.csv; do
    [ -f "$f" ] && { echo "== $f"; head -40 "$f"; cp "$f" "$OUT/loadtest_failures.csv"; }
done
rm -rf "$OUT/loadtest"
date -u
