"""Keeping heavy work off the server's event loop."""

from __future__ import annotations

import asyncio
from typing import Any, Callable


async def off_loop(fn: Callable[..., Any], *args: Any) -> Any:
    """Run `fn` in a thread: export, merge, compression and rendering never block the event loop."""
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
