#!/usr/bin/env bash
# Runs a subset of the suite against the installed wheel on other CPythons, each in a
# Debian root: 3.13, 3.14, 3.15 from sid; 3.9 from bullseye (glibc 2.31) with the
# oldest dask/distributed pyproject.toml allows; free-threaded 3.13t, built in the sid
# root from Debian stable's source package, with its own cp313t wheel. No Debian suite
# has 3.10 or 3.12: pyenv's builds (with symbols, unlike Debian's), where the machine
# has them, run on the host, their venvs in $DASK_PYSPY_ROOTS/pyenv.
#   bash ci/matrix.sh [WHEEL]     # as root; without WHEEL it runs ci/wheel.sh
# Roots and venvs stay in $DASK_PYSPY_ROOTS (default below) for the next run; logs in its logs/.
set -euo pipefail

# What reads the interpreter: the sampler, readers, states, stalls and native frames, a
# LocalCluster's task tags, the report of a collection (and of a reader's fallback) and
# what the plugin leaves behind. The report's other pages, the dashboard and speedscope's
# app render what Rust wrote, the same on any interpreter: the main suite runs them.
REPORT_TESTS="tests/cluster/test_report.py::test_report_opens_offline_and_escapes_names
    tests/cluster/test_report.py::test_task_views_lead_with_task_code tests/cluster/test_report.py::test_a_reader_fallback_is_an_error
    tests/cluster/test_findings.py::test_summary_prints_the_findings_and_keeps_the_totals"
# Memory per task's shapes on a real cluster (the report, pprof and speedscope files: the main suite).
MEMORY_TESTS="tests/cluster/test_task_memory.py::test_an_array_a_worker_holds_is_charged_to_the_task_that_made_it
    tests/cluster/test_task_memory.py::test_a_leak_grows_with_its_calls_and_is_charged_to_its_prefix
    tests/cluster/test_task_memory.py::test_allocations_freed_in_the_task_leave_nothing_in_use
    tests/cluster/test_task_memory.py::test_a_block_freed_by_another_task_stays_charged_to_the_one_that_made_it"
MATRIX_TESTS="tests/inprocess/test_sampler.py tests/inprocess/test_reader.py tests/inprocess/test_states.py tests/inprocess/test_stalls.py
    tests/inprocess/test_native.py tests/inprocess/test_task_memory.py tests/cluster/test_cluster.py::test_task_attribution
    $REPORT_TESTS $MEMORY_TESTS tests/cluster/test_no_trace.py"
# What runs without pandas and pyarrow, which have no cp313t wheels: the sampler and
# reader, the local threaded scheduler, a LocalCluster with the plugin, the report.
MATRIX_TESTS_FREE_THREADED="tests/inprocess/test_sampler.py tests/inprocess/test_reader.py
    tests/inprocess/test_free_threaded.py tests/inprocess/test_local.py tests/inprocess/test_native.py tests/inprocess/test_stalls.py
    tests/inprocess/test_task_memory.py tests/cluster/test_cluster.py::test_task_attribution $REPORT_TESTS
    $MEMORY_TESTS tests/cluster/test_no_trace.py"
# pyenv's 3.10 and 3.12, on the host: what reads the interpreter's own structures (the
# rest runs on 3.9, 3.11 and 3.13+), to keep CI near 45 minutes.
MATRIX_TESTS_PYENV="tests/inprocess/test_sampler.py tests/inprocess/test_reader.py tests/inprocess/test_states.py
    tests/inprocess/test_native.py tests/cluster/test_cluster.py::test_task_attribution"
# arrow's native frames need pyarrow.
MATRIX_DESELECT_FREE_THREADED="tests/inprocess/test_native.py::test_pyarrow_names_are_demangled
    tests/inprocess/test_native.py::test_cpp_exceptions_while_sampling"
PYTHONS=${MATRIX_PYTHONS:-"3.13:sid 3.14:sid 3.15:sid 3.9:bullseye 3.13t:sid 3.10:pyenv 3.12:pyenv"} # MATRIX_PYTHONS: a few only
PYENV_VERSIONS=${PYENV_ROOT:-/root/.pyenv}/versions
# Debian ships no free-threaded CPython; sid's 3.14 and 3.15 sources cannot be fetched.
FREE_THREADED_SOURCE=python3.13/trixie
FREE_THREADED_BUILD_DEPS="build-essential libssl-dev zlib1g-dev libffi-dev libbz2-dev liblzma-dev libsqlite3-dev
    uuid-dev"
