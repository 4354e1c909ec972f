"""Event-loop stalls in a server: its loop's selector timed (the native `LoopWatch`),
and distributed's "Event loop was unresponsive" line followed by one of ours saying
what held the loop.

Servers that share a loop (a LocalCluster without processes) share its watch; the log
filter is one per process. The last server to let go removes both.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from dask_pyspy import _native, config
from dask_pyspy._loop import in_background
from dask_pyspy.sampler import Sampler
from dask_pyspy.stalls import describe

logger = logging.getLogger(__name__)

UNRESPONSIVE = "Event loop was unresponsive"  # distributed.core's message, `Server._measure_tick`
TICK_LOGGER = "distributed.core"
# How long the explanation waits for the sampler to store the stall distributed saw.
FIND_FOR_S = 2.0
FIND_EVERY_S = 0.05
# How far from distributed's line its stall may have ended: its tick waits for the
# callbacks queued behind the stall.
ENDED_WITHIN_S = 0.5
# How long ours waits for distributed's line to be written first (a handler that never
# writes it, filtered by level, costs this wait once).
TOLD_WITHIN_S = 5.0


class LoopWatch:
    """The running loop's selector, timed for stalls while any server here holds it."""

    _held: dict[int, tuple[Any, _native.LoopWatch, int]] = {}  # by id(selector): (selector, watch, holders)

    def __init__(self, sampler: Sampler, threshold: float) -> None:
        self.sampler = sampler
        self.selector = getattr(asyncio.get_running_loop(), "_selector", None)
        if self.selector is None:  # uvloop, or another loop without a Python selector
            logger.info("dask-pyspy: this event loop has no selector to time: its stalls are not watched")
            return
        held = self._held.get(id(self.selector))
        if held is None:
            watch = sampler.native.watch_loop(self.selector.select, threshold)
            self.selector.select = watch
            held = (self.selector, watch, 0)
        self._held[id(self.selector)] = (held[0], held[1], held[2] + 1)

    def remove(self) -> None:
        if self.selector is None:
            return
        selector, watch, holders = self._held.pop(id(self.selector))
        if holders > 1:
            self._held[id(selector)] = (selector, watch, holders - 1)
            return
        if vars(selector).get("select") is watch:
            del selector.select
        self.sampler.native.unwatch_loop(watch)


class _Told(str):
    """distributed's message, marking when a handler first formats it: its line is being
    written then, under the handler's lock, which ours then waits for. A filter runs
    before any handler, so without it ours could be written first."""

    told: threading.Event

    def __new__(cls, message: str, told: threading.Event) -> _Told:
        marked = super().__new__(cls, message)
        marked.told = told
        return marked

    def __str__(self) -> str:
        self.told.set()
        return str.__str__(self)


class ExplainStalls(logging.Filter):
    """On `distributed.core`: lets every record through, and after distributed's line on
    an unresponsive loop logs ours, at its level, explaining the stall it measured.
    The explanation is found off the loop, from what the sampler already holds."""

    holders: int = 0
    installed: ExplainStalls | None = None

    def __init__(self, sampler: Sampler) -> None:
        super().__init__()
        self.sampler = sampler

    @classmethod
    def hold(cls, sampler: Sampler) -> None:
        if cls.holders == 0:
            cls.installed = cls(sampler)
            logging.getLogger(TICK_LOGGER).addFilter(cls.installed)
        cls.holders += 1

    @classmethod
    def release(cls) -> None:
        cls.holders -= 1
        if cls.holders == 0 and cls.installed is not None:
            logging.getLogger(TICK_LOGGER).removeFilter(cls.installed)
            cls.installed = None

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith(UNRESPONSIVE):
            seconds = record.args[-1] if isinstance(record.args, tuple) and record.args else None
            if isinstance(seconds, (int, float)):
                told = threading.Event()
                record.msg = _Told(record.msg, told)
                in_background(self._explain, record, float(seconds), told)
        return True

    def _explain(self, record: logging.LogRecord, seconds: float, told: threading.Event) -> None:
        stall = self._find(record.created, seconds)
        told.wait(TOLD_WITHIN_S)
        out = logging.getLogger(record.name)
        if stall is None:
            out.debug("dask-pyspy: the sampler saw no stall like that %.2f s one", seconds)
            return
        out.log(record.levelno, "dask-pyspy: that %s", describe(stall))

    def _find(self, seen_at: float, seconds: float) -> dict[str, Any] | None:
        """The stall distributed measured: of about `seconds`, ended just before
        `seen_at` (its tick runs once the loop is back). The sampler stores it at its
        next tick; an earlier stall is never taken for it."""
        deadline = time.monotonic() + FIND_FOR_S
        while True:
            found = self.sampler.stalls(seen_at - seconds - ENDED_WITHIN_S, None, min_duration=seconds / 2, most=5)
            ended = [s for s in found["explained"] if abs(seen_at - s["start"] - s["duration"]) <= ENDED_WITHIN_S]
            if ended:
                return {**max(ended, key=lambda s: s["start"]), "holders": found["holders"]}
            if time.monotonic() > deadline or not self.sampler.is_running:
                return None
            time.sleep(FIND_EVERY_S)


class StallWatch:
    """A server's part: its loop timed, and the log explained, while it holds the sampler."""

    def __init__(self, sampler: Sampler) -> None:
        self.loop: LoopWatch | None = None
        try:
            threshold = config.stall_threshold()
        except ValueError as e:  # sampling goes on; only stalls go unwatched
            logger.error("dask-pyspy: event-loop stalls are not watched: %s", e)
            return
        self.loop = LoopWatch(sampler, threshold)
        ExplainStalls.hold(sampler)

    def remove(self) -> None:
        if self.loop is not None:
            self.loop.remove()
            ExplainStalls.release()
