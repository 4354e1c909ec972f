"""Windows over folded history (issue 34): four threads in `early_phase` for 10 s,
then four in `late_phase` for 40 s, sampled at 1000 Hz into a 1 MiB store, so the
recent window shrinks and both phases fold into minute buckets. Then windows over
them: padded around the run, partitioning it, and inside one phase. True shares are
the threads' own accounts of their busy time (perf_counter)."""

from __future__ import annotations

import threading
import time

from benchmarks.common import Section, table, verdict
from dask_pyspy import Profile, Sampler

THREADS = 4
MIB = 2**20


def spin(seconds: float, busy: list[float]) -> None:
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        sum(range(200))
    busy.append(time.perf_counter() - start)


def early_phase(seconds: float, busy: list[float]) -> None:
    spin(seconds, busy)


def late_phase(seconds: float, busy: list[float]) -> None:
    spin(seconds, busy)


PHASES = (early_phase, late_phase)


def phase_seconds(profile: Profile) -> dict[str, float]:
    """Seconds of samples with each phase function on their stack."""
    doc = profile.speedscope(by="thread")
    names = [f["name"] for f in doc["shared"]["frames"]]
    out = {p.__name__: 0.0 for p in PHASES}
    for prof in doc["profiles"]:
        for sample, weight in zip(prof["samples"], prof["weights"]):
            for phase in {names[i] for i in sample} & out.keys():
                out[phase] += weight
    return out


def run_phases(lengths: tuple[float, float]) -> tuple[list[float], dict[str, float]]:
    """Runs each phase on THREADS threads in turn; returns the times between them and
    each phase's busy seconds."""
    times, busy = [time.time()], {}
    for phase, seconds in zip(PHASES, lengths):
        account: list[float] = []
        threads = [threading.Thread(target=phase, args=(seconds, account)) for _ in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        times.append(time.time())
        busy[phase.__name__] = sum(account)
    return times, busy


def share(seconds: dict[str, float]) -> float:
    return 100 * seconds["early_phase"] / max(sum(seconds.values()), 1e-9)


def run(quick: bool) -> Section:
    lengths = (4.0, 16.0) if quick else (10.0, 40.0)
    sampler = Sampler(rate=1000, cpu_budget=1.0, idle=True, max_memory=MIB)
    sampler.start()
    try:
        (t0, t1, t2), busy = run_phases(lengths)
    finally:
        sampler.stop()
    store = sampler.stats()["store"]
    whole = phase_seconds(sampler.profile())
    padded = phase_seconds(sampler.profile(start=t0 - 1, stop=t2 + 1))
    cuts = [t0 - 1, t0 + lengths[0] / 3, t1, t1 + lengths[1] / 2, t2 + 1]
    parts = [phase_seconds(sampler.profile(start=lo, stop=hi)) for lo, hi in zip(cuts, cuts[1:])]
    summed = {p: sum(part[p] for part in parts) for p in whole}
    inside = phase_seconds(sampler.profile(start=t0, stop=t1 - 0.5))
    resolution = sampler.profile(start=t0 - 1, stop=t2 + 1).processes[0]["stats"]["resolution"]
    folded = sum(r["to"] - r["from"] for r in resolution if r["step"] > 0)
    rows = [
        ["threads' own account", f"{busy['early_phase']:.1f}", f"{busy['late_phase']:.1f}", f"{share(busy):.1f}%"],
        ["whole store", f"{whole['early_phase']:.1f}", f"{whole['late_phase']:.1f}", f"{share(whole):.1f}%"],
        ["window t0-1 .. t2+1", f"{padded['early_phase']:.1f}", f"{padded['late_phase']:.1f}", f"{share(padded):.1f}%"],
        ["4 windows partitioning it, summed", f"{summed['early_phase']:.1f}", f"{summed['late_phase']:.1f}", ""],
        ["window t0 .. t1-0.5 (early only)", f"{inside['early_phase']:.1f}", f"{inside['late_phase']:.2f}", ""],
    ]
    off = abs(share(padded) - share(busy))
    partition_off = max(abs(summed[p] - padded[p]) for p in padded)
    notes = [
        f"Store: {store['bytes'] / MIB:.2f} of 1 MiB, {store['buckets']} buckets, {store['samples_held']:,} raw "
        f"samples, {store['folded_held']:,} folded rows standing for {store['samples_folded']:,}; "
        f"{folded:.1f} s of the padded window folded (resolution).",
        f"Target: the padded window reads the early phase within 5 points of its true share. "
        f"{share(padded):.1f}% against {share(busy):.1f}%, {off:.1f} points: {verdict(off <= 5)}.",
        f"Target: windows that partition the run sum to the whole. Largest difference {partition_off:.6f} s: "
        f"{verdict(partition_off < 1e-3)}.",
        f"A window inside the early phase holds {inside['late_phase']:.2f} s of the late one, which ran in the "
        "same bucket after it.",
    ]
    return Section(
        "Windows over folded history (issue 34)",
        __doc__ or "",
        [table(["", "early_phase s", "late_phase s", "early share"], rows)],
        notes,
    )