# The test extra without dask[dataframe] and bokeh (pandas, pyarrow) and hypothesis (its
# newest release builds from source with Rust there), none of which these tests import;
# numpy, which the dataframe extra brought; msgpack as pure Python (no cp313t wheel).
# Wheels only for numpy and psutil: their newest releases may have no cp313t wheel.
FREE_THREADED_TEST_DEPS="--only-binary=numpy,psutil pytest>=8 pytest-timeout selenium psutil numpy"
# bullseye runs only the report tests without a browser; strace: a privileges test;
# linux-perf: the tick-anatomy benchmark counts 3.13t's system calls in its root.
EXTRA_PACKAGES_sid="chromium chromium-driver strace linux-perf"
OLDEST_DASK_ON=3.9
ROOTS=${DASK_PYSPY_ROOTS:-/var/cache/dask-pyspy-roots}
LOGS=$ROOTS/logs
# The archive the host's own apt uses: the only one known to be reachable.
MIRROR=$(awk '$1 == "URIs:" { print $2; exit }' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
MIRROR=${MIRROR:-$(awk '$1 == "deb" { print $2; exit }' /etc/apt/sources.list 2>/dev/null || true)}
if [[ -z $MIRROR ]]; then
    echo "ci/matrix.sh: no Debian archive in this machine's apt sources (/etc/apt/sources.list.d/*.sources," \
        "/etc/apt/sources.list); the roots are built from it" >&2
    exit 2
fi
CA=/etc/dask-pyspy-ca.crt

host() { [[ $1 == "$ROOTS/pyenv" ]]; } # ROOT: pyenv's is a directory of the host's, entered by no chroot
inside() { if host "$1"; then echo "$1$2"; else echo "$2"; fi; } # ROOT PATH: PATH in ROOT, as its commands see it

in_root() { # ROOT COMMAND...: a clean environment, so the host's PIP_FIND_LINKS and PATH stay out
    local root=$1 enter=(chroot "$1") ca=$CA; shift
    if host "$root"; then enter=() ca=${PIP_CERT:-}; fi
    "${enter[@]}" /usr/bin/env -i HOME=/root LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive \
        PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_DEFAULT_TIMEOUT=180 ${PIP_CERT:+PIP_CERT=$ca} "$@"
}

ready_root() { # ROOT: mounts (idempotent), name resolution, the host's CA bundle for pip
    local root=$1 m
    if host "$root"; then return; fi
    mountpoint -q "$root/proc" || mount -t proc proc "$root/proc"
    # /dev/shm: multiprocessing's semaphores (LocalCluster worker processes).
    for m in /dev /dev/pts /dev/shm /sys; do mountpoint -q "$root$m" || mount --bind "$m" "$root$m"; done
    cp /etc/resolv.conf "$root/etc/resolv.conf"
    # A file of our own: Debian's ca-certificates rewrites the bundle it owns on every apt install.
    if [[ -n ${PIP_CERT:-} ]]; then cp "$PIP_CERT" "$root$CA"; fi
}

unmount_under() { # DIR: stop what still runs in a root (chromedriver, stray workers), then unmount, deepest first
    local p
    for p in /proc/[0-9]*; do
        case $(readlink "$p/root" 2>/dev/null) in "$1" | "$1"/*) kill -9 "${p#/proc/}" 2>/dev/null || true ;; esac
    done
    findmnt -rn -o TARGET | { grep "^$1/" || true; } | sort -r |
        while read -r m; do umount "$m" 2>/dev/null || umount -l "$m"; done
}

build_root() { # SUITE PACKAGE...
    local suite=$1 root=$ROOTS/$1; shift
    local want="$suite $*"
    if host "$root"; then mkdir -p "$root/opt"; return; fi
    if [[ $(cat "$root.ok" 2>/dev/null) == "$want" ]]; then
        echo "reusing $root"; ready_root "$root"; return
    fi
    if [[ ! -e $root/.debootstrap-ok ]]; then # a root left half-built is started over
        unmount_under "$root"
        rm -rf --one-file-system "$root"
        debootstrap --variant=minbase "$suite" "$root" "$MIRROR"
        touch "$root/.debootstrap-ok"
    fi
    ready_root "$root"
    # sid's Release file reads as expired on this archive.
    in_root "$root" apt-get -qq -o Acquire::Check-Valid-Until=false update
    in_root "$root" apt-get -qq -y --no-install-recommends install "$@"
    echo "$want" >"$root.ok"
}

free_threaded() { [[ $1 == *t ]]; } # PYTHON
python_in_root() { # PYTHON [ROOT]: nothing for a pyenv version the machine does not have
    if free_threaded "$1"; then echo "/opt/python$1/bin/python$1"
    elif host "${2:-}"; then ls -d "$PYENV_VERSIONS/$1".*/bin/"python$1" 2>/dev/null | sort -V | tail -n 1
    else echo "python$1"; fi
}

build_free_threaded() { # ROOT PYTHON: built once into /opt/pythonPYTHON, kept in the root for the next run
    local root=$1 py=$2 src=/opt/src-$2
    if [[ $(cat "$root/opt/python$py/.source" 2>/dev/null) == "$FREE_THREADED_SOURCE" ]]; then
        echo "reusing $root/opt/python$py"; return
    fi
    echo "deb-src $MIRROR ${FREE_THREADED_SOURCE#*/} main" >"$root/etc/apt/sources.list.d/free-threaded-src.list"
    in_root "$root" apt-get -qq -o Acquire::Check-Valid-Until=false update
    rm -rf --one-file-system "${root:?}$src" "$root/opt/python$py" && mkdir -p "$root$src"
    in_root "$root" /usr/bin/env -C "$src" apt-get source -qq --download-only "$FREE_THREADED_SOURCE"
    # Upstream's tarball, without Debian's patches: they turn ensurepip (pip in a venv) off.
    tar -xJf "$root$src"/*.orig.tar.xz -C "$root$src" --strip-components=1
    in_root "$root" /usr/bin/env -C "$src" sh -c "./configure -q --disable-gil --prefix=/opt/python$py &&
        make -s -j$(nproc) && make -s altinstall" >/dev/null
    in_root "$root" "$(python_in_root "$py")" -c 'import sys; assert not sys._is_gil_enabled(), "the GIL is on"'
    echo "$FREE_THREADED_SOURCE" >"$root/opt/python$py/.source"
}

build_free_threaded_wheel() { # ROOT PYTHON: its path in $LOGS/wheel PYTHON.path
    WHEEL_ROOT=$1 WHEEL_PYTHON=$(python_in_root "$2") bash ci/wheel.sh >"$LOGS/wheel $2.path"
}

make_venv() { # ROOT PYTHON WHEEL [REQUIREMENT...]: reused while the wheel's requirements are unchanged
    local root=$1 py=$2 wheel=$3; shift 3
    local venv=/opt/venv-$py sha iv iwhl
    iv=$(inside "$root" "$venv") iwhl=$(inside "$root" "/opt/wheels/${wheel##*/}")
    sha=$(sha256sum "$wheel" | cut -d' ' -f1)
    local deps; deps=$(printf '%s\n' "$REQUIRES" "$@" | sha256sum)
    if [[ $(cat "$root$venv/.deps" 2>/dev/null) != "$deps" ]]; then
        rm -rf --one-file-system "${root:?}$venv"
        in_root "$root" "$(python_in_root "$py" "$root")" -m venv "$iv"
        if free_threaded "$py"; then
            in_root "$root" /usr/bin/env MSGPACK_PUREPYTHON=1 "$iv/bin/pip" install -q "$iwhl" $FREE_THREADED_TEST_DEPS "$@"
        else
            in_root "$root" "$iv/bin/pip" install -q "$iwhl[test]" "$@"
        fi
        echo "$deps" >"$root$venv/.deps"
    elif [[ $(cat "$root$venv/.wheel" 2>/dev/null) != "$sha" ]]; then
        in_root "$root" "$iv/bin/pip" install -q --no-deps --force-reinstall "$iwhl"
    fi
    echo "$sha" >"$root$venv/.wheel"
    in_root "$root" "$iv/bin/pip" list 2>/dev/null | grep -E '^(dask|distributed|pandas|numpy) '
}

