"""What our stalls say held the loop: the spinning handler's activity (target 2), the GIL
holder's task key and function (target 3, and on an executor starting its threads), the
sleeping handler's system call (target 4)."""

from __future__ import annotations

from typing import Any

from benchmarks.common import Section, table, verdict
from benchmarks.stalls.stalls_provoke import COLD_THREADS, KINDS, Provoked, Runs
from benchmarks.stalls.stalls_servers import THRESHOLD_S

SLEEP_CALL = "clock_nanosleep"


def long(stalls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [s for s in stalls if s["duration"] >= THRESHOLD_S]


def states(stalls: list[dict[str, Any]]) -> str:
    return "; ".join(", ".join(f"{k} {v:.2f}" for k, v in sorted(s["states"].items())) for s in stalls)


def reads_blocked(stall: dict[str, Any]) -> bool:
    return stall["states"].get("blocked", 0.0) >= 0.8 * sum(stall["states"].values())


def durations(stalls: list[dict[str, Any]]) -> str:
    return ", ".join(f"{s['duration']:.3f}" for s in stalls)


def spinning(p: Provoked) -> tuple[list[object], bool]:
    """Target 2: exactly one stall of 1.0 +- 0.1 s, named by the handler."""
    found = long(p.stalls)
    ok = len(found) == 1 and abs(found[0]["duration"] - 1.0) <= 0.1 and found[0]["activity"] == "scheduler: spin"
    activities = ", ".join(str(s["activity"]) for s in found)
    return ["2: scheduler handler spinning 1 s", len(found), durations(found), activities, states(found)], ok


def holding(p: Provoked) -> tuple[list[object], bool]:
    """Target 3: the task named (key and function) as the GIL holder for >= 80% of the stall."""
    found = long(p.stalls)
    holder = found[0]["gil_holders"][0] if len(found) == 1 and found[0]["gil_holders"] else None
    share = holder["seconds"] / found[0]["duration"] if holder else 0.0
    ok = bool(holder and holder["task_key"] == p.key and holder["function"].startswith("hold_gil ") and share >= 0.8)
    who = f"{holder['task_key']} in {holder['function']}, {100 * share:.0f}%" if holder else "none named"
    return [f"3: worker task holding the GIL {p.own:.2f} s", len(found), durations(found), who, states(found)], ok


def sleeping(p: Provoked) -> tuple[list[object], bool]:
    """Target 4: one stall, read 'blocked', naming the call."""
    found = long(p.stalls)
    s = found[0] if len(found) == 1 else None
    ok = bool(s and reads_blocked(s) and s["call"] == SLEEP_CALL)
    return [f"4: {p.kind} 1 s", len(found), durations(found), f"call {s['call']}" if s else "-", states(found)], ok


def targets(section: Section, runs: Runs) -> None:
    """Targets 2-4 on the 1 s and 2 s provoked stalls, a table row each."""
    checks = [
        ("2", spinning, [p for p in runs.provoked if (p.kind, p.asked) == (KINDS[2], 1.0)]),
        ("3", holding, [p for p in runs.provoked if (p.kind, p.asked) == (KINDS[0], 2.0)]),
        ("4", sleeping, [p for p in runs.provoked if p.kind in (KINDS[1], KINDS[3]) and p.asked == 1.0]),
    ]
    rows: list[list[object]] = []
    met: dict[str, tuple[int, int]] = {}
    for target, check, cases in checks:
        results = [check(p) for p in cases]
        rows += [[*row, verdict(ok)] for row, ok in results]
        met[target] = (sum(ok for _, ok in results), len(results))
    header = ["target: provoked by", "stalls of ours", "durations s", "activity / GIL holder / call", "states s", ""]
    section.tables.append(table(header, rows))

    def tally(target: str) -> str:
        n, of = met[target]
        return f"{n}/{of} runs: {verdict(n == of and of > 0)}"

    section.notes += [
        "Target 2: a scheduler handler spinning 1 s gives exactly one stall of 1.0 +- 0.1 s named "
        f"'scheduler: spin': {tally('2')}.",
        "Target 3: a task holding the GIL in one C call ~2 s is named (key and function) as the GIL holder "
        f"for >= 80% of the worker's stall: {tally('3')}. Over all lengths, the task was the first GIL holder "
        f"named in {named_holders(runs)}.",
        f"Target 4: a handler blocked in time.sleep(1) reads 'blocked' and names the call ({SLEEP_CALL}): "
        f"{tally('4')}. Over all lengths, the sleeping handlers' stalls named their call in {named_calls(runs)}.",
    ]
    spun_note(section, runs)


def named_calls(runs: Runs) -> str:
    naps = [s for p in runs.provoked if p.kind in (KINDS[1], KINDS[3]) for s in long(p.stalls)]
    missed = [f"{s['duration']:.1f} s ({s['call'] or 'none'})" for s in naps if s["call"] != SLEEP_CALL]
    return f"{len(naps) - len(missed)} of {len(naps)}" + (f"; not in {', '.join(missed)}" if missed else "")


def named_holders(runs: Runs) -> str:
    held = [(p, s) for p in runs.provoked if p.kind == KINDS[0] for s in long(p.stalls)]
    missed = [
        f"{s['duration']:.1f} s ({states([s])})"
        for p, s in held
        if not (s["gil_holders"] and s["gil_holders"][0]["task_key"] == p.key)
    ]
    return f"{len(held) - len(missed)} of {len(held)}" + (f"; not in {', '.join(missed)}" if missed else "")


def spun_note(section: Section, runs: Runs) -> None:
    """The spinning handlers run Python and make no system call: what their stalls read."""
    spun = [s for p in runs.provoked if p.kind == KINDS[2] for s in long(p.stalls)]
    if not spun:
        return
    blocked = sum(s["states"].get("blocked", 0.0) for s in spun)
    waiting = sum(s["states"].get("cpu-wait", 0.0) for s in spun)
    calls = [s["call"] for s in spun if s["call"]]
    section.notes.append(
        f"The spinning handlers' {len(spun)} stalls ({sum(s['duration'] for s in spun):.1f} s, pure Python, no "
        f"system call): {blocked:.2f} s read 'blocked' and {waiting:.2f} s 'cpu-wait'; {len(calls)} name a "
        f"call ({', '.join(sorted(set(calls))) or '-'})."
    )


def cold(section: Section, runs: Runs) -> None:
    """GIL-holding tasks on an executor starting its threads: is the holder still named?"""
    rows: list[list[object]] = []
    for c in runs.cold:
        found = long(c["stalls"])
        holders = "; ".join(
            f"{h['task_key']} in {h['function']} {h['seconds']:.2f} s" for s in found for h in s["gil_holders"]
        )
        stacks = "; ".join(s["stack"][0] for s in found if s["stack"])
        rows.append(
            [c["key"], c["thread"], c["ran_on"], f"{c['own']:.2f}", durations(found) or "-", states(found)]
            + [holders or "none named", stacks]
        )
    header = ["task", "executor thread", "ran on", "its own s", "stall s", "states s", "GIL holders", "loop's stack"]
    section.tables.append(table(header, rows))
    section.notes.append(cold_note(runs.cold))


def cold_note(cold: list[dict[str, Any]]) -> str:
    named = [any(s["gil_holders"] for s in c["stalls"]) for c in cold]
    started = [i for i, c in enumerate(cold) if c["thread"] == "started for it"]
    text = (
        f"Tasks holding the GIL ~1 s, one at a time, on the second worker ({COLD_THREADS} threads) from before its "
        "executor had a thread (table above): distributed's executor starts a thread per submit up to its size, "
        "and the loop waits in `Thread.start` until the new thread runs. The GIL holder was named for "
        f"{sum(named[i] for i in started)} of the {len(started)} tasks submitted while a thread was being started "
        f"for them, and {sum(named) - sum(named[i] for i in started)} of {len(cold) - len(started)} on a "
        "started pool."
    )
    unnamed = [cold[i] for i in started if not named[i]]
    if unnamed:
        older = [c for i, c in enumerate(cold) if i in started and not named[i] and _thread_index(c["ran_on"]) < i]
        blocked = [c for c in unnamed if any(reads_blocked(s) for s in c["stalls"])]
        text += (
            f" Of the {len(unnamed)} without a holder, {len(older)} ran on an older thread of the pool, which took "
            f"the task while the new one was starting, and {len(blocked)} read 'blocked': the new thread cannot run "
            "to say it started while the task holds the GIL, so the loop waits on a lock (`Condition.wait`), not on "
            "the GIL, and no GIL holder is marked, though the GIL is what keeps it."
        )
    return text


def _thread_index(name: str) -> int:
    """The executor thread's number: its name's last part ("Dask-Default-Threads-9026-2")."""
    tail = name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 0
