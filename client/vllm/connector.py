"""HiCacheConnector: vLLM's v1 KV connector over hicache-daemon, a shared host KV tier.

    --kv-transfer-config '{"kv_connector": "HiCacheConnector",
                           "kv_connector_module_path": "hicache.client.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"hicache.endpoint": "ipc://..."}}'

vLLM makes one instance in its scheduler process (role SCHEDULER) and one in every worker
(role WORKER); they share nothing but vLLM's per-step metadata. This class only routes vLLM's
calls to the half of its role: ``scheduler.SchedulerSide`` and ``worker.WorkerSide``.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any, cast

from hicache.client.vllm.compat import (
    HOST_SOURCE,
    KVConnectorBase_V1,
    KVConnectorRole,
    check_version,
    has_worker_metadata,
)
from hicache.client.vllm.daemon_link import DaemonLink
from hicache.client.vllm.meta import StepPlan
from hicache.client.vllm.scheduler import SchedulerSide
from hicache.client.vllm.settings import ConnectorSettings, model_identity
from hicache.client.vllm.worker import WorkerSide

log = logging.getLogger("hicache.vllm")


class HiCacheConnector(KVConnectorBase_V1):
    if HOST_SOURCE is not None:
        _cache_hit_source = HOST_SOURCE  # vLLM's metrics count these hits as host hits

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
        check_version()
        route_logs_to_vllm()
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = ConnectorSettings.from_extra(
            vllm_config.kv_transfer_config.kv_connector_extra_config
        )
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise ValueError("HiCacheConnector: pipeline parallelism is not supported")
        self.model = model_identity(vllm_config)
        self.block_size = vllm_config.cache_config.block_size
        engine = vllm_config.kv_transfer_config.engine_id or "vllm"
        self.sched: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        s = self.settings
        if role == KVConnectorRole.SCHEDULER:
            store = s.store and has_worker_metadata()  # stores need the workers' reports
            if s.store and not store:
                log.warning("hicache: this vLLM sends no worker reports: loads only")
            name = f"vllm-scheduler:{engine}"
            link = DaemonLink(
                s.endpoint,
                name,
                s.timeout_s,
                s.retry_s,
                self.model,
                _known_layout(vllm_config),
                s.daemon_user or None,
            )
            self.sched = SchedulerSide(
                s if store else _no_store(s), link, self.block_size, parallel.world_size
            )
            link.ready()  # connect now (the workers registered the layout before this)
            _say_connected(link, s.endpoint)
            _stop_on_signals(link)
        else:
            rank = getattr(parallel, "rank", 0) % max(1, parallel.tensor_parallel_size)
            self.worker = WorkerSide(
                s.endpoint,
                s.timeout_s,
                rank,
                f"vllm-worker{rank}:{engine}",
                s.layerwise,
                s.daemon_user or None,
            )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped store is a later miss

    # ---- scheduler side -----------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.sched is not None:
            self.sched.block_ids = lambda rid: kv_cache_manager.get_block_ids(rid)[0]

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple:
        assert self.sched is not None  # (vLLM calls it in the scheduler role)
        n = self.sched.lookup(request, num_computed_tokens)  # None: ask again next step
        return n, False  # loaded synchronously, before the forward pass of its step

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        ids = blocks.get_block_ids()[0] if num_external_tokens else []
        assert self.sched is not None  # (vLLM calls it in the scheduler role)
        self.sched.after_alloc(request, ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> StepPlan:
        assert self.sched is not None  # (vLLM calls it in the scheduler role)
        return self.sched.plan(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        assert self.sched is not None  # (vLLM calls it in the scheduler role)
        self.sched.report(getattr(connector_output, "kv_connector_worker_meta", None))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        assert self.sched is not None  # (vLLM calls it in the scheduler role)
        self.sched.finished(request.request_id)
        return False, None  # stores were copied in the steps that computed them

    # ---- worker side --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict) -> None:
        cfg = self._vllm_config
        mc, parallel = cfg.model_config, cfg.parallel_config
        assert self.worker is not None  # (vLLM calls it in a worker)
        self.worker.register(
            kv_caches,
            model=self.model,
            num_blocks=getattr(self._kv_cache_config, "num_blocks", None),
            num_kv_heads=mc.get_num_kv_heads(parallel),
            total_kv_heads=mc.get_total_num_kv_heads(),
            head_size=mc.get_head_size(),
            block_size=self.block_size,
            tp_size=parallel.tensor_parallel_size,
            backend=self._backend(),
        )

    def _backend(self) -> str:
        """The byte format's name: platform, resolved cache layout, attention spec."""
        from vllm.platforms import current_platform

        layout = getattr(self._kv_cache_config, "kv_cache_layout", None) or getattr(
            self._vllm_config.cache_config, "kv_cache_layout", None
        )
        groups = getattr(self._kv_cache_config, "kv_cache_groups", None) or []
        spec = type(groups[0].kv_cache_spec).__name__ if groups else ""
        return f"{current_platform.device_type}/{layout or ''}/{spec}"

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self.worker is not None  # (vLLM calls it in a worker)
        self.worker.load(cast(StepPlan, self._get_connector_metadata()))  # (ours: our plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self.worker is not None  # (vLLM calls it in a worker)
        self.worker.wait_layer(layer_name)  # (layer-wise loads; else it landed already)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any):
        return  # whole blocks are stored in wait_for_save, after the forward pass

    def wait_for_save(self) -> None:
        assert self.worker is not None  # (vLLM calls it in a worker)
        self.worker.store(cast(StepPlan, self._get_connector_metadata()))  # (ours: our plan)

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.worker is not None  # (vLLM calls it in a worker)
        return self.worker.take_load_errors()

    def build_connector_worker_meta(self) -> Any:
        plan = self._connector_metadata if self.has_connector_metadata() else None
        assert self.worker is not None  # (vLLM calls it in a worker)
        return self.worker.report(cast("StepPlan | None", plan))  # (ours: our plan)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.sched is not None:
            self.sched.close()


