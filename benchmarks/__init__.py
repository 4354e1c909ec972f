"""Benchmarks, not part of the test suite: run `python -m benchmarks [--quick]` on a quiet
machine (docs/benchmarks.md).

One package per group of sections, each section's run(quick) in the module of its name
(benchmarks.tick.rate makes the section `rate`; __main__.SECTIONS lists them all):
overhead/ (overhead, memory), tick/ (sample_cost, tick_anatomy, rate), fidelity/ (oracle,
bias, attribution, diff, idle), states/, collection/, activities/, history/ (retention,
history_windows, export_lateness, bounded_loads), free_threaded/, native/ (native, native_merge), stalls/, and
peer_suite/, run on its own (`python -m benchmarks.peer_suite`). What they share is here:
common.py (sections, tables, statistics, the results file), workload.py (task functions),
process_cluster.py (a cluster of `dask` processes) and stacks.py (tasks with deep stacks).
"""

import os

# The checkout that holds this package: child processes run from it to import benchmarks.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
