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


def host_pool(layout: str, mla: bool = False, pages: int = 64, dtype=torch.float16):
    """SGLang's host pool (and the device pool it mirrors) of about ``pages`` pages."""
    stub_torchvision()
    if mla:
        from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

        dev = MLATokenToKVPool(
            size=pages * PAGE, page_size=PAGE, dtype=dtype, kv_lora_rank=LORA,
            qk_rope_head_dim=ROPE, layer_num=LAYERS, device="cpu", enable_memory_saver=False,
        )  # fmt: skip
        info = dev.get_device_pool_infos()[0].buffer_info
        host = MLATokenToKVPoolHost(
            info, 1.0, 0, PAGE, layout, pin_memory=False, device="cpu",
            override_kv_cache_dim=dev.kv_cache_dim, device_capacity_tokens=dev.size,
            start_layer=dev.start_layer, end_layer=dev.end_layer, target_layer_num=LAYERS,
        )  # fmt: skip
        return dev, host
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _mha_host_inputs
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    dev = MHATokenToKVPool(
        size=pages * PAGE, page_size=PAGE, dtype=dtype, head_num=HEADS, head_dim=HEAD_DIM,
        layer_num=LAYERS, device="cpu", enable_memory_saver=False, enable_alt_stream=False,
    )  # fmt: skip
    cls, info, kw = _mha_host_inputs(dev)
    return dev, cls(info, 1.0, 0, PAGE, layout, pin_memory=False, device="cpu", **kw)


def storage_config(extra: dict, mla: bool = False, tp_rank: int = 0, tp_size: int = 1):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
        is_page_first_layout=True, model_name=MODEL, extra_config=dict(extra),
    )  # fmt: skip


def extra_config(endpoint: str, v1: bool = True, **more) -> dict:
    """What a user passes as --hicache-storage-backend-extra-config."""
    return {
        "backend_name": "hicache",
        "module_path": "hicache.client.sglang",
        "class_name": "HiCacheStore",
        "interface_v1": 1 if v1 else 0,
        "hicache.endpoint": endpoint,
        **more,
    }


def backend(host, extra: dict, mla: bool = False, tp_rank: int = 0, tp_size: int = 1):
    """A backend as SGLang builds it (the factory's dynamic path), its host pool registered."""
    stub_torchvision()
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    cfg = storage_config(extra, mla, tp_rank, tp_size)
    be = StorageBackendFactory.create_backend("dynamic", cfg, host)
    be.register_mem_pool_host(host)
    return be


def controller(dev, host, extra: dict, init_file: str):
    """A real HiCacheController (write-through, its storage threads running) over one rank."""
    stub_torchvision()
    import torch.distributed as dist
    from types import SimpleNamespace

    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.runtime_context import get_parallel

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    group = dist.new_group([0], backend="gloo")
    get_parallel().override_permanently(
        attn_dcp_size=1, attn_dcp_rank=0, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1
    )
    return HiCacheController(
        SimpleNamespace(get_kvcache=lambda: dev), host, PAGE, group, threading.Event(),
        write_policy="write_through", io_backend="direct", storage_backend="dynamic",
        model_name=MODEL, storage_backend_extra_config=dict(extra),
    )  # fmt: skip
