#!/usr/bin/env bash
# Installs everything the tests need on a fresh machine, builds the extension,
# then runs every test: Rust unit tests and the Python suite.
set -euo pipefail
cd "$(dirname "$0")/.."

# Headless Chromium for the HTML report and dashboard tests.
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
fi

python3 -m venv .venv
source .venv/bin/activate
pip install -q -U pip maturin
maturin develop --release --extras test

cargo test --lib --quiet
python -m pytest -q -p no:cacheprovider tests
