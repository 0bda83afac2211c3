#!/usr/bin/env bash
# GPU check for vllm-kv-cache-limit, for a machine with an NVIDIA GPU.
#
#   scripts/gpu-check.sh
#
# Uses the vLLM already installed for $PYTHON when there is one (a virtual
# environment with --system-site-packages; nothing is fetched from a package
# registry, so it runs offline); only without one does it install the CUDA
# build of vLLM (vllm==$VLLM_VERSION, default 0.33.0) from the registry. The
# plugin is installed with --no-deps --no-build-isolation (or, without
# hatchling, put on the path with its start-up hook). Then it checks every
# hook against the installed vLLM, builds the tiny model and runs the GPU
# end-to-end tests (`pytest -m gpu tests/gpu`): the cap on cuda:0 (eager and
# with CUDA graphs), a cap that cannot fit, two capped engines in either
# order and at once, explicit sizes, max_model_len auto, tensor parallel 2
# (skipped below two GPUs).
# Writes one log, $VENV/gpu-check.log: the GPU, driver, CUDA, torch and vLLM
# versions and one line per check. Exits non-zero when any check fails.
# Target: under 10 minutes on one GPU with vLLM installed.
#
# Environment: VLLM_VERSION, GPU_CHECK_VENV (default .cache/gpu-venv; removed
# and recreated), PYTHON (default python3), GPU_CHECK_TIMEOUT_S (pytest's
# limit, default 480).
set -euo pipefail

cd "$(dirname "$0")/.."
VLLM_VERSION="${VLLM_VERSION:-0.33.0}"
VENV="${GPU_CHECK_VENV:-.cache/gpu-venv}"
PYTHON="${PYTHON:-python3}"
TIMEOUT_S="${GPU_CHECK_TIMEOUT_S:-480}"
REPORT="${VENV}/gpu-check-junit.xml"
LOG="${VENV}.log"
export HF_HUB_OFFLINE=1
START=$(date +%s)
FAILED=0

elapsed() { echo "$(( $(date +%s) - START ))s"; }
line() { printf '%-4s %-22s %s\n' "$1" "$2" "$3" | tee -a "$LOG"; }
mkdir -p "$(dirname "$VENV")"
: >"$LOG"

if ! nvidia-smi -L >/dev/null 2>&1; then
    line FAIL gpu "nvidia-smi finds no NVIDIA GPU; run this on a GPU machine"
    exit 1
fi
line INFO gpu "$(nvidia-smi -L | head -n 1); driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -n 1)"

# 1. The environment. An installed vLLM is used as it is.
rm -rf "$VENV"
if "$PYTHON" -c "import vllm" >/dev/null 2>&1; then
    "$PYTHON" -m venv --system-site-packages "$VENV"
    VPY="$VENV/bin/python"
    SITE=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    # When $PYTHON is itself a virtual environment, --system-site-packages
    # reaches only its base: add its own site-packages too.
    "$PYTHON" -c 'import site; print("\n".join(site.getsitepackages()))' >"$SITE/gpu_check_base_env.pth"
    if "$VPY" -m pip install -q --no-deps --no-build-isolation --no-index . >"$VENV/install.log" 2>&1; then
        HOW="installed vLLM; plugin installed with --no-deps --no-build-isolation"
    else
        # No hatchling offline: the package from this checkout, and its start-up hook.
        echo "$PWD" >"$SITE/00-vllm-kv-cache-limit-src.pth"  # before the hook's .pth (sorted)
        cp vllm_kv_cache_limit.pth "$SITE/"
        HOW="installed vLLM; plugin from this checkout (no build backend offline)"
    fi
    for mod in pytest pytest_timeout requests psutil; do
        "$VPY" -c "import $mod" 2>/dev/null || { line FAIL install "python module $mod is missing beside the installed vLLM"; exit 1; }
    done
else
    "$PYTHON" -m venv "$VENV"
    VPY="$VENV/bin/python"
    if ! {
        "$VPY" -m pip install -q --progress-bar off --upgrade pip &&
        "$VPY" -m pip install -q --progress-bar off "vllm==${VLLM_VERSION}" pytest pytest-timeout pytest-mock hypothesis requests psutil &&
        "$VPY" -m pip install -q --progress-bar off .
    } >"$VENV/install.log" 2>&1; then
        tail -n 30 "$VENV/install.log"
        line FAIL install "pip install failed, see $VENV/install.log ($(elapsed))"
        exit 1
    fi
    HOW="vllm==${VLLM_VERSION} installed from the registry"
fi
line PASS install "$HOW ($(elapsed))"
line INFO versions "$("$VPY" -c 'import torch, vllm_kv_cache_limit as p; from vllm_kv_cache_limit import compat; print("vLLM", compat.installed_vllm_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda, "| plugin", p.__version__)' 2>/dev/null)"

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
if ! "$VPY" -m tests.tiny_model models/tiny-llama >"$VENV/model.log" 2>&1; then
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
"$VPY" - "$REPORT" <<'EOF' | tee -a "$LOG" || FAILED=1
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
        message = skipped.get("message") or ""
        if "two GPUs" not in message and "more than 101 GiB free" not in message:
            bad += 1  # on a GPU machine a skip is a failure of the check
        print(f"SKIP {name:<22} {message}")
    else:
        print(f"PASS {name:<22} {props.get('summary', '')}")
sys.exit(1 if bad else 0)
EOF
if [ "$STATUS" -ne 0 ]; then
    FAILED=1
    echo "pytest exited $STATUS; full log: $VENV/pytest.log" | tee -a "$LOG"
fi

TOTAL=$(( $(date +%s) - START ))
if [ "$TOTAL" -gt 600 ]; then
    line WARN time "${TOTAL}s, above the 10 minute target"
else
    line INFO time "${TOTAL}s"
fi
echo "log: $LOG"
exit "$FAILED"
