#!/usr/bin/env bash
# The Python package's tests (part of the README's test command): a virtual environment with
# torch, transformers, pytest and maturin from PyPI (created if missing, ~1.5 min the first time:
# PyPI's Linux torch wheel brings its CUDA libraries, and runs on the CPU without a GPU), the
# package built from ./python into it, then pytest. FA_PY_VENV picks another environment.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${FA_PY_VENV:-$HOME/.cache/flash-attn-py}"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
pip=("$venv/bin/pip" install --quiet --disable-pip-version-check)
"${pip[@]}" torch "transformers>=4.48" pytest numpy "maturin>=1.9,<2"
# The build uses the venv's maturin (no isolated build environment to download each time) and the
# workspace's target folder, so the library compiled by `cargo test --release` is reused.
PATH="$venv/bin:$PATH" "${pip[@]}" --no-build-isolation --force-reinstall --no-deps ./python
cd python
"$venv/bin/pytest" -q -p no:cacheprovider "$@"
