"""The `pyspy` namespace of dask config, registered the way distributed registers its own."""

from __future__ import annotations

import os
from typing import Any

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
    (`DASK_PYSPY__RATE` etc.); `max_memory` may be a size such as "64MiB"."""
    names = SamplerOptions.names()
    options.known("sampler options", given, names)
    out = {name: get(name) if given.get(name) is None else given[name] for name in names}
    if isinstance(out["max_memory"], str):
        out["max_memory"] = parse_bytes(out["max_memory"])
    return SamplerOptions(**out)


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
