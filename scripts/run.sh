#!/usr/bin/env bash
# One entry point that installs what it needs, then runs:
#   bash scripts/run.sh bench [dtree bench options]   # the benchmark (main job)
#   bash scripts/run.sh test  [pytest options]         # the test suite
#
# Installs into the active virtual environment if there is one, otherwise into
# ./.venv (created with --system-site-packages so an installed torch, e.g. a CUDA
# build, is reused). torch: an importable one is kept; otherwise torch==2.13.0 is
# installed (CPU wheel where pip's index has it).
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-}"
shift || true
case "$what" in
  bench) extras="" ;;
  test) extras="[test]" ;;
  *) echo "usage: bash scripts/run.sh bench|test [args...]" >&2; exit 2 ;;
esac

if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -x .venv/bin/python ] || python3 -m venv --system-site-packages .venv
  py=.venv/bin/python
else
  py=python
fi
if ! "$py" -c "import torch" 2>/dev/null; then
  "$py" -m pip install "torch==2.13.0"
fi
"$py" -m pip install -q -e ".${extras}"

if [ "$what" = bench ]; then
  exec "$py" -m dtree bench "$@"
else
  exec "$py" -m pytest "$@"
fi
