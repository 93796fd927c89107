#!/usr/bin/env bash
# The GPU check of issue 13, in one run of under 8 minutes, fetching nothing.
#
# 1. installs colls from this tree (pip install --no-deps --no-build-isolation -e .; where the
#    image has no setuptools, the tree goes on PYTHONPATH with its entry points declared by a
#    generated dist-info, which is what plugin discovery reads);
# 2. runs tests/gpu (nccl at world size 1: every collective against NumPy, stream ordering, torch
#    and JAX arrays, the device checks, two ranks on one GPU; tcp with CUDA arrays at 2 and 4
#    ranks) and tests/nccl (the CPU-side tests, now with CuPy and a device present);
# 3. prints benchmarks/gpu_bench.py's table: colls' nccl against cupyx.distributed and torch's
#    NCCL process group, all_reduce at world size 1;
# 4. prints benchmarks/gpu_tcp_bench.py's table: tcp with CuPy arrays at 2 ranks (staged through
#    pinned memory) against the host transport and the copy bandwidth measured in the same run.
#
# Needs: python with numpy, pluggy, cupy (+ the NCCL wheel), pytest; torch and jax are optional.
# Without pytest in the image it installs it from $COLLS_GPU_WHEELS (a folder of wheels: pytest,
# pytest-timeout, iniconfig, packaging) when given, with --no-index.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
status=0

echo "== machine"
command -v nvidia-smi >/dev/null && nvidia-smi -L
"$PY" - <<'PYEOF'
import importlib, sys
print("python", sys.version.split()[0])
for name in ("numpy", "pluggy", "cupy", "torch", "jax", "pytest"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as exc:
        print(name, "missing:", type(exc).__name__, exc)
try:
    from cupy.cuda import nccl
    print("nccl", nccl.get_version())
except Exception as exc:
    print("nccl missing:", exc)
PYEOF

echo "== install colls from the tree"
if ! "$PY" -m pip install -q --no-deps --no-build-isolation -e . ; then
    meta=$(mktemp -d)/colls-0.1.0.dist-info
    mkdir -p "$meta"
    printf 'Metadata-Version: 2.1\nName: colls\nVersion: 0.1.0\n' > "$meta/METADATA"
    "$PY" - "$meta/entry_points.txt" <<'PYEOF'
import sys, tomllib
with open("pyproject.toml", "rb") as f:
    points = tomllib.load(f)["project"]["entry-points"]["colls"]
with open(sys.argv[1], "w") as out:
    out.write("[colls]\n" + "".join(f"{k} = {v}\n" for k, v in points.items()))
PYEOF
    export PYTHONPATH="$PWD:$PWD/adapters:$(dirname "$meta")${PYTHONPATH:+:$PYTHONPATH}"
    echo "pip could not install the tree; using PYTHONPATH=$PYTHONPATH"
fi
"$PY" -c "import colls; print('colls', colls.__file__); print(colls.available_backends())"

if ! "$PY" -c "import pytest" 2>/dev/null; then
    if [ -n "${COLLS_GPU_WHEELS:-}" ]; then
        "$PY" -m pip install -q --no-index --find-links "$COLLS_GPU_WHEELS" pytest pytest-timeout
    else
        echo "pytest is missing and COLLS_GPU_WHEELS is not set: the tests cannot run"
        status=1
    fi
fi

echo "== tests/gpu and tests/nccl"
if "$PY" -c "import pytest" 2>/dev/null; then
    timeout 270 "$PY" -m pytest -q -rs -p no:cacheprovider tests/gpu tests/nccl || status=1
fi

echo "== benchmark: nccl at world size 1 vs cupyx.distributed and torch"
timeout 90 "$PY" benchmarks/gpu_bench.py --iters 50 || status=1

echo "== benchmark: tcp with CuPy arrays at 2 ranks vs the host transport and the copies"
timeout 100 "$PY" benchmarks/gpu_tcp_bench.py --iters 5 || status=1

echo "== gpu_check.sh exit status $status"
exit $status
