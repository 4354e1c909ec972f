"""Collecting a 16-worker cluster's 10 minutes (issue 13): `client.pyspy_profile()` and report latency,
the scheduler's transient memory, and event-loop stalls, with a task stream running."""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from distributed import Client, Future

import dask_pyspy
import dask_pyspy.client
from benchmarks.common import Section, spread, table, verdict
from benchmarks.merge_scale import scale_rows
from benchmarks.process_cluster import N_WORKERS, THREADS, cluster
from benchmarks.stacks import PREFIXES, TASKS
from benchmarks.stacks import VARIANTS as PATHS_PER_PREFIX

RATE = 1000  # 10x the default: time runs 10x faster where the machine keeps up
TARGET = 240_000  # samples per worker: 10 minutes at 100 Hz x 4 busy threads
IN_FLIGHT = 8 * N_WORKERS * THREADS  # tasks kept queued or running: the scheduler never runs dry
BYS = ("thread", "task", "prefix")
MEASURE_TASK_SECONDS = (2.0, 4.0)  # ~20 tasks/s on 64 threads while measuring
# Each entry is one set of rows; `aggregate` is new, and rows without it say "not available".
VARIANTS: list[dict[str, Any]] = [{}, {"aggregate": True}]
MIB = 2**20


# --- the task stream ---


