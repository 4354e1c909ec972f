"""The main job: profile a realistic dataframe workload on a LocalCluster."""

from __future__ import annotations

import click


def workload(days: int) -> None:
    """A shuffle-heavy dataframe job and a pure-Python one, as users run them."""
    import dask
    import dask.bag as db

    df = dask.datasets.timeseries(
        start="2000-01-01", end=f"2000-01-{1 + min(days, 30):02d}", freq="1s", partition_freq="1d"
    )
    df.set_index("id")[["x", "y"]].mean().compute()
    df.groupby("name").x.std().compute()
    db.range(200_000, npartitions=40).map(lambda i: sum(range(i % 500))).sum().compute()


def run_demo(output: str, n_workers: int = 2, threads: int = 2, days: int = 20) -> None:
    from distributed import Client, LocalCluster

    import dask_pyspy
    from dask_pyspy.files import check_writable

    check_writable(output)  # before anything starts
    with (
        LocalCluster(
            n_workers=n_workers, threads_per_worker=threads, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        client.register_plugin(dask_pyspy.PySpyPlugin())
        click.echo(f"Cluster up: {n_workers} workers x {threads} threads; dashboard {client.dashboard_link}")
        with dask_pyspy.profile(output, client=client) as rec:
            workload(days)
        prof = rec.profile
    assert prof is not None, "set as the block ended"
    start, stop = prof.metadata["window"]  # the workload's time, not collecting and shutting down
    click.echo(f"Profiled {stop - start:.1f} s: {prof.n_samples} samples from {len(prof.processes)} processes")
    for proc in prof.processes:
        s = proc["stats"]
        cpu = 100 * s["cpu_fraction"]
        click.echo(f"  {proc['name']}: {s['achieved_rate']:.0f} Hz achieved, sampler CPU {cpu:.1f}% of a core")
    click.echo(f"Saved {output}")
