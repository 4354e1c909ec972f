"""`dask pyspy ...` (through distributed's `dask_cli` entry point) and `dask-pyspy ...`."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, TypeVar

import click

from dask_pyspy import options

T = TypeVar("T")

# How long an unreachable scheduler takes to fail; a reachable one accepts at once.
CONNECT_TIMEOUT = 2.0


class RequestError(click.ClickException):
    """A request that cannot be served (a bad argument, an unreachable scheduler, no
    plugin, unknown workers): one line, with a usage error's exit code 2."""

    exit_code = 2


@contextmanager
def _connect(scheduler: str, timeout: float) -> Iterator[Any]:
    """A client of the scheduler. `timeout` bounds the connection only, so an unreachable
    scheduler fails fast; closing gets what a default client gets (twice the connect
    timeout of distributed's config)."""
    from dask.config import get
    from dask.utils import parse_timedelta
    from distributed import Client

    try:
        client = Client(scheduler, timeout=timeout)
    except (OSError, TimeoutError, ValueError) as e:
        raise RequestError(f"cannot reach the scheduler at {scheduler}: {e}") from e
    try:
        yield client
    finally:
        client.close(timeout=2 * parse_timedelta(get("distributed.comm.timeouts.connect")))


def _ask(call: Callable[[], T]) -> T:
    """A request to the cluster; what it refuses becomes one line, not a traceback."""
    try:
        return call()
    except (ValueError, RuntimeError, OSError) as e:
        raise RequestError(str(e)) from e


