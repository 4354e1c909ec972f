"""python -m benchmarks [--quick] [--only overhead,rate,...]: prints and writes benchmarks/RESULTS.md."""

from __future__ import annotations

import argparse
import importlib
import os
import time

from benchmarks.common import machine

SECTIONS = ["overhead", "sample_cost", "oracle", "attribution", "rate", "idle", "memory", "collection"]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="shorter runs (~15 minutes on 2 cores)")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("-o", "--output", default=os.path.join(os.path.dirname(__file__), "RESULTS.md"))
    args = parser.parse_args()
    chosen = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(chosen) - set(SECTIONS)
    if unknown:
        parser.error(f"--only: unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    parts = ["# dask-pyspy benchmarks", machine(), f"Mode: {'quick' if args.quick else 'full'}."]
    for name in chosen:
        print(f"== {name}", flush=True)
        began = time.time()
        section = importlib.import_module(f"benchmarks.{name}").run(args.quick)
        # The machine may be shared: the load says how much the figures are worth.
        section.notes.append(f"Section took {time.time() - began:.0f} s; 1-minute load average at its end "
                             f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores.")
        parts.append(section.markdown())
        print(section.markdown(), flush=True)
    with open(args.output, "w") as f:
        f.write("\n\n".join(parts) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
