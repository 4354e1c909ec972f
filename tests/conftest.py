"""Helpers shared by the in-process and cluster tests."""

from __future__ import annotations

import sys
import sysconfig
import time
from typing import Any, Callable

# A free-threaded build (3.13t): no GIL, and py-spy's reader does not read it.
FREE_THREADED = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))
# The fast reader reads CPython 3.11+; before, py-spy's is the only reader, no fallback.
FAST_WORKS = sys.version_info >= (3, 11)


def wait_for(condition: Callable[[], Any], what: str = "condition", timeout: float = 60.0) -> Any:
    """`condition()`'s first true answer, asked until `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, f"no {what} within {timeout:g} s"
        time.sleep(0.05)
    return result


def frame_names(doc: dict[str, Any], sample: list[int]) -> list[str]:
    frames = doc["shared"]["frames"]
    return [frames[i]["name"] for i in sample]


def weight_by_function(doc: dict[str, Any], profile: dict[str, Any]) -> dict[str, float]:
    """Seconds each function name appears anywhere on the stacks of one speedscope profile."""
    out: dict[str, float] = {}
    for sample, weight in zip(profile["samples"], profile["weights"]):
        for name in set(frame_names(doc, sample)):
            out[name] = out.get(name, 0.0) + weight
    return out


def profiles_named(doc: dict[str, Any], fragment: str) -> list[dict[str, Any]]:
    return [p for p in doc["profiles"] if fragment in p["name"]]


def self_seconds(doc: dict[str, Any], name: str) -> float:
    """Seconds a function of this name was the leaf of a stack, over a speedscope
    document's thread profiles (by="thread" documents hold no other)."""
    frames = doc["shared"]["frames"]
    return sum(
        w for p in doc["profiles"] for s, w in zip(p["samples"], p["weights"]) if s and frames[s[-1]]["name"] == name
    )


def most_sampled_state(stall: dict[str, Any]) -> str:
    """The state a stalled loop's thread was sampled in most: sampled seconds can fall
    short of a stall's duration on a loaded machine, whose sampler is starved too."""
    return max(stall["states"], key=stall["states"].get)
