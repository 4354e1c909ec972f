#!/usr/bin/env bash
# Installs everything the tests need on a fresh machine, builds the extension, runs
# the linters (ci/lint.sh) and builds the docs (sphinx-build -W: a warning fails), then
# every test: Rust unit tests, the Python suite on a loaded machine, and a subset on
# CPython 3.13, 3.14, 3.15, 3.9, 3.13t and pyenv's 3.10 and 3.12 on an idle one
# (ci/matrix.sh, with the manylinux2014 wheel).
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages: headless Chromium (report, dashboard and speedscope tests), strace
# (syscall fault injection), Debian's python3 (runs a test as an unprivileged user),
# npm (fetches speedscope's app) and Go (its `go tool pprof` reads our pprof files).
need=()
command -v chromium >/dev/null || need+=(chromium)
command -v chromedriver >/dev/null || need+=(chromium-driver)
command -v strace >/dev/null || need+=(strace)
command -v setpriv >/dev/null || need+=(util-linux)
command -v stress-ng >/dev/null || need+=(stress-ng)
command -v npm >/dev/null || need+=(npm)
command -v go >/dev/null || need+=(golang-go)
[ -x /usr/bin/python3 ] || need+=(python3)
if [ ${#need[@]} -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

bash ci/speedscope.sh

python3 -m venv .venv
source .venv/bin/activate
pip install -q -U pip maturin
maturin develop --release --extras test

bash ci/lint.sh
# The docs (docs/, MyST pages and the API reference from docstrings) after the linters,
# before the long tests: a broken link, heading or docstring fails early. docs/_build is
# ignored by git.
pip install -q -r docs/requirements.txt
sphinx-build -W --keep-going -q -b html docs docs/_build/html
cargo test --lib --quiet

# The whole suite beside a CPU hog per core: tests assert what holds on any machine and
# wait for conditions, never for a rate in a fixed time, so load must not fail them.
# Idle runs are the matrix's, on every interpreter but this one. One pass, not an idle
# one and a loaded one, to keep CI near 45 minutes on 2 cores. The timeout only bounds
# a hung pass, the trap stops stress-ng when the pass ends.
stress-ng --cpu "$(nproc)" --timeout 3600s --quiet &
stress=$!
trap 'kill $stress 2>/dev/null || true' EXIT
python -m pytest -q -p no:cacheprovider tests
kill $stress 2>/dev/null || true
wait $stress 2>/dev/null || true
trap - EXIT

bash ci/matrix.sh
