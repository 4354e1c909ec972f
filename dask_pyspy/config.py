"""The `pyspy` namespace of dask config, registered the way distributed registers its own."""

from __future__ import annotations

import math
import os
from typing import Any, Callable

import dask.config
import yaml
from dask.utils import parse_bytes, parse_timedelta

from dask_pyspy import options
from dask_pyspy.options import SamplerOptions

with open(os.path.join(os.path.dirname(__file__), "pyspy.yaml")) as f:
    # libyaml's loader where PyYAML has it: every worker (re)start reads this file.
    defaults = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))

dask.config.update_defaults(defaults)


def get(name: str) -> Any:
    """`pyspy.<name>`; the packaged default where the config lacks it (a config restored
    from a snapshot taken before this module was imported, as distributed's tests do)."""
    return dask.config.get(f"pyspy.{name}", default=defaults["pyspy"][name.replace("_", "-")])


def sampler_options(**given: Any) -> SamplerOptions:
    """Sampler options: the given ones (None: not given), the rest from dask config
    (`DASK_PYSPY__RATE` etc.); `max_memory` may be a size such as "64MiB", `recent`
    and `history_step` durations such as "10 minutes"."""
    names = SamplerOptions.names()
    options.known("sampler options", given, names)
    out = {name: get(name) if given.get(name) is None else given[name] for name in names}
    for name, parse, example in PARSED:
        if isinstance(out[name], str):
            out[name] = _parsed(name, out[name], parse, example)
    return SamplerOptions(**out)


# Options that dask config may give as strings: how to read them, and an example.
PARSED = (
    ("max_memory", parse_bytes, "'64MiB'"),
    ("recent", parse_timedelta, "'10 minutes'"),
    ("history_step", parse_timedelta, "'1 minute'"),
)


def _parsed(name: str, value: str, parse: Callable[[str], Any], example: str) -> Any:
    try:
        return parse(value)
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{name} must be a number or a string such as {example}, got {value!r}") from None


def timeout(given: Any = None) -> float:
    """Seconds to wait for each worker: `given`, else config `pyspy.timeout`."""
    if given is None:
        return options.seconds("config pyspy.timeout", parse_timedelta(get("timeout")))
    return options.seconds("timeout", given)


def max_result() -> int:
    """Bytes a merged profile may take: config `pyspy.max-result`."""
    value = get("max-result")
    try:
        size = parse_bytes(value) if isinstance(value, str) else value
    except ValueError:
        size = None
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ValueError(
            f"config pyspy.max-result must be a size in bytes such as '512MiB' or 536870912, got {value!r}"
        )
    return size


def stall_threshold() -> float:
    """Seconds an event loop must be kept from its poll to have stalled: config
    `pyspy.stall-threshold`, such as '200ms'."""
    value = get("stall-threshold")
    try:
        seconds = parse_timedelta(value) if isinstance(value, str) else value
    except (ValueError, KeyError, TypeError):
        seconds = None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < math.inf:
        raise ValueError(
            f"config pyspy.stall-threshold must be a positive duration such as '200ms' or 0.2, got {value!r}"
        )
    return float(seconds)
