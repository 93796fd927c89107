#!/usr/bin/env bash
# The GPU check (issues 13 and 31): every answer from one run of at most 4 minutes on a bare GPU
# machine without network. Only the tail of what it prints comes back from such a machine, so
# everything is also written under $OUT as each step ends: a run cut off still tells all it
# reached. Not yet run on a GPU.
#
# Usage: OUT=/some/dir bash benchmarks/gpu_check.sh      (OUT unset: a new temporary directory)
#
# Steps, in order of value, with their budgets in seconds (240 in all; time a step does not use
# passes to the later ones, and no step starts past the 240):
#   preflight   20  nvidia-smi, then benchmarks/gpu_preflight.py: driver, CUDA runtime, CuPy,
#                   NCCL, the devices, torch, jax. Exits the script at once, status 1, naming
#                   the reason, when colls_plugins.nccl.runtime.unavailable_reason() is not None.
#   install     15  colls from this tree: pip install --no-deps --no-build-isolation --no-index
#                   -e . (without setuptools: the tree on PYTHONPATH and a generated dist-info
#                   declaring its entry points); pytest and pytest-timeout, if missing, from the
#                   wheels in $COLLS_GPU_WHEELS (default .gpu-wheels, carried with the tree; pip
#                   download --only-binary=:all: --python-version 3.12 -d .gpu-wheels pytest
#                   pytest-timeout), by pip or else unpacked onto PYTHONPATH.
#   nccl        50  tests/gpu/test_nccl_gpu.py: nccl at world size 1.
#   tcp         55  tests/gpu/test_tcp_cuda.py: CUDA arrays through tcp at 2 and 4 processes.
#   torch       30  tests/gpu/test_torch_cuda.py: colls_torch on CUDA (streams, device maps).
#   jax         35  tests/gpu/test_jax_cuda.py: colls_jax on GPU arrays, eager, jit and grad;
#                   under jit both the CUDA FFI handler (tcp at 2 processes, nccl at 1) and the
#                   host callbacks.
#   bench-nccl  15  benchmarks/gpu_bench.py, sizes up to 16 MiB, 20 iterations.
#   bench-tcp   20  benchmarks/gpu_tcp_bench.py, 2 ranks, sizes up to 16 MiB, 3 iterations.
# tests/nccl is not run here: it runs on the CPU, in CI.
#
# Timeouts, innermost first, so that a hang is reported with its stack and the step's summary:
# a spawned job's own timeout < a test's (pytest-timeout; tests/gpu/gpu_limits.py shortens it to
# end by the step's deadline) < the step's outer `timeout`. A skip in tests/gpu fails its step.
#
# Files under $OUT (a GPU machine returns at most 8): gpu_check.log (all of the output),
# steps.txt (one line per step as it ends), junit-{nccl,tcp,torch,jax}.xml,
# bench-nccl.json, bench-tcp.json.
#
# Exit status: 0 when every step passed; 1 otherwise (at once when the preflight fails).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TOTAL=240
if [ -z "${OUT:-}" ]; then
    OUT=$(mktemp -d)
    echo "OUT is not set: writing to $OUT"
fi
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
STEPS="$OUT/steps.txt"
: > "$STEPS"
exec > >(tee -a "$LOG") 2>&1
TEE=$!
trap 'exec 1>&- 2>&-; wait "$TEE" 2>/dev/null' EXIT

export NCCL_DEBUG=${NCCL_DEBUG:-WARN}  # a first NCCL failure explains itself
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # the ranks of a test share the one GPU
export PYTHONUNBUFFERED=1
status=0

# Budgets of the steps, in order; a step may use what earlier steps left unused.
STEP_NAMES=(preflight install nccl tcp torch jax bench-nccl bench-tcp)
STEP_BUDGETS=(20 15 50 55 30 35 15 20)

# limit_of NAME: seconds NAME may take: its budget plus what earlier steps saved, within what is
# left of TOTAL once the later steps' budgets are set aside (never more than is left).
limit_of() {
    local i later=0 budget=0 found=0
    for i in "${!STEP_NAMES[@]}"; do
        if [ "$found" = 1 ]; then later=$((later + STEP_BUDGETS[i])); fi
        if [ "${STEP_NAMES[i]}" = "$1" ]; then budget=${STEP_BUDGETS[i]}; found=1; fi
    done
    local left=$((TOTAL - SECONDS)) limit
    limit=$((left - later))
    if [ "$limit" -lt "$budget" ]; then limit=$budget; fi
    if [ "$limit" -gt "$left" ]; then limit=$left; fi
    echo "$limit"
}

# record NAME RESULT SECONDS [DETAIL]: one line in steps.txt, at once, and in the log.
record() {
    printf '%-10s %-7s %4ss  %s\n' "$1" "$2" "$3" "${4:-}" >> "$STEPS"
    echo "== $1: $2 in $3 s${4:+: $4}"
    if [ "$2" != "ok" ]; then status=1; fi
}

# junit_verdict FILE: print the counts; fail on a failure, an error, a skip, or no test at all.
junit_verdict() {
    "$PY" - "$1" <<'PYEOF'
import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root)
n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
print(f"{n['tests']} tests, {n['failures']} failed, {n['errors']} errors, "
      f"{n['skipped']} skipped (a skip counts as a failure)")
sys.exit(1 if n["failures"] or n["errors"] or n["skipped"] or not n["tests"] else 0)
PYEOF
}

