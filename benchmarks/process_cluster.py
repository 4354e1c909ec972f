"""The benchmarks' cluster: a scheduler and N_WORKERS worker processes started by the `dask`
command line, real processes so the scheduler's memory is its own, each torn down with its
process group (collection/collection.py, history/retention.py)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

from benchmarks import ROOT

N_WORKERS = 16
THREADS = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(args: list[str], log: str) -> subprocess.Popen:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
        # distributed's own profiler walks every stack 100 times a second in each worker: on 2 cores it
        # slowed the fill by a fifth, and it is beside the point here.
        DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED="False",
    )
    with open(log, "wb") as out:
        # The benchmark's session, as one script or shell starts them: in sessions of their own
        # (PYSPY_BENCH_SESSIONS=apart), Linux's autogroups share the CPU out per session, and the
        # scheduler's loop waited 100-600 ms runnable, not running, in some collections (RESULTS). A
        # process group of its own: the whole group (nannies' workers too) goes at teardown.
        apart = os.environ.get("PYSPY_BENCH_SESSIONS") == "apart"
        return subprocess.Popen(
            args,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
            start_new_session=apart,
            process_group=None if apart else 0,
            preexec_fn=_die_with_parent,
        )


def _die_with_parent() -> None:
    """In the child: SIGTERM when the benchmark dies, even killed outright (PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


def stop_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):  # stragglers, the leader gone or not
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def cluster(logs: str) -> Iterator[tuple[str, int]]:
    """A scheduler and N_WORKERS worker processes; yields the address and the scheduler's pid."""
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    dask = os.path.join(os.path.dirname(sys.executable), "dask")
    procs = []
    # A SIGTERM to the benchmark unwinds through the teardown below instead of ending it on the spot.
    previous = signal.signal(signal.SIGTERM, _exit_on_term)
    try:
        procs.append(
            spawn(
                [dask, "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"],
                os.path.join(logs, "scheduler.log"),
            )
        )
        procs.append(
            spawn(
                [
                    dask,
                    "worker",
                    address,
                    "--nworkers",
                    str(N_WORKERS),
                    "--nthreads",
                    str(THREADS),
                    "--memory-limit",
                    "0",
                    "--no-dashboard",
                ],
                os.path.join(logs, "workers.log"),
            )
        )
        yield address, procs[0].pid
    finally:
        for proc in reversed(procs):
            stop_group(proc)
        signal.signal(signal.SIGTERM, previous)


def _exit_on_term(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)
