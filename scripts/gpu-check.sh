#!/usr/bin/env bash
# GPU check for vllm-kv-cache-limit, for a machine with an NVIDIA GPU.
#
#   scripts/gpu-check.sh
#
# Creates a fresh virtual environment, installs the CUDA build of vLLM
# (vllm==$VLLM_VERSION, default 0.33.0) and this package (`pip install .`),
# checks every hook against the installed vLLM, builds the tiny model and
# runs the GPU end-to-end tests (`pytest -m gpu tests/gpu`):
#   - the cap holds on cuda:0, measured with torch.cuda in the worker;
#   - a cap above torch.cuda.mem_get_info()'s free memory fails before the
#     KV cache is allocated;
#   - two engines with caps share one GPU.
# Prints one summary line per check and exits non-zero when any fails.
# Meant to finish in under 8 minutes on an H200 (about half of it installing).
#
# Environment: VLLM_VERSION, GPU_CHECK_VENV (default .cache/gpu-venv; removed
# and recreated), PYTHON (default python3), GPU_CHECK_TIMEOUT_S (pytest's
# limit, default 360).
set -euo pipefail

cd "$(dirname "$0")/.."
VLLM_VERSION="${VLLM_VERSION:-0.33.0}"
VENV="${GPU_CHECK_VENV:-.cache/gpu-venv}"
PYTHON="${PYTHON:-python3}"
TIMEOUT_S="${GPU_CHECK_TIMEOUT_S:-360}"
REPORT="${VENV}/gpu-check-junit.xml"
export HF_HUB_OFFLINE=1
START=$(date +%s)
FAILED=0

elapsed() { echo "$(( $(date +%s) - START ))s"; }
line() { printf '%-4s %-22s %s\n' "$1" "$2" "$3"; }

if ! nvidia-smi -L >/dev/null 2>&1; then
    line FAIL gpu "nvidia-smi finds no NVIDIA GPU; run this on a GPU machine"
    exit 1
fi
line INFO gpu "$(nvidia-smi -L | head -n 1)"

# 1. Fresh environment: the CUDA vLLM build and this package, with its
#    start-up hook (.pth). torchvision stays: the CUDA build needs it.
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
VPY="$VENV/bin/python"
if ! {
    "$VPY" -m pip install -q --progress-bar off --upgrade pip &&
    "$VPY" -m pip install -q --progress-bar off "vllm==${VLLM_VERSION}" pytest pytest-timeout hypothesis requests psutil &&
    "$VPY" -m pip install -q --progress-bar off .
} >"$VENV/install.log" 2>&1; then
    tail -n 30 "$VENV/install.log"
    line FAIL install "pip install failed, see $VENV/install.log ($(elapsed))"
    exit 1
fi
line PASS install "$("$VPY" -c 'import importlib.metadata as m; print("vllm", m.version("vllm"), "+ vllm-kv-cache-limit", m.version("vllm-kv-cache-limit"))') ($(elapsed))"

# 2. Every hook against the installed CUDA build (imported, not just read).
if HOOKS=$("$VPY" - 2>/dev/null <<'EOF'
from vllm_kv_cache_limit import compat

problems = compat.check_hooks()
version = compat.installed_vllm_version()
if problems:
    print(f"vLLM {version}: " + "; ".join(problems))
    raise SystemExit(1)
print(f"all {len(compat.HOOKS)} hooks fit vLLM {version}")
EOF
); then
    line PASS hooks "$HOOKS"
else
    line FAIL hooks "$HOOKS"
    FAILED=1
fi

# 3. The tiny model (a few seconds; random weights, nothing downloaded).
if ! "$VPY" -m vllm_kv_cache_limit.tiny_model models/tiny-llama >"$VENV/model.log" 2>&1; then
    tail -n 30 "$VENV/model.log"
    line FAIL model "building the tiny model failed ($(elapsed))"
    exit 1
fi
line PASS model "models/tiny-llama ($(elapsed))"

# 4. The GPU end-to-end tests, one summary line each.
set +e
timeout "$TIMEOUT_S" "$VPY" -m pytest -m gpu tests/gpu -p no:cacheprovider -q \
    -o junit_family=xunit1 --junitxml="$REPORT" >"$VENV/pytest.log" 2>&1
STATUS=$?
set -e
if [ ! -s "$REPORT" ]; then
    tail -n 40 "$VENV/pytest.log"
    line FAIL tests "pytest exited $STATUS without a report (timeout ${TIMEOUT_S}s?) ($(elapsed))"
    exit 1
fi
"$VPY" - "$REPORT" <<'EOF' || FAILED=1
import sys
import xml.etree.ElementTree as ET

bad = 0
for case in ET.parse(sys.argv[1]).iter("testcase"):
    name = case.get("name").removeprefix("test_")
    props = {p.get("name"): p.get("value") for p in case.iter("property")}
    problem = case.find("failure")
    if problem is None:
        problem = case.find("error")
    skipped = case.find("skipped")
    if problem is not None:
        bad += 1
        message = (problem.get("message") or problem.text or "").strip().splitlines()
        print(f"FAIL {name:<22} {(message or ['?'])[0][:300]}")
    elif skipped is not None:
        bad += 1  # on a GPU machine a skip is a failure of the check
        print(f"SKIP {name:<22} {skipped.get('message')}")
    else:
        print(f"PASS {name:<22} {props.get('summary', '')}")
sys.exit(1 if bad else 0)
EOF
if [ "$STATUS" -ne 0 ]; then
    FAILED=1
    echo "pytest exited $STATUS; full log: $VENV/pytest.log"
fi

TOTAL=$(( $(date +%s) - START ))
if [ "$TOTAL" -gt 480 ]; then
    line WARN time "${TOTAL}s, above the 8 minute target"
else
    line INFO time "${TOTAL}s"
fi
exit "$FAILED"
