"""Native frames, parts 1 and 2: the work threads' sampled time by the library of the leaf
frame, dask-pyspy's against `py-spy record --native` recording at once, and whether the Python
comparator reads caller -> qsort -> compare."""

from __future__ import annotations

import collections
import importlib.util
import os
import re
import tempfile
from typing import Any

from benchmarks.common import Section, table, verdict
from benchmarks.native.native_runs import PYSPY, PYSPY_RATE, Doc, Fidelity, Recording, pyspy_alone, record, signals

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
#: Running samples against running samples (issue 44): the share of native leaves and
#: of each of py-spy's top libraries, within this many points.
RUNNING_AGREEMENT = 5.0
TOP_LIBRARIES = 5
ORDER = 95.0  # % of the comparator's samples
#: Frames of dask-pyspy's signal handler: py-spy, recording at once, pauses a thread inside
#: it at times; its own unwinder stops there.
HANDLER = "dask_pyspy_native::reader::native::signal::"
#: A native frame that waits (a condition, a futex, the GIL's wait): its thread is not running.
WAITING = re.compile(r"pthread_cond_(timed)?wait|futex_(abstimed_)?wait|take_gil|sem_(timed)?wait")
RECORDING = (
    f"dask-pyspy native=True at 100 Hz (budget 0.2) inside the process, `py-spy record --native --rate {PYSPY_RATE}` "
    "from outside; shares of the work threads' sampled time by the library of the leaf frame, stacks as py-spy "
    "shows them (libpython frames left out)"
)

Frame = dict[str, Any]


# --- 1. Agreement with py-spy: leaf classes ---------------------------------------------------


def package_libraries() -> dict[str, list[str]]:
    """File name -> paths of the shared libraries of numpy, pandas and pyarrow: dask-pyspy's
    native frames name only the file outside site-packages."""
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
        if file.startswith("/"):  # py-spy: the whole path
            return file
        if "/" in file:  # dask-pyspy: the path below site-packages
            return "/" + file
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


def pyspy_running(doc: Doc) -> tuple[Doc, float, float]:
    """py-spy's samples of running threads: those waiting in a native wait (`WAITING`) and
    those paused inside dask-pyspy's signal handler left out; with the seconds of each."""
    frames = doc["shared"]["frames"]
    waiting = in_handler = 0.0
    profiles = []
    for p in doc["profiles"]:
        work = "work-" in p["name"]  # the seconds left out are counted as `work_samples` counts
        kept: tuple[list[list[int]], list[float]] = ([], [])
        for stack, weight in zip(p["samples"], p["weights"]):
            names = [frames[i]["name"] for i in stack]
            if any(HANDLER in n for n in names):
                in_handler += weight * work
            elif any(WAITING.search(n) for n in names):
                waiting += weight * work
            else:
                kept[0].append(stack)
                kept[1].append(weight)
        profiles.append({**p, "samples": kept[0], "weights": kept[1]})
    return {**doc, "profiles": profiles}, waiting, in_handler


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


# --- the tables -------------------------------------------------------------------------------


def agreement(section: Section, seconds: float, fidelity: list[Fidelity]) -> Recording | None:
    """Sections 1 and 2: each layout recorded by both tools at once, and by each alone
    (py-spy's pauses change what dask-pyspy sees); the comparator's order per run. Gives
    dask-pyspy's recording of the 4 threads together, alone."""
    if not os.path.exists(PYSPY):
        section.notes.append(f"py-spy is not installed at {PYSPY} (`pip install py-spy`): no agreement figures.")
        return None
    classifier = Classifier()
    order: dict[str, dict[str, float]] = {}
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
                order[f"{layout}, {label}"] = comparator_order(r.doc, examples)
                fidelity.append(Fidelity.of(f"agreement, {layout}, {label}", r.stats))
            agreement_table(section, classifier, layout, what, runs)
            print(f"  agreement: {layout}, py-spy alone", flush=True)
            running_table(section, classifier, layout, runs, pyspy_alone(layout, seconds, tmp))
    section.notes.append(
        "Why the shares can differ: dask-pyspy (idle=False) keeps a thread's sample when it ran at least half the "
        "interval or holds the GIL, and merges native frames into the samples of threads on a CPU, from a timer on "
        "each thread's own CPU clock; py-spy keeps the threads it does not take for idle, threads waiting on a "
        "condition or the GIL among them (left out of the running tables). A sample without a capture (none in "
        "the last ticks, or mismatched halves) keeps its Python frames only: its "
        "leaf counts as Python code. py-spy stops the process with ptrace for each of its samples: the alone "
        "columns are dask-pyspy without py-spy (another run of the same workload)."
    )
    for label, others in classifier.others.items():
        total = sum(others.values()) or 1.0
        ranked = sorted(others.items(), key=lambda kv: -kv[1])[:5]
        top = ", ".join(f"{name} {100 * s / total:.0f}%" for name, s in ranked)
        section.notes.append(f"Leaves classed other, {label}: {top or 'none'}.")
    if classifier.ambiguous:
        section.notes.append(f"Leaf libraries dask-pyspy's file names could not place: {dict(classifier.ambiguous)}.")
    order_table(section, order, examples)
    return runs["alone"]  # of the last layout: together


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
        f"native frames ({signals(r.stats['native'])}, mismatched {r.stats['native']['mismatched']}, "
        f"unwind median {r.stats['native']['median_us'][-2]:.0f} µs)"
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


