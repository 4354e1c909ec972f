"""python -m benchmarks [--quick] [--only overhead,rate,...] [--baseline PYTHON]: prints the
sections and writes them into benchmarks/RESULTS.md, keeping the sections not run."""

from __future__ import annotations

import argparse
import importlib
import os
import time

from benchmarks.common import cpu_kind, kept_sections, machine

# The sections in the order they run and are written, each with the module whose run(quick) makes it.
SECTIONS = {
    "overhead": "benchmarks.overhead.overhead",
    "sample_cost": "benchmarks.tick.sample_cost",
    "tick_anatomy": "benchmarks.tick.tick_anatomy",
    "oracle": "benchmarks.fidelity.oracle",
    "bias": "benchmarks.fidelity.bias",
    "states": "benchmarks.states.states",
    "attribution": "benchmarks.fidelity.attribution",
    "diff": "benchmarks.fidelity.diff",
    "rate": "benchmarks.tick.rate",
    "idle": "benchmarks.fidelity.idle",
    "memory": "benchmarks.overhead.memory",
    "collection": "benchmarks.collection.collection",
    "activities": "benchmarks.activities.activities",
    "retention": "benchmarks.history.retention",
    "history_windows": "benchmarks.history.history_windows",
    "export_lateness": "benchmarks.history.export_lateness",
    "bounded_loads": "benchmarks.history.bounded_loads",
    "free_threaded": "benchmarks.free_threaded.free_threaded",
    "native": "benchmarks.native.native",
    "native_merge": "benchmarks.native.native_merge",
    "task_memory": "benchmarks.task_memory.task_memory",
    "stalls": "benchmarks.stalls.stalls",
}
# Sections kept once per kind of CPU (`name@kind`): what a tick asks of the kernel is priced
# differently on each, and the team's machines are of both kinds.
PER_CPU_KIND = {"tick_anatomy"}


def keys(name: str, sections: dict[str, str]) -> list[str]:
    """The keys `name` is kept under: itself, or one per kind of CPU it ran on."""
    return sorted(k for k in sections if k == name or k.startswith(f"{name}@"))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="shorter runs (~15 minutes on 2 cores)")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {list(SECTIONS)}")
    parser.add_argument("-o", "--output", default=os.path.join(os.path.dirname(__file__), "RESULTS.md"))
    parser.add_argument(
        "--baseline",
        metavar="PYTHON",
        help="an interpreter with another build of dask-pyspy installed, run beside this one (bias, export_lateness)",
    )
    args = parser.parse_args()
    chosen = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(chosen) - set(SECTIONS)
    if unknown:
        parser.error(f"--only: unknown sections {sorted(unknown)}; choose from {list(SECTIONS)}")
    if args.baseline:
        for name in ("bias", "export_lateness"):
            importlib.import_module(SECTIONS[name]).BASELINE = args.baseline
    parts = [
        "# dask-pyspy benchmarks",
        machine(),
        "The table is the machine of the last run. Each section says when, in which mode and on which CPU it "
        "last ran: figures from different machines are not comparable.",
    ]
    sections = kept_sections(args.output)
    kind = cpu_kind()
    for name in chosen:
        print(f"== {name}", flush=True)
        began = time.time()
        section = importlib.import_module(SECTIONS[name]).run(args.quick)
        # The machine may be shared: the load says how much the figures are worth.
        mode = "quick" if args.quick else "full"
        section.notes.append(
            f"Run {time.strftime('%Y-%m-%d %H:%M')} ({mode}) on {kind}; section took "
            f"{time.time() - began:.0f} s; 1-minute load average at its end "
            f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores."
        )
        key = name
        if name in PER_CPU_KIND:
            key = f"{name}@{kind}"
            section.title += f" ({kind})"
        sections[key] = f"<!-- section: {key} -->\n{section.markdown()}"
        print(section.markdown(), flush=True)
    ours = [key for name in SECTIONS for key in keys(name, sections)]
    parts += [sections[key] for key in ours]
    # Sections their own scripts wrote (peer_suite needs a checkout of distributed) stay.
    parts += [text for key, text in sections.items() if key not in ours]
    with open(args.output, "w") as f:
        f.write("\n\n".join(parts) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
