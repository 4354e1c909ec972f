#!/usr/bin/env bash
# Builds a manylinux2014 (glibc 2.17) abi3 wheel into dist/ and prints its path,
# the only thing written to stdout. zig links against an old glibc, so the wheel
# installs on RHEL 7/8-class systems whatever the build machine's glibc is.
#   bash ci/wheel.sh              # sources of this checkout
#   WHEEL_SRC=DIR bash ci/wheel.sh  # another checkout (e.g. a clean worktree of HEAD)
#   WHEEL_ROOT=DIR WHEEL_PYTHON=/opt/python3.13t/bin/python3.13t bash ci/wheel.sh
#       # a free-threaded (cp313t) wheel instead, built inside the Debian root that
#       # holds that interpreter (ci/matrix.sh builds it): it does not run on this
#       # machine's older glibc. As root (chroot, mount).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
src=${WHEEL_SRC:-$repo}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/tmp/dpspy-wheel-target}

check_wheel() { # WHEEL ABI AUDITWHEEL...: auditwheel reads the symbols the .so needs; trust neither name nor maturin
    local wheel=$1 abi=$2; shift 2
    local show; show=$("$@" show "$wheel" 2>&1) || { echo "$show" >&2; return 1; }
    if ! tr -d '\n' <<<"$show" | grep -q 'platform tag: *"manylinux_2_17_x86_64"' || [[ $wheel != *-"$abi"-*manylinux_2_17_x86_64* ]]; then
        echo "$show" >&2
        echo "wheel.sh: $wheel is not a manylinux2014 $abi wheel" >&2
        return 1
    fi
}

free_threaded_wheel() { # in $WHEEL_ROOT, for $WHEEL_PYTHON, with this machine's toolchain mounted in
    local root=$WHEEL_ROOT cargo_home=${CARGO_HOME:-$HOME/.cargo} rustup_home=${RUSTUP_HOME:-$HOME/.rustup} d
    mounts=("$root/mnt/host$cargo_home" "$root/mnt/host$rustup_home")
    trap 'for m in "${mounts[@]}"; do umount "$m" 2>/dev/null || true; done' EXIT
    for d in "$cargo_home" "$rustup_home"; do
        mkdir -p "$root/mnt/host$d"
        mountpoint -q "$root/mnt/host$d" || mount --bind "$d" "$root/mnt/host$d"
    done
    rm -rf --one-file-system "$root/opt/wheel-src" "$root/opt/wheel-dist" && mkdir -p "$root/opt/wheel-src"
    (cd "$src" && tar -c --exclude=./target --exclude=./.venv --exclude=./dist --exclude=./.cache --exclude=./.git .) |
        tar -x -C "$root/opt/wheel-src"
    in_wheel_root() {
        chroot "$root" /usr/bin/env -i HOME=/root LANG=C.UTF-8 PIP_DISABLE_PIP_VERSION_CHECK=1 \
            PATH="/opt/wheel-tools/bin:/mnt/host$cargo_home/bin:/usr/bin:/bin" \
            CARGO_HOME="/mnt/host$cargo_home" RUSTUP_HOME="/mnt/host$rustup_home" CARGO_TARGET_DIR=/opt/wheel-target \
            ${PIP_CERT:+PIP_CERT=/etc/dask-pyspy-ca.crt} "$@"
    }
    if [[ ! -x $root/opt/wheel-tools/bin/auditwheel ]]; then
        in_wheel_root "$WHEEL_PYTHON" -m venv /opt/wheel-tools
        in_wheel_root /opt/wheel-tools/bin/pip install -q ziglang maturin auditwheel
    fi
    in_wheel_root /usr/bin/env -C /opt/wheel-src maturin build --release --zig --compatibility manylinux2014 \
        -i "$WHEEL_PYTHON" -o /opt/wheel-dist >&2
    local built; built=$(ls "$root"/opt/wheel-dist/*.whl)
    check_wheel "/opt/wheel-dist/${built##*/}" cp313t in_wheel_root /opt/wheel-tools/bin/auditwheel
    mkdir -p "$repo/dist" && cp "$built" "$repo/dist/"
    echo "$repo/dist/${built##*/}"
}

if [[ -n ${WHEEL_ROOT:-} ]]; then
    free_threaded_wheel
    exit
fi

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

check_wheel "$wheel" abi3 "$tools/bin/auditwheel"
echo "$wheel"
