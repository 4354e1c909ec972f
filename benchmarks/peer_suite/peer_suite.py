"""distributed's own tests, with and without our preloads: which outcomes differ.

A benchmark, not part of CI. distributed ships its tests in neither its wheel nor its
sdist, so this needs a source checkout of distributed at the tag matching the installed
distributed (`git clone` distributed's repository, then `git checkout 2026.7.0` or
whatever `python -c "import distributed; print(distributed.__version__)"` says), and a
Python with dask, distributed, dask_pyspy and the test suite's needs (pytest,
pytest-timeout, pandas, numpy, pyarrow, bokeh, ...; `pip install -e CHECKOUT --no-deps`
keeps the installed metadata in line with the tests).

    python -m benchmarks.peer_suite CHECKOUT [--python PY] [--runs 2] [--files F ...]
        [--tests NODEID ...] [--timeout 300] [--env KEY=VALUE] [--out results.json]
        [--results RESULTS.md [--section NAME]] [-- extra pytest args]
    python -m benchmarks.peer_suite --render results.json --results benchmarks/RESULTS.md

Runs pytest from the checkout's root with its own config, once per mode and run,
alternating: "plain", then "preload" with `distributed.{scheduler,worker}.preload:
[dask_pyspy]` set through the environment. Reruns are off (pytest-rerunfailures
disabled, its `flaky` marker still registered) so they hide no difference. Prints the
counts per mode, the tests whose set of outcomes differs between modes (with counts),
and the tests that failed in both (the machine's own). Logs and junit files go to
--logs (a new temporary directory by default). `--env DASK_PYSPY__NATIVE=True` adds to
the preloaded mode's environment (here: native frames on). --results writes the
section `peer_suite` (or --section) of benchmarks/RESULTS.md; --render writes it from a
saved --out file.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.common import Section, table, write_section

# The 13 files of issue 33.
FILES = [
    "distributed/tests/test_core.py",
    "distributed/tests/test_batched.py",
    "distributed/tests/test_worker.py",
    "distributed/tests/test_scheduler.py",
    "distributed/tests/test_nanny.py",
    "distributed/tests/test_spans.py",
    "distributed/diagnostics/tests/test_worker_plugin.py",
    "distributed/diagnostics/tests/test_scheduler_plugin.py",
    "distributed/tests/test_worker_state_machine.py",
    "distributed/tests/test_steal.py",
    "distributed/comm/tests/test_comms.py",
    "distributed/shuffle/tests/test_shuffle.py",
    "distributed/tests/test_client.py",
]

# Tests that dial (or resolve) an address off this machine: on a closed network they
# fail or hang in both modes for reasons that are not ours. Node-id prefixes, as
# pytest's --deselect takes them. Tests that dial this machine's own interface address
# (get_ip(): a UDP route lookup sends no packet) stay in: their traffic never leaves it.
DESELECTED = [
    "distributed/tests/test_client.py::test_bad_address",  # 123.123.123.123
    "distributed/tests/test_client.py::TestClientSecurityLoader::test_security_loader_import_failed",  # bad-address
    "distributed/comm/tests/test_comms.py::test_get_local_address_for",  # 8.8.8.8
]

MODES = {
    "plain": {},
    "preload": {
        "DASK_DISTRIBUTED__SCHEDULER__PRELOAD": '["dask_pyspy"]',
        "DASK_DISTRIBUTED__WORKER__PRELOAD": '["dask_pyspy"]',
    },
}

# Loaded with -p: with pytest-rerunfailures disabled, `--strict-markers` (in the
# checkout's addopts) would reject @pytest.mark.flaky and fail collection of whole files.
PLUGIN = """def pytest_configure(config):
    config.addinivalue_line("markers", "flaky: reruns disabled by peer_suite")
