#!/usr/bin/env bash
# Installs everything the tests need on a fresh machine, builds the extension,
# then runs every test: Rust unit tests, the Python suite, and a subset of it on
# CPython 3.13, 3.14, 3.15 and 3.9 (ci/matrix.sh, with the manylinux2014 wheel).
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages: headless Chromium (report and dashboard tests), strace (syscall
# fault injection) and Debian's python3 (runs a test as an unprivileged user).
need=()
command -v chromium >/dev/null || need+=(chromium)
command -v chromedriver >/dev/null || need+=(chromium-driver)
command -v strace >/dev/null || need+=(strace)
command -v setpriv >/dev/null || need+=(util-linux)
[ -x /usr/bin/python3 ] || need+=(python3)
if [ ${#need[@]} -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

python3 -m venv .venv
source .venv/bin/activate
pip install -q -U pip maturin
maturin develop --release --extras test

cargo test --lib --quiet
python -m pytest -q -p no:cacheprovider tests
bash ci/matrix.sh
