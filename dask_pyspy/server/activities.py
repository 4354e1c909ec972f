"""Name what a server's event loop does outside tasks, where distributed dispatches it.

Each hook enters an activity ("scheduler: task-finished") in the event loop's thread
and leaves it after; the sampler reads the thread's activity beside its task tag.
Coroutines run through the native `steps`, which enters their activity around each
step, so the name holds across `await`s and nothing else inherits it meanwhile.

The hooks sit at the dispatch points, not on handlers by name, so handlers added
later by other plugins are named too:
- RPC and stream handlers, by op, through the server's `handlers` and
  `stream_handlers` dicts (looked up per message in `distributed/core.py`);
- periodic callbacks, by their name in `periodic_callbacks`;
- the worker's asynchronous instructions (`gather_dep`, `execute`) and its state
  machine (`handle_stimulus`, by event class), which names time outside any op;
- comms' reads and writes outside any op ("receiving", "sending": a stream's
  batches, batched sends), the offload thread's (de)serialising, and tornado's I/O
  callbacks, in the activity that asked for them (`Shared`);
- the rest of the loop thread's time (polling, timers) is "<kind>: event loop".

A dispatch point missing from the installed distributed is skipped: its time stays
"(no task)".
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from collections.abc import Awaitable
from typing import Any, Callable

from distributed import Scheduler, Worker
from distributed.comm import utils as comm_utils
from distributed.comm.core import Comm
from distributed.utils import iscoroutinefunction
from tornado.iostream import BaseIOStream

from dask_pyspy import _native

logger = logging.getLogger(__name__)

CONNECTION, DISPATCH, STATE_MACHINE = "connection", "dispatch", "state-machine"
NOTED = "_pyspy_activity"  # a tornado stream's attribute: the activity of its last read or write
COMM_IO = {"read": "receiving", "write": "sending"}
STREAM_IO = ("read_bytes", "read_into", "write")


def run_in(
    native: _native.Sampler, activity: _native.Activity, func: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """`func(*args, **kwargs)` with the calling thread in `activity`."""
    previous = native.enter_activity(activity)
    try:
        return func(*args, **kwargs)
    finally:
        native.leave_activity(previous)


def same_signature(wrapper: Callable[..., Any], func: Callable[..., Any]) -> Callable[..., Any]:
    """`wrapper` with `func`'s signature, which distributed reads (a first `comm`).

    `functools.wraps` alone is not enough: on Python 3.9 `inspect` unwraps a decorated
    bound method (`Worker.get_data`) to its function, `self` first.
    """
    try:
        wrapper.__signature__ = inspect.signature(func)  # type: ignore[attr-defined]
    except (TypeError, ValueError):  # no signature to keep (some builtins)
        pass
    return wrapper


class Named:
    """The activities of one server, each made once: `<kind>: <name>`."""

    def __init__(self, native: _native.Sampler, kind: str) -> None:
        self.native = native
        self.kind = kind
        self._made: dict[tuple[str, str], _native.Activity] = {}

    def __call__(self, name: str, level: str = DISPATCH) -> _native.Activity:
        activity = self._made.get((name, level))
        if activity is None:
            activity = self._made[name, level] = _native.Activity(f"{self.kind}: {name}", level)
        return activity

    def wrap(self, func: Callable[..., Any], activity: _native.Activity) -> Callable[..., Any]:
        """`func` run in `activity`, each call counted once as one of its calls; a
        coroutine function stays one (distributed checks)."""
        native = self.native
        if iscoroutinefunction(func):

            @functools.wraps(func)
            async def run_coroutine(*args: Any, **kwargs: Any) -> Any:
                native.count_call(activity)
                return await native.steps(func(*args, **kwargs), activity)

            return same_signature(run_coroutine, func)

        @functools.wraps(func)
        def run(*args: Any, **kwargs: Any) -> Any:
            native.count_call(activity)
            result = run_in(native, activity, func, *args, **kwargs)
            return self.stepped(result, activity) if inspect.iscoroutine(result) else result

        return same_signature(run, func)

    async def stepped(self, coro: Awaitable[Any], activity: Any) -> Any:
        return await self.native.steps(coro, activity)


class NamedHandlers(dict):
    """A server's handlers dict whose lookups return each handler run in its op's
    activity; wrappers are kept, so distributed's per-function caches stay small."""

    def __init__(self, handlers: dict[str, Any], named: Named) -> None:
        super().__init__(handlers)
        self._named = named
        self._wrapped: dict[str, tuple[Any, Callable[..., Any]]] = {}

    def __getitem__(self, op: str) -> Any:
        handler = super().__getitem__(op)
        kept = self._wrapped.get(op)
        if kept is None or kept[0] is not handler:
            kept = self._wrapped[op] = (handler, self._named.wrap(handler, self._named(op)))
        return kept[1]


