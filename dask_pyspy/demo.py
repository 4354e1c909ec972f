"""The main job: profile a realistic workload on a LocalCluster sized to this machine."""

from __future__ import annotations

import datetime
import importlib
import logging
import os
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from distributed import LocalCluster

    from dask_pyspy.model import Profile

SCHEDULER_CORES = 1  # left to the scheduler and the client, which share this process
MAX_WORKERS = 4  # more processes would only slow the demo's start
WORKLOAD_MODULES = ("dask.array", "dask.dataframe")
WINDOW = 100  # rows `slow_python_loop` looks back over, for each row
# What `remember_names` keeps in each worker, by partition: a cache nobody clears.
_SEEN: dict[int, list[str]] = {}


def sized(cores: int, workers: int | None = None, threads: int | None = None) -> tuple[int, int]:
    """Workers and threads per worker whose task threads fit `cores` beside the
    scheduler, so the demo's report shows no CPU waits the demo caused. A count given
    stays; the other fills the cores left."""
    free = max(1, cores - SCHEDULER_CORES)
    if workers is None:
        workers = max(1, free // threads) if threads else min(MAX_WORKERS, max(1, free // 2))
    if threads is None:
        threads = max(1, free // workers)
    return workers, threads


def slow_python_loop(part: Any) -> float:
    """Deliberately slow: the mean rank of each row of a partition (a pandas DataFrame)
    among the WINDOW rows before it, by a pure-Python loop where `rolling(...).rank()`
    would do it in C. The report's tables find it."""
    xs = part["x"].tolist()
    below = 0
    for i, x in enumerate(xs):
        for earlier in xs[max(0, i - WINDOW) : i]:
            if earlier < x:
                below += 1
    return below / max(len(xs), 1)


def remember_names(part: Any) -> int:
    """Keeps every name of a partition as Python strings in a module-level cache that is
    never cleared: unmanaged memory, which the report's memory section names."""
    _SEEN[id(part)] = [f"{name}:{i}" for i, name in enumerate(part["name"].tolist())]
    return len(_SEEN[id(part)])


def workload(days: int) -> Any:
    """A dataframe kept in the workers' memory, then its shuffle and groupby, a numpy QR
    decomposition, `slow_python_loop` and `remember_names`, each scaling with `days`
    (one partition a day): what the report tells apart, in time and in memory. Returns
    the kept dataframe: the workers hold it while the caller keeps it."""
    import dask
    import dask.array as da
    from distributed import wait

    end = datetime.date(2000, 1, 1) + datetime.timedelta(days=days)
    df = dask.datasets.timeseries(start="2000-01-01", end=end.isoformat(), freq="1s", partition_freq="1d")
    df = df.persist()  # results the workers hold: distributed's managed memory
    wait(df)
    dask.compute(df.shuffle("id").groupby("id").x.mean(), df.groupby("name").agg({"x": "std", "y": "mean"}))
    _, r = da.linalg.qr(da.random.random((400 * days, 1000), chunks=1000))  # a tall matrix's QR
    r.compute()
    dask.compute(*map(dask.delayed(slow_python_loop), df.to_delayed()))
    dask.compute(*map(dask.delayed(remember_names), df.to_delayed()))
    return df


def local_cluster(workers: int, threads: int) -> LocalCluster:
    """The demo's cluster: worker processes beside the scheduler in this one, quiet
    but for errors. Each worker applies `silence_logs` in its own process too, where a
    `logging` dask config would come too late (a spawned worker sets up its logging
    as it imports distributed, before it takes its nanny's config)."""
    from distributed import LocalCluster

    return LocalCluster(
        n_workers=workers,
        threads_per_worker=threads,
        processes=True,
        dashboard_address=":0",
        silence_logs=logging.ERROR,
    )


def run_demo(output: str, days: int, workers: int | None = None, threads: int | None = None) -> None:
    """Profile `workload(days)` on a new LocalCluster into `output`; workers and
    threads per worker are `sized` to this process's cores unless given."""
    from distributed import Client

    import dask_pyspy
    from dask_pyspy.render.findings import count

    _import_workload_modules()
    cores = len(os.sched_getaffinity(0))
    n_workers, n_threads = sized(cores, workers, threads)
    how = "as asked" if workers and threads else f"sized to {cores} cores, one kept for the scheduler"
    with local_cluster(n_workers, n_threads) as cluster, Client(cluster) as client:
        client.register_plugin(dask_pyspy.PySpyPlugin(memory=True))
        click.echo(f"Cluster up: {count(n_workers, 'worker')} x {count(n_threads, 'thread')} ({how})")
        click.echo(f"Dashboard: {client.dashboard_link}")
        click.echo(
            f"Profiling {days} days of data: a dataframe kept in memory and shuffled, a numpy QR, "
            "a slow Python function, a cache that is never cleared"
        )
        with dask_pyspy.profile(output, client=client) as rec:
            kept = workload(days)  # held until the report is written: its memory section shows it
        del kept
    assert rec.profile is not None, "set as the block ended"
    _tell(rec.profile, output)


def _import_workload_modules() -> None:
    """Before the cluster starts, and before the window: the report shows the work, not
    this process importing pandas and pyarrow."""
    for name in WORKLOAD_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise click.ClickException(f"the demo needs {name}: pip install 'dask-pyspy[demo]' ({e})") from e


def _tell(prof: Profile, output: str) -> None:
    """What the profile found, what sampling cost, and where the report is."""
    from dask_pyspy.render.findings import named

    click.echo(prof.summary())
    for proc in prof.processes:
        s = proc["stats"]
        cpu = 100 * s["cpu_fraction"]
        click.echo(f"Sampler in {named(proc['name'])}: {s['achieved_rate']:.0f} Hz achieved, {cpu:.1f}% of a core")
    click.echo(f"Report: {os.path.abspath(output)}")