"""

Outcomes = dict[str, list[str]]  # node id -> one outcome per run
RANK = ["skipped", "xfailed", "passed", "error", "failed"]


def pytest_command(python: str, targets: list[str], junit: Path, timeout: int, extra: list[str]) -> list[str]:
    return [
        python,
        "-m",
        "pytest",
        *targets,
        *(f"--deselect={d}" for d in DESELECTED),
        "-p",
        "no:cacheprovider",
        "-p",
        "no:rerunfailures",
        "-p",
        "_peer_suite_plugin",
        f"--junitxml={junit}",
        f"--timeout={timeout}",
        "-o",
        "timeout_method=signal",  # the checkout's "thread" ends the whole session on a timeout
        "--color=no",
        *extra,
    ]


def node_id(checkout: Path, classname: str, name: str) -> str:
    """junit's dotted `classname` back to a pytest node id."""
    parts = classname.split(".")
    for i in range(len(parts), 0, -1):
        path = "/".join(parts[:i]) + ".py"
        if (checkout / path).is_file():
            return "::".join([path, *parts[i:], name])
    return f"{classname}::{name}"


def read_junit(checkout: Path, junit: Path) -> tuple[dict[str, str], dict[str, str]]:
    """Outcome and first message line of each test case."""
    outcomes: dict[str, str] = {}
    messages: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        nid = node_id(checkout, case.get("classname", ""), case.get("name", ""))
        outcome = "passed"
        for tag in ("skipped", "error", "failure"):  # the last found wins
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                if tag == "skipped" and el.get("type") == "pytest.xfail":
                    outcome = "xfailed"
                if tag != "skipped":
                    messages[nid] = (el.get("message") or el.text or "").strip().split("\n")[0][:200]
        if nid not in outcomes or RANK.index(outcome) > RANK.index(outcomes[nid]):  # teardown errors add a case
            outcomes[nid] = outcome
    return outcomes, messages


def last_started(log: Path) -> str:
    """The last node id pytest -v printed: the test running when the process died."""
    found = re.findall(r"^(\S+::\S+)", log.read_text(errors="replace"), re.M)
    return found[-1] if found else "?"


def describe(outcomes: list[str]) -> str:
    return ", ".join(f"{k} {n}/{len(outcomes)}" for k, n in sorted(Counter(outcomes).items()))


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.peer_suite",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("checkout", type=Path, nargs="?", help="root of a distributed source checkout")
    parser.add_argument("--python", default=sys.executable, help="interpreter to run pytest with")
    parser.add_argument("--runs", type=int, default=2, help="runs per mode")
    parser.add_argument("--files", nargs="+", default=FILES, help="test files, relative to the checkout")
    parser.add_argument("--tests", nargs="+", help="node ids to run instead of --files (run in this order)")
    parser.add_argument("--timeout", type=int, default=300, help="per-test timeout, seconds")
    parser.add_argument("--logs", type=Path, help="directory for pytest logs and junit files")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE", help="more environment for the preloaded mode"
    )
    parser.add_argument("--results", type=Path, help="write the section --section of this RESULTS.md")
    parser.add_argument("--section", default="peer_suite", help="its name there")
    parser.add_argument("--note", action="append", default=[], help="a line for the section (why tests failed)")
    parser.add_argument("--render", type=Path, help="a saved --out file to write --results from, without running")
    args, extra = parser.parse_known_args()
    if any("=" not in e for e in args.env):
        parser.error(f"--env: KEY=VALUE expected, got {args.env}")
    args.preload_env = dict(e.split("=", 1) for e in args.env)
    if args.render:
        if not args.results:
            parser.error("--render needs --results: the RESULTS.md to write")
        return args, extra
    if args.checkout is None:
        parser.error("checkout: the root of a distributed source checkout is required (or --render)")
    args.checkout = args.checkout.resolve()
    args.targets = args.tests or args.files
    for t in args.targets:
        if not (args.checkout / t.split("::")[0]).exists():
            parser.error(f"{t}: not in {args.checkout}")
    return args, [a for a in extra if a != "--"]


