"""Profiles by dask span (`distributed.span`) on a real cluster: grouping, filtering,
nesting, spans the scheduler forgot, and the CLI."""

from __future__ import annotations

import json
import subprocess
import time
import uuid

import pytest
from distributed import span

from dask_pyspy import _native
from dask_pyspy.client import _call
from tests.cluster.test_cli import DASK, one_line_error, run
from tests.cluster.workload import spin_for
from tests.conftest import frame_names


def tasks(client, prefix: str, n: int) -> list:
    """`n` tasks of 10 ms, keys of task prefix `prefix`. distributed puts a task group (one
    prefix) in one span, the span of its first tasks while the group lives: each test
    uses prefixes of its own, so no earlier test's group decides its spans."""
    run = uuid.uuid4().hex
    return [client.submit(spin_for, 0.01, key=f"{prefix}-{run}-{i}") for i in range(n)]


def span_weights(doc: dict) -> dict[tuple[str, ...], float]:
    """Seconds per (span path..., task prefix) root chain of the merged by-span profile."""
    frames = doc["shared"]["frames"]
    merged = doc["profiles"][0]
    assert merged["name"] == "whole cluster by span (task code only)"
    out: dict[tuple[str, ...], float] = {}
    for sample, weight in zip(merged["samples"], merged["weights"]):
        roots = tuple(frames[f]["name"] for f in sample if frames[f]["file"] in ("dask span", "dask task"))
        if roots:  # samples outside tasks root at their activity instead
            out[roots] = out.get(roots, 0.0) + weight
    return out


def under(weights: dict[tuple[str, ...], float], prefix: str) -> dict[tuple[str, ...], float]:
    """Seconds of `prefix`'s samples per span path."""
    return {k[:-1]: w for k, w in weights.items() if k[-1] == prefix}


def share(part: dict[tuple[str, ...], float], path: tuple[str, ...]) -> float:
    return part.get(path, 0.0) / max(sum(part.values()), 1e-9)


def test_two_spans_at_once_keep_their_own_tasks(client):
    start = time.time()
    with span("ingest"):
        a = tasks(client, "ingest_work", 300)
    with span("train"):
        b = tasks(client, "train_work", 300)
    client.gather(a + b)  # submitted together: the two spans run at once
    prof = client.pyspy_profile(start=start, by="span")
    weights = span_weights(prof.speedscope())
    ingest, train = under(weights, "ingest_work"), under(weights, "train_work")
    assert share(ingest, ("ingest",)) >= 0.99, ingest
    assert share(train, ("train",)) >= 0.99, train

    only = client.pyspy_profile(start=start, span="ingest").summary()
    samples = {p["prefix"]: p["samples"] for p in only["prefixes"]}
    whole = {p["prefix"]: p["samples"] for p in prof.summary()["prefixes"]}
    assert samples.get("ingest_work", 0) >= 0.99 * sum(samples.values()), samples
    assert samples["ingest_work"] == whole["ingest_work"], "the filter keeps every sample of the span"
    assert only["untagged"]["seconds"] == 0


def test_nested_spans_and_their_filters(client):
    start = time.time()
    with span("outer") as outer_id:
        a = tasks(client, "outer_work", 200)
        with span("inner"):
            b = tasks(client, "inner_work", 200)
    client.gather(a + b)
    prof = client.pyspy_profile(start=start, by="span")
    weights = span_weights(prof.speedscope())
    assert share(under(weights, "outer_work"), ("outer",)) >= 0.99
    assert share(under(weights, "inner_work"), ("outer", "inner")) >= 0.99
    paths = {tuple(s["path"]): s["samples"] for s in prof.summary()["spans"]}
    assert paths[("outer",)] > paths[("outer", "inner")] > 0, "a span counts the spans nested in it"

    def prefixes(**request):
        return {p["prefix"] for p in client.pyspy_profile(start=start, **request).summary()["prefixes"]}

    assert prefixes(span="outer") == {"outer_work", "inner_work"}
    assert prefixes(span=outer_id) == {"outer_work", "inner_work"}, "by id, with its nested spans"
    assert prefixes(span="inner") == {"inner_work"}
    assert prefixes(span=("outer", "inner")) == {"inner_work"}
    with pytest.raises(ValueError, match=r"no span has the path \('inner',\)"):  # a path starts at the outermost span
        prefixes(span=["inner"])


def reply_bytes(client, **request) -> int:
    """Bytes of samples in the processes' parts of the scheduler's reply: what moved to
    it, but each process's stats (the same whatever the span)."""
    parts = client.sync(_call, client, "pyspy_profile", **request)["parts"].values()
    return sum(_native.Profile.wire_head(part)["body_bytes"] for part in parts)


