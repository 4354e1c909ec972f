"""Free-threaded CPython (3.13t): the sampler reads it without turning the GIL back on,
and tags stay right while threads really run at once. Only a free-threaded build runs
these (ci/matrix.sh's 3.13t); elsewhere they are skipped, saying so."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from dask_pyspy import Sampler
from dask_pyspy.render.report import render_html
from tests.conftest import FREE_THREADED, frame_names

pytestmark = pytest.mark.skipif(not FREE_THREADED, reason="needs a free-threaded CPython (ci/matrix.sh runs 3.13t)")

THREADS = 8
KINDS = ("alpha", "beta")


def alpha_work(n: int) -> int:
    total = 0
    for i in range(n):
        total += i
    return total


def beta_work(n: int) -> int:
    total = 0
    for i in range(n):
        total -= i
    return total


WORK = {"alpha": "alpha_work", "beta": "beta_work"}


def run_tasks(sampler: Sampler, worker: int, stop: threading.Event) -> None:
    """Tasks of both kinds, about a millisecond each, tagged in this thread."""
    ident, n = threading.get_ident(), 0
    while not stop.is_set():
        for prefix, work in (("alpha", alpha_work), ("beta", beta_work)):
            sampler.set_thread_tag(ident, f"{prefix}-{worker}-{n}", prefix)
            work(20_000)
            sampler.clear_thread_tag(ident)
        n += 1


def judged(doc: dict) -> list[tuple[str, str, str]]:
    """(kind running, kind of the task key at the root, thread) for each sample of a
    `by="task"` document inside a task's own function."""
    out = []
    for profile in doc["profiles"]:
        for sample in profile["samples"]:
            names = frame_names(doc, sample)
            running = [k for k, fn in WORK.items() if fn in names]
            if running:
                out.append((running[0], names[0].split("-")[0], profile["name"]))
    return out


def test_importing_and_sampling_keep_the_gil_off():
    # A fresh process: what is judged is this package's import, not pytest's plugins.
    code = """
import json, sys, time
before = sys._is_gil_enabled()
from dask_pyspy import Sampler
from dask_pyspy.render.report import render_html
s = Sampler(rate=100)
s.start()
deadline = time.monotonic() + 60
while s.stats()["ticks"] < 20 and time.monotonic() < deadline:
    sum(range(10_000))
stats = s.stats()
s.stop()
print(json.dumps({"before": before, "after": sys._is_gil_enabled(), "reader": stats["reader"],
                  "reader_stats": stats["reader_stats"], "ticks": stats["ticks"]}))
"""
    out = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert out["before"] is False and out["after"] is False, out
    assert out["ticks"] >= 20 and out["reader"] == "fast", out
    assert out["reader_stats"]["free_threaded"] is True and out["reader_stats"]["gil_enabled"] is False, out


def test_pyspy_reader_is_refused_with_the_reason():
    s = Sampler(reader="pyspy")
    with pytest.raises(RuntimeError, match="py-spy's reader does not read free-threaded"):
        s.start()
    assert not s.is_running


def test_parallel_tasks_keep_their_own_tags():
    sampler = Sampler(rate=200, cpu_budget=0.5)
    sampler.start()
    stop = threading.Event()
    threads = [threading.Thread(target=run_tasks, args=(sampler, i, stop), name=f"t{i}") for i in range(THREADS)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 180
        while len(judged(sampler.profile(by="task").speedscope())) < 2000:
            assert time.monotonic() < deadline, "timed out waiting for 2000 samples inside tasks"
            time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join()
        sampler.stop()
    samples = judged(sampler.profile(by="task").speedscope())
    crossed = [s for s in samples if s[1] in KINDS and s[1] != s[0]]
    untagged = [s for s in samples if s[1] not in KINDS]
    assert not crossed, f"{len(crossed)} of {len(samples)} samples carry the other kind's tag"
    assert len(untagged) <= 0.02 * len(samples), f"{len(untagged)} of {len(samples)} samples lost their tag"
    sampled = {thread for _, _, thread in samples}
    assert all(any(f" t{i} (" in thread for thread in sampled) for i in range(THREADS)), sampled


def test_the_report_has_no_gil_columns_and_says_why():
    sampler = Sampler(rate=200, cpu_budget=0.5)
    sampler.start()
    stop = threading.Event()
    worker = threading.Thread(target=run_tasks, args=(sampler, 0, stop))
    worker.start()
    try:
        deadline = time.monotonic() + 60
        while sampler.profile().n_samples < 50:
            assert time.monotonic() < deadline, "timed out waiting for samples"
            time.sleep(0.2)
    finally:
        stop.set()
        worker.join()
        sampler.stop()
    html = render_html(sampler.profile(by="prefix"))
    assert "free-threaded (no-GIL) CPython with its GIL off" in html, "the report says why"
    assert "<th>on CPU</th>" in html
    assert not any(h in html for h in ("on CPU, GIL", "waiting for the GIL", "<th>GIL share</th>"))
