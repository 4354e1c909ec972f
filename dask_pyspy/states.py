"""Thread states, named once for the report's columns and the live dump's threads."""

from __future__ import annotations

# By the key a profile's summary splits time by (`Split` in rust/profile/summary.rs).
STATES = {
    "gil": "on CPU, GIL",
    "no_gil": "on CPU, no GIL",
    "cpu_wait": "waiting for a CPU",
    "gil_wait": "waiting for the GIL",
    "native": "native threads",
    "blocked": "blocked",
}
# The summary key of each state code a dump's thread carries (`State::name` in rust/profile/sample.rs).
KEYS = {
    "cpu-gil": "gil",
    "cpu": "no_gil",
    "cpu-wait": "cpu_wait",
    "gil-wait": "gil_wait",
    "native": "native",
    "blocked": "blocked",
}


def name(code: str) -> str:
    """The report's name of a state code ("gil-wait": "waiting for the GIL"); a code
    this version does not know, as it is."""
    return STATES[KEYS[code]] if code in KEYS else code
