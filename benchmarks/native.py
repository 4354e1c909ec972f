"""Native frames (native=True): where the time goes by library against `py-spy record
--native`, Python -> C -> Python in order, what a native sample costs, the symbol tables'
memory, fidelity (lost reads, mismatches, the bias runs) and sleeps never interrupted."""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from benchmarks import bias
from benchmarks.common import Section, interleave, spread, table, verdict

CHILD = os.path.join(os.path.dirname(__file__), "native_child.py")
PYSPY = os.path.join(os.path.dirname(sys.executable), "py-spy")
# The child imports numpy after setting this too; here it also holds for its start-up.
ENV = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
PYSPY_RATE = 50
CLASSES = (
    "numpy core (umath, multiarray)",
    "numpy.random",
    "OpenBLAS",
    "arrow",
    "pandas (_libs)",
    "libc",
    "libpython",
    "Python code",
    "other",
)
#: libpython frames py-spy keeps (src/native_stack_trace.rs); it drops every other one.
PYSPY_KEEPS = {"time_sleep", "_time_sleep", "PyGILState_Ensure", "_PyGILState_Ensure"}
AGREEMENT = 3.0  # points
RECORDING = (
    f"dask-pyspy native=True at 100 Hz (budget 0.2) inside the process, `py-spy record --native --rate {PYSPY_RATE}` "
    "from outside; shares of the work threads' sampled time by the library of the leaf frame, stacks as py-spy "
    "shows them (libpython frames left out)"
)
COST_RATE, COST_CPU = 0.02, 0.015
SYMBOLS_MAX = 64 << 20
LOST_MAX, BIAS_MAX = 0.01, 2.0
SLEEPS = 10_000

Frame = dict[str, Any]
Doc = dict[str, Any]


