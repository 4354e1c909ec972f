#!/usr/bin/env bash
# Builds a manylinux2014 (glibc 2.17) abi3 wheel into dist/ and prints its path,
# the only thing written to stdout. zig links against an old glibc, so the wheel
# installs on RHEL 7/8-class systems whatever the build machine's glibc is.
#   bash ci/wheel.sh              # sources of this checkout
#   WHEEL_SRC=DIR bash ci/wheel.sh  # another checkout (e.g. a clean worktree of HEAD)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
src=${WHEEL_SRC:-$repo}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/tmp/dpspy-wheel-target}

# Kept with the build cache: with a new venv each run, every crate was rebuilt each run.
tools=$CARGO_TARGET_DIR/wheel-tools
{
    [[ -x $tools/bin/auditwheel ]] || { python3 -m venv "$tools" && "$tools/bin/pip" install -q ziglang maturin auditwheel; }
    # maturin finds zig through the ziglang module of the Python on PATH.
    export PATH="$tools/bin:$PATH"
    cd "$src"
    maturin build --release --zig --compatibility manylinux2014 -o "$repo/dist" 2>&1 | tee "$tools/build.log"
} >&2
wheel=$(grep -o '/[^ ]*\.whl' "$tools/build.log" | tail -1)

# Trust neither the filename nor maturin: auditwheel reads the symbols the .so needs.
"$tools/bin/auditwheel" show "$wheel" >"$tools/show.log" 2>&1 || { cat "$tools/show.log" >&2; exit 1; }
if ! tr -d '\n' <"$tools/show.log" | grep -q 'platform tag: *"manylinux_2_17_x86_64"' || [[ $wheel != *-abi3-*manylinux_2_17_x86_64* ]]; then
    cat "$tools/show.log" >&2
    echo "wheel.sh: $wheel is not a manylinux2014 abi3 wheel" >&2
    exit 1
fi
echo "$wheel"