run_tests() { # ROOT PYTHON
    local root=$1 py=$2 tests=$MATRIX_TESTS t dir python
    local selected=() env=()
    dir=$(inside "$root" /opt/t) python=$(inside "$root" "/opt/venv-$py/bin/python")
    if free_threaded "$py"; then
        tests=$MATRIX_TESTS_FREE_THREADED
        for t in $MATRIX_DESELECT_FREE_THREADED; do selected+=(--deselect "$t"); done
        # distributed's built-in profiler reads running threads' frames through
        # sys._current_frames(), a use-after-free on free-threaded 3.13 (CPython issue
        # 152355): it crashed a test's worker with a segfault. Ours copies frames as bytes.
        env=(DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED=False)
    elif host "$root"; then
        tests=$MATRIX_TESTS_PYENV
    fi
    for t in $tests; do
        if [[ -e ${t%%::*} ]]; then selected+=("$t"); else echo "matrix: skipping $t: ${t%%::*} does not exist yet"; fi
    done
    # Run from /opt/t, where no dask_pyspy/ lies: prove the installed one is what is tested.
    in_root "$root" /usr/bin/env -C "$dir" "$python" -c \
        'import dask_pyspy, sys; f = dask_pyspy.__file__; print(sys.version, f); assert "/opt/venv-" in f' &&
    in_root "$root" /usr/bin/env -C "$dir" "${env[@]}" "$python" -m pytest -q -rfEs \
        -p no:cacheprovider -p matrix_plugin "${selected[@]}"
}

