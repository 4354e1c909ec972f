"""Whether our stalls agree with distributed's lines: the provoked stalls' lengths (target
1), what our line after distributed's described, and the stalls of a small-tasks workload
and of an idle cluster (target 5)."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.common import Section, spread, table, verdict
from benchmarks.stalls.stalls_provoke import GAP_S, KINDS, LENGTHS_S, Observed, Provoked, Runs
from benchmarks.stalls.stalls_servers import PAIRED_WITHIN_S, THRESHOLD_S, TICK_LIMIT_S, Line, pair
from dask_pyspy.stalls import describe

AGREE_S, AGREE_SHARE = 0.05, 0.05  # target 1: within 50 ms or 5%
ANSWERS = ("its stall", "another stall", "other text", "none")

Pair = tuple[Line, dict[str, Any] | None]


def agrees(ours: float, theirs: float) -> bool:
    return abs(theirs - ours) <= max(AGREE_S, AGREE_SHARE * theirs)


def provoked_by(line: Line, provoked: list[Provoked]) -> Provoked | None:
    return next((p for p in provoked if p.process == line.process and p.began <= line.at <= p.ended + GAP_S), None)


def lengths(section: Section, runs: Runs) -> None:
    """Target 1: per kind and length, distributed's figure against ours."""
    pairs = pair(runs.during.lines, runs.during.stalls)
    cases_of = [(line, s, provoked_by(line, runs.provoked)) for line, s in pairs]
    rows: list[list[object]] = []
    diffs: list[float] = []
    all_ok = True
    for kind in KINDS:
        for seconds in LENGTHS_S:
            cases = [p for p in runs.provoked if (p.kind, p.asked) == (kind, seconds)]
            matched = [(line, s) for line, s, p in cases_of if s is not None and p in cases]
            d = [line.seconds - s["duration"] for line, s in matched]
            ok = len(matched) == len(cases) and all(agrees(s["duration"], line.seconds) for line, s in matched)
            all_ok &= ok
            diffs += d
            rows.append(
                [
                    kind,
                    f"{seconds:.1f}",
                    spread([p.own for p in cases], "{:.3f}"),
                    f"{len(matched)}/{len(cases)}",
                    spread([s["duration"] for _, s in matched], "{:.3f}") if matched else "-",
                    spread([line.seconds for line, _ in matched], "{:.2f}") if matched else "-",
                    spread(d, "{:+.3f}") if d else "-",
                    verdict(ok),
                ]
            )
    header = ["provoked by", "asked s", "its own s", "distributed's lines matched", "ours s", "distributed s"]
    section.tables.append(table([*header, "distributed - ours s", "within 50 ms or 5%"], rows))
    worst = max((abs(x) for x in diffs), default=0.0)
    section.notes.append(
        f"Target 1: each of distributed's lines for a provoked stall matches one of ours within 50 ms or 5%. "
        f"{len(diffs)} pairs; distributed - ours median {statistics.median(diffs) * 1000:+.0f} ms, "
        f"worst {worst * 1000:.0f} ms: {verdict(all_ok)}."
        if diffs
        else "Target 1: no pairs matched: NOT met."
    )
    unprovoked = [(line, s) for line, s, p in cases_of if p is None]
    if unprovoked:
        section.notes.append("Lines of distributed's outside the provoked stalls: " + _listed(unprovoked) + ".")


def _listed(pairs: list[Pair]) -> str:
    return "; ".join(
        f"{line.process} {line.seconds:.2f} s (ours {s['duration']:.3f} s, {s['activity']})"
        if s
        else f"{line.process} {line.seconds:.2f} s (none of ours)"
        for line, s in pairs
    )


def as_logged(stall: dict[str, Any]) -> str:
    """`describe` as the server's line does: its stall has no `holders` (the window has)."""
    return describe({k: v for k, v in stall.items() if k != "holders"})


def explained_as(line: Line, stall: dict[str, Any] | None, others: list[dict[str, Any]]) -> str:
    """Whether our line after distributed's described its stall, another one, or none."""
    if line.explained is None:
        return "none"
    if stall is not None and line.explained == as_logged(stall):
        return "its stall"
    if any(line.explained == as_logged(s) for s in others if s is not stall):
        return "another stall"
    return "other text"


