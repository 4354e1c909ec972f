"""Drop-in replacements for dask-pyspy 0.4's context managers.

Same signatures and output files; underneath, the in-process sampler (no py-spy
child process, no ptrace rights). Options that only made sense for the py-spy
command line are accepted and ignored, or refused where they cannot be honoured.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from distributed import Client, default_client

from dask_pyspy import client as client_api
from dask_pyspy.files import check_writable
from dask_pyspy.model import Profile
from dask_pyspy.server.scheduler import PySpyPlugin

logger = logging.getLogger(__name__)


def legacy_filename(addr: str) -> str:
    """The file name dask-pyspy 0.4 gave a worker's profile."""
    return addr.replace("://", "-").replace(".", "_").replace(":", "-") + ".json"


def _check_legacy_options(format: str, extra_pyspy_args: Sequence[str], subprocesses: bool, nonblocking: bool) -> None:
    if format != "speedscope":
        raise ValueError(f"format must be 'speedscope' (the only format written in-process), got {format!r}")
    if extra_pyspy_args:
        raise ValueError(
            f"extra_pyspy_args cannot apply: no py-spy command line is run (got {list(extra_pyspy_args)!r})"
        )
    if not subprocesses:
        logger.info("dask-pyspy: subprocesses=False has no effect: each server process samples itself")
    if not nonblocking:
        logger.info("dask-pyspy: in-process sampling is always non-blocking; nonblocking=False is ignored")


@contextmanager
def _record(client: Client | None, plugin: PySpyPlugin, workers: Any, scheduler: bool) -> Iterator[list[Profile]]:
    """Record the block with `plugin`'s options; the list yielded holds the profile after it."""
    client = client or default_client()
    # A cluster that already samples takes these options from now on, keeping its samples.
    client.register_plugin(plugin)
    recorded: list[Profile] = []
    with client_api.profile(client=client, workers=workers, scheduler=scheduler) as rec:
        yield recorded
    assert rec.profile is not None, "set as the block ended"
    recorded.append(rec.profile)


@contextmanager
def pyspy_on_scheduler(
    output: str | os.PathLike,
    format: str = "speedscope",
    rate: int = 100,
    subprocesses: bool = True,
    function: bool = False,
    gil: bool = False,
    threads: bool = False,
    idle: bool = True,
    nonblocking: bool = False,
    native: bool = False,
    extra_pyspy_args: Sequence[str] = (),
    log_level: str | None = None,
    client: Client | None = None,
) -> Iterator[None]:
    """Profile the scheduler for the block and write one speedscope file to `output`."""
    check_writable(output)
    _check_legacy_options(format, extra_pyspy_args, subprocesses, nonblocking)
    plugin = PySpyPlugin(rate=rate, function=function, gil_only=gil, idle=idle, native=native)
    with _record(client, plugin, workers=[], scheduler=True) as recorded:
        yield
    client_api.save_or_keep(recorded[0], output)


@contextmanager
def pyspy(
    output: str | os.PathLike,
    workers: int | list[str] | None = None,
    format: str = "speedscope",
    rate: int = 100,
    subprocesses: bool = True,
    function: bool = False,
    gil: bool = False,
    threads: bool = False,
    idle: bool = True,
    nonblocking: bool = False,
    native: bool = False,
    extra_pyspy_args: Sequence[str] = (),
    log_level: str | None = None,
    client: Client | None = None,
) -> Iterator[None]:
    """Profile workers for the block; write one speedscope file per worker into directory `output`."""
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    check_writable(out / legacy_filename("tcp://probe"))
    _check_legacy_options(format, extra_pyspy_args, subprocesses, nonblocking)
    plugin = PySpyPlugin(rate=rate, function=function, gil_only=gil, idle=idle, native=native)
    with _record(client, plugin, workers=workers, scheduler=False) as recorded:
        yield
    for addr, part in split_by_process(recorded[0]).items():
        client_api.save_or_keep(part, out / legacy_filename(addr))


def split_by_process(profile: Profile) -> dict[str, Profile]:
    """One profile per sampled process, keyed by process name."""
    return {p["name"]: profile.only_process(i) for i, p in enumerate(profile.processes)}