class TaskStream:
    """Keeps IN_FLIGHT tasks queued or running, from a background thread: of 50-300 ms
    while filling, longer (`pace`) while measuring, so dask's own work per task leaves the
    2 cores room and a stall is the collection's, not the load's."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.seconds = (0.05, 0.3)
        self.finished = self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="task-stream", daemon=True)

    def __enter__(self) -> TaskStream:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        rng = random.Random(0)
        futures: set[Future] = set()
        while not self._stop.is_set():
            done = {f for f in futures if f.done()}
            self.finished += len(done)
            self.errors += sum(f.status == "error" for f in done)
            futures -= done
            batch: dict[str, list[tuple[int, float]]] = {}
            for _ in range(IN_FLIGHT - len(futures)):
                batch.setdefault(rng.choice(PREFIXES), []).append(
                    (rng.randrange(PATHS_PER_PREFIX), rng.uniform(*self.seconds))
                )
            for prefix, args in batch.items():
                variants, seconds = zip(*args)
                futures.update(self.client.map(TASKS[prefix], variants, seconds, pure=False))
            self._stop.wait(0.05)
        self.client.cancel(list(futures))


# --- event-loop stall monitors on the scheduler and every worker ---


def _waited_s() -> float:
    """Seconds this thread has spent runnable but not running (schedstat's run delay)."""
    with open("/proc/thread-self/schedstat") as f:
        return int(f.read().split()[1]) / 1e9


def _install(server: Any) -> None:
    # The worst stall, and how much of it the loop's thread spent waiting for a CPU:
    # the rest it waited for the GIL or ran something else.
    state = {"max": 0.0, "waiting": 0.0}

    async def watch() -> None:
        while True:
            t, waited = time.perf_counter(), _waited_s()
            await asyncio.sleep(0.005)
            stall = time.perf_counter() - t - 0.005
            if stall > state["max"]:
                state["max"], state["waiting"] = stall, _waited_s() - waited

    server.pyspy_bench_stall = state
    server.pyspy_bench_task = asyncio.ensure_future(watch())  # held: a bare task may be collected


def _take(server: Any) -> tuple[float, float]:
    """The worst stall since the last take and its wait for a CPU; starts a new window."""
    state = server.pyspy_bench_stall
    worst = state["max"], state["waiting"]
    state["max"] = state["waiting"] = 0.0
    return worst


async def _install_worker(dask_worker: Any) -> None:
    _install(dask_worker)


async def _install_scheduler(dask_scheduler: Any) -> None:
    _install(dask_scheduler)


def _take_worker(dask_worker: Any) -> tuple[float, float]:
    return _take(dask_worker)


def _take_scheduler(dask_scheduler: Any) -> tuple[float, float]:
    return _take(dask_scheduler)


def take_stalls(client: Client) -> dict[str, float]:
    """Worst stall (s) since the last call, the scheduler's and the worst worker's, and
    the part of each its loop waited for a CPU."""
    sched = client.run_on_scheduler(_take_scheduler)
    work = max(client.run(_take_worker).values())
    return {"sched": sched[0], "sched_cpu": sched[1], "work": work[0], "work_cpu": work[1]}


# --- the samplers ---


def _store() -> dict[str, Any]:
    st = dask_pyspy.sampler.process_sampler.sampler.stats()
    return {
        "held": st["store"]["samples_held"],
        "evicted": st["store"]["samples_evicted"],
        "bytes": st["store"]["bytes"],
        "hz": st["achieved_rate"],
    }


def _pause() -> None:
    dask_pyspy.sampler.process_sampler.sampler.stop()  # its samples stay in the store


def fill(client: Client, deadline: float) -> tuple[float, dict[str, dict[str, Any]]]:
    """Sample until every worker holds TARGET samples or `deadline` s pass, pausing each
    sampler as its store gets there (they sample at different rates), then the rest."""
    began = time.perf_counter()
    paused: set[str] = set()
    while True:
        stores = client.run(_store)
        held = min(s["held"] for s in stores.values())
        print(
            f"\r  filling: {time.perf_counter() - began:.0f} s, {held:,} samples in the emptiest store",
            end="",
            flush=True,
        )
        full = [w for w, s in stores.items() if s["held"] >= TARGET and w not in paused]
        if full:
            client.run(_pause, workers=full)
            paused.update(full)
        if len(paused) == len(stores) or time.perf_counter() - began > deadline:
            break
        time.sleep(0.5)
    print()
    client.run(_pause)
    client.run_on_scheduler(_pause)
    return time.perf_counter() - began, client.run(_store)


# --- what the scheduler and the client receive ---


def unknown_keyword(error: TypeError, variant: dict[str, Any]) -> None:
    """Returns if `error` is about a keyword of `variant` (which today's code may lack); else raises it."""
    if not any(name in str(error) for name in variant):
        raise error


async def _reply(start: float, stop: float, variant: dict[str, Any], dask_worker: Any) -> bytes:
    reply = await dask_worker.handlers["pyspy_profile"](start=start, stop=stop, **variant)
    return getattr(reply, "data", reply)  # the bytes, sent as a frame in a `Serialize` since issue 21


def worker_replies(client: Client, variant: dict[str, Any]) -> dict[str, bytes] | None:
    """Each worker's reply to the scheduler for the whole window; None if the handler takes no `variant`."""
    stop = time.time()
    try:
        return client.run(_reply, stop - 3600, stop, variant)
    except TypeError as e:
        unknown_keyword(e, variant)
        return None


class ReplyMeter:
    """Size and arrival time of the scheduler's `pyspy_profile` replies to this client, read where the
    client receives them (a wrapper on `dask_pyspy.client._call`; without one, nothing is read)."""

    def __init__(self) -> None:
        self.size: int | None = None
        self.arrived = 0.0
        self._call = getattr(dask_pyspy.client, "_call", None)

    def __enter__(self) -> ReplyMeter:
        if self._call is not None:
            dask_pyspy.client._call = self._metered
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._call is not None:
            dask_pyspy.client._call = self._call

    async def _metered(self, client: Client, op: str, **kwargs: Any) -> Any:
        reply = await self._call(client, op, **kwargs)
        if op == "pyspy_profile" and isinstance(reply, dict) and "parts" in reply:
            self.size, self.arrived = sum(map(len, reply["parts"].values())), time.perf_counter()
        return reply


def distinct_stacks(wire: bytes) -> int:
    """Distinct thread stacks in one worker's reply."""
    doc = dask_pyspy.Profile.from_wire(wire).speedscope(by="thread")
    return len({tuple(s) for p in doc["profiles"] for s in p["samples"]})


# --- the scheduler's memory and CPU ---


def status_kib(pid: int, name: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(name + ":"))


def reset_peak(pid: int) -> int:
    """Resets VmHWM to the current RSS; returns that RSS (KiB)."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")
    return status_kib(pid, "VmRSS")


def _cpu(stat: str) -> float:
    with open(stat) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def off_loop_cpu(pid: int) -> float:
    """User + system CPU seconds of the process's threads but its main one (the event loop), ended ones
    included: the collection's export, merge and encoding run there, the task stream's work barely."""
    return _cpu(f"/proc/{pid}/stat") - _cpu(f"/proc/{pid}/task/{pid}/stat")


# --- the operations ---

OPS = (*BYS, "report")


def accepts(client: Client, variant: dict[str, Any]) -> bool:
    """Whether `client.pyspy_profile` takes the variant's keywords (an empty window tells, cheaply)."""
    try:
        client.pyspy_profile(start=time.time() - 0.001, stop=time.time(), **variant)
    except TypeError as e:
        unknown_keyword(e, variant)
        return False
    return True


@dataclass
class Rig:
    client: Client
    pid: int  # the scheduler's
    out: str  # where saves go
    meter: ReplyMeter


def collect(rig: Rig, op: str, variant: dict[str, Any]) -> dict[str, float]:
    """One collection (by=op; the default for the HTML report), then its save."""
    take_stalls(rig.client)
    rss, cpu = reset_peak(rig.pid), off_loop_cpu(rig.pid)
    rig.meter.size = None
    began = time.perf_counter()
    prof = rig.client.pyspy_profile(last=3600, **({} if op == "report" else {"by": op}), **variant)
    collected = time.perf_counter()
    peak, cpu = status_kib(rig.pid, "VmHWM"), off_loop_cpu(rig.pid) - cpu
    stalls = take_stalls(rig.client)
    prof.save(os.path.join(rig.out, "report.html" if op == "report" else f"profile-{op}.json.gz"))
    saved = time.perf_counter()
    size = rig.meter.size
    return {
        "collect": collected - began,
        "save": saved - collected,
        "total": saved - began,
        "decode": collected - rig.meter.arrived if size else float("nan"),
        "reply": size or float("nan"),
        "transient": (peak - rss) * 1024,
        "cpu": cpu,
        **stalls,
    }


def baseline(rig: Rig, seconds: float) -> dict[str, float]:
    """The same load and no collection, for `seconds`: stalls and the scheduler's CPU."""
    take_stalls(rig.client)
    cpu = off_loop_cpu(rig.pid)
    time.sleep(seconds)
    return {"seconds": seconds, "cpu": off_loop_cpu(rig.pid) - cpu, **take_stalls(rig.client)}


def request(variant: dict[str, Any], by: str | None = None) -> str:
    given = {**({} if by is None else {"by": by}), **variant}
    return f"pyspy_profile(last=3600{''.join(f', {k}={v!r}' for k, v in given.items())})"


def label(op: str, variant: dict[str, Any]) -> str:
    if op == "report":
        return f"report: {request(variant)} + save .html"
    return f"{request(variant, op)} + save .json.gz"


def op_row(op: str, variant: dict[str, Any], runs: list[dict[str, float]], received: int | None) -> list[object]:
    def col(k, scale=1.0):
        return [scale * r[k] for r in runs]

    ratio = spread([v / received for v in col("transient")], "{:.1f}") if received else "?"
    return [
        label(op, variant),
        spread(col("collect"), "{:.2f}"),
        spread(col("decode"), "{:.2f}"),
        spread(col("save"), "{:.2f}"),
        spread(col("total"), "{:.2f}"),
        spread(col("cpu"), "{:.2f}"),
        spread(col("transient", 1 / MIB), "{:.0f}"),
        ratio,
        *stall_cells(col),
    ]


def baseline_row(bases: list[dict[str, float]]) -> list[object]:
    def col(k, scale=1.0):
        return [scale * b[k] for b in bases]

    return [
        f"baseline: no collection, {spread(col('seconds'), '{:.1f}')} s",
        "-",
        "-",
        "-",
        "-",
        spread(col("cpu"), "{:.2f}"),
        "-",
        "-",
        *stall_cells(col),
    ]


def stall_cells(col: Callable[[str, float], list[float]]) -> list[str]:
    return [spread(col(k, 1000), "{:.0f}") for k in ("sched", "sched_cpu", "work", "work_cpu")]


def notes_for(
    variant: dict[str, Any],
    results: dict[str, list[dict[str, float]]],
    bases: list[dict[str, float]],
    received: int | None,
) -> list[str]:
    name = f" ({', '.join(f'{k}={v!r}' for k, v in variant.items())})" if variant else ""
    collect = max(statistics.median(r["collect"] for r in results[b]) for b in BYS)
    report = statistics.median(r["total"] for r in results["report"])
    runs = [r for rs in results.values() for r in rs]
    # Worst stall while collecting minus the worst in any baseline window.
    sched = max(r["sched"] for r in runs) - max(b["sched"] for b in bases)
    work = max(r["work"] for r in runs) - max(b["work"] for b in bases)
    notes = [
        f"Target (issue 13){name}: pyspy_profile < 2 s. Measured {collect:.2f} s (slowest grouping, median): "
        f"{verdict(collect < 2)}.",
        f"Target (issue 13){name}: report < 4 s. Measured {report:.2f} s (median): {verdict(report < 4)}.",
        f"Target (issue 13){name}: no event loop stalled > 50 ms beyond its baseline. Worst stall while collecting "
        f"minus worst in a baseline: scheduler {1000 * sched:+.0f} ms, workers {1000 * work:+.0f} ms: "
        f"{verdict(max(sched, work) <= 0.05)}.",
    ]
    noise = max(max(b["sched"], b["work"]) for b in bases)
    if noise > 0.05:
        notes.append(
            f"The baseline itself stalled {1000 * noise:.0f} ms at worst: on this loaded machine the stall "
            "verdict cannot resolve differences near 50 ms."
        )
    if received:
        ratio = max(r["transient"] for r in runs) / received
        notes.append(
            f"Target (issue 13){name}: scheduler transient memory < 4x the bytes it received from workers. "
            f"Measured {ratio:.2f}x at worst: {verdict(ratio < 4)}."
        )
    return notes


# --- the section ---


@dataclass
class Measured:
    rows: list[list[object]]
    sizes: list[object]
    notes: list[str] = field(default_factory=list)
    part: bytes | None = None  # one worker's reply


def sizes_row(variant: dict[str, Any], replies: dict[str, bytes] | None, runs: list[dict[str, float]]) -> list[object]:
    lengths = [len(r) for r in replies.values()] if replies else []
    to_client = [r["reply"] / MIB for r in runs]
    return [
        request(variant),
        len(lengths) or "?",
        spread([n / MIB for n in lengths], "{:.2f}") if lengths else "?",
        f"{sum(lengths) / MIB:.1f}" if lengths else "?",
        spread(to_client, "{:.1f}"),
    ]


def measure_variant(rig: Rig, variant: dict[str, Any], repeats: int) -> Measured:
    """Operation rows, a sizes row and verdict notes for one variant."""
    if not accepts(rig.client, variant):
        missing = f"not available: pyspy_profile takes no {', '.join(variant)} keyword"
        return Measured(
            [[label(op, variant), missing, *["-"] * 8] for op in OPS], [request(variant), missing, *["-"] * 3]
        )
    print(f"  {request(variant)}: worker replies", flush=True)
    replies = worker_replies(rig.client, variant)
    received = sum(len(r) for r in replies.values()) if replies else None
    results: dict[str, list[dict[str, float]]] = {op: [] for op in OPS}
    bases = []
    for r in range(repeats):
        for op in OPS:  # interleaved, so a slow spell of the shared machine hits every operation
            print(f"  {request(variant)}: round {r + 1}/{repeats}: {op}", flush=True)
            results[op].append(collect(rig, op, variant))
        bases.append(baseline(rig, statistics.median(results[op][-1]["collect"] for op in OPS)))
    rows = [op_row(op, variant, runs, received) for op, runs in results.items()] + [baseline_row(bases)]
    return Measured(
        rows,
        sizes_row(variant, replies, [r for runs in results.values() for r in runs]),
        notes_for(variant, results, bases, received),
        next(iter(replies.values())) if replies else None,
    )


def fill_row(
    seconds: float, stores: dict[str, dict[str, Any]], part: bytes | None, tasks_per_s: list[float]
) -> list[object]:
    held = [s["held"] for s in stores.values()]
    return [
        f"{N_WORKERS} x {THREADS}",
        f"{seconds:.0f}",
        spread(held, "{:,.0f}"),
        f"{sum(held):,}",
        f"{statistics.median(held) / (100 * THREADS * 60):.1f}",
        spread([s["hz"] for s in stores.values()], "{:.0f}"),
        sum(s["evicted"] for s in stores.values()),
        spread([s["bytes"] / MIB for s in stores.values()], "{:.1f}"),
        distinct_stacks(part) if part else "?",
        " / ".join(f"{r:.0f}" for r in tasks_per_s),
    ]


def run(quick: bool) -> Section:
    repeats = 1 if quick else 3
    deadline = 300.0 if quick else 480.0
    with (
        tempfile.TemporaryDirectory(prefix="pyspy-bench-") as tmp,
        cluster(tmp) as (address, pid),
        Client(address) as client,
        ReplyMeter() as meter,
    ):
        client.wait_for_workers(N_WORKERS, timeout=180)
        client.register_plugin(dask_pyspy.PySpyPlugin(rate=RATE, cpu_budget=1.0, max_memory=256 * MIB))
        client.run(_install_worker)
        client.run_on_scheduler(_install_scheduler)
        with TaskStream(client) as stream:
            seconds, stores = fill(client, deadline)
            filled, began = stream.finished, time.perf_counter()
            stream.seconds = MEASURE_TASK_SECONDS
            rig = Rig(client, pid, tmp, meter)
            measured = [measure_variant(rig, variant, repeats) for variant in VARIANTS]
            tasks_per_s = [filled / seconds, (stream.finished - filled) / (time.perf_counter() - began)]
            errors = stream.errors
    part = measured[0].part
    real_parts = {kind: m.part for kind, m in zip(("raw", "aggregated"), measured) if m.part is not None}
    print("  merging copies of one worker's parts", flush=True)
    scale, reports = scale_rows(real_parts)
    return Section(
        "Collection",
        intro(repeats, deadline),
        [
            table(
                [
                    "workers x threads",
                    "fill s",
                    "samples per worker",
                    "samples in all",
                    "equivalent minutes per worker",
                    "achieved Hz per worker",
                    "evicted",
                    "store MiB per worker",
                    "distinct stacks (one worker)",
                    "tasks/s, filling / measuring",
                ],
                [fill_row(seconds, stores, part, tasks_per_s)],
            ),
            table(
                ["request", "workers", "reply MiB per worker", "scheduler received MiB", "client received MiB"],
                [m.sizes for m in measured],
            ),
            table(
                [
                    "operation",
                    "collect s",
                    "of which client decode s",
                    "save s",
                    "total s",
                    "scheduler CPU s off loop",
                    "scheduler transient MiB",
                    "x bytes received",
                    "scheduler stall ms",
                    "of which waiting for a CPU",
                    "worker stall ms",
                    "of which waiting for a CPU",
                ],
                [r for m in measured for r in m.rows],
            ),
            "Towards 1000 workers: copies of one worker's part above (raw, and aggregated), each as its own process "
            "with task keys of its own, merged in one fresh process as the client merges a collection "
            "(`python -m benchmarks.merge_scale`); the report drawn from the merged profile after.",
            table(["part", "workers", "samples", "wire MiB", "merge s", "peak MiB over RSS", "then"], scale),
        ],
        [n for m in measured for n in m.notes]
        + [
            f"Only the samples are compressed in time, not the tasks: the fill ran {filled / N_WORKERS:,.0f} tasks per "
            f"worker, so the stores hold that many task keys, where 10 real minutes of 175 ms tasks on {THREADS} busy "
            f"threads would hold ~{600 * THREADS / 0.175:,.0f}.",
            "While filling, the task stream keeps both cores busy (dask's own work per task); while measuring its "
            "tasks are longer, so the figures are the collection's more than the load's.",
            f"Tasks that failed during the run: {errors}.",
            sessions_note(),
            big_report_note(reports),
        ],
    )


def sessions_note() -> str:
    if os.environ.get("PYSPY_BENCH_SESSIONS") == "apart":
        return (
            "The scheduler and the workers each ran in a session of its own (PYSPY_BENCH_SESSIONS=apart), "
            "as separate services would: Linux's autogroups share the CPU out per session first."
        )
    return (
        "The scheduler and the workers run in the benchmark's session, as one script or shell starts them "
        "(`spawn`); PYSPY_BENCH_SESSIONS=apart starts each in a session of its own. So started, on 2 cores, the "
        "scheduler's loop stalled 100-600 ms in some collections, all of it runnable but not running (its "
        "schedstat): Linux's autogroups share the CPU out per session first, and no priority inside the "
        "workers' session yields to another session."
    )


def big_report_note(reports: dict[tuple[str, int], float]) -> str:
    seconds = reports.get(("aggregated", 1000))
    if seconds is None:
        return "Target (issue 21): 1000-worker aggregated report < 10 s: not run (memory)."
    return (
        f"Target (issue 21): 1000-worker aggregated report < 10 s. Measured {seconds:.1f} s: {verdict(seconds < 10)}."
    )


def intro(repeats: int, deadline: float) -> str:
    return (
        f"The issue-13 case: a scheduler and {N_WORKERS} worker processes x {THREADS} threads, each its own process "
        f"(`dask scheduler`, `dask worker --nworkers {N_WORKERS}`), every worker's store holding the equivalent of 10 "
        f"minutes at 100 Hz x {THREADS} busy threads ({TARGET:,} samples). Time is compressed: the plugin samples at "
        f"{RATE} Hz with cpu_budget=1.0 until each worker holds {TARGET:,} samples (or {deadline:.0f} s pass; the "
        "first table says what was reached); then every sampler is paused, its samples kept, so each collection sees "
        f"the same stores. A task stream runs throughout, the measurements included: {IN_FLIGHT} tasks queued or "
        f"running, of {len(PREFIXES)} prefixes, 50-300 ms each while filling and {MEASURE_TASK_SECONDS[0]:g}-"
        f"{MEASURE_TASK_SECONDS[1]:g} s each while measuring, 15-40 frames deep along {PATHS_PER_PREFIX} call "
        "paths per prefix, mostly in 20 ms sleeps with a little pure-Python compute (task threads are sampled while "
        "they sleep); "
        "distributed's built-in profiler is off. "
        f"Each operation runs {repeats} time(s), interleaved: median (min-max). Collect = `client.pyspy_profile()` "
        "until it returns; client decode = from the reply's arrival to then. Scheduler CPU = user + system seconds "
        "of the scheduler's threads but its event loop's (where its part of a collection runs: its own export, "
        "reading heads) during the collection. "
        "Stall = worst extra delay of a 5 ms asyncio timer during the collection (not the save), on the scheduler "
        "and on the worst worker, with the part of that stall its loop's thread spent runnable but not running "
        "(its schedstat run delay; the rest it waited for the GIL or ran something); each round ends with a "
        "baseline window as long as its median collection (same load, no collection). Transient memory = the "
        "scheduler's VmHWM during the collection minus its VmRSS before (clear_refs resets the peak); received = "
        "the sum of the workers' replies to the same request."
    )