build_wheel() { bash ci/wheel.sh >"$LOGS/wheel.path"; }

declare -A running status secs
job() { # NAME COMMAND...: in the background; output in $LOGS/NAME.log
    local name=$1; shift
    set -m # its own process group, so cleanup can stop debootstrap and pip with it
    (s=$SECONDS; "$@"; echo $((SECONDS - s)) >"$LOGS/$name.secs") >"$LOGS/$name.log" 2>&1 &
    running[$name]=$!
    set +m
}
wait_jobs() {
    local name
    for name in "${!running[@]}"; do
        if wait "${running[$name]}"; then
            status[$name]=ok; secs[$name]=$(cat "$LOGS/$name.secs")
            echo "  $name: ${secs[$name]} s"
        else
            status[$name]=failed
            echo "  $name: FAILED; end of $LOGS/$name.log:"; tail -n 30 "$LOGS/$name.log" | sed 's/^/    /'
        fi
    done
    running=()
}

cleanup() {
    local pid
    for pid in "${running[@]}"; do kill -- "-$pid" 2>/dev/null || true; done
    wait || true
    unmount_under "$ROOTS"
}

cd "$(dirname "$0")/.."
[[ $EUID -eq 0 ]] || { echo "matrix.sh: needs root (debootstrap, mount, chroot)" >&2; exit 1; }
mkdir -p "$LOGS"
trap cleanup EXIT
if ! command -v debootstrap >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
fi
bash ci/speedscope.sh  # test_report.py opens our files in speedscope's app