def run_child(args: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, CHILD, json.dumps(args)], capture_output=True, text=True, env=ENV, timeout=timeout
    )
    if done.returncode != 0:
        raise RuntimeError(f"native_child {args} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


# --- 1. Agreement with py-spy ---------------------------------------------------------------


@dataclass
class Recording:
    """One agreement run: dask-pyspy's profile and stats, and py-spy's profile if it ran."""

    doc: Doc
    stats: dict[str, Any]
    pyspy: Doc | None = None
    complaint: str = ""

    @property
    def captured(self) -> float:
        """The share of the kept samples that carry native frames."""
        return self.stats["native"]["merged"] / max(self.stats["store"]["samples_recorded"], 1)


def record(layout: str, seconds: float, tmp: str, with_pyspy: bool) -> Recording:
    """The workload recorded by dask-pyspy inside it for about `seconds`, and by py-spy
    --native from outside at the same time if `with_pyspy`."""
    ours = os.path.join(tmp, f"{layout}-{with_pyspy}-ours.json")
    theirs = os.path.join(tmp, f"{layout}-pyspy.json")
    args = json.dumps({"mode": "agreement", "layout": layout, "out": ours})
    child = subprocess.Popen(
        [sys.executable, CHILD, args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ENV
    )
    assert child.stdin is not None and child.stdout is not None
    spy = None
    try:
        assert child.stdout.readline().strip() == "ready", "the agreement child did not start"
        if with_pyspy:
            spy = subprocess.run(
                [PYSPY, "record", "--native", "--rate", str(PYSPY_RATE), "--pid", str(child.pid)]
                + ["--duration", str(round(seconds)), "--format", "speedscope", "--output", theirs],
                capture_output=True,
                text=True,
                timeout=seconds + 120,
            )
        else:
            time.sleep(seconds)
        child.stdin.write("stop\n")
        child.stdin.flush()
        out, _ = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    if child.returncode != 0:
        raise RuntimeError(f"agreement child ({layout}) exited with {child.returncode}")
    with open(ours) as f:
        got = Recording(json.load(f), json.loads(out.splitlines()[-1])["stats"])
    if spy is not None and spy.returncode == 0 and os.path.exists(theirs):
        with open(theirs) as f:
            got.pyspy = json.load(f)
    elif spy is not None:
        got.complaint = spy.stderr.strip()[-300:]
    return got


def package_libraries() -> dict[str, list[str]]:
    """File name -> paths of the shared libraries of numpy, pandas and pyarrow: dask-pyspy's
    native frames name only the file."""
    spec = importlib.util.find_spec("numpy")
    assert spec is not None and spec.origin is not None
    site = os.path.dirname(os.path.dirname(spec.origin))
    out: dict[str, list[str]] = {}
    for top in ("numpy", "numpy.libs", "pandas", "pyarrow", "pyarrow.libs"):
        for root, _, files in os.walk(os.path.join(site, top)):
            for name in files:
                if ".so" in name:
                    out.setdefault(name, []).append(os.path.join(root, name))
    return out


def is_python(frame: Frame) -> bool:
    file = str(frame.get("file", ""))
    return file.endswith(".py") or file.startswith("<")


def library_class(path: str) -> str:
    """The class of a native frame from its library's path (or bare file name)."""
    name = os.path.basename(path)
    if "openblas" in name:
        return "OpenBLAS"
    if "/numpy/random/" in path:
        return "numpy.random"
    if "/numpy/" in path:
        return "numpy core (umath, multiarray)"
    if "/pyarrow/" in path or name.startswith(("libarrow", "libparquet")):
        return "arrow"
    if "/pandas/" in path:
        return "pandas (_libs)"
    if name.startswith("libc.so"):
        return "libc"
    if name.startswith("libpython"):
        return "libpython"
    return "other"


class Classifier:
    """Leaf classes of both tools' stacks; counts the file names it could not place."""

    def __init__(self) -> None:
        self.libraries = package_libraries()
        self.ambiguous: collections.Counter[str] = collections.Counter()
        #: Seconds of the leaves classed "other", by file name, per labelled profile.
        self.others: dict[str, dict[str, float]] = {}

    def path(self, frame: Frame) -> str:
        file = str(frame.get("file", ""))
        if "/" in file:  # py-spy: the whole path
            return file
        paths = self.libraries.get(file, [file])
        if len(paths) == 1:
            return paths[0]
        # Same file name in two packages (pandas/_libs/lib... and pyarrow/lib...): Cython's
        # symbol names carry their module's path.
        named = [p for p in paths if any(pkg in frame["name"] for pkg in ("pandas", "pyarrow") if f"/{pkg}/" in p)]
        if len(named) == 1:
            return named[0]
        self.ambiguous[f"{file}: {frame['name']}"] += 1
        return ""

    def of(self, frame: Frame) -> str:
        return "Python code" if is_python(frame) else library_class(self.path(frame))

    def leaves(self, doc: Doc, label: str | None = None) -> tuple[dict[str, float], dict[str, float]]:
        """Seconds of the workload threads' samples per leaf class: as py-spy shows stacks
        (libpython frames left out but a few), and as dask-pyspy keeps them. With `label`,
        the "other" leaves are kept by file name in `others`."""
        frames = doc["shared"]["frames"]
        shown: dict[str, float] = dict.fromkeys(CLASSES, 0.0)
        kept: dict[str, float] = dict.fromkeys(CLASSES, 0.0)
        others: dict[str, float] = {}
        for stack, weight in work_samples(doc):
            full = [frames[i] for i in stack]
            trimmed = [f for f in full if self.of(f) != "libpython" or f["name"] in PYSPY_KEEPS]
            leaf = trimmed[-1] if trimmed else {"name": "?", "file": "?"}
            shown[self.of(leaf)] += weight
            kept[self.of(full[-1]) if full else "other"] += weight
            if self.of(leaf) == "other":
                name = os.path.basename(str(leaf.get("file")))
                others[name] = others.get(name, 0.0) + weight
        if label:
            self.others[label] = others
        return shown, kept


def work_samples(doc: Doc) -> list[tuple[list[int], float]]:
    """(stack root first, seconds) of the workload threads ("work-N"), in both tools' naming."""
    return [
        (stack, weight)
        for p in doc["profiles"]
        if "work-" in p["name"]
        for stack, weight in zip(p["samples"], p["weights"])
    ]


def percent(seconds: dict[str, float]) -> dict[str, float]:
    total = sum(seconds.values()) or 1.0
    return {k: 100 * v / total for k, v in seconds.items()}


def agreement_rows(
    ours: dict[str, float], kept: dict[str, float], theirs: dict[str, float], alone: dict[str, float]
) -> tuple[list[list[object]], float, float]:
    """Rows class | dask-pyspy % | py-spy % | difference | dask-pyspy alone % | its difference |
    the same of native leaves only, with the worst differences beside py-spy: of all leaves,
    and of native leaves (where capture failures, which leave Python leaves, do not count)."""
    a, k, b, c = percent(ours), percent(kept), percent(theirs), percent(alone)
    an, bn = percent(native_only(ours)), percent(native_only(theirs))
    rows: list[list[object]] = []
    worst = worst_native = 0.0
    for cls in CLASSES:
        worst = max(worst, abs(a[cls] - b[cls]))
        as_kept = f" ({k[cls]:.1f} as kept)" if abs(k[cls] - a[cls]) >= 0.05 else ""
        row: list[object] = [cls, f"{a[cls]:.1f}{as_kept}", f"{b[cls]:.1f}", f"{a[cls] - b[cls]:+.1f}", f"{c[cls]:.1f}"]
        row.append(f"{c[cls] - b[cls]:+.1f}")
        if cls in an:
            worst_native = max(worst_native, abs(an[cls] - bn[cls]))
            row += [f"{an[cls]:.1f} / {bn[cls]:.1f}", f"{an[cls] - bn[cls]:+.1f}"]
        else:
            row += ["-", "-"]
        rows.append(row)
    return rows, worst, worst_native


def native_only(seconds: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in seconds.items() if k != "Python code"}


# --- 2. Order: caller -> qsort -> comparator --------------------------------------------------

QSORT = re.compile(r"qsort|msort|quicksort")


def is_native(frame: Frame) -> bool:
    return "line" not in frame and not is_python(frame)


def comparator_order(doc: Doc, examples: list[str]) -> dict[str, float]:
    """Seconds of the work threads' samples in the Python comparator: read in order
    (sort_with_qsort -> a qsort frame -> compare), Python-only (no native frame between:
    not captured, or the halves disagreed) or otherwise (examples kept)."""
    frames = doc["shared"]["frames"]
    out = {"samples": 0.0, "in order": 0.0, "Python-only": 0.0, "out of order": 0.0}
    for stack, weight in work_samples(doc):
        st = [frames[i] for i in stack]
        names = [f["name"] for f in st]
        if "compare" not in names:
            continue
        out["samples"] += weight
        caller = names.index("sort_with_qsort") if "sort_with_qsort" in names else len(names)
        callback = names.index("compare")
        sorts = [i for i, f in enumerate(st) if is_native(f) and QSORT.search(f["name"])]
        if any(caller < i < callback for i in sorts):
            out["in order"] += weight
        elif not any(is_native(f) for f in st[caller + 1 : callback]):
            out["Python-only"] += weight
        else:
            out["out of order"] += weight
            if len(examples) < 3:
                examples.append(" -> ".join(f"{f['name']} [{f.get('file', '')}]" for f in st))
    return out


# --- 3. Cost -----------------------------------------------------------------------------------


def cost_run(native: bool, seconds: float, budget: float | None = None) -> dict[str, float]:
    stats = run_child({"mode": "cost", "native": native, "seconds": seconds, "budget": budget})["stats"]
    out = {
        "rate": stats["achieved_rate"],
        "cpu": stats["cpu_fraction"],
        "throttled": stats["throttled_ticks"] / max(stats["ticks"], 1),
        **lost_reads(stats),
    }
    if native:
        n = stats["native"]
        out.update(zip(("round_trip", "unwind", "symbols"), n["median_us"]))
        out.update({k: float(n[k]) for k in ("asked", "answered", "timed_out", "merged", "mismatched")})
    return out


#: Counters of threads not signalled, by the names the build at hand uses.
NOT_ASKED = ("in_syscall", "blocked", "blocked_lately", "still_pending")


def signals(n: dict[str, Any]) -> str:
    """What native capture did with the threads it considered, as counts."""
    counted = ("asked", "answered", "timed_out", *NOT_ASKED)
    return ", ".join(f"{k.replace('_', ' ')} {n[k]}" for k in counted if k in n)


def lost_reads(stats: dict[str, Any]) -> dict[str, float]:
    r = stats["reader_stats"]
    return {"lost": float(r.get("lost_reads", 0)), "reads": float(r.get("thread_reads", 0))}


# --- the section -------------------------------------------------------------------------------


def run(quick: bool) -> Section:
    seconds = 10.0 if quick else 20.0
    section = Section("Native frames", __doc__.split("\n\n")[0].replace("\n", " "))
    before = built()
    fidelity: list[Fidelity] = []
    agreement(section, seconds, fidelity)
    cost(section, seconds, 2 if quick else 3, fidelity)
    memory(section, 4.0 if quick else 8.0)
    bias_with_native(section, seconds, quick, fidelity)
    eintr(section)
    after = built()
    section.notes.append(
        f"Extension built {before}."
        if after == before
        else f"Extension rebuilt during the run ({before}, then {after}): the figures mix two builds."
    )
    return section


def built() -> str:
    """When the extension the children load was built: each child loads the file anew."""
    from dask_pyspy import _native

    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(os.path.getmtime(_native.__file__ or "")))


def agreement(section: Section, seconds: float, fidelity: list[Fidelity]) -> None:
    """Sections 1 and 2: each layout recorded by both tools at once, and by dask-pyspy
    alone (py-spy's pauses change what dask-pyspy sees); the comparator's order over all."""
    if not os.path.exists(PYSPY):
        section.notes.append(f"py-spy is not installed at {PYSPY} (`pip install py-spy`): no agreement figures.")
        return
    classifier = Classifier()
    order: dict[str, float] = {}
    examples: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for layout, what in (
            ("in turn", "one thread running the 5 jobs in turn, at least 0.05 s each"),
            ("together", "4 threads at once: matmul, arrow, groupby, numpy.random + qsort in turn"),
        ):
            runs = {}
            for label, with_pyspy in (("beside py-spy", True), ("alone", False)):
                print(f"  agreement: {layout}, {label}", flush=True)
                runs[label] = r = record(layout, seconds, tmp, with_pyspy)
                for k, v in comparator_order(r.doc, examples).items():
                    order[k] = order.get(k, 0.0) + v
                fidelity.append(Fidelity.of(f"agreement, {layout}, {label}", r.stats))
            agreement_table(section, classifier, layout, what, runs)
    section.notes.append(
        "Why the shares can differ: dask-pyspy (idle=False) keeps a thread's sample when it ran at least half the "
        "interval or holds the GIL, and signals only threads that ran at least half of it, are running now and did "
        "not block since last looked at; py-spy keeps every thread in state R (running or waiting for a CPU). A "
        "sample whose capture failed (not asked, no answer in time, or mismatched halves) keeps its Python "
        "frames only: its leaf counts as Python code. py-spy stops the process with ptrace for each of its samples; "
        "a stop counts as a voluntary context switch, so beside py-spy threads often read as blocked lately and are "
        "not asked: the alone columns are dask-pyspy without py-spy (another run of the same workload)."
    )
    for label, others in classifier.others.items():
        total = sum(others.values()) or 1.0
        ranked = sorted(others.items(), key=lambda kv: -kv[1])[:5]
        top = ", ".join(f"{name} {100 * s / total:.0f}%" for name, s in ranked)
        section.notes.append(f"Leaves classed other, {label}: {top or 'none'}.")
    if classifier.ambiguous:
        section.notes.append(f"Leaf libraries dask-pyspy's file names could not place: {dict(classifier.ambiguous)}.")
    order_table(section, order, examples)


def agreement_table(
    section: Section, classifier: Classifier, layout: str, what: str, runs: dict[str, Recording]
) -> None:
    beside, alone = runs["beside py-spy"], runs["alone"]
    if beside.pyspy is None:
        section.notes.append(f"Agreement ({layout}): py-spy recorded nothing: {beside.complaint}")
        return
    ours, kept = classifier.leaves(beside.doc, f"dask-pyspy ({layout})")
    theirs, _ = classifier.leaves(beside.pyspy, f"py-spy ({layout})")
    own, _ = classifier.leaves(alone.doc)
    rows, worst, worst_native = agreement_rows(ours, kept, theirs, own)
    captures = "; ".join(
        f"{label}: {sum(classifier.leaves(r.doc)[0].values()):.1f} thread-s sampled, {100 * r.captured:.0f}% with "
        f"native frames (threads {signals(r.stats['native'])}, mismatched {r.stats['native']['mismatched']}, "
        f"round trip median {r.stats['native']['median_us'][0]:.0f} µs)"
        for label, r in runs.items()
    )
    section.tables.append(
        f"Agreement, {layout} ({what}); {RECORDING}. dask-pyspy {captures}; py-spy: "
        f"{sum(theirs.values()):.1f} thread-s sampled:\n\n"
        + table(
            [
                "leaf library",
                "dask-pyspy beside py-spy %",
                "py-spy %",
                "difference (points)",
                "dask-pyspy alone %",
                "alone - py-spy",
                "native leaves only: dask-pyspy beside / py-spy %",
                "difference",
            ],
            rows,
        )
    )
    section.notes.append(
        f"Target: each library's share within ±{AGREEMENT:g} points of py-spy's ({layout}, recorded at once). "
        f"Worst {worst:.1f} points: {verdict(worst <= AGREEMENT)}. Among native leaves only (what capture "
        f"failures, which keep Python leaves, leave out): worst {worst_native:.1f} points."
    )


@dataclass
class Fidelity:
    """One run's lost reads and native mismatches."""

    run: str
    lost: float
    reads: float
    mismatched: float | None  # None: native capture off
    merged: float
    rate: str

    @classmethod
    def of(cls, run: str, stats: dict[str, Any]) -> Fidelity:
        n = stats.get("native")
        return cls(
            run,
            **lost_reads(stats),
            mismatched=n["mismatched"] if n else None,
            merged=n["merged"] if n else 0,
            rate=f"{stats['achieved_rate']:.1f}",
        )

    @property
    def lost_share(self) -> float:
        return self.lost / self.reads if self.reads else 0.0

    def row(self) -> list[object]:
        mismatched = "-" if self.mismatched is None else f"{self.mismatched:.0f} / {self.merged:.0f}"
        return [self.run, f"{100 * self.lost_share:.2f}% ({self.lost:.0f} of {self.reads:.0f})", mismatched, self.rate]


def order_table(section: Section, order: dict[str, float], examples: list[str]) -> None:
    total = order.get("samples", 0.0)
    if not total:
        section.notes.append("Order: no dask-pyspy sample held the comparator.")
        return
    share = {k: 100 * order.get(k, 0.0) / total for k in ("in order", "Python-only", "out of order")}
    with_native = order.get("in order", 0.0) + order.get("out of order", 0.0)
    of_native = 100 * order.get("in order", 0.0) / with_native if with_native else float("nan")
    section.tables.append(
        "Order: dask-pyspy samples of the work threads holding the Python comparator `compare`, both layouts "
        "(by sampled seconds; ~100 samples a second):\n\n"
        + table(
            [
                "comparator seconds",
                "caller -> qsort -> compare",
                "Python-only",
                "out of order",
                "in order, of those with native frames",
            ],
            [[f"{total:.2f}", *(f"{v:.1f}%" for v in share.values()), f"{of_native:.1f}%"]],
        )
    )
    section.notes.append(
        f"Target: 100% of the comparator's samples read caller -> qsort -> comparator. "
        f"Measured {share['in order']:.1f}% of all ({of_native:.1f}% of those with native frames): "
        f"{verdict(share['in order'] >= 99.95)}."
    )
    for example in examples:
        section.notes.append(f"Out of order: `{example}`")


def cost(section: Section, seconds: float, rounds: int, fidelity: list[Fidelity]) -> None:
    contenders: dict[str, Callable[[], dict[str, float]]] = {
        "native=False": lambda: cost_run(False, seconds),
        "native=True": lambda: cost_run(True, seconds),
        # Whether the rate comes back where the budget does not bind.
        "native=True, cpu_budget=0.05": lambda: cost_run(True, seconds, 0.05),
    }
    runs = interleave(contenders, rounds)
    rows: list[list[object]] = []
    for name, m in runs.items():
        native = name.startswith("native=True")
        rows.append(
            [
                name,
                spread(m["rate"], "{:.1f}"),
                spread([100 * c for c in m["cpu"]], "{:.2f}"),
                spread([100 * t for t in m["throttled"]], "{:.0f}"),
                " / ".join(spread(m[k], "{:.1f}") for k in ("round_trip", "unwind", "symbols")) if native else "-",
                f"{sum(m['asked']):.0f} / {sum(m['answered']):.0f} / {sum(m['timed_out']):.0f}" if native else "-",
            ]
        )
        mismatched = sum(m["mismatched"]) if native else None
        fidelity.append(
            Fidelity(
                f"cost, {name}",
                sum(m["lost"]),
                sum(m["reads"]),
                mismatched,
                sum(m.get("merged", [0])),
                spread(m["rate"], "{:.1f}"),
            )
        )
    section.tables.append(
        f"Cost: 4 busy threads (2 numpy matmul, 2 pandas groupby) sampled at 100 Hz with the default CPU budget "
        f"(0.01) unless said, for {seconds:g} s, {rounds} run(s) each, interleaved; median (min-max):\n\n"
        + table(
            [
                "sampler",
                "achieved Hz",
                "sampler CPU, % of a core",
                "ticks throttled by the budget, %",
                "per native thread-sample µs: round trip / unwind / symbols+merge",
                "signals asked / answered / timed out",
            ],
            rows,
        )
    )
    nat = runs["native=True"]
    rate_ok = all(abs(r - 100) <= 100 * COST_RATE for r in nat["rate"])
    cpu_ok = all(c <= COST_CPU for c in nat["cpu"])
    section.notes += [
        "The round trip is wall time from the signal's sending to the last answer of its batch, mostly the signal's "
        "delivery (the thread must be on a CPU to run the handler); the sampler sleeps meanwhile. Unwind and "
        "symbols+merge are the sampler thread's CPU per thread-sample. The handler's own copy of registers and stack "
        "top runs in the sampled thread and is not in the sampler's CPU.",
        f"Target: achieved rate 100 Hz ± {100 * COST_RATE:.0f}% with native=True. Measured "
        f"{spread(nat['rate'], '{:.1f}')}: {verdict(rate_ok)}.",
        f"Target: sampler CPU ≤ {100 * COST_CPU:.1f}% of a core with native=True. Measured "
        f"{spread([100 * c for c in nat['cpu']], '{:.2f}')}%: {verdict(cpu_ok)}.",
    ]


def memory(section: Section, seconds: float) -> None:
    print("  memory", flush=True)
    runs = {native: run_child({"mode": "memory", "native": native, "seconds": seconds}) for native in (False, True)}
    rows: list[list[object]] = []
    for native, r in runs.items():
        growth = {k: (r["after"][k] - r["before"][k]) / 1024 for k in ("VmRSS", "RssAnon", "RssFile")}
        mods = (r["stats"].get("native") or {}).get("modules")
        rows.append(
            [
                f"native={native}",
                f"{mods['symbol_bytes'] / 2**20:.1f}" if mods else "-",
                f"{mods['mapped_bytes'] / 2**20:.0f}" if mods else "-",
                f"{mods['modules']} / {mods['symbols']}" if mods else "-",
                f"{r['before']['VmRSS'] / 1024:.0f}",
                " / ".join(f"{growth[k]:+.1f}" for k in ("VmRSS", "RssAnon", "RssFile")),
            ]
        )
    section.tables.append(
        f"Memory: numpy, pandas, pyarrow imported, a thread in matmul; RSS read before the "
        f"sampler starts and {seconds:g} s after (100 Hz):\n\n"
        + table(
            [
                "sampler",
                "symbol tables MiB",
                "mapped MiB",
                "modules / symbols",
                "RSS before MiB",
                "growth MiB: VmRSS / RssAnon / RssFile",
            ],
            rows,
        )
    )
    symbols = runs[True]["stats"]["native"]["modules"]["symbol_bytes"]
    section.notes.append(
        f"Target: symbol tables ≤ {SYMBOLS_MAX >> 20} MiB with numpy, pandas and pyarrow. Measured "
        f"{symbols / 2**20:.1f} MiB: {verdict(symbols <= SYMBOLS_MAX)}. Mapped: the modules' files the sampler "
        f"maps to read unwind tables and symbols (shared, paged in as read: RssFile)."
    )


def bias_with_native(section: Section, seconds: float, quick: bool, fidelity: list[Fidelity]) -> None:
    """The bias benchmark's measurement (bias.py) with native=True, beside the same runs
    with native=False."""
    configs = [
        (threads, periods, share, native)
        for threads in (1, 4)
        for periods in ((1, 10) if quick else bias.PERIODS)
        for share in ((0.7,) if quick else bias.SHARES)
        for native in (False, True)
    ]
    print(f"  bias: {len(configs)} runs", flush=True)
    with ThreadPoolExecutor(2) as pool:  # two at a time, as bias.py runs them
        results = list(pool.map(lambda c: bias.one_run(sys.executable, c[1], c[2], c[0], seconds, c[3]), configs))
    rows: list[list[object]] = []
    worst = (0.0, 0.0)
    for (threads, periods, share, native), r in zip(configs, results):
        truth, sampled = bias.shares(r)
        error = 100 * (sampled - truth)
        # The standard error of a share read from this many independent samples, as bias.py gives it.
        se = 100 * (truth * (1 - truth) / (threads * r["achieved_rate"] * seconds)) ** 0.5
        split = f"{100 * share:.0f}/{100 - 100 * share:.0f}"
        if native:
            worst = max(worst, (abs(error), abs(error) / se))
            fidelity.append(Fidelity.of(f"bias, {threads} thread(s), period {periods:g}, {split}", r))
        n = r.get("native") or {}
        rows.append(
            [
                threads,
                f"{periods:g}",
                split,
                native,
                f"{100 * truth:.1f}",
                f"{100 * sampled:.1f}",
                f"{error:+.1f} ({error / se:+.1f} SE)",
                f"{100 * bias.lost(r):.2f}%",
                f"{n['mismatched']} / {n['merged']}" if n else "-",
                f"{r['achieved_rate']:.1f}",
            ]
        )
    section.tables.append(
        f"Bias: bias.py's alternating churny/steady threads, {seconds:g} s at {bias.RATE:g} Hz (idle=True, budget "
        f"1.0), with native=True and, for comparison, native=False; one run per line, two at a time:\n\n"
        + table(
            [
                "threads",
                "period (intervals)",
                "split",
                "native",
                "true churny %",
                "sampled churny %",
                "error, points (standard errors)",
                "reads lost",
                "mismatched / merged",
                "achieved Hz",
            ],
            rows,
        )
    )
    section.notes.append(
        f"Target: every sampled share within ±{BIAS_MAX:g} points of the truth with native=True. "
        f"Worst {worst[0]:.1f} points ({worst[1]:.1f} standard errors): {verdict(worst[0] <= BIAS_MAX)}."
    )
    fidelity_table(section, fidelity)


def fidelity_table(section: Section, fidelity: list[Fidelity]) -> None:
    section.tables.append(
        "Fidelity with native=True (native=False for comparison): reads the fast reader lost, and native "
        "captures whose Python and native halves disagreed (a Python-only sample kept):\n\n"
        + table(["run", "reads lost", "mismatched / merged", "achieved Hz"], [f.row() for f in fidelity])
    )
    worst = max((f.lost_share for f in fidelity if f.mismatched is not None), default=0.0)
    section.notes.append(
        f"Target: reads lost ≤ {100 * LOST_MAX:.0f}% with native=True. Worst {100 * worst:.2f}%: "
        f"{verdict(worst <= LOST_MAX)}."
    )


def eintr(section: Section) -> None:
    rows = []
    total = 0
    for case, what in (("a", "back to back"), ("b", "each after ~1 ms of numpy/Python work")):
        print(f"  EINTR case {case}", flush=True)
        r = run_child({"mode": "eintr", "case": case, "count": SLEEPS})
        n = r["stats"]["native"]
        total += r["eintr"]
        rows.append(
            [
                f"({case}) {what}",
                r["sleeps"],
                r["eintr"],
                r["other_errors"],
                f"{r['sleeper_s']:.2f} / {r['sleeper_native_s']:.2f}",
                signals(n),
                f"{r['stats']['achieved_rate']:.1f}",
            ]
        )
    section.tables.append(
        f"EINTR: a thread doing {SLEEPS:,} libc nanosleeps of 1 ms (ctypes) beside 2 busy numpy matmul threads, "
        "sampled at 100 Hz with native=True (budget 0.2):\n\n"
        + table(
            [
                "case",
                "sleeps",
                "EINTR",
                "other errors",
                "sleeper sampled s / with native frames",
                "native capture, all threads",
                "achieved Hz",
            ],
            rows,
        )
    )
    section.notes.append(
        f"Target: 0 sleeps interrupted in {SLEEPS:,}, in each case. Measured {', '.join(str(r[2]) for r in rows)}: "
        f"{verdict(total == 0)}."
    )
