"""AsyncHiCacheClient: a HiCacheClient for asyncio engines that never loses a lock or slots.

Each call runs in a worker thread (the client gives every thread a connection of its own, so
calls of several tasks are in flight at once). Cancelling a task cannot stop a call the daemon
is already running; instead, when a cancelled call finishes, what it brought is given back:
a Match (or the Matches of a batch, or of ``insert_and_lock``) is released, slots from
``alloc`` are freed. ``alloc_extend`` and ``alloc_decode`` are not offered here: their slots
may continue a page the request still uses, so only the engine knows what to give back.

    hc = await AsyncHiCacheClient.open(name="my-engine")
    m = await hc.match_prefix(prompt)
    ...
    await hc.release(m)
    await hc.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable
from typing import Any

from hicache.client.client import HiCacheClient, Inserted
from hicache.client.connection import ClientClosed, DaemonError, DaemonTimeout
from hicache.client.results import LoadTicket, Match


class AsyncHiCacheClient:
    def __init__(self, client: HiCacheClient):
        self.client = client  # the thread-safe client every call goes through

    @classmethod
    async def open(cls, *args: Any, **kwargs: Any) -> AsyncHiCacheClient:
        """Open a HiCacheClient (arguments as its) without blocking the loop."""
        return cls(await asyncio.to_thread(HiCacheClient, *args, **kwargs))

    async def _run(self, fn: Callable, *args: Any, undo: Callable | None = None, **kw: Any):
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(None, functools.partial(fn, *args, **kw))
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if undo is not None:  # the call goes on: give back what it brings when it lands
                future.add_done_callback(functools.partial(_undo, loop, undo))
            raise

    async def match_prefix(self, token_ids: Any, namespace: Any = None) -> Match:
        return await self._run(
            self.client.match_prefix, token_ids, namespace, undo=self.client.release
        )

    async def match_batch(self, batch: list, namespaces: list | None = None) -> list[Match]:
        return await self._run(
            self.client.match_batch, batch, namespaces, undo=_release_all_of(self.client)
        )

    async def load_back(self, match: Match) -> Any:
        return await self._run(self.client.load_back, match)  # the match's lock covers it

    async def load_back_async(self, match: Match) -> LoadTicket | None:
        return await self._run(self.client.load_back_async, match)

    async def wait_load(self, load: LoadTicket, timeout: float | None = None) -> None:
        await self._run(self.client.wait_load, load, timeout)

    async def alloc(self, num_tokens: int) -> Any:
        return await self._run(self.client.alloc, num_tokens, undo=self.client.free)

    async def insert(self, token_ids: Any, slots: Any, namespace: Any = None) -> int:
        return await self._run(self.client.insert, token_ids, slots, namespace)

    async def insert_and_lock(self, token_ids: Any, slots: Any, namespace: Any = None) -> Inserted:
        undo = _release_inserted(self.client)
        return await self._run(self.client.insert_and_lock, token_ids, slots, namespace, undo=undo)

    async def release(self, *matches: Match) -> None:
        await self._run(self.client.release, *matches)

    async def free(self, slots: Any) -> None:
        await self._run(self.client.free, slots)

    async def stats(self, check: bool = False) -> dict:
        return await self._run(self.client.stats, check)

    async def close(self) -> None:
        await asyncio.to_thread(self.client.close)


def _release_all_of(client: HiCacheClient) -> Callable[[list[Match]], None]:
    return lambda matches: client.release(*matches)


def _release_inserted(client: HiCacheClient) -> Callable[[Inserted], None]:
    return lambda done: client.release(done.match)


def _undo(loop: asyncio.AbstractEventLoop, undo: Callable, future: asyncio.Future) -> None:
    """A cancelled call finished: give its result back (in a thread; errors are moot)."""
    if future.cancelled() or future.exception() is not None:
        return
    result = future.result()

    def give_back() -> None:
        with contextlib.suppress(DaemonError, DaemonTimeout, ClientClosed):
            undo(result)

    with contextlib.suppress(RuntimeError):  # the loop is closing: the session's end frees it
        loop.run_in_executor(None, give_back)
