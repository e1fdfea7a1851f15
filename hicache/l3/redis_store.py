"""RedisStore: pages in a Redis Cluster (or one Redis server), one key per page.

Every batch is split by the node that owns each key and sent as pipelines of at most
``batch_pages`` commands to that node alone, so a dead node costs only its own keys (a mixed
cluster pipeline fails whole), and a pipeline's buffers stay small (Redis counts client
buffers against ``maxmemory``: large pipelines evict other keys). Connections retry twice, at once,
and time out fast: a failing node is a miss now; the tier's breaker decides when to look again.
Values go through one copy each way (redis-py sends and returns ``bytes``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

from hicache.l3.pages import TRAILER_BYTES
from hicache.l3.store import Check, Got, L3Store, Parents, StoreDown

KEY_PIPELINE = 256  # commands per pipeline that carry only a key (exists, delete): small replies


class RedisStore(L3Store):
    def __init__(
        self,
        hosts: list[tuple[str, int]],
        batch_pages: int = 8,
        timeout_s: float = 1.0,
        password: str | None = None,
        **_: object,
    ):
        import redis
        from redis.backoff import NoBackoff
        from redis.cluster import ClusterNode, RedisCluster
        from redis.exceptions import RedisClusterException
        from redis.retry import Retry

        self.url = "redis://" + ",".join(f"{h}:{p}" for h, p in hosts)
        self.batch_pages = max(1, batch_pages)
        self.errors = (redis.RedisError, RedisClusterException, OSError)
        kw: dict[str, Any] = dict(
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 2),  # (a few: the client picks another node at start)
            password=password,
        )
        self.cluster: RedisCluster | None = None
        self.single: redis.Redis | None = None
        last: Exception | None = None
        for host, port in hosts:  # the first node that answers tells the cluster's layout
            try:
                self.cluster = RedisCluster(
                    startup_nodes=[ClusterNode(host, port)], require_full_coverage=False, **kw
                )
                break
            except self.errors as exc:
                last = exc
                if "not enabled" in str(exc).lower() and len(hosts) == 1:  # one plain server
                    self.single = redis.Redis(host=host, port=port, **kw)
                    try:
                        self.single.ping()
                    except self.errors as exc2:
                        raise StoreDown(f"{self.url}: {exc2}") from None
                    break
        if self.cluster is None and self.single is None:
            raise StoreDown(f"{self.url}: {last}")
        self.node_errors = 0
        if self.single is not None:
            self.nodes = 1
        else:
            assert self.cluster is not None  # (one of the two, or StoreDown above)
            self.nodes = len(self.cluster.get_primaries())

    # ---- routing ----------------------------------------------------------------------------
    def _by_node(self, keys: list[str]) -> dict[Any, list[int]]:
        """Indices of ``keys`` grouped by the client of the node that owns them."""
        if self.single is not None:
            return {self.single: list(range(len(keys)))}
        groups: dict[Any, list[int]] = defaultdict(list)
        cluster = self.cluster
        assert cluster is not None  # (no single server: a cluster)
        manager = cluster.nodes_manager
        for i, key in enumerate(keys):
            node = manager.get_node_from_slot(cluster.keyslot(key))
            groups[node.redis_connection or cluster.get_redis_connection(node)].append(i)
        return groups

    def _run(
        self,
        keys: list[str],
        add: Callable[[Any, int], None],
        fill: list[Any],
        take: Callable,
        per_pipe: int = 0,
    ) -> None:
        """Per node, pipelines of ``per_pipe`` commands (default ``batch_pages``: commands that
        carry pages) built by ``add(pipe, i)``; each reply goes through ``take(i, reply)`` into
        ``fill[i]``. A node that fails leaves its entries as they are (misses); every node
        failing raises StoreDown."""
        groups = self._by_node(keys)
        failed, last = 0, None
        per_pipe = per_pipe or self.batch_pages
        for client, idx in groups.items():
            try:
                for at in range(0, len(idx), per_pipe):
                    part = idx[at : at + per_pipe]
                    pipe = client.pipeline(transaction=False)
                    for i in part:
                        add(pipe, i)
                    for i, reply in zip(part, pipe.execute(raise_on_error=False), strict=True):
                        if not isinstance(reply, Exception):
                            fill[i] = take(i, reply)
            except self.errors as exc:
                failed, last = failed + 1, exc
                self.node_errors += 1
        if groups and failed == len(groups):
            raise StoreDown(f"{self.url}: {last}")

    # ---- the interface ----------------------------------------------------------------------
    def exists(self, keys: list[str]) -> list[bool]:
        out = [False] * len(keys)
        exists = lambda pipe, i: pipe.exists(keys[i])  # noqa: E731
        self._run(keys, exists, out, lambda i, r: bool(r), KEY_PIPELINE)
        return out

    def put(
        self, keys: list[str], pages: list[int], trailers: list[bytes], parents: Parents = None
    ) -> list[bool]:
        out = [False] * len(keys)

        def add(pipe: Any, i: int) -> None:
            pipe.set(keys[i], b"".join([*self.pages.views(pages[i]), trailers[i]]))

        self._run(keys, add, out, lambda i, r: bool(r))
        return out

    def get(
        self, keys: list[str], pages: list[int], check: Check | None = None, parents: Parents = None
    ) -> list[Got]:
        out: list[Got] = [None] * len(keys)
        size = self.pages.page_bytes

        def take(i: int, value: bytes | None) -> Got:
            if value is None or len(value) != size + TRAILER_BYTES:
                return None  # missing, evicted, or not one of our values
            data, tail = memoryview(value)[:size], value[size:]
            if check is not None and not check(i, data, tail):  # (one hot pass, no thread)
                return False
            self.pages.write(pages[i], data)
            return True if check is not None else tail

        self._run(keys, lambda pipe, i: pipe.get(keys[i]), out, take)
        return out

    def remove(self, keys: list[str]) -> None:
        done = [None] * len(keys)
        self._run(keys, lambda pipe, i: pipe.delete(keys[i]), done, lambda i, r: r, KEY_PIPELINE)

    def describe(self) -> dict[str, object]:
        return {"nodes": self.nodes, "node_errors": self.node_errors}

    def close(self) -> None:
        for client in (self.cluster, self.single):
            if client is not None:
                try:
                    client.close()
                except Exception:  # noqa: BLE001  (closing a broken connection)
                    pass
        self.cluster = self.single = None