# pytest_step NAME PER_TEST_SECONDS FILE...: run the files' tests within the step's limit.
pytest_step() {
    local name=$1 per_test=$2 limit started rc junit="$OUT/junit-$1.xml" verdict
    shift 2
    limit=$(limit_of "$name")
    started=$SECONDS
    echo "== $name: $* (limit ${limit} s, ${per_test} s a test)"
    if [ "$limit" -lt 10 ]; then
        record "$name" SKIPPED 0 "no time left of the ${TOTAL} s"
        return
    fi
    if ! "$PY" -c "import pytest, pytest_timeout" 2>/dev/null; then
        record "$name" FAILED 0 "pytest or pytest-timeout is missing (see the install step)"
        return
    fi
    rm -f "$junit"  # a report left by an earlier run must not stand for this one
    # The tests end 8 s before the outer limit: pytest's teardown and junit need the rest.
    GPU_CHECK_DEADLINE=$(($(date +%s) + limit - 8)) GPU_CHECK_TEST_TIMEOUT=$per_test \
        timeout -k 5 "$limit" "$PY" -m pytest -q -p no:cacheprovider --timeout="$per_test" \
        -o junit_family=xunit2 --junitxml="$junit" "$@"
    rc=$?
    if [ ! -s "$junit" ]; then
        record "$name" FAILED $((SECONDS - started)) \
            "pytest exit $rc and no junit (killed at the ${limit} s limit?)"
    elif verdict=$(junit_verdict "$junit") && [ "$rc" -eq 0 ]; then
        record "$name" ok $((SECONDS - started)) "$verdict"
    else
        record "$name" FAILED $((SECONDS - started)) "pytest exit $rc; $verdict"
    fi
}

# command_step NAME COMMAND...: run COMMAND within the step's limit.
command_step() {
    local name=$1 limit started rc
    shift
    limit=$(limit_of "$name")
    started=$SECONDS
    echo "== $name: $* (limit ${limit} s)"
    if [ "$limit" -lt 5 ]; then
        record "$name" SKIPPED 0 "no time left of the ${TOTAL} s"
        return
    fi
    timeout -k 5 "$limit" "$@"
    rc=$?
    if [ "$rc" -eq 0 ]; then
        record "$name" ok $((SECONDS - started))
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        record "$name" FAILED $((SECONDS - started)) "exit $rc: killed at the ${limit} s limit"
    else
        record "$name" FAILED $((SECONDS - started)) "exit $rc"
    fi
}

echo "== gpu_check.sh $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)," \
    "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), writing to $OUT"

# -- preflight ---------------------------------------------------------------------------------
started=$SECONDS
if command -v nvidia-smi >/dev/null; then
    timeout 15 nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used \
        --format=csv,noheader
else
    echo "nvidia-smi: not found"
fi
PYTHONPATH="$PWD:$PWD/adapters${PYTHONPATH:+:$PYTHONPATH}" \
    timeout -k 5 "$(limit_of preflight)" "$PY" benchmarks/gpu_preflight.py
rc=$?
if [ "$rc" -ne 0 ]; then
    record preflight FAILED $((SECONDS - started)) \
        "exit $rc: NCCL cannot run here (the reason is above); nothing else is run"
    echo "== gpu_check.sh exit status 1"
    exit 1
fi
record preflight ok $((SECONDS - started))

# -- install -----------------------------------------------------------------------------------
started=$SECONDS
limit=$(limit_of install)
echo "== install: colls from this tree (limit ${limit} s)"
if ! timeout -k 5 "$limit" "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e .
then  # no setuptools in the image: the tree on PYTHONPATH, its entry points in a dist-info
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
if ! "$PY" -c "import pytest, pytest_timeout" 2>/dev/null; then
    wheels=${COLLS_GPU_WHEELS:-.gpu-wheels}
    if ! timeout -k 5 "$limit" "$PY" -m pip install -q --no-index --find-links "$wheels" \
            pytest pytest-timeout; then  # no pip: unpack the wheels (pure Python) instead
        unpacked=$(mktemp -d)
        for wheel in "$wheels"/*.whl; do "$PY" -m zipfile -e "$wheel" "$unpacked"; done
        export PYTHONPATH="$unpacked${PYTHONPATH:+:$PYTHONPATH}"
        echo "pip could not install from $wheels; unpacked its wheels on PYTHONPATH"
    fi
fi
if "$PY" -c "import colls; print('colls', colls.__file__, colls.available_backends())" \
        && "$PY" -c "import pytest, pytest_timeout; print('pytest', pytest.__version__)"; then
    record install ok $((SECONDS - started))
else
    record install FAILED $((SECONDS - started)) \
        "colls, pytest or pytest-timeout cannot be imported"
fi

# -- the tests, then the benchmarks --------------------------------------------------------------
pytest_step nccl 30 tests/gpu/test_nccl_gpu.py
pytest_step tcp 40 tests/gpu/test_tcp_cuda.py
pytest_step torch 20 tests/gpu/test_torch_cuda.py
pytest_step jax 40 tests/gpu/test_jax_cuda.py
command_step bench-nccl "$PY" benchmarks/gpu_bench.py --iters 20 --max-bytes $((16 << 20)) \
    --json "$OUT/bench-nccl.json"
command_step bench-tcp "$PY" benchmarks/gpu_tcp_bench.py --iters 3 --max-bytes $((16 << 20)) \
    --json "$OUT/bench-tcp.json"

echo "== steps (also in $STEPS)"
cat "$STEPS"
echo "== gpu_check.sh exit status $status after $SECONDS s"
exit $status