def route_logs_to_vllm() -> None:
    """hicache's log lines go where vLLM's go (its handlers and format; they would reach no
    handler otherwise: vLLM configures only its own loggers). Once per process."""
    ours, theirs = logging.getLogger("hicache"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    ours.propagate = False


def _say_connected(link: DaemonLink, endpoint: str) -> None:
    """One line per engine start where vLLM's operator reads: the daemon, the layout, the
    pool (or why hicache is not used yet)."""
    pool, layout = link.pool, link.layout
    if pool is None or layout is None:
        log.warning(
            "hicache: daemon at %s not usable yet: lookups are misses until it is", endpoint
        )
        return
    tokens = pool.config.get("device_tokens", 0)
    log.info(
        "hicache: host tier of this engine: daemon at %s (boot epoch %d); layout %s, %d layers, "
        "%d KV heads of %d, %s, block %d; pool %d tokens (%.2f GiB), shared by every engine "
        "of this layout",
        endpoint,
        pool.epoch,
        layout.model,
        layout.num_layers,
        layout.num_kv_heads * max(1, layout.tp_size),
        layout.head_size,
        layout.dtype,
        layout.block_size,
        tokens,
        tokens // max(1, layout.block_size) * layout.page_bytes / 2**30,
    )


def _stop_on_signals(link: DaemonLink) -> None:
    """On SIGTERM or SIGINT, end the scheduler's session as stopping before vLLM's handler
    runs: vLLM's engine process may be killed before its shutdown reaches shutdown() below,
    and the daemon would hold the session's pages for a lease and a quarantine. Installed
    only from the main thread (where vLLM's engine core builds the connector)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(sig)

        def on_signal(signum: int, frame: Any, previous: Any = previous) -> None:
            if previous == signal.SIG_IGN:
                return  # the process goes on: so does its session
            stopper = threading.Thread(target=link.stop, name="hicache-stop", daemon=True)
            stopper.start()
            stopper.join(STOP_WAIT_S)  # (a goodbye to a stalled daemon does not hold vLLM)
            if callable(previous):
                previous(signum, frame)
            else:  # SIG_DFL, or None (set outside Python): the default action, death
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        signal.signal(sig, on_signal)


STOP_WAIT_S = 1.0  # a signal waits at most this long for the stopping goodbye


def _no_store(settings: ConnectorSettings) -> ConnectorSettings:
    from dataclasses import replace

    return replace(settings, store=False)


def _known_layout(vllm_config: Any) -> dict[str, Any]:
    """Layout facts the scheduler knows from the config (a layout the daemon serves is taken
    as this engine's before its workers report only when these match)."""
    out: dict[str, Any] = {"block_size": vllm_config.cache_config.block_size}
    try:
        out["head_size"] = int(vllm_config.model_config.get_head_size())
        out["num_layers"] = int(
            vllm_config.model_config.get_num_layers(vllm_config.parallel_config)
        )
    except Exception:  # noqa: BLE001  (a vLLM without these: wait for the workers' reports)
        out["unknown"] = True  # matches no layout
    return out