def _workers(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    if not value:
        return None
    try:
        return options.workers(int(value) if value.isdigit() else value.split(","))
    except ValueError as e:
        raise RequestError(f"--workers: {e}") from e


workers_option = click.option(
    "--workers",
    default=None,
    callback=_workers,
    help="A number of workers, or comma-separated addresses (default: all).",
)
timeout_option = click.option(
    "--timeout",
    default=CONNECT_TIMEOUT,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds to wait for the scheduler to accept the connection.",
)
OUTPUT_HELP = "Output file: .html (report), .json or .json.gz (speedscope), .pb.gz (pprof)."


@click.group(name="pyspy", help="Profile dask clusters with the in-process py-spy sampler.")
def pyspy() -> None:
    pass


@pyspy.command(
    help="Record the cluster for a while and save the profile (.html report, speedscope .json[.gz] or pprof .pb.gz)."
)
@click.option("--scheduler", required=True, help="Scheduler address, e.g. tcp://10.0.0.1:8786.")
@click.option(
    "--duration",
    default=10.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds to record.",
)
@workers_option
@click.option("--by", type=click.Choice(options.BY_CHOICES), default="thread", show_default=True)
@click.option(
    "--span", default=None, help="Only this dask span (a name or id) and the spans in it; a/b for a path of names."
)
@click.option(
    "--weight",
    type=click.Choice(options.WEIGHT_CHOICES),
    default="wall",
    show_default=True,
    help="What a sample weighs in the views.",
)
@click.option(
    "--aggregate",
    is_flag=True,
    help="Each process sends counts per stack and task prefix, not every sample: for big clusters; no timeline.",
)
@click.option(
    "--native/--no-native",
    default=None,
    help="First turn native (C) frames on (or off) in every server: registers PySpyPlugin(native=...), "
    "its other options from this machine's dask config.",
)
@click.option(
    "--memory/--no-memory",
    default=None,
    help="First turn memory per task on (or off) in every server: registers PySpyPlugin(memory=...), "
    "its other options from this machine's dask config; counts start afresh.",
)
@click.option(
    "-o",
    "--output",
    default="pyspy-profile.html",
    show_default=True,
    help=OUTPUT_HELP,
)
@timeout_option
def record(
    scheduler: str,
    duration: float,
    workers: Any,
    by: str,
    span: str | None,
    weight: str,
    aggregate: bool,
    native: bool | None,
    memory: bool | None,
    output: str,
    timeout: float,
) -> None:
    from dask_pyspy.client import get_profile, save_or_keep
    from dask_pyspy.files import check_writable
    from dask_pyspy.server.scheduler import PySpyPlugin

    try:
        check_writable(output)
    except (OSError, ValueError) as e:
        raise RequestError(f"--output: {e}") from e
    with _connect(scheduler, timeout) as client:
        switched = {name: on for name, on in (("native", native), ("memory", memory)) if on is not None}
        if switched:
            _ask(lambda: client.register_plugin(PySpyPlugin(**switched)))
        # An empty window first: no plugin or an unknown worker fails now, not after --duration.
        now = time.time()
        _ask(lambda: get_profile(client, workers=workers, start=now, stop=now))
        start = time.time()
        steps = max(1, int(duration * 10))
        with click.progressbar(range(steps), label=f"Recording {duration:g} s") as bar:
            for _ in bar:
                time.sleep(duration / steps)
        span_arg = span.split("/") if span and "/" in span else span
        request = dict(workers=workers, by=by, span=span_arg, weight=weight, aggregate=aggregate)
        prof = _ask(lambda: get_profile(client, start=start, stop=time.time(), **request))
        try:
            save_or_keep(prof, output)
        except (OSError, ValueError) as e:
            raise click.ClickException(str(e)) from e
    missing = prof.metadata["missing"]
    click.echo(prof.summary())
    click.echo(f"Saved {prof.n_samples} samples of {len(prof.processes)} processes to {output}")
    for name, error in missing.items():
        click.echo(f"missing {name}: {error}", err=True)


@pyspy.command(help="Print every thread's current stack on every worker and the scheduler, with its task.")
@click.option("--scheduler", required=True, help="Scheduler address.")
@workers_option
@timeout_option
def dump(scheduler: str, workers: Any, timeout: float) -> None:
    from dask_pyspy.client import dump as dump_stacks

    with _connect(scheduler, timeout) as client:
        click.echo(str(_ask(lambda: dump_stacks(client, workers=workers))))


@pyspy.command(
    help="Print the cluster's event-loop stalls, longest first: how long each held its loop, and what held it."
)
@click.option("--scheduler", required=True, help="Scheduler address.")
@click.option(
    "--last",
    default=600.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds back from now.",
)
@click.option(
    "--min-duration", default=0.0, show_default=True, type=click.FloatRange(min=0), help="Only stalls this long."
)
@click.option("--limit", default=20, show_default=True, type=click.IntRange(min=1), help="Stalls printed at most.")
@workers_option
@timeout_option
def stalls(scheduler: str, last: float, min_duration: float, limit: int, workers: Any, timeout: float) -> None:
    from dask_pyspy.client import get_stalls
    from dask_pyspy.stalls import table

    with _connect(scheduler, timeout) as client:
        found = _ask(lambda: get_stalls(client, last=last, min_duration=min_duration, workers=workers, limit=limit))
    click.echo(table(found))


@pyspy.command(
    help="Profile a realistic workload (a dataframe shuffle, numpy, a slow Python function) "
    "on a new LocalCluster and save the report."
)
@click.option(
    "-o",
    "--output",
    default="dask-pyspy-demo.html",
    show_default=True,
    help=OUTPUT_HELP,
)
@click.option(
    "--workers",
    "n_workers",
    default=None,
    type=click.IntRange(min=1),
    help="Worker processes (default: sized to the cores this process may use, one kept for the scheduler).",
)
@click.option(
    "--threads",
    default=None,
    type=click.IntRange(min=1),
    help="Threads per worker (default: sized like --workers).",
)
@click.option(
    "--days",
    default=30,  # about 20 s on 2 cores
    show_default=True,
    type=click.IntRange(min=1),
    help="Size of the workload: days of timeseries data, one partition each; every part scales with it.",
)
def demo(output: str, n_workers: int | None, threads: int | None, days: int) -> None:
    from dask_pyspy.demo import run_demo
    from dask_pyspy.files import check_writable

    try:
        check_writable(output)  # before anything starts
    except (OSError, ValueError) as e:
        raise RequestError(f"--output: {e}") from e
    run_demo(output, days, workers=n_workers, threads=threads)


@pyspy.command(
    help="Compare two saved profiles (.pyspy.gz, or speedscope .json[.gz] saved by dask-pyspy): "
    "a differential flame graph and the functions and task prefixes that gained or lost most, as an HTML page."
)
@click.argument("base")
@click.argument("new")
@click.option("-o", "--output", default="pyspy-diff.html", show_default=True, help="Output file (.html).")
def diff(base: str, new: str, output: str) -> None:
    from dask_pyspy.model import Profile
    from dask_pyspy.render.diff import check_output

    try:
        check_output(output)
    except (OSError, ValueError) as e:
        raise RequestError(f"--output: {e}") from e
    profiles = []
    for name, path in (("BASE", base), ("NEW", new)):
        try:
            profiles.append(Profile.load(path))
        except (OSError, ValueError) as e:
            raise RequestError(f"{name}: {e}") from e
    changes = profiles[1].diff(profiles[0])
    title = f"dask-pyspy diff: {os.path.basename(new)} against {os.path.basename(base)}"
    try:
        changes.save(output, title=title, base=base, new=new)
    except OSError as e:
        raise RequestError(f"--output: {e}") from e
    click.echo(f"Wrote {output}: {changes.base_seconds:.1f} -> {changes.new_seconds:.1f} sampled thread-seconds")
    for way in ("gained", "lost"):
        for row in changes.functions[way][:1]:
            click.echo(f"most {way}: {row['name']} ({row['file']}) {row['seconds']:+.3f} s")


main = pyspy
