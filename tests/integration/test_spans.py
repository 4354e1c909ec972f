"""Profiles by dask span (`distributed.span`) on a real cluster: grouping, filtering,
nesting, spans the scheduler forgot, and the CLI."""

from __future__ import annotations

import json
import subprocess
import time

import pytest
from distributed import span

from tests.conftest import frame_names
from tests.integration.test_cli import DASK
from tests.integration.workload import alpha, beta


def span_weights(doc: dict) -> dict[tuple[str, ...], float]:
    """Seconds per (span path..., task prefix) root chain of the merged by-span profile."""
    frames = doc["shared"]["frames"]
    merged = doc["profiles"][0]
    assert merged["name"] == "whole cluster by span (task code only)"
    out: dict[tuple[str, ...], float] = {}
    for sample, weight in zip(merged["samples"], merged["weights"]):
        roots = tuple(frames[f]["name"] for f in sample if frames[f]["file"] in ("dask span", "dask task"))
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
        a = client.map(alpha, range(300), [0.01] * 300, pure=False)
    with span("train"):
        b = client.map(beta, range(300), [0.01] * 300, pure=False)
    client.gather(a + b)  # submitted together: the two spans run at once
    prof = client.pyspy_profile(start=start, by="span")
    weights = span_weights(prof.speedscope())
    alphas, betas = under(weights, "alpha"), under(weights, "beta")
    assert share(alphas, ("ingest",)) >= 0.99, alphas
    assert share(betas, ("train",)) >= 0.99, betas

    only = client.pyspy_profile(start=start, span="ingest").summary()
    samples = {p["prefix"]: p["samples"] for p in only["prefixes"]}
    whole = {p["prefix"]: p["samples"] for p in prof.summary()["prefixes"]}
    assert samples.get("alpha", 0) >= 0.99 * sum(samples.values()), samples
    assert samples["alpha"] == whole["alpha"], "the filter keeps every sample of the span"
    assert only["untagged_seconds"] == 0


def test_nested_spans_and_their_filters(client):
    start = time.time()
    with span("outer") as outer_id:
        a = client.map(alpha, range(200), [0.01] * 200, pure=False)
        with span("inner"):
            b = client.map(beta, range(200), [0.01] * 200, pure=False)
    client.gather(a + b)
    prof = client.pyspy_profile(start=start, by="span")
    weights = span_weights(prof.speedscope())
    assert share(under(weights, "alpha"), ("outer",)) >= 0.99
    assert share(under(weights, "beta"), ("outer", "inner")) >= 0.99
    paths = {tuple(s["path"]): s["samples"] for s in prof.summary()["spans"]}
    assert paths[("outer",)] > paths[("outer", "inner")] > 0, "a span counts the spans nested in it"

    def prefixes(**request):
        return {p["prefix"] for p in client.pyspy_profile(start=start, **request).summary()["prefixes"]}

    assert prefixes(span="outer") == {"alpha", "beta"}
    assert prefixes(span=outer_id) == {"alpha", "beta"}, "by id, with its nested spans"
    assert prefixes(span="inner") == {"beta"}
    assert prefixes(span=("outer", "inner")) == {"beta"}
    assert prefixes(span=["inner"]) == set(), "a path starts at the outermost span"


def test_a_span_the_scheduler_forgot_keeps_a_name(client):
    start = time.time()
    with span("forgotten") as named_id:
        named = client.map(alpha, range(100), [0.01] * 100, pure=False)
    default = client.map(beta, range(100), [0.01] * 100, pure=False)
    client.gather(named + default)
    default_id = client.run_on_scheduler(_span_of, default[0].key)
    client.run_on_scheduler(_forget, ids=[named_id, default_id])
    try:
        paths = {tuple(s["path"]) for s in client.pyspy_profile(start=start).summary()["spans"]}
    finally:
        client.run_on_scheduler(_forget, ids=[])
    # The worker read the name from the task's annotation; the default span has none.
    assert ("forgotten",) in paths and (default_id,) in paths, paths


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


def test_record_by_span_from_the_cli(client, tmp_path):
    out = tmp_path / "spans.json"
    cli = subprocess.Popen([DASK, "pyspy", "record", "--scheduler", client.scheduler.address, "--duration", "2",
                            "--by", "span", "--span", "cli-span", "-o", str(out)], stderr=subprocess.PIPE, text=True)
    while cli.poll() is None:  # work in the span and outside it until the recording ends
        with span("cli-span"):
            inside = client.map(alpha, range(40), [0.01] * 40, pure=False)
        client.gather(inside + client.map(beta, range(40), [0.01] * 40, pure=False))
    assert cli.wait(timeout=120) == 0, cli.stderr.read()
    doc = json.loads(out.read_text())
    weights = span_weights(doc)
    assert weights and all(path[0] == "cli-span" for path in weights), weights
    assert any(frame_names(doc, s)[-1] == "spin" for s in doc["profiles"][0]["samples"])
