"""The report's section on event-loop stalls, from processes' `stats["stalls"]` as a
window gives them: none without stalls, the most stalled process first, the longest
stalls explained, and where GIL holders could not be known it says so."""

from __future__ import annotations

from typing import Any

from dask_pyspy.render.stalls import MOST_HOLDERS, SHOWN, section


def stats(durations: list[float], holders: str = "known", start: float = 1e9) -> dict[str, Any]:
    records = [[start + 10 * i, d] for i, d in enumerate(durations)]
    gil = [
        {"thread": "t", "task_key": f"f-{i}", "prefix": "f", "activity": None, "function": "f (x.py:1)", "seconds": 0.1}
        for i in range(MOST_HOLDERS + 2)
    ]
    explained = [
        {
            "thread": "loop",
            "start": s,
            "duration": d,
            "activity": "worker: execute",
            "states": {"gil-wait": d},
            "stack": [f"frame{j} (y.py:{j})" for j in range(9)],
            "call": None,
            "gil_holders": gil if holders == "known" else [],
        }
        for s, d in sorted(records, key=lambda r: -r[1])
    ]
    return {"watched": True, "threshold": 0.2, "holders": holders, "records": records, "explained": explained}


def test_no_stalls_no_section():
    assert section([("w", stats([]))], None) is None
    assert section([], None) is None


def test_processes_and_the_longest_stalls():
    shown = section(
        [("tcp://a:1", stats([0.3] * 30)), ("tcp://b:1", stats([2.0, 0.5], holders="unknown on py-spy's reader"))],
        "<svg/>",
    )
    assert shown is not None
    assert [row[:4] for row in shown["processes"]] == [["tcp://a:1", 30, 9.0, 0.3], ["tcp://b:1", 2, 2.5, 2.0]]
    assert "GIL holders unknown on py-spy's reader" in shown["processes"][1][4]
    assert shown["count"] == 32 and shown["threshold"] == "200 ms"
    longest = shown["stalls"]
    assert len(longest) == SHOWN and [s["seconds"] for s in longest[:2]] == [2.0, 0.5]
    assert longest[0]["holders"]["unknown"] == "unknown on py-spy's reader"
    assert "2.00 s waiting for the GIL held by an unknown thread" in longest[0]["held"][0]
    third = longest[2]
    assert len(third["holders"]["shown"]) == MOST_HOLDERS and third["holders"]["more"] == 2
    assert third["holders"]["shown"][0] == {"who": "f-0", "function": "f (x.py:1)", "seconds": 0.1}
    assert third["stack"][0] == "frame0 (y.py:0)" and len(third["stack"]) < 9
    unknown = [{"reason": "unknown on py-spy's reader", "processes": ["tcp://b:1"], "free_threaded": False}]
    assert shown["unknown_holders"] == unknown
