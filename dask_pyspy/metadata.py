"""What reports read from a profile's metadata and its processes' sampler stats,
checked where a profile comes from a file: a file that loads must render, so a field
of the wrong type is a ValueError naming it at load, not a crash in the report."""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, NamedTuple


class Is(NamedTuple):
    what: str
    test: Callable[[Any], bool]


class Omittable(NamedTuple):
    """A field that may be absent."""

    schema: Any


class OrNull(NamedTuple):
    schema: Any


class Each(NamedTuple):
    """An object whose every value matches `schema`."""

    schema: Any


class Items(NamedTuple):
    """A list whose every item matches `schema`."""

    schema: Any


def _finite(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


NUMBER = Is("a number", _finite)
COUNT = Is("a count", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0)
FLAG = Is("true or false", lambda v: isinstance(v, bool))
TEXT = Is("a string", lambda v: isinstance(v, str))
# A Unix time a date can be made of (the report prints them as dates).
TIME = Is("a Unix time", lambda v: v is None or (_finite(v) and 0 <= v <= 1e11))
STEPS = Is("a list of numbers or nulls", lambda v: isinstance(v, list) and all(x is None or _finite(x) for x in v))
TEXTS = Is("a list of strings", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v))
MOMENT = Is("a Unix time", lambda v: v is not None and TIME.test(v))
STALL_RECORD = Is(
    "[start, duration] in seconds",
    lambda v: isinstance(v, list) and len(v) == 2 and MOMENT.test(v[0]) and _finite(v[1]),
)
WINDOW = Is(
    "[start, stop] in Unix seconds", lambda v: isinstance(v, list) and len(v) == 2 and all(TIME.test(t) for t in v)
)

METADATA = {
    "window": Omittable(OrNull(WINDOW)),
    "missing": Omittable(OrNull(Each(TEXT))),
    "tasks": Omittable(OrNull(Each(Each({"count": NUMBER, "seconds": NUMBER})))),
}

# A window's event-loop stalls (dask_pyspy.stalls); older profiles have none.
STALLS = {
    "watched": FLAG,
    "threshold": OrNull(NUMBER),
    "holders": TEXT,
    "count": Omittable(NUMBER),
    "stalled_s": Omittable(NUMBER),
    "records": Items(STALL_RECORD),
    "explained": Items(
        {
            "thread": TEXT,
            "start": MOMENT,
            "duration": NUMBER,
            "activity": OrNull(TEXT),
            "states": Each(NUMBER),
            "stack": TEXTS,
            "call": OrNull(TEXT),
            "gil_holders": Items(
                {
                    "thread": TEXT,
                    "task_key": OrNull(TEXT),
                    "prefix": OrNull(TEXT),
                    "activity": OrNull(TEXT),
                    "function": OrNull(TEXT),
                    "seconds": NUMBER,
                }
            ),
        }
    ),
    "dropped": COUNT,
    "dropped_s": NUMBER,
    "lost": COUNT,
}

STATS = {
    "requested_rate": NUMBER,
    "achieved_rate": NUMBER,
    "cpu_fraction": NUMBER,
    "ticks": COUNT,
    "failed_ticks": COUNT,
    "throttled_ticks": COUNT,
    "config": {"cpu_budget": NUMBER, "idle": FLAG},
    "store": {"samples_evicted": COUNT},
    # Profiles saved before thread states were read have neither.
    "cores": Omittable(COUNT),
    "window_cpu": Omittable({"process_cpu_s": NUMBER, "native_cpu_s": NUMBER}),
    # CPU and resident memory per step (sampling/series.rs); older profiles have none.
    # `in_use`: bytes held per task prefix and step, where memory per task was tracked;
    # `arrow`: what arrow's pool held, where noted.
    "series": Omittable(
        {
            "start": TIME,
            "step": NUMBER,
            "cpu": STEPS,
            "rss": STEPS,
            "in_use": Omittable(Items({"prefix": OrNull(TEXT), "bytes": STEPS})),
            "arrow": Omittable(STEPS),
        }
    ),
    # Memory per task (dask_pyspy.memory), and a worker's results in memory by prefix.
    "memory": Omittable(
        {
            "prefixes": Items({"prefix": OrNull(TEXT), "allocated": NUMBER, "in_use": NUMBER, "peak": NUMBER}),
            "sites": Omittable(
                Items(
                    {
                        "prefix": OrNull(TEXT),
                        "frames": Items({"name": TEXT, "file": TEXT, "line": NUMBER}),
                        "note": OrNull(TEXT),
                        "allocated": NUMBER,
                        "in_use": NUMBER,
                    }
                )
            ),
            "window": Omittable(OrNull(WINDOW)),
            "dropped": COUNT,
            "mean_bytes": COUNT,
        }
    ),
    "managed": Omittable(Each(NUMBER)),
    "stalls": Omittable(STALLS),
    "reader": Omittable(OrNull(TEXT)),
    "last_error": Omittable(OrNull(TEXT)),
    "panic": Omittable(OrNull(TEXT)),
    "reader_stats": Omittable(
        OrNull(
            {
                "thread_reads": Omittable(OrNull(NUMBER)),
                "lost_reads": Omittable(NUMBER),
                "torn_reads": Omittable(NUMBER),
                "fallback_reason": Omittable(OrNull(TEXT)),
                "fallback_expected": Omittable(FLAG),
                "free_threaded": Omittable(FLAG),
                "gil_enabled": Omittable(FLAG),
            }
        )
    ),
}


def check(metadata: dict[str, Any], processes: list[dict[str, Any]]) -> None:
    """Raise ValueError naming the first field a report could not read."""
    _check(metadata, METADATA, "metadata")
    for i, process in enumerate(processes):
        _check(process["stats"], STATS, f"processes[{i}].stats")


def _check(value: Any, schema: Any, where: str) -> None:
    if isinstance(schema, OrNull):
        if value is not None:
            _check(value, schema.schema, where)
    elif isinstance(schema, Is):
        if not schema.test(value):
            raise ValueError(f"{where} must be {schema.what}, got {_short(value)}")
    elif isinstance(schema, Items):
        if not isinstance(value, list):
            raise ValueError(f"{where} must be a list, got {_short(value)}")
        for i, item in enumerate(value):
            _check(item, schema.schema, f"{where}[{i}]")
    elif not isinstance(value, dict):
        raise ValueError(f"{where} must be an object, got {_short(value)}")
    elif isinstance(schema, Each):
        for key, item in value.items():
            _check(item, schema.schema, f"{where}[{key!r}]")
    else:
        for key, field in schema.items():
            if isinstance(field, Omittable):
                if key not in value:
                    continue
                field = field.schema
            elif key not in value:
                raise ValueError(f"{where}.{key} is missing")
            _check(value[key], field, f"{where}.{key}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
