"""Hostile names from user code, read back by the real sampler, survive every export."""

from __future__ import annotations

import json
import threading
import time
import types

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dask_pyspy import Sampler
from dask_pyspy.render.report import render_html
from tests.conftest import wait_for


def spin(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(300))


def renamed(name: str) -> types.FunctionType:
    """`spin` whose code object carries `name` as function and file name, as py-spy reads them."""
    code = spin.__code__.replace(co_name=name, co_qualname=name, co_filename=name)
    return types.FunctionType(code, spin.__globals__)


@pytest.fixture(scope="module")
def sampler():
    s = Sampler(rate=500, cpu_budget=1.0)
    s.start()
    yield s
    s.stop()


names = st.text(min_size=1, max_size=300)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=names, key=names)
@example(name="<script>alert(1)</script>", key="<img src=x onerror=alert(1)>")
@example(name="a\x00b\n\"'&", key="\udc80 lone surrogate")
@example(name="f" * 20_000, key="k" * 100_000)
def test_names_survive_speedscope_and_html(sampler, name, key):
    stop = threading.Event()
    thread = threading.Thread(target=renamed(name), args=(stop,), name=name, daemon=True)
    start = time.time()
    thread.start()
    sampler.set_thread_tag(thread.ident, key, key)
    lossy_key = key.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    # py-spy skips (does not fail on) frames whose name or file is 4096 characters or more.
    wanted = {lossy_key} if len(name) >= 4096 else {lossy_key, name}

    def frame_names():
        doc = json.loads(sampler.profile(start=start, by="task").to_bytes(compress=False))  # valid JSON, any names
        return {f["name"] for f in doc["shared"]["frames"]}

    # Until the thread was sampled in `spin` under its tag: a loaded machine may take long.
    wait_for(lambda: wanted <= frame_names())
    stop.set()
    thread.join()
    sampler.clear_thread_tag(thread.ident)
    prof = sampler.profile(start=start, by="task")
    html = render_html(prof)
    for text in (name, key):
        # A short one ("<", "</td") may be the report's own markup.
        if "<" in text and len(text) >= 20:
            assert text not in html, "markup from user code is escaped"
    assert html.count("<script") == 2, "only the report's own scripts"
