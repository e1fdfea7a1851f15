"""What the scheduler side keeps per request and per step (``Store``, ``Tracked``), its figures,
and ``timed`` (the CPU time of its calls). Plain data: scheduler.py mutates it, on vLLM's
scheduler thread only."""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

import torch

from hicache.client.results import Match
from hicache.client.vllm.meta import PoolRef


class Timed(Protocol):
    """What ``timed`` adds to: a scheduler side's figures."""

    figures: Figures


P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S", bound=Timed)


def timed(method: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
    """Adds the call's CPU time on this thread to ``self.figures.scheduler_s`` (the time spent
    waiting for the daemon is added by DaemonLink: wall time would also count the other
    threads of vLLM's process that run meanwhile)."""

    @functools.wraps(method)
    def wrapper(self: S, /, *args: P.args, **kw: P.kwargs) -> R:
        started = time.thread_time()
        try:
            return method(self, *args, **kw)
        finally:
            self.figures.scheduler_s += time.thread_time() - started

    return wrapper


@dataclass
class Store:
    """Blocks of one request planned for publication: tokens [start, end)."""

    job: int
    step: int
    start: int
    end: int
    pages: torch.Tensor  # pool pages (ids) the session owns until insert or free
    generation: int
    ok: bool | None = None  # the step's outcome once every rank reported it


@dataclass
class Tracked:
    request: Any  # vLLM's Request (its all_token_ids grow as it decodes)
    namespace: str
    generation: int  # the daemon session the chain belongs to
    pool: PoolRef | None = None  # the pool the chain's pages are in
    looked: float = 0.0  # when the lookup locked the chain (monotonic)
    chain: Match | None = None  # locked in the daemon: tokens [0, chain_len)
    chain_len: int = 0
    planned: int = 0  # tokens cached or planned for a store (>= chain_len)
    local: int = 0  # vLLM's own block-aligned hit at lookup
    pending: deque[Store] = field(default_factory=deque)
    finished: bool = False


@dataclass
class Figures:
    """What the scheduler side did (tokens): for logs, tests and benchmarks."""

    lookups: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0  # hicache hits beyond vLLM's own
    loaded_tokens: int = 0
    stored_tokens: int = 0  # published
    failed_stores: int = 0
    unavailable: int = 0  # lookups answered as misses because the daemon was not usable
    l3_not_yet: int = 0  # lookups answered "ask again": the prefix was coming from the store
    scheduler_s: float = 0.0  # CPU time of the scheduler side's calls, plus daemon waits
    worker_s: float = 0.0  # spent copying in the workers (the slowest rank per step)
