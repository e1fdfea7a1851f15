"""KV pools: one contiguous buffer per pool, viewed per layer and per page.

Every pool, whatever its layout, also exposes ``page_view``: a strided 5-D view
``[num_kv, num_layers, num_pages, page_size, heads * dim]`` of the same memory. Copies between
pools are written once against that view, and each host layout is nothing but a different
permutation of it:

    device       buffer [kv, L, P*ps, H, D]     page_view = view(kv, L, P, ps, HD)
    layer_first  buffer [kv, L, P*ps, H, D]     page_view = view(kv, L, P, ps, HD)
    page_first   buffer [kv, P*ps, L, H, D]     page_view = view(kv, P, ps, L, HD).permute
    page_direct  buffer [kv, P, L, ps, H, D]    page_view = view(kv, P, L, ps, HD).permute

(MLA keeps kv = 1 and H = 1, D = kv_lora_rank + qk_rope_head_dim.)
"""

from __future__ import annotations

from dataclasses import dataclass

from hicache.config import HiCacheConfig, HostLayout, KVFormat
from hicache.memory.backing import Backing, PlainBacking


@dataclass(frozen=True)
class LayoutSpec:
    """A pool layout: buffer shape and the permutation that turns it into page_view order."""

    name: str  # for messages and the daemon's pool description
    order: tuple[str, ...]  # buffer dims, outermost first, in terms of kv/L/P/ps/HD
    # page_view is buffer.view(sizes in `order`).permute(to_page_view)
    to_page_view: tuple[int, ...]


LAYER_FIRST = LayoutSpec("layer_first", ("kv", "L", "P", "ps", "HD"), (0, 1, 2, 3, 4))
LAYOUTS: dict[str, LayoutSpec] = {  # by HostLayout (a str: its value finds it too)
    HostLayout.LAYER_FIRST: LAYER_FIRST,
    HostLayout.PAGE_FIRST: LayoutSpec("page_first", ("kv", "P", "ps", "L", "HD"), (0, 3, 1, 2, 4)),
    HostLayout.PAGE_FIRST_DIRECT: LayoutSpec(
        "page_first_direct", ("kv", "P", "L", "ps", "HD"), (0, 2, 1, 3, 4)
    ),
}


class KVPool:
    """A pool of ``num_pages`` pages of KV in one buffer from ``backing``.

    The buffer is allocated once and never reallocated, so views handed out stay valid until
    ``close()``. Slots are rows: slot = page * page_size + offset.
    """

    def __init__(
        self,
        config: HiCacheConfig,
        num_pages: int,
        layout: LayoutSpec,
        backing: Backing,
        what: str,
    ):
        self.config = config
        self.num_pages = num_pages
        self.layout = layout
        self.backing = backing
        heads, dim = config.head_shape
        sizes = {
            "kv": config.num_kv,
            "L": config.num_layers,
            "P": num_pages,
            "ps": config.page_size,
            "HD": heads * dim,
        }
        self.nbytes = num_pages * config.page_size * config.token_bytes
        self.buffer = backing.allocate(self.nbytes, what)  # uint8, the one allocation
        flat = self.buffer.view(config.torch_dtype)
        self.page_view = flat.view(*(sizes[d] for d in layout.order)).permute(*layout.to_page_view)

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.config.page_size

    @property
    def page_bytes(self) -> int:
        return self.config.page_size * self.config.token_bytes

    def close(self) -> None:
        # dropped, so that the memory can go: a closed pool is never read again
        self.page_view = None  # type: ignore[assignment]  # (a live pool's are never None)
        self.buffer = None  # type: ignore[assignment]  # (a live pool's are never None)
        self.backing.close()


class DevicePool(KVPool):
    """The device pool, layer-first, with page 0 as the padding page (slot 0 is padding).

    MHA: ``k_buffer[l]`` and ``v_buffer[l]`` are ``[device_tokens + page_size, H, D]``.
    MLA: ``kv_buffer[l]`` is ``[device_tokens + page_size, 1, kv_lora_rank + qk_rope_head_dim]``.
    """

    def __init__(self, config: HiCacheConfig, backing: Backing | None = None):
        backing = backing or PlainBacking(config.device)
        pages = config.device_tokens // config.page_size + 1
        super().__init__(config, pages, LAYER_FIRST, backing, "device KV pool")
        heads, dim = config.head_shape
        rows = self.num_tokens
        per_layer = self.buffer.view(config.torch_dtype).view(
            config.num_kv, config.num_layers, rows, heads, dim
        )
        self.layers = per_layer  # [kv, L, rows, H, D]
        if config.kv_format is KVFormat.MHA:
            self.k_buffer = list(per_layer[0].unbind(0))
            self.v_buffer = list(per_layer[1].unbind(0))
        else:
            self.kv_buffer = list(per_layer[0].unbind(0))


class HostPool(KVPool):
    """The host pool in the configured layout; pinned when CUDA is present. No padding page."""

    def __init__(self, config: HiCacheConfig, backing: Backing | None = None):
        backing = backing or PlainBacking("cpu", pin=True)
        pages = config.host_capacity_tokens // config.page_size
        super().__init__(config, pages, LAYOUTS[config.host_layout], backing, "host KV pool")