def explanations(section: Section, runs: Runs) -> None:
    """What dask-pyspy's line after each of distributed's said, provoked and small tasks."""
    tally: dict[str, dict[str, int]] = {}
    odd: list[str] = []
    reworded: list[str] = []
    for seen, provoked in ((runs.during, True), (runs.small_seen, False)):
        for line, stall in pair(seen.lines, seen.stalls):
            p = provoked_by(line, runs.provoked) if provoked else None
            name = (p.kind if p else "(not provoked)") if provoked else "small tasks"
            answer = explained_as(line, stall, [s for s in seen.stalls if s["process"] == line.process])
            tally.setdefault(name, dict.fromkeys(ANSWERS, 0))[answer] += 1
            if answer != "its stall":
                ours = f"ours {as_logged(stall)!r}" if stall else "none of ours paired"
                odd.append(f"{line.process} {line.seconds:.2f} s: said {line.explained!r}, {ours}")
            elif stall is not None and describe(stall) != line.explained:
                reworded.append(f"{line.explained!r} / {describe(stall)!r}")
    rows: list[list[object]] = [[name, *t.values()] for name, t in tally.items()]
    section.tables.append(table(["distributed's line for", *(f"ours described {a}" for a in ANSWERS)], rows))
    total = {a: sum(t[a] for t in tally.values()) for a in ANSWERS}
    lines = sum(total.values())
    section.notes.append(
        f"dask-pyspy's line after distributed's ('dask-pyspy: that ... stall: ...') described the stall distributed "
        f"measured (the one paired with its line) after {total['its stall']} of {lines} lines, another stall of "
        f"the same process after {total['another stall']}, something else after {total['other text']}, and was "
        f"missing after {total['none']}: {verdict(total['its stall'] == lines)}. It waits up to 2 s for the sampler "
        f"to store a stall that ended within 0.5 s of distributed's line."
        + (" Not its stall: " + "; ".join(odd) + "." if odd else "")
    )
    if reworded:
        section.notes.append(
            f"The same stall reads differently in the log and through get_stalls (the CLI, the report) after "
            f"{len(reworded)} of the lines: the log's stall has no `holders`, which the window gives, and a GIL "
            f"holder not sampled reads '(not sampled)' in one and '(known)' in the other: "
            + "; ".join(sorted(set(reworded))[:3])
            + "."
        )


def small_tasks(section: Section, runs: Runs) -> None:
    """Target 5, second part: every stall of ours as long as the tick limit has a line."""
    seen: Observed = runs.small_seen
    pairs = pair(seen.lines, seen.stalls)
    paired = {id(s) for _, s in pairs if s is not None}
    long = [s for s in seen.stalls if s["duration"] >= TICK_LIMIT_S]
    alone = [s for s in long if id(s) not in paired]
    rows: list[list[object]] = [
        [
            "scheduler" if line.process.startswith("scheduler") else "worker",
            f"{line.seconds:.2f}",
            f"{s['duration']:.3f}" if s else "-",
            f"{(line.seconds - s['duration']) * 1000:+.0f}" if s else "-",
            (s or {}).get("activity") or "-",
        ]
        for line, s in pairs
    ]
    rows += [["(no line)", "-", f"{s['duration']:.3f}", "-", s["activity"]] for s in alone]
    if rows:
        header = ["process", "distributed s", "ours s", "distributed - ours ms", "our activity"]
        section.tables.append(table(header, rows))
    with_ours = sum(s is not None for _, s in pairs)
    close = sum(s is not None and agrees(s["duration"], line.seconds) for line, s in pairs)
    section.notes.append(
        f"Target 5, small tasks ({runs.small:,} tiny tasks in {runs.small_s:.1f} s, the cluster above, "
        f"tick limit {TICK_LIMIT_S * 1000:.0f} ms): {len(seen.stalls)} stalls of ours (>= "
        f"{THRESHOLD_S * 1000:.0f} ms), {len(long)} of them >= the tick limit, of which {len(long) - len(alone)} "
        f"match one of distributed's {len(seen.lines)} lines: {verdict(not alone)}. {with_ours} of distributed's "
        f"{len(seen.lines)} lines have a stall of ours ending within {PAIRED_WITHIN_S} s of it, {close} of them "
        f"within 50 ms or 5% of distributed's figure."
        + (
            " distributed measures from one of its 20 ms ticks to the next, and a tick waits for every callback "
            "queued before it: the iterations after a stall, each under the threshold, count in distributed's gap "
            "and not in our stall."
            if close < with_ours
            else ""
        )
    )


def idle(section: Section, found: dict[str, Any]) -> None:
    listed = "; ".join(f"{s['process']} {s['duration']:.3f} s {s['activity']}" for s in found["stalls"])
    section.notes.append(
        f"Target 5, idle: a LocalCluster (scheduler in this process, 2 worker processes x 2 threads) left idle "
        f"{found['seconds']:.0f} s with the plugin: {len(found['stalls'])} stalls in {found['processes']} processes"
        + (f" ({listed})" if listed else "")
        + f": {verdict(not found['stalls'])}."
    )
