"""The dask-pyspy 0.4 context managers, on the in-process sampler."""

from __future__ import annotations

import json

import pytest

from dask_pyspy.legacy import legacy_filename, pyspy, pyspy_on_scheduler
from tests.cluster.workload import alpha


def test_one_speedscope_file_per_worker(client, tmp_path):
    with pyspy(tmp_path / "prof", client=client):
        client.gather(client.map(alpha, range(200)))
    workers = list(client.scheduler_info()["workers"])
    files = sorted(p.name for p in (tmp_path / "prof").iterdir())
    assert files == sorted(legacy_filename(w) for w in workers)
    for name in files:
        doc = json.loads((tmp_path / "prof" / name).read_text())
        assert doc["$schema"] == "https://www.speedscope.app/file-format-schema.json"
        assert doc["profiles"] and all(p["type"] == "sampled" for p in doc["profiles"])


def test_scheduler_file(client, tmp_path):
    out = tmp_path / "scheduler.json"
    with pyspy_on_scheduler(out, client=client):
        client.gather(client.map(alpha, range(100)))
    doc = json.loads(out.read_text())
    names = [p["name"] for p in doc["profiles"]]
    assert names and all(n.startswith("scheduler ") for n in names)


def test_legacy_filename():
    assert legacy_filename("tcp://127.0.0.1:8786") == "tcp-127_0_0_1-8786.json"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"format": "flamegraph"}, "format must be 'speedscope'"),
        ({"extra_pyspy_args": ["--full-filenames"]}, "extra_pyspy_args cannot apply"),
    ],
)
def test_options_that_cannot_apply_are_refused(client, tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        with pyspy(tmp_path, client=client, **kwargs):
            pytest.fail("the block must not run")
