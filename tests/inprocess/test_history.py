"""Windows over folded history, on real threads: a window takes the share of each
folded row that ran inside it, so its edges are right and windows that partition a
run add up to it."""

from __future__ import annotations

import threading
import time

from dask_pyspy import Profile, Sampler
from tests.conftest import weight_by_function


def early_phase(seconds: float) -> None:
    _spin(seconds)


def late_phase(seconds: float) -> None:
    _spin(seconds)


def _spin(seconds: float) -> None:
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        sum(range(200))


def seconds_by_function(profile: Profile) -> dict[str, float]:
    doc = profile.speedscope(by="thread")
    out: dict[str, float] = {}
    for p in doc["profiles"]:
        for name, seconds in weight_by_function(doc, p).items():
            out[name] = out.get(name, 0.0) + seconds
    return out


def run_phases(sampler: Sampler) -> tuple[float, float, float]:
    """Two threads in early_phase for 2 s, then two in late_phase for 3 s; the times
    before, between and after."""
    times = [time.time()]
    for phase, seconds in ((early_phase, 2.0), (late_phase, 3.0)):
        threads = [threading.Thread(target=phase, args=(seconds,)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        times.append(time.time())
    return times[0], times[1], times[2]


def test_windows_over_folded_buckets_are_right_at_their_edges():
    # Everything folds at once into 30 s buckets: both phases share a bucket or two.
    # Idle threads too, so a thread waiting for the GIL keeps its time.
    sampler = Sampler(rate=200, cpu_budget=1.0, idle=True, recent=0, history_step=30)
    sampler.start()
    try:
        t0, t1, t2 = run_phases(sampler)
    finally:
        sampler.stop()
    store = sampler.stats()["store"]
    assert store["samples_folded"] > 100 * store["samples_held"], store  # all but the last tick's
    whole = seconds_by_function(sampler.profile())
    padded = seconds_by_function(sampler.profile(start=t0 - 1, stop=t2 + 1))
    # A window padded around the run holds all of each phase, where it used to drop a
    # bucket begun before its start and count whole one begun inside it. (Against the
    # store, not the threads' own account: on a loaded machine a starved sampler misses
    # time, which is not what this tests.)
    for name in ("early_phase", "late_phase"):
        assert padded[name] > 0 and abs(padded[name] - whole[name]) < 1e-3, (name, padded, whole)
    # Windows that partition the run add up to it.
    cuts = [t0 - 1, t0 + 0.7, t1, t1 + 1.3, t2 + 1]
    parts: dict[str, float] = {}
    for lo, hi in zip(cuts, cuts[1:]):
        for name, seconds in seconds_by_function(sampler.profile(start=lo, stop=hi)).items():
            parts[name] = parts.get(name, 0.0) + seconds
    for name in ("early_phase", "late_phase"):
        assert abs(parts[name] - padded[name]) < 1e-3, (name, parts, padded)
    # A window inside the early phase holds early time, and almost none of the late
    # phase that ran in the same bucket after it (a row's extent is kept in 256ths of
    # its bucket: 0.12 s here).
    inside = seconds_by_function(sampler.profile(start=t0, stop=t1 - 0.3))
    assert inside["early_phase"] > 0.7 * padded["early_phase"], (inside, padded)
    assert inside.get("late_phase", 0.0) < 0.01, inside
    resolution = sampler.profile(start=t0, stop=t2).processes[0]["stats"]["resolution"]
    assert resolution[0]["step"] == 30 and all(r["step"] == 0 for r in resolution[1:]), resolution  # the last tick raw
    assert resolution[0]["from"] >= t0 - 1e-6 and resolution[-1]["to"] <= t2 + 1e-6, "clipped to the window"
