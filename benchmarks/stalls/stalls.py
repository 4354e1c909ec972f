"""Event-loop stalls (issue 35): whether the stalls the servers' loop watches report
agree with distributed's own tick measurement, say what held the loop, stay silent on
an idle cluster, and what watching costs.

This module runs the section; the servers and their logs are in stalls_servers.py, the
runs on clusters in stalls_provoke.py, the tables and verdicts in stalls_agreement.py
(targets 1 and 5), stalls_attribution.py (2-4) and stalls_cost.py (6)."""

from __future__ import annotations

import os
import platform

import distributed

import dask_pyspy
from benchmarks.common import Section, cpu_model
from benchmarks.stalls import stalls_agreement, stalls_attribution, stalls_cost
from benchmarks.stalls.stalls_provoke import GAP_S, idle_cluster, run_on_servers
from benchmarks.stalls.stalls_servers import PAIRED_WITHIN_S, THRESHOLD_S, TICK_LIMIT_S


def run(quick: bool) -> Section:
    section = Section("Event-loop stalls (issue 35)", intro())
    runs = run_on_servers(quick)
    stalls_agreement.lengths(section, runs)
    stalls_agreement.explanations(section, runs)
    stalls_attribution.targets(section, runs)
    stalls_attribution.cold(section, runs)
    stalls_agreement.small_tasks(section, runs)
    stalls_agreement.idle(section, idle_cluster(60.0 if quick else 300.0))
    stalls_cost.per_tick(section, quick)
    stalls_cost.memory(section)
    stalls_cost.small_tasks(section, quick)
    return section


def intro() -> str:
    machine = (
        f"{os.cpu_count()} cores ({cpu_model()}, shared), Linux {platform.release()}, Python "
        f"{platform.python_version()}, distributed {distributed.__version__}, dask-pyspy {dask_pyspy.__version__}"
    )
    return (
        (__doc__ or "").split("\n\n")[0]
        + f"\n\n{machine}. A scheduler and 2 workers (2 and 4 threads, no nanny) run as `dask` command-line "
        f"processes with `DASK_DISTRIBUTED__ADMIN__TICK__LIMIT={TICK_LIMIT_S * 1000:.0f}ms`, their logs captured; "
        f"the plugin at its defaults (100 Hz, stall threshold {THRESHOLD_S * 1000:.0f} ms). Stalls are provoked one "
        f"at a time, {GAP_S:.0f} s apart: a task holding the GIL in one `sum(range(n))` (n sized by the worker's "
        "own rate), a worker function blocked in `time.sleep` (through `client.run`, on the worker's loop), and "
        "scheduler handlers that spin or sleep. Each of distributed's 'Event loop was unresponsive' lines is paired "
        f"with the stall of ours in the same process that ended nearest to it (within {PAIRED_WITHIN_S} s), and "
        "with the dask-pyspy line that follows it in the same log."
    )
