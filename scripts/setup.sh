#!/usr/bin/env bash
# Create .venv with what mok needs, once. On a machine without a GPU: the CPU build of torch,
# and triton 3.6 with numpy < 2.3 (Triton 3.6's interpreter breaks on newer numpy).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
if ! .venv/bin/python -c "import torch, triton, pytest" 2>/dev/null; then
  $PIP install -q --upgrade pip
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    $PIP install -q "torch>=2.11" "triton>=3.6"
  else
    $PIP install -q "torch==2.13.0" "triton==3.6.0" "numpy<2.3"
  fi
fi
$PIP install -q --no-build-isolation -e ".[test]"
.venv/bin/python -c "import torch, triton, mok; print('mok', mok.__version__, '| torch', torch.__version__, '| triton', triton.__version__, '| cuda', torch.cuda.is_available())"