class NamedCallbacks(dict):
    """`periodic_callbacks` that names each callback put in it by its key."""

    def __init__(self, callbacks: dict[str, Any], named: Named) -> None:
        super().__init__()
        self._named = named
        self.originals: dict[int, tuple[Any, Callable[..., Any]]] = {}
        for name, pc in callbacks.items():
            self[name] = pc

    def __setitem__(self, name: str, pc: Any) -> None:
        callback = getattr(pc, "callback", None)
        if callable(callback) and id(pc) not in self.originals:
            self.originals[id(pc)] = (pc, callback)
            pc.callback = self._named.wrap(callback, self._named(f"periodic {name}"))
        super().__setitem__(name, pc)

    def restore(self) -> dict[str, Any]:
        for pc, callback in self.originals.values():
            pc.callback = callback
        return dict(self)


class Shared:
    """Hooks on what a process's servers share: distributed's comms, its offload thread
    and tornado's streams. The first server's `Hooks` put them in, the last's remove them.

    - A comm's reads and writes outside any op (a stream's batches, batched sends, a
      connection opened before the hooks) are "receiving" and "sending".
    - (De)serialising a large message on the offload thread runs in the caller's activity.
    - A 50 MB `get_data` reply is written mostly by tornado's own callback on the socket
      becoming writable, outside the handler's steps; each stream read and write notes
      the caller's activity on the stream, and the callback runs in it.
    """

    servers: dict[int, list[Named]] = {}  # by event loop thread: its servers' names
    originals: list[tuple[Any, str, Any]] = []

    @classmethod
    def hold(cls, named: Named) -> None:
        if not cls.servers:
            replacements = cls._replacements(named.native)
            cls.originals = [(owner, name, vars(owner)[name]) for owner, name, _ in replacements]
            for owner, name, replacement in replacements:
                setattr(owner, name, replacement)
        cls.servers.setdefault(threading.get_ident(), []).append(named)

    @classmethod
    def release(cls, named: Named) -> None:
        here = cls.servers[threading.get_ident()]
        here.remove(named)
        if not here:
            del cls.servers[threading.get_ident()]
        if not cls.servers:
            for owner, name, original in cls.originals:
                setattr(owner, name, original)

    @classmethod
    def here(cls) -> Named | None:
        """The names of the (first) server whose event loop runs on this thread."""
        here = cls.servers.get(threading.get_ident())
        return here[0] if here else None

    @classmethod
    def _replacements(cls, native: _native.Sampler) -> list[tuple[Any, str, Callable[..., Any]]]:
        out: list[tuple[Any, str, Callable[..., Any]]] = []
        for comm in cls._subclasses(Comm):
            methods = (name for name in COMM_IO if name in vars(comm))
            out += [(comm, name, cls._comm_io(vars(comm)[name], COMM_IO[name])) for name in methods]
        if hasattr(comm_utils, "offload"):
            out.append((comm_utils, "offload", cls._offload(native, comm_utils.offload)))
        out += [(BaseIOStream, name, cls._noting(native, vars(BaseIOStream)[name])) for name in STREAM_IO]
        out.append((BaseIOStream, "_handle_events", cls._in_noted(native, BaseIOStream._handle_events)))
        return out

    @classmethod
    def _subclasses(cls, base: type) -> list[type]:
        """The subclasses of `base` imported so far (tcp, tls, inproc, ...)."""
        subclasses: list[type] = base.__subclasses__()
        return [c for sub in subclasses for c in (sub, *cls._subclasses(sub))]

    @classmethod
    def _comm_io(cls, method: Callable[..., Any], name: str) -> Callable[..., Any]:
        @functools.wraps(method)
        async def run(comm: Comm, *args: Any, **kwargs: Any) -> Any:
            named = cls.here()
            if named is None:  # a client's or another thread's comm
                return await method(comm, *args, **kwargs)
            return await named.native.steps(method(comm, *args, **kwargs), named(name, CONNECTION))

        return run

    @classmethod
    def _offload(cls, native: _native.Sampler, offload: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(offload)
        def run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            activity = native.current_activity() if cls.here() else None
            if activity is None:
                return offload(fn, *args, **kwargs)
            return offload(run_in, native, activity, fn, *args, **kwargs)

        return run

    @staticmethod
    def _noting(native: _native.Sampler, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def noting(self: BaseIOStream, *args: Any, **kwargs: Any) -> Any:
            setattr(self, NOTED, native.current_activity())
            return method(self, *args, **kwargs)

        return noting

    @staticmethod
    def _in_noted(native: _native.Sampler, handle_events: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(handle_events)
        def in_noted(self: BaseIOStream, fd: Any, events: int) -> None:
            activity = getattr(self, NOTED, None)
            if activity is None:
                return handle_events(self, fd, events)
            run_in(native, activity, handle_events, self, fd, events)

        return in_noted


class Hooks:
    """The hooks on one server; `remove` puts back what they replaced."""

    def __init__(self, server: Scheduler | Worker, native: _native.Sampler) -> None:
        self.server = server
        self.named = Named(native, "scheduler" if isinstance(server, Scheduler) else "worker")
        self._attributes: list[str] = []
        server.handlers = NamedHandlers(server.handlers, self.named)
        server.stream_handlers = NamedHandlers(server.stream_handlers, self.named)
        server.periodic_callbacks = NamedCallbacks(server.periodic_callbacks, self.named)
        # Installed on the event loop, so this is its thread's base activity.
        self._base = native.enter_activity(self.named("event loop", CONNECTION))
        Shared.hold(self.named)
        self._hook("_handle_comm", self._connection)
        self._hook("handle_stream", self._stream)
        if isinstance(server, Worker):
            self._hook("_start_async_instruction", self._instruction)
            self._hook("handle_stimulus", self._stimulus)

    def _hook(self, attribute: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        original = getattr(self.server, attribute, None)
        if original is None:
            logger.info("dask-pyspy: this distributed has no %s; its time stays unnamed", attribute)
            return
        setattr(self.server, attribute, make(original))
        self._attributes.append(attribute)

    def _connection(self, handle_comm: Callable[..., Any]) -> Callable[..., Any]:
        """Steps of an RPC connection are its op's until the reply is written, and
        reading the next message otherwise (`_comms` holds each comm's op)."""
        named, comms = self.named, getattr(self.server, "_comms", {})
        receiving = named(COMM_IO["read"], CONNECTION)

        def current(comm: Any) -> _native.Activity:
            op = comms.get(comm)
            return receiving if op is None else named(op)

        @functools.wraps(handle_comm)
        async def run(comm: Any) -> None:
            await named.native.steps(handle_comm(comm), functools.partial(current, comm))

        return run

    def _stream(self, handle_stream: Callable[..., Any]) -> Callable[..., Any]:
        receiving = self.named(COMM_IO["read"], CONNECTION)

        @functools.wraps(handle_stream)
        async def run(comm: Any, extra: dict[str, Any] | None = None) -> None:
            await self.named.stepped(handle_stream(comm, extra), receiving)

        return run

    def _instruction(self, start: Callable[..., Any]) -> Callable[..., Any]:
        named = self.named

        @functools.wraps(start)
        def run(task_name: str, func: Callable[..., Any], /, *args: Any, **kwargs: Any) -> None:
            name = getattr(func, "__name__", "instruction")
            start(task_name, named.wrap(func, named(name)), *args, **kwargs)

        return run

    def _stimulus(self, handle_stimulus: Callable[..., Any]) -> Callable[..., Any]:
        named = self.named

        @functools.wraps(handle_stimulus)
        def run(*stims: Any) -> None:
            activity = named(type(stims[0]).__name__ if stims else "stimulus", STATE_MACHINE)
            named.native.count_call(activity)
            run_in(named.native, activity, handle_stimulus, *stims)

        return run

    def remove(self) -> None:
        """Called on the event loop, like `__init__`."""
        self.named.native.leave_activity(self._base)
        Shared.release(self.named)
        server = self.server
        server.handlers = dict(server.handlers)
        server.stream_handlers = dict(server.stream_handlers)
        callbacks = server.periodic_callbacks
        server.periodic_callbacks = callbacks.restore() if isinstance(callbacks, NamedCallbacks) else callbacks
        for attribute in self._attributes:
            vars(server).pop(attribute, None)