echo "matrix: wheel and roots"
WHEEL=${1:-}
[[ -n $WHEEL ]] || job wheel build_wheel
SUITES=$(for e in $PYTHONS; do echo "${e#*:}"; done | sort -u)
for suite in $SUITES; do
    pkgs=$(for e in $PYTHONS; do
        if [[ ${e#*:} != "$suite" ]]; then continue; fi
        if free_threaded "${e%:*}"; then echo "$FREE_THREADED_BUILD_DEPS"; else echo "python${e%:*} python${e%:*}-venv"; fi
    done | tr ' ' '\n' | sort -u)
    extra=EXTRA_PACKAGES_$suite
    job "root $suite" build_root "$suite" $pkgs ${!extra:-}
done
wait_jobs
# Free-threaded interpreters, then their wheels: built in their roots, one after the other.
for e in $PYTHONS; do
    py=${e%:*}
    if ! free_threaded "$py" || [[ ${status[root ${e#*:}]:-} != ok ]]; then continue; fi
    job "python $py" build_free_threaded "$ROOTS/${e#*:}" "$py"
    wait_jobs
    if [[ ${status[python $py]:-} == ok ]]; then job "wheel $py" build_free_threaded_wheel "$ROOTS/${e#*:}" "$py"; fi
    wait_jobs
done
[[ -n $WHEEL ]] || WHEEL=$(cat "$LOGS/wheel.path")
[[ -f $WHEEL ]] || { echo "matrix: no wheel; FAILED on every interpreter" >&2; exit 1; }
WHEEL=$(realpath "$WHEEL")
REQUIRES=$(python3 -c 'import sys, zipfile
z = zipfile.ZipFile(sys.argv[1]); meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
print("\n".join(l[15:] for l in z.read(meta).decode().splitlines() if l.startswith("Requires-Dist: ")))' "$WHEEL")
# The oldest versions claimed: "dask>=2024.8" becomes "dask==2024.8".
OLDEST=$(sed -nE 's/^(dask|distributed) *>= *([^ ;,]+)$/\1==\2/p' <<<"$REQUIRES")

echo "matrix: venvs ($WHEEL)"
for suite in $SUITES; do
    [[ ${status[root $suite]} == ok ]] || continue
    root=$ROOTS/$suite
    mkdir -p "$root/opt/wheels" && cp "$WHEEL" "$root/opt/wheels/"
    for e in $PYTHONS; do
        if [[ ${e#*:} == "$suite" && ${status[wheel ${e%:*}]:-} == ok ]]; then cp "$(cat "$LOGS/wheel ${e%:*}.path")" "$root/opt/wheels/"; fi
    done
    rm -rf --one-file-system "$root/opt/t" && mkdir -p "$root/opt/t"
    tar -c --exclude=__pycache__ tests benchmarks pyproject.toml .cache/speedscope | tar -x -C "$root/opt/t"
    cat >"$root/opt/t/matrix_plugin.py" <<'EOF'
# Without a browser in the root, deselect the tests that need one instead of failing them.
import os

def pytest_collection_modifyitems(config, items):
    if os.path.exists("/usr/bin/chromium"):
        return
    drop = [i for i in items if any("chromium" in f for f in getattr(i, "fixturenames", ()))]
    config.hook.pytest_deselected(items=drop)
    items[:] = [i for i in items if i not in drop]
EOF
    for e in $PYTHONS; do
        [[ ${e#*:} == "$suite" ]] || continue
        py=${e%:*} wheel=$WHEEL
        if free_threaded "$py"; then
            [[ ${status[wheel $py]:-} == ok ]] || continue
            wheel=$(cat "$LOGS/wheel $py.path")
        fi
        if [[ -z $(python_in_root "$py" "$root") ]]; then status[venv $py]=absent; continue; fi
        pins=(); if [[ $py == "$OLDEST_DASK_ON" ]]; then pins=($OLDEST); fi
        job "venv $py" make_venv "$root" "$py" "$wheel" "${pins[@]}"
    done
done
wait_jobs

# One at a time: the tests measure rates and deadlines on a 2-core machine.
failed=()
for e in $PYTHONS; do
    py=${e%:*} suite=${e#*:} name="CPython ${e%:*} (${e#*:})"
    if [[ ${status[venv $py]:-} == absent ]]; then
        echo "matrix: $name is not on this machine (no $PYENV_VERSIONS/$py.*): not run"
        status[tests $py]="not on this machine"; continue
    fi
    if [[ ${status[venv $py]:-} != ok ]]; then failed+=("$name: no root, interpreter, wheel or venv"); continue; fi
    echo "matrix: tests on $name"
    s=$SECONDS
    if run_tests "$ROOTS/$suite" "$py" 2>&1 | tee "$LOGS/tests $py.log"; then status[tests $py]=ok
    else status[tests $py]=failed; failed+=("$name: tests failed, see $LOGS/tests $py.log"); fi
    secs[tests $py]=$((SECONDS - s))
    unmount_under "$ROOTS/$suite"; ready_root "$ROOTS/$suite" # nothing lingers into the next run
done

echo "matrix: seconds per step (roots, wheel and venvs are built concurrently)"
printf '  %-22s %6s %6s %6s  %s\n' interpreter root venv tests result
for e in $PYTHONS; do
    py=${e%:*}
    printf '  %-22s %6s %6s %6s  %s\n' "CPython $py (${e#*:})" "${secs[root ${e#*:}]:--}" \
        "${secs[venv $py]:--}" "${secs[tests $py]:--}" "${status[tests $py]:-not run}"
done
for step in wheel $(for e in $PYTHONS; do if free_threaded "${e%:*}"; then echo "python:${e%:*} wheel:${e%:*}"; fi; done); do
    step=${step/:/ }
    if [[ -n ${secs[$step]:-} ]]; then echo "  $step: ${secs[$step]} s"; fi
done
if ((${#failed[@]})); then
    printf 'FAILED on %s\n' "${failed[@]}" >&2
    exit 1
fi
echo "matrix: all passed"