def versions(python: str, checkout: Path, logs: Path, env: dict[str, str]) -> tuple[str, str]:
    """What is installed (asked from elsewhere than the checkout, whose code the tests
    import), and the checkout's tag."""
    probe = (
        "import dask, distributed as d, dask_pyspy as p; print(dask.__version__, d.__version__, d.__file__, p.__file__)"
    )
    installed = subprocess.run(
        [python, "-c", probe], cwd=logs, env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    tag = subprocess.run(["git", "describe", "--tags"], cwd=checkout, capture_output=True, text=True).stdout.strip()
    return installed, tag


class Results:
    """Each test's outcome per run, and its first failure message, per mode."""

    def __init__(self) -> None:
        self.outcomes: dict[str, Outcomes] = {mode: {} for mode in MODES}
        self.messages: dict[str, dict[str, str]] = {mode: {} for mode in MODES}
        self.runs: list[dict[str, Any]] = []

    def add(self, mode: str, checkout: Path, junit: Path) -> None:
        found, msgs = read_junit(checkout, junit)
        for nid, outcome in found.items():
            self.outcomes[mode].setdefault(nid, []).append(outcome)
        for nid, msg in msgs.items():
            self.messages[mode].setdefault(nid, msg)

    def compare(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The tests whose set of outcomes differs between modes, and those that failed in both."""
        differ, failed_both = [], []
        for nid in sorted(set().union(*self.outcomes.values())):
            per_mode = {mode: self.outcomes[mode].get(nid, []) for mode in MODES}
            messages = {m: self.messages[m][nid] for m in MODES if nid in self.messages[m]}
            entry = {"test": nid, **per_mode, "messages": messages}
            if len({frozenset(o) for o in per_mode.values()}) > 1:
                differ.append(entry)
            elif {"failed", "error"} & set(per_mode["plain"]):
                failed_both.append(entry)
        return differ, failed_both


def run_modes(args: argparse.Namespace, extra: list[str], logs: Path, env: dict[str, str]) -> Results:
    """Every run of every mode, alternating, so the machine's drift falls on both."""
    results = Results()
    for run in range(args.runs):
        for mode, mode_env in MODES.items():
            junit, log = logs / f"{mode}-{run}.xml", logs / f"{mode}-{run}.log"
            junit.unlink(missing_ok=True)
            t0 = time.monotonic()
            with open(log, "w") as f:
                command = pytest_command(args.python, args.targets, junit, args.timeout, extra)
                env_here = {**env, **mode_env, **(args.preload_env if mode == "preload" else {})}
                rc = subprocess.run(command, cwd=args.checkout, env=env_here, stdout=f, stderr=subprocess.STDOUT)
            info: dict[str, Any] = {"mode": mode, "run": run, "rc": rc.returncode, "log": str(log)}
            info["seconds"] = round(time.monotonic() - t0, 1)
            if junit.exists():
                results.add(mode, args.checkout, junit)
            else:
                info["crashed_in"] = last_started(log)
            results.runs.append(info)
            crash = f", no junit, last test {info['crashed_in']}" if "crashed_in" in info else ""
            print(f"{mode} run {run + 1}/{args.runs}: exit {rc.returncode} in {info['seconds']} s{crash}", flush=True)
    return results


def print_summary(results: Results, differ: list[dict[str, Any]], failed_both: list[dict[str, Any]]) -> None:
    print()
    for mode in MODES:
        counts = Counter(o for per_run in results.outcomes[mode].values() for o in per_run)
        print(f"{mode}: " + ", ".join(f"{k} {counts[k]}" for k in ("passed", "failed", "error", "skipped", "xfailed")))
    for title, entries in (("outcomes that differ", differ), ("failed in both modes (the machine's own)", failed_both)):
        print(f"\n{title}: {len(entries)}")
        for e in entries:
            print(f"  {e['test']}: " + "; ".join(f"{m} {describe(e[m]) or 'not run'}" for m in MODES))
            for m, msg in e["messages"].items():
                print(f"      {m}: {msg}")


def markdown(result: dict[str, Any]) -> str:
    runs = result["runs"]
    minutes = {m: sum(r["seconds"] for r in runs if r["mode"] == m) / 60 for m in MODES}
    counts = {m: Counter(o for per_run in result["outcomes"][m].values() for o in per_run) for m in MODES}
    kinds = ("passed", "failed", "error", "skipped", "xfailed")
    section = Section(
        "distributed's own suite, preloaded" + "".join(f", {k}={v}" for k, v in result.get("preload_env", {}).items()),
        f"distributed's tests ({result['checkout_tag']}; installed dask, distributed "
        f"{' '.join(result['versions'].split()[:2])}), {len(result['targets'])} files, "
        f"{max(r['run'] for r in runs) + 1} run(s) per mode, alternating: plain, and with "
        "`distributed.{scheduler,worker}.preload: [dask_pyspy]`"
        + "".join(f", `{k}={v}`" for k, v in result.get("preload_env", {}).items())
        + "; reruns off. "
        "`python -m benchmarks.peer_suite CHECKOUT`.",
    )
    rows = [[m, *(counts[m][k] for k in kinds), f"{minutes[m]:.0f}"] for m in MODES]
    section.tables.append(table(["mode", *kinds, "minutes"], rows))

    def listed(entries: list[dict[str, Any]]) -> list[list[object]]:
        return [
            [f"`{e['test']}`", *(describe(e[m]) or "not run" for m in MODES), e["messages"].get("preload", "")]
            for e in entries
        ]

    for title, entries in (("Outcomes that differ", result["differ"]), ("Failed in both", result["failed_both"])):
        section.tables.append(f"{title}: {len(entries)}")
        if entries:
            section.tables.append(table(["test", *MODES, "message (preload)"], listed(entries)))
    section.notes += result.get("notes", [])
    section.notes.append("Deselected (they dial addresses off this machine): " + ", ".join(result["deselected"]))
    section.notes.append("Selected: " + ", ".join(f"`{t}`" for t in result["targets"]))
    section.notes.append(f"Run {result.get('date', '?')} on {result.get('cores', '?')} cores.")
    return section.markdown()


def main() -> None:
    args, extra = parse_args()
    if args.render:
        saved = json.loads(args.render.read_text())
        saved["notes"] = saved.get("notes", []) + args.note
        write_section(str(args.results), args.section, markdown(saved))
        print(f"wrote {args.results}")
        return
    logs = args.logs or Path(tempfile.mkdtemp(prefix="peer-suite-"))
    logs.mkdir(parents=True, exist_ok=True)
    (logs / "_peer_suite_plugin.py").write_text(PLUGIN)
    env = {k: v for k, v in os.environ.items() if not k.endswith("__PRELOAD")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(logs), env.get("PYTHONPATH")) if p)
    installed, tag = versions(args.python, args.checkout, logs, env)
    print(f"python {args.python}\ninstalled dask, distributed: {installed}\ncheckout at {tag or '?'}")
    if installed.split()[1] != tag:
        print("WARNING: the installed distributed is not the checkout's version")
    print(f"logs in {logs}; deselected:", *DESELECTED, sep="\n  ")

    results = run_modes(args, extra, logs, env)
    differ, failed_both = results.compare()
    print_summary(results, differ, failed_both)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cores": os.cpu_count(),
        "checkout": str(args.checkout),
        "python": args.python,
        "versions": installed,
        "checkout_tag": tag,
        "targets": args.targets,
        "extra_pytest_args": extra,
        "deselected": DESELECTED,
        "preload_env": args.preload_env,
        "notes": args.note,
        "runs": results.runs,
        "differ": differ,
        "failed_both": failed_both,
        "outcomes": results.outcomes,
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
        print(f"\nwrote {args.out}")
    if args.results:
        write_section(str(args.results), args.section, markdown(result))
        print(f"wrote {args.results}")