def running_table(
    section: Section, classifier: Classifier, layout: str, runs: dict[str, Recording], alone: tuple[Doc | None, str]
) -> None:
    """Running samples against running samples: the share of native leaves and of py-spy's
    top libraries, each tool recording alone (another run of the same workload), and both
    at once, where each perturbs the other."""
    spy_alone, complaint = alone
    beside = runs["beside py-spy"]
    if spy_alone is None or beside.pyspy is None:
        section.notes.append(f"Running samples ({layout}): py-spy recorded nothing: {complaint or beside.complaint}")
        return
    theirs_alone, waiting, in_handler = pyspy_running(spy_alone)
    theirs_beside, waiting_beside, in_handler_beside = pyspy_running(beside.pyspy)
    docs = (runs["alone"].running, theirs_alone, beside.running, theirs_beside)
    ours, theirs, ours_b, theirs_b = (percent(classifier.leaves(d)[0]) for d in docs)
    libraries = [c for c in CLASSES if c not in ("Python code", "other")]
    top = sorted(libraries, key=lambda c: -theirs[c])[:TOP_LIBRARIES]
    a, b, x, y = (100 - d["Python code"] for d in (ours, theirs, ours_b, theirs_b))
    shares = [("all native leaves", a, b, x, y)]
    shares += [(c, ours[c], theirs[c], ours_b[c], theirs_b[c]) for c in top]
    rows = [
        [c, f"{a:.1f}", f"{b:.1f}", f"{a - b:+.1f}", f"{x:.1f} / {y:.1f}", f"{x - y:+.1f}"] for c, a, b, x, y in shares
    ]
    section.tables.append(
        f"Running samples, {layout}: dask-pyspy's samples of threads on a CPU or waiting for one (states cpu, "
        f"cpu-gil, cpu-wait); py-spy's without those in a native wait (a condition, a futex, the GIL: "
        f"{waiting:.1f} thread-s alone, {waiting_beside:.1f} beside) or paused inside dask-pyspy's signal handler "
        f"({in_handler_beside:.1f} thread-s beside, where py-spy's unwinder stops: its pauses stop threads inside "
        f"the handler's reads; {in_handler:.1f} alone). Each tool alone (two runs of the workload), and both at "
        f"once, where each perturbs the other. The share of native leaves and of py-spy's top {TOP_LIBRARIES} "
        f"libraries:\n\n"
        + table(
            [
                "leaves",
                "dask-pyspy alone %",
                "py-spy alone %",
                "difference (points)",
                "at once: dask-pyspy / py-spy %",
                "difference",
            ],
            rows,
        )
    )
    worst = max(abs(a - b) for _, a, b, _, _ in shares)
    worst_beside = max(abs(x - y) for _, _, _, x, y in shares)
    section.notes.append(
        f"Target: running samples against running samples, the share of native leaves and of each of py-spy's top "
        f"{TOP_LIBRARIES} libraries within {RUNNING_AGREEMENT:g} points, each tool alone ({layout}). Worst "
        f"{worst:.1f} points: {verdict(worst <= RUNNING_AGREEMENT)}. Recorded at once: worst {worst_beside:.1f}."
    )


def order_table(section: Section, order: dict[str, dict[str, float]], examples: list[str]) -> None:
    rows, alone = [], []
    for run, counts in order.items():
        total = counts.get("samples", 0.0)
        if not total:
            continue
        share = {k: 100 * counts.get(k, 0.0) / total for k in ("in order", "Python-only", "out of order")}
        with_native = counts.get("in order", 0.0) + counts.get("out of order", 0.0)
        of_native = 100 * counts.get("in order", 0.0) / with_native if with_native else float("nan")
        rows.append([run, f"{total:.2f}", *(f"{v:.1f}%" for v in share.values()), f"{of_native:.1f}%"])
        if run.endswith("alone"):
            alone.append(share["in order"])
    if not rows:
        section.notes.append("Order: no dask-pyspy sample held the comparator.")
        return
    section.tables.append(
        "Order: dask-pyspy samples of the work threads holding the Python comparator `compare`, per run "
        "(by sampled seconds; ~100 samples a second):\n\n"
        + table(
            [
                "run",
                "comparator seconds",
                "caller -> qsort -> compare",
                "Python-only",
                "out of order",
                "in order, of those with native frames",
            ],
            rows,
        )
    )
    worst = min(alone, default=float("nan"))
    section.notes.append(
        f"Target: ≥ {ORDER:g}% of the comparator's samples read caller -> qsort -> comparator, recorded alone "
        f"(py-spy's pauses change what dask-pyspy sees). Worst {worst:.1f}%: {verdict(worst >= ORDER)}."
    )
    for example in examples:
        section.notes.append(f"Out of order: `{example}`")