def test_workers_send_only_the_samples_of_the_span_asked_for(client):
    start = time.time()
    with span("moved") as moved_id:
        inside = tasks(client, "moved_work", 100)
    client.gather(inside + tasks(client, "stays_work", 400))
    stop = time.time()
    window = {"start": start, "stop": stop}
    for request in ({"span": "moved"}, {"span": moved_id}, {"span": ("moved",)}):
        assert reply_bytes(client, **request, **window) < reply_bytes(client, **window) / 2, request
        filtered = client.pyspy_profile(**request, **window).summary()
        after = client.pyspy_profile(**window).only_span(request["span"]).summary()
        assert filtered["prefixes"] == after["prefixes"] and filtered["samples"] == after["samples"] > 0, request
    aggregated = client.pyspy_profile(span="moved", aggregate=True, **window).summary()
    assert {p["prefix"] for p in aggregated["prefixes"]} == {"moved_work"}


def test_a_span_the_scheduler_forgot_keeps_a_name(client):
    start = time.time()
    with span("forgotten") as named_id:
        named = tasks(client, "named_work", 100)
    default = tasks(client, "default_work", 100)
    client.gather(named + default)
    default_id = client.run_on_scheduler(_span_of, default[0].key)
    client.run_on_scheduler(_forget, ids=[named_id, default_id])
    try:
        paths = {tuple(s["path"]) for s in client.pyspy_profile(start=start).summary()["spans"]}
    finally:
        client.run_on_scheduler(_forget, ids=[])
    # The worker read the name from the task's annotation; the default span has none.
    assert ("forgotten",) in paths and (default_id,) in paths, paths


def test_an_id_the_scheduler_forgot_keeps_the_spans_nested_in_it(client):
    start = time.time()
    with span("lost") as lost_id, span("child"):
        inside = tasks(client, "lost_child_work", 100)
    client.gather(inside + tasks(client, "beside_work", 100))
    child_id = client.run_on_scheduler(_span_of, inside[0].key)
    client.run_on_scheduler(_forget, ids=[lost_id, child_id])
    try:
        # The scheduler resolves the id to itself alone; the workers add the spans they named in it.
        kept = client.pyspy_profile(start=start, span=lost_id).summary()["prefixes"]
    finally:
        client.run_on_scheduler(_forget, ids=[])
    assert {p["prefix"] for p in kept} == {"lost_child_work"}


def _span_of(key, dask_scheduler=None):
    return dask_scheduler.tasks[key].group.span_id


class _Forgetful(dict):
    """The scheduler's spans, with some hidden from lookups by `get` (as ours are) while
    distributed's own indexing still finds them: removing them would break its heartbeats."""

    hidden: frozenset = frozenset()

    def get(self, key, default=None):
        return default if key in self.hidden else super().get(key, default)


def _forget(ids, dask_scheduler=None):
    ext = dask_scheduler.extensions["spans"]
    if ids:
        ext.spans = _Forgetful(ext.spans)
        ext.spans.hidden = frozenset(ids)
    else:
        ext.spans = dict(ext.spans)


@pytest.mark.parametrize("span_arg", ["", 3, [], ["load", 1]])
def test_bad_span_is_refused(client, span_arg):
    with pytest.raises(ValueError, match="span must be None, a span name or id"):
        client.pyspy_profile(last=1, span=span_arg)


def test_an_unknown_span_is_refused_naming_the_known_ones(client, tmp_path):
    start = time.time()
    with span("known"):
        client.gather(tasks(client, "known_work", 40))
    with pytest.raises(ValueError, match=r"span: no span is named 'nope' or has that id; span names: .*'known'"):
        client.pyspy_profile(start=start, span="nope")
    with pytest.raises(ValueError, match=r"span: no span has the path \('known', 'nope'\); span paths: .*\('known',\)"):
        client.pyspy_profile(start=start, span=("known", "nope"))
    assert client.pyspy_profile(start=start, span="known").n_samples > 0
    # An id passes unknown: samples keep the id of a span the scheduler cannot name.
    assert client.pyspy_profile(start=start, span=str(uuid.uuid4())).n_samples == 0
    one_line_error(
        run(
            "record",
            "--scheduler",
            client.scheduler.address,
            "--duration",
            "0.5",
            "--span",
            "nope",
            "-o",
            str(tmp_path / "x.html"),
        ),
        "span: no span is named 'nope'",
    )


def test_record_by_span_from_the_cli(client, tmp_path):
    out = tmp_path / "spans.json"
    cli = subprocess.Popen(
        [
            DASK,
            "pyspy",
            "record",
            "--scheduler",
            client.scheduler.address,
            "--duration",
            "2",
            "--by",
            "span",
            "--span",
            "cli-span",
            "-o",
            str(out),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    while cli.poll() is None:  # work in the span and outside it until the recording ends
        with span("cli-span"):
            inside = tasks(client, "cli_work", 40)
        client.gather(inside + tasks(client, "outside_work", 40))
    assert cli.wait(timeout=120) == 0, cli.stderr.read()
    doc = json.loads(out.read_text())
    weights = span_weights(doc)
    assert weights and all(path[0] == "cli-span" for path in weights), weights
    assert any(frame_names(doc, s)[-1] == "spin" for s in doc["profiles"][0]["samples"])
