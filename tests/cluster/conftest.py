from __future__ import annotations

import pytest
from distributed import Client, LocalCluster

import dask_pyspy


def start_cluster(processes: bool, n_workers: int = 2) -> tuple[LocalCluster, Client]:
    cluster = LocalCluster(
        n_workers=n_workers,
        threads_per_worker=2,
        processes=processes,
        dashboard_address=":0",
        worker_dashboard_address=None,
    )
    client = Client(cluster)
    # A generous budget so short tests collect enough samples on a shared 2-core machine.
    client.register_plugin(dask_pyspy.PySpyPlugin(rate=200, cpu_budget=0.3))
    return cluster, client


@pytest.fixture
def fresh():
    """A cluster of its own, for tests that break or reshape it."""
    cluster, client = start_cluster(processes=True)
    yield cluster, client
    client.close()
    cluster.close()


@pytest.fixture(scope="module")
def client():
    cluster, client = start_cluster(processes=True)
    yield client
    client.close()
    cluster.close()
