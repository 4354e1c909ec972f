"""Checks for user-supplied options: each error names the argument and what is allowed."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Callable, Iterable
from typing import Any

BY_CHOICES = ("thread", "task", "prefix", "span", "activity")
WEIGHT_CHOICES = ("wall", "cpu")
READER_CHOICES = ("auto", "fast", "pyspy")


def number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def integer(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


def duration_at_least(name: str, value: Any) -> float:
    """A number of seconds, 0 or more."""
    given = number(name, value)
    if not 0 <= given < math.inf:
        raise ValueError(f"{name} must be a number of seconds, 0 or more, got {value!r}")
    return given


def limit(value: Any) -> int | None:
    """How many items to return: None (all) or a positive integer."""
    if value is None:
        return None
    given = integer("limit", value)
    if given < 1:
        raise ValueError(f"limit must be a positive integer or None, got {value!r}")
    return given


def flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def known(kind: str, given: Iterable[str], allowed: Iterable[str]) -> None:
    """Every name in `given` is one of `allowed` (keyword options)."""
    unknown = set(given) - set(allowed)
    if unknown:
        raise TypeError(f"unknown {kind} {sorted(unknown)}; allowed: {', '.join(allowed)}")


def by(value: Any) -> str:
    return choice("by", value, BY_CHOICES)


def weight(value: Any) -> str:
    return choice("weight", value, WEIGHT_CHOICES)


def span(value: Any) -> str | list[str] | None:
    """None (every sample), a span's name or id, or a name path outermost first."""
    if value is None:
        return None
    if isinstance(value, str) and value:
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) and v for v in value):
        return list(value)
    raise ValueError(
        f"span must be None, a span name or id (e.g. 'load'), or a path of names outermost first "
        f"(e.g. ('load', 'parse')), got {value!r}"
    )


def workers(value: Any) -> int | list[str] | None:
    """None (all), a positive count (a random sample), or worker addresses/names."""
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        if value < 1:
            raise ValueError(
                f"workers must be None, a positive number of workers or a list of worker addresses, got {value}"
            )
        return int(value)
    if isinstance(value, (list, tuple, set)) and all(isinstance(w, str) for w in value):
        return list(value)
    raise ValueError(f"workers must be None, a positive number of workers or a list of worker addresses, got {value!r}")


def seconds(name: str, value: Any) -> float:
    """A duration: a positive, finite number of seconds."""
    given = number(name, value)
    if not 0 < given < math.inf:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return given


def last(value: Any) -> float | None:
    """Seconds before now that a window starts."""
    return None if value is None else seconds("last", value)


def window(start: Any, stop: Any) -> tuple[float | None, float | None]:
    """A time window in Unix seconds; either end may be open (None)."""
    start = None if start is None else number("start", start)
    stop = None if stop is None else number("stop", stop)
    if start is not None and stop is not None and stop < start:
        raise ValueError(f"stop must not be before start, got start={start} stop={stop}")
    return start, stop


def _checked_by(check: Callable[[str, Any], Any]) -> Any:
    """A required option field whose value `check(name, value)` checks and converts."""
    return dataclasses.field(metadata={"check": check})


@dataclasses.dataclass(frozen=True)
class SamplerOptions:
    """How a process samples: the options of `Sampler`, `PySpyPlugin` and `PySpyProfiler`.

    Their defaults are dask config's `pyspy.*` (`dask_pyspy/pyspy.yaml`), filled in by
    `config.sampler_options`. Types are checked here; the native sampler checks ranges.

    Args:
        rate: samples per second, in (0, 10000].
        idle: also keep samples of threads that are waiting (off CPU, not holding the GIL)
            and run no task (a task's waits are always kept).
        gil_only: only sample threads running Python: the one holding the GIL, or on a
            free-threaded build every thread attached to the interpreter.
        cpu_budget: largest fraction of one core the sampler may use, in (0, 1]; past it
            the interval stretches and samples are weighted by the time they stand for.
        max_memory: cap on the sample store in bytes (at least 1 MiB), raw and folded samples
            alike. Past it the oldest history buckets merge into coarser ones (up to an
            hour), then the raw window shrinks, then the oldest buckets go.
        recent: seconds samples stay raw, in [0, 604800]; older ones are folded into the
            history: summed per thread, stack, task prefix, span, activity and state.
        history_step: seconds per history bucket, in [1, 3600].
        lines: record line numbers; off gives function-level profiles at ~25% less cost.
        function: aggregate by each function's first line (``py-spy record --function``).
        reader: ``"auto"`` (the fast reader where its self-check at start passes, else
            py-spy's), ``"fast"`` (our own reader; RuntimeError where it cannot work) or
            ``"pyspy"`` (py-spy's reader, ~8 syscalls per frame). ``stats()["reader"]``
            says which one runs, ``stats()["reader_stats"]["fallback_reason"]`` why.
        native: also capture the native (C, C++, Rust) frames of each thread running on a
            CPU, merged with its Python frames (Linux x86-64, 4.19 or later; a timer on each
            busy thread's CPU clock signals it where it runs). ``stats()["native"]`` counts
            what it did.
        memory: also sample allocations (Python's allocators and numpy's array buffers,
            one every ~512 KiB allocated on average), each charged to the task prefix
            running on the allocating thread, and match the frees of those sampled:
            ``Sampler.memory()``, ``client.pyspy_memory()``. One count per process,
            afresh each time the sampler starts. On by default (about 1% of CPU where
            allocations abound); off, the allocators are left alone.
    """

    rate: float = _checked_by(number)
    idle: bool = _checked_by(flag)
    gil_only: bool = _checked_by(flag)
    cpu_budget: float = _checked_by(number)
    max_memory: int = _checked_by(integer)
    recent: float = _checked_by(number)
    history_step: float = _checked_by(number)
    lines: bool = _checked_by(flag)
    function: bool = _checked_by(flag)
    reader: str = _checked_by(functools.partial(choice, choices=READER_CHOICES))
    native: bool = _checked_by(flag)
    memory: bool = _checked_by(flag)

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):  # in field order; numbers as the native sampler takes them
            object.__setattr__(self, field.name, field.metadata["check"](field.name, getattr(self, field.name)))

    @staticmethod
    def names() -> tuple[str, ...]:
        return tuple(field.name for field in dataclasses.fields(SamplerOptions))

    def replace(self, **changes: Any) -> SamplerOptions:
        """These options with `changes` (names as the fields'), checked."""
        known("sampler options", changes, self.names())
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The options as RPC sends them; `SamplerOptions(**d)` reads them back."""
        return dataclasses.asdict(self)
