#!/usr/bin/env bash
# Create .venv with everything memra_pp needs. Without a GPU, torch comes first as the local CPU build
# (torch==2.13.0), so that no later dependency pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$py" -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  "${pip[@]}" torch==2.13.0
fi
"${pip[@]}" -e '.[test]'
