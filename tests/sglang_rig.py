"""SGLang's real cache classes on the CPU, for the storage backend's tests: host pools in every
layout (MHA and MLA), a backend built by SGLang's own StorageBackendFactory, and a real
HiCacheController with its threads on a one-rank gloo group.

SGLang cannot run a model here, and one of its modules (memory_pool -> configs ->
internvl_utils) imports torchvision at module level, which does not load beside the CPU torch:
``stub_torchvision`` puts a stand-in in sys.modules for the test process only. The backend
itself (hicache.client.sglang) imports nothing of that.
"""

from __future__ import annotations

import enum
import sys
import threading
import types

import torch

PAGE = 4
LAYERS = 3
HEADS, HEAD_DIM = 2, 8
LORA, ROPE = 16, 8
MODEL = "rig/model"


def stub_torchvision() -> None:
    if "torchvision" in sys.modules:
        return
    from transformers.utils import import_utils

    assert import_utils.is_torchvision_available() is False  # (a real one would be used)

    class InterpolationMode(enum.Enum):
        NEAREST, BILINEAR, BICUBIC, LANCZOS = "nearest", "bilinear", "bicubic", "lanczos"

    def missing(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise RuntimeError(f"torchvision stub: {name}")

    tv = types.ModuleType("torchvision")
    tr = types.ModuleType("torchvision.transforms")
    fn = types.ModuleType("torchvision.transforms.functional")
    tv.__version__, tr.__path__ = "0.0.0-stub", []
    for m in (tr, fn):
        m.InterpolationMode = InterpolationMode
        m.__getattr__ = missing
    tv.transforms, tr.functional = tr, fn
    sys.modules.update(
        {"torchvision": tv, "torchvision.transforms": tr, "torchvision.transforms.functional": fn}
    )


def host_pool(
    layout: str, mla: bool = False, pages: int = 64, dtype=torch.float16, page: int = PAGE
):
    """SGLang's host pool (and the device pool it mirrors) of about ``pages`` pages of
    ``page`` tokens."""
    stub_torchvision()
    if mla:
        from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

        dev = MLATokenToKVPool(
            size=pages * page, page_size=page, dtype=dtype, kv_lora_rank=LORA,
            qk_rope_head_dim=ROPE, layer_num=LAYERS, device="cpu", enable_memory_saver=False,
        )  # fmt: skip
        info = dev.get_device_pool_infos()[0].buffer_info
        host = MLATokenToKVPoolHost(
            info, 1.0, 0, page, layout, pin_memory=False, device="cpu",
            override_kv_cache_dim=dev.kv_cache_dim, device_capacity_tokens=dev.size,
            start_layer=dev.start_layer, end_layer=dev.end_layer, target_layer_num=LAYERS,
        )  # fmt: skip
        return dev, host
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _mha_host_inputs
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    dev = MHATokenToKVPool(
        size=pages * page, page_size=page, dtype=dtype, head_num=HEADS, head_dim=HEAD_DIM,
        layer_num=LAYERS, device="cpu", enable_memory_saver=False, enable_alt_stream=False,
    )  # fmt: skip
    cls, info, kw = _mha_host_inputs(dev)
    return dev, cls(info, 1.0, 0, page, layout, pin_memory=False, device="cpu", **kw)


def storage_config(extra: dict, mla: bool = False, tp_rank: int = 0, tp_size: int = 1, **ranks):
    """SGLang's HiCacheStorageConfig for one rank (``ranks``: pp_rank, pp_size, ...)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    fields = {"pp_rank": 0, "pp_size": 1, "attn_cp_rank": 0, "attn_cp_size": 1, **ranks}
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, is_mla_model=mla, enable_storage_metrics=False,
        is_page_first_layout=True, model_name=MODEL, extra_config=dict(extra), **fields,
    )  # fmt: skip


def extra_config(endpoint: str, v1: bool = True, chains: bool = False, **more) -> dict:
    """What a user passes as --hicache-storage-backend-extra-config (``chains``: with
    ``hicache_storage_pass_prefix_keys``, which SGLang's cache controller passes on to the
    backend when used as a library)."""
    return {
        "backend_name": "hicache",
        "module_path": "hicache.client.sglang",
        "class_name": "HiCacheStore",
        "interface_v1": 1 if v1 else 0,
        **({"hicache_storage_pass_prefix_keys": True} if chains else {}),
        "hicache.endpoint": endpoint,
        **more,
    }


def backend(host, extra: dict, mla: bool = False, tp_rank: int = 0, tp_size: int = 1, **ranks):
    """A backend as SGLang builds it (the factory's dynamic path), its host pool registered."""
    stub_torchvision()
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    cfg = storage_config(extra, mla, tp_rank, tp_size, **ranks)
    be = StorageBackendFactory.create_backend("dynamic", cfg, host)
    be.register_mem_pool_host(host)
    return be


def controller(dev, host, extra: dict):
    """A real HiCacheController (write-through, its storage threads running) over one rank."""
    stub_torchvision()
    from types import SimpleNamespace

    from sglang.srt.managers.cache_controller import HiCacheController

    return HiCacheController(
        SimpleNamespace(get_kvcache=lambda: dev), host, PAGE, _group(), threading.Event(),
        write_policy="write_through", io_backend="direct", storage_backend="dynamic",
        model_name=MODEL, storage_backend_extra_config=dict(extra),
    )  # fmt: skip


_GROUP: list = []


def _group():
    """This process's one-rank gloo group (made once: controllers share it in turn)."""
    if not _GROUP:
        import socket

        import torch.distributed as dist
        from sglang.srt.runtime_context import get_parallel

        with socket.socket() as s:  # a free loopback port for the rendezvous (no files)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        _GROUP.append(dist.new_group([0], backend="gloo"))
        get_parallel().override_permanently(
            attn_dcp_size=1, attn_dcp_rank=0, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1
        )
    return _GROUP[0]


def chain_hashes(tokens: list[int], prior: bytes = b"") -> list[str]:
    """SGLang's page keys in pure Python: sha256(previous digest || the page's tokens as
    uint32 little-endian), chained from ``prior`` (nothing, unless a namespace seeds it)."""
    import hashlib

    import numpy as np

    out, prev = [], prior
    for i in range(0, len(tokens) - len(tokens) % PAGE, PAGE):
        prev = hashlib.sha256(prev + np.asarray(tokens[i : i + PAGE], "<u4").tobytes()).digest()
        out.append(prev.hex())
    return out


def canonical_page(host, index: int) -> torch.Tensor:
    """One page as ``[kv, layers, page, width]`` through SGLang's own accessor (its layout's
    shape), so pages of pools of different layouts compare."""
    page = host.get_data_page(index, flat=False)
    layout, mla = host.layout, hasattr(host, "kv_lora_rank")
    if mla:  # layer_first [L, P, 1, W], page_first [P, L, 1, W], direct [1, L, P, 1, W]
        page = page.squeeze(-2)
        if layout == "page_first":
            page = page.permute(1, 0, 2)
        elif layout == "page_first_direct":
            page = page[0]
        return page[None].clone()
    # layer_first [2, L, P, H, D], page_first [2, P, L, H, D], direct [2, 1, L, P, H, D]
    if layout == "page_first":
        page = page.permute(0, 2, 1, 3, 4)
    elif layout == "page_first_direct":
        page = page[:, 0]
    return page.flatten(3).clone()


def set_canonical(host, index: int, page: torch.Tensor) -> None:
    """Write ``page`` (``[kv, layers, page, width]``) at ``index`` through SGLang's accessor:
    the inverse of canonical_page."""
    view = host.get_data_page(index, flat=False)
    layout, mla = host.layout, hasattr(host, "kv_lora_rank")
    if mla:
        view = view.squeeze(-2)
        view = {"page_first": view.permute(1, 0, 2), "page_first_direct": view[0]}.get(layout, view)
        view.copy_(page[0])
        return
    view = {"page_first": view.permute(0, 2, 1, 3, 4), "page_first_direct": view[:, 0]}.get(
        layout, view
    )
    view.copy_(page.view(view.shape))


def fill(host, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(host.kv_buffer.shape, generator=gen)
    host.kv_buffer.copy_(values.to(host.kv_buffer.dtype))


def write_through(
    endpoint: str, layout: str, mla: bool, v1: bool, tokens: list[int],
    seed: int = 0, chain: bool = False, **more,
) -> tuple[int, list[torch.Tensor]]:  # fmt: skip
    """A controller writes ``tokens``' pages to the daemon (its backup thread, SGLang's own
    write path); returns the tokens it acknowledged and the pages it wrote. ``chain``: the
    calls carry prefix keys (SGLang's ``hicache_storage_pass_prefix_keys``)."""
    dev, host = host_pool(layout, mla)
    c = controller(dev, host, extra_config(endpoint, v1, chain, **more))
    try:
        fill(host, seed)
        src = host.alloc(len(tokens))
        pages = [canonical_page(host, int(src[i])) for i in range(0, len(tokens), PAGE)]
        prefix = [] if chain else None
        c.write_storage(src, tokens, hash_value=chain_hashes(tokens), prefix_keys=prefix)
        ack = c.ack_backup_queue.get(timeout=60)
        return ack.completed_tokens, pages
    finally:
        c.detach_storage_backend()


def read_through(
    endpoint: str, layout: str, mla: bool, v1: bool, tokens: list[int],
    chain: bool = False, skip: int = 0, **more,
) -> tuple[int, list[torch.Tensor]]:  # fmt: skip
    """A controller prefetches ``tokens`` from the daemon (SGLang's prefetch threads), from
    page ``skip`` on (its host holds the pages before: it asks mid-chain): returns the tokens
    found and the pages it read. ``chain``: the calls carry prefix keys."""
    dev, host = host_pool(layout, mla)
    c = controller(dev, host, extra_config(endpoint, v1, chain, **more))
    try:
        keys = chain_hashes(tokens)[:skip]
        last = keys[-1] if keys else None
        return prefetch(c, host, tokens[skip * PAGE :], last, keys if chain else None)
    finally:
        c.detach_storage_backend()


def prefetch(
    c, host, tokens: list[int], last_hash: str | None = None, prefix: list[str] | None = None
) -> tuple[int, list[torch.Tensor]]:
    """What SGLang's scheduler does around a prefetch: ask, give host room for the hit, wait
    for the acks. Returns the tokens read and their pages."""
    c.prefetch("rid", tokens, last_hash, prefix)
    op = c.prefetch_hit_queue.get(timeout=60)
    hit = op.storage_hit_count
    if not hit:
        return 0, []
    op.host_indices = host.alloc(hit)
    c.prefetch_buffer.put(op)
    done = 0
    while True:
        ack = c.ack_prefetch_queue.get(timeout=60)
        if ack.completed_req:
            break
        done = max(done, ack.completed_tokens or 0)
    pages = [canonical_page(host, int(op.host_indices[i])) for i in range(0, done, PAGE)]
    return done, pages
