"""The scheduler's half: relay profile requests to the workers (checking sizes before
any sample moves), serve the dashboard pages, and send workers their options."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
import uuid
from typing import Any, Callable

from distributed import Scheduler
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.protocol import Serialize, Serialized, deserialize, to_serialize
from distributed.protocol.pickle import dumps

from dask_pyspy import _native, config, options
from dask_pyspy._loop import off_loop
from dask_pyspy.options import SamplerOptions
from dask_pyspy.protocol import EVENT_TOPIC
from dask_pyspy.sampler import Sampler
from dask_pyspy.server.shared import PLUGIN_NAME, SamplerHold, install_handlers, rejected, remove_handlers
from dask_pyspy.server.worker import PySpyWorkerPlugin

logger = logging.getLogger(__name__)

SCHEDULER = "scheduler"
SLACK_BYTES = 1 << 20  # samples a process takes between saying its size and sending


def too_large(total: int, cap: int, sizes: dict[str, dict[str, int]], aggregate: bool) -> str:
    samples = sum(size["samples"] for size in sizes.values())
    shorter = "a shorter window (last=, or start= and stop=)"
    ask = shorter if aggregate else "aggregate=True or " + shorter
    return (
        f"the profile would take about {total / 2**20:.0f} MiB ({samples} samples from {len(sizes)} processes), "
        f"over config pyspy.max-result ({cap / 2**20:.0f} MiB): ask for {ask}, "
        "or fewer workers, or raise pyspy.max-result"
    )


def checked_parts(
    replies: dict[str, Any], sizes: dict[str, dict[str, int]], missing: dict[str, str]
) -> tuple[dict[str, bytes], list[str]]:
    """The replies that are wire bytes no larger than announced, by process, and the
    span ids they hold; the rest are named in `missing`. Only heads are read: the
    client decodes the samples (and names a part it cannot decode)."""
    parts, span_ids = {}, set()
    for name, reply in replies.items():
        data = payload(reply)
        announced = sizes[name]["bytes"]
        allowed = announced * 11 // 10 + SLACK_BYTES
        try:
            if not isinstance(data, bytes):
                raise ValueError(f"an answer of type {type(data).__name__}, not a profile")
            if len(data) > allowed:
                raise ValueError(f"{len(data)} bytes, more than the {announced} it announced")
            head = _native.Profile.wire_head(data)
            if head["memory_bytes"] > allowed:
                raise ValueError(f"a profile of {head['memory_bytes']} bytes, more than the {announced} it announced")
        except ValueError as e:
            missing[name] = f"an unusable profile: {e}"
            continue
        parts[name] = data
        span_ids.update(head["span_ids"])
    return parts, sorted(span_ids)


def payload(reply: Any) -> Any:
    """A worker's part as the bytes it sent. The scheduler deserialises nothing, so a
    part comes as frames (in process, as the worker's wrapper); joining them here, off
    the loop, spares the loop the copy."""
    if isinstance(reply, Serialize):
        return reply.data
    if isinstance(reply, Serialized):
        return deserialize(reply.header, reply.frames)
    return reply


def is_span_id(text: str) -> bool:
    """Whether `text` reads as a span id (distributed makes them with uuid4)."""
    try:
        uuid.UUID(text)
    except ValueError:
        return False
    return True


def listed(items: list[Any], most: int = 20) -> str:
    shown = ", ".join(map(repr, items[:most]))
    return shown + (f", ... ({len(items)} in all)" if len(items) > most else "")


def check_span(ext: Any, span: str | list[str] | None) -> None:
    """Refuse a span name or path that no span on the scheduler has, as an unknown
    worker is refused, rather than answer with no samples. An id passes even when the
    scheduler does not know it: samples keep the id of a span it cannot name."""
    if span is None or ext is None:
        return
    # .get, and skipping empty lists: distributed's own lookups leave empty entries.
    if isinstance(span, str):
        if ext.spans_search_by_tag.get(span) or span in ext.spans or is_span_id(span):
            return
        names = sorted(name for name, spans in ext.spans_search_by_tag.items() if spans)
        raise ValueError(f"span: no span is named {span!r} or has that id; span names: {listed(names)}")
    if ext.spans_search_by_name.get(tuple(span)) or (len(span) == 1 and is_span_id(span[0])):
        return
    paths = sorted(path for path, spans in ext.spans_search_by_name.items() if spans)
    raise ValueError(f"span: no span has the path {tuple(span)!r}; span paths: {listed(paths)}")


def kept_span_ids(ext: Any, span: str | list[str] | None) -> list[str] | None:
    """The ids of the spans a `span=` request keeps, as `SpanFilter` keeps them (a
    name: the spans with it on their path; an id: that span and those nested in it; a
    path: the spans whose path starts with it), for the workers to send only their
    samples. None: no span asked for, or no span extension to resolve it."""
    if span is None or ext is None:
        return None
    if isinstance(span, str):
        chosen = [*ext.spans_search_by_tag.get(span, ()), *filter(None, [ext.spans.get(span)])]
        ids = {span}  # an id the scheduler does not know still tags samples
    else:
        chosen = list(ext.spans_search_by_name.get(tuple(span), ()))
        ids = set(span[:1]) if len(span) == 1 else set()
    ids.update(nested.id for top in chosen for nested in top.traverse_spans())
    return sorted(ids)


class ClusterProfiler:
    """The scheduler's half: its sampler hold, the RPC handlers, the dashboard pages and
    the options every worker samples with. It outlives a re-registered `PySpyPlugin`,
    which hands it the new options."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.hold = SamplerHold(scheduler)
        self.sampler_options: SamplerOptions | None = None
        self._lock = asyncio.Lock()

    async def start(self, opts: SamplerOptions) -> None:
        # Imported here, on the scheduler only: workers start (and restart) without the pages.
        from dask_pyspy.server.dashboard import add_routes

        self.sampler_options = opts
        await self.hold.apply(opts)
        handlers: dict[str, Callable[..., Any]] = {
            "pyspy_profile": self.profile_rpc,
            "pyspy_dump": self.dump,
            "pyspy_stalls": self.stalls,
            "pyspy_memory": self.memory,
        }
        install_handlers(self.scheduler, handlers)
        self.scheduler.log_event(EVENT_TOPIC, {"action": "start"})
        add_routes(self.scheduler, self)
        await self.scheduler.register_worker_plugin(
            None, dumps(PySpyWorkerPlugin(opts)), name=PLUGIN_NAME, idempotent=False
        )

    async def apply(self, opts: SamplerOptions) -> None:
        """New options for the scheduler, every worker and future workers; samples are kept."""
        async with self._lock:
            if opts == self.sampler_options:
                return
            timeout = config.timeout()  # a bad config fails the registration before anything changes
            self.sampler_options = opts
            await self.hold.apply(opts)
            # Future workers set up with these; current ones apply them in place, since
            # registering the worker plugin again would tear down each worker's task log.
            self.scheduler.worker_plugins[PLUGIN_NAME] = dumps(PySpyWorkerPlugin(opts))
            addresses = list(self.scheduler.workers)
            replies, missing = await self._ask_workers(
                addresses, "pyspy_configure", timeout, sampler_options=opts.to_dict()
            )
            missing.update((addr, reply["error"]) for addr, reply in replies.items() if reply["error"])
            if missing:
                logger.warning("dask-pyspy: workers that could not take the new sampler options: %s", missing)

    async def close(self) -> None:
        remove_handlers(self.scheduler)
        self.scheduler.log_event(EVENT_TOPIC, {"action": "close"})
        await self.hold.release()

    def select_workers(self, workers: Any) -> list[str]:
        known = list(self.scheduler.workers)
        workers = options.workers(workers)
        if workers is None:
            return known
        if isinstance(workers, int):
            return random.sample(known, min(workers, len(known)))
        chosen = [self.scheduler.aliases.get(w, w) for w in workers]
        unknown = [w for w, a in zip(workers, chosen) if a not in self.scheduler.workers]
        if unknown:
            raise ValueError(f"workers: unknown worker addresses {unknown}; the cluster has {known}")
        return chosen

    async def _ask_workers(
        self, addresses: list[str], op: str, timeout: float, **kwargs: Any
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """Ask workers concurrently; failures and time-outs are named, never fatal."""

        async def ask(addr: str) -> Any:
            return await asyncio.wait_for(getattr(self.scheduler.rpc(addr), op)(**kwargs), timeout)

        replies = await asyncio.gather(*(ask(a) for a in addresses), return_exceptions=True)
        ok: dict[str, Any] = {}
        missing: dict[str, str] = {}
        for addr, reply in zip(addresses, replies):
            if isinstance(reply, asyncio.TimeoutError):
                missing[addr] = f"no answer within {timeout:g} s"
            elif isinstance(reply, BaseException):
                missing[addr] = f"{type(reply).__name__}: {reply}"
            elif reply is None:
                missing[addr] = f"the worker has no {op} handler (the plugin is not set up there)"
            else:
                ok[addr] = reply
        return ok, missing

    def _span_names(self, ids: list[str]) -> dict[str, dict[str, list[str]]]:
        """Names and id paths of the spans with these ids that the scheduler knows."""
        ext = self.scheduler.extensions.get("spans")
        out = {}
        for span_id in ids:
            span = ext.spans.get(span_id) if ext is not None else None
            if span is None:
                continue
            path, node = [], span
            while node is not None:
                path.append(node.id)
                node = node.parent
            out[span_id] = {"names": list(span.name), "ids": path[::-1]}
        return out

    async def profile(
        self,
        workers: Any = None,
        scheduler: bool = True,
        start: float | None = None,
        stop: float | None = None,
        timeout: float | None = None,
        span: str | list[str] | None = None,
        aggregate: bool = False,
    ) -> dict[str, Any]:
        """Every selected process's samples of `[start, stop]` as wire parts, for the
        client to merge (`dask_pyspy.protocol.assemble`): the scheduler only relays them,
        so its memory stays near the bytes it receives. First each process says how
        large its part is; a request over `pyspy.max-result` is refused before any
        sample moves."""
        try:
            start, stop = options.window(start, stop)
            addresses = self.select_workers(workers)
            timeout = config.timeout(timeout)
            span = options.span(span)
            ext = self.scheduler.extensions.get("spans")
            check_span(ext, span)
            aggregate = options.flag("aggregate", aggregate)
            scheduler = options.flag("scheduler", scheduler)
            cap = config.max_result()
        except ValueError as e:
            return rejected(e)
        stop = max(time.time(), start or 0.0) if stop is None else stop
        window = {"start": start, "stop": stop, "aggregate": aggregate, "span_ids": kept_span_ids(ext, span)}
        own = self.hold.sampler if scheduler else None
        sizes, missing = await self._sizes(addresses, own, timeout, window)
        if scheduler and own is None:
            missing[SCHEDULER] = f"sampling is off on the scheduler: {self.hold.error}"
        total = sum(size["bytes"] for size in sizes.values())
        if total > cap:
            return rejected(ValueError(too_large(total, cap, sizes, aggregate)))
        replies, failed = await self._ask_workers(
            [a for a in sizes if a != SCHEDULER], "pyspy_profile", timeout, **window
        )
        missing.update(failed)
        if own is not None:
            name = f"scheduler {self.scheduler.address}"
            replies[SCHEDULER] = await off_loop(own.export, start, stop, aggregate, name, {}, {}, window["span_ids"])
        parts, span_ids = await off_loop(checked_parts, replies, sizes, missing)
        meta = {
            "window": [start, stop],
            "workers": addresses,
            "missing": missing,
            "collected": time.time(),
            "span": span,
            "aggregate": aggregate,
        }
        return {"parts": parts, "spans": self._span_names(span_ids), "metadata": meta}

    async def profile_rpc(self, **request: Any) -> dict[str, Any]:
        """`profile` for a client: each part goes as a frame of its own, which the loop
        writes as it is, where packing it into the message would copy it on the loop."""
        reply = await self.profile(**request)
        if "parts" in reply:
            reply["parts"] = {name: to_serialize(part) for name, part in reply["parts"].items()}
        return reply

    async def _sizes(
        self, addresses: list[str], own: Sampler | None, timeout: float, window: dict[str, Any]
    ) -> tuple[dict[str, dict[str, int]], dict[str, str]]:
        """What each process would send (the scheduler's own with `own`); one that cannot say is missing."""
        replies, missing = await self._ask_workers(addresses, "pyspy_size", timeout, **window)
        sizes = {}
        for addr, reply in replies.items():
            if isinstance(reply, dict) and all(isinstance(reply.get(k), int) for k in ("samples", "bytes")):
                sizes[addr] = reply
            else:
                missing[addr] = f"an unreadable size reply: {reply!r:.100}"
        if own is not None:
            sizes[SCHEDULER] = await off_loop(lambda: own.window_size(**window))
        return sizes, missing

    async def dump(self, workers: Any = None, scheduler: bool = True, timeout: float | None = None) -> dict[str, Any]:
        try:
            addresses = self.select_workers(workers)
            timeout = config.timeout(timeout)
        except ValueError as e:
            return rejected(e)
        replies, missing = await self._ask_workers(addresses, "pyspy_dump", timeout)
        sampler = self.hold.sampler
        if scheduler and sampler is not None:
            replies[SCHEDULER] = {
                "process": f"scheduler {self.scheduler.address}",
                "pid": os.getpid(),
                **await off_loop(sampler.dump),
            }
        return {"processes": replies, "missing": missing}

    async def stalls(
        self,
        workers: Any = None,
        scheduler: bool = True,
        start: float | None = None,
        stop: float | None = None,
        min_duration: float = 0.0,
        limit: int | None = 100,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Every selected process's stalls in the window, the `limit` longest of each
        explained (None: all), by process name; processes that could not say are missing."""
        try:
            start, stop = options.window(start, stop)
            addresses = self.select_workers(workers)
            timeout = config.timeout(timeout)
            min_duration = options.duration_at_least("min_duration", min_duration)
            limit = options.limit(limit)
        except ValueError as e:
            return rejected(e)
        most = limit or 2**31
        window = {"start": start, "stop": stop, "min_duration": min_duration, "most": most}
        replies, missing = await self._ask_workers(addresses, "pyspy_stalls", timeout, **window)
        own = (lambda sampler: sampler.stalls(start, stop, min_duration, most)) if scheduler else None
        return await self._with_own(replies, missing, own)

    async def memory(
        self,
        workers: Any = None,
        scheduler: bool = True,
        start: float | None = None,
        stop: float | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Every selected process's memory counts in the window (`Sampler.memory`), by
        process name; processes that could not say are missing."""
        try:
            start, stop = options.window(start, stop)
            addresses = self.select_workers(workers)
            timeout = config.timeout(timeout)
        except ValueError as e:
            return rejected(e)
        replies, missing = await self._ask_workers(addresses, "pyspy_memory", timeout, start=start, stop=stop)
        own = (lambda sampler: sampler.memory(start, stop)) if scheduler else None
        return await self._with_own(replies, missing, own)

    async def _with_own(
        self, replies: dict[str, Any], missing: dict[str, str], own: Callable[[Sampler], Any] | None
    ) -> dict[str, Any]:
        """The workers' `replies` and `missing`, with the scheduler's own reply, `own` of its
        sampler (off the event loop), where asked for: missing while sampling is off."""
        sampler = self.hold.sampler
        if own is not None and sampler is not None:
            replies[f"scheduler {self.scheduler.address}"] = await off_loop(own, sampler)
        elif own is not None:
            missing[SCHEDULER] = f"sampling is off on the scheduler: {self.hold.error}"
        return {"processes": replies, "missing": missing}


class PySpyPlugin(SchedulerPlugin):
    """Profile a whole dask cluster: `client.register_plugin(PySpyPlugin())`.

    Starts the in-process sampler in the scheduler and in every current and future
    worker. `options` are `SamplerOptions`' fields by name (rate, idle, ...: see
    there); those not given (or None) come from dask config (`pyspy.*`).
    Registering it again with other options applies them to every running sampler
    (and future workers), keeping the samples taken so far; with the same options it
    does nothing.
    """

    # Not idempotent: distributed would skip a re-registration, and its new options with it.
    idempotent = False
    name = PLUGIN_NAME
    profiler: ClusterProfiler

    def __init__(self, **options: Any) -> None:
        # A Sampler, never started, checks every option here, in the caller's process.
        self.sampler_options = Sampler(**options).options

    async def start(self, scheduler: Scheduler) -> None:
        current = scheduler.plugins.get(PLUGIN_NAME)
        if isinstance(current, PySpyPlugin) and current is not self:
            self.profiler = current.profiler
            await self.profiler.apply(self.sampler_options)
            # distributed adds this plugin next; removing the one it replaces first spares
            # the "overwriting" warning (the old one holds nothing of its own to close).
            scheduler.remove_plugin(PLUGIN_NAME)
        else:
            self.profiler = ClusterProfiler(scheduler)
            await self.profiler.start(self.sampler_options)

    async def close(self) -> None:
        await self.profiler.close()
