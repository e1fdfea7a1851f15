"""HiCache's ``direct`` io copies between SGLang's device pool and its host pool, for CPU tensors.

Arguments as ``sgl_kernel.kvcacheio``'s; indices are token slots. A device layer (and a host
``layer_first`` layer) is ``[tokens, heads, dim]``; a host ``page_first_direct`` buffer (one for
K, one for V) is ``[pages, layers, page_size, heads, dim]``.
"""

from __future__ import annotations

import torch


def transfer_kv_direct(
    src_layers: list[torch.Tensor],
    dst_layers: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Tokens ``src_indices`` of every source layer to ``dst_indices`` of its destination."""
    if len(src_layers) != len(dst_layers):
        raise ValueError(f"{len(src_layers)} source layers, {len(dst_layers)} destinations")
    src_at, dst_at = src_indices.long(), dst_indices.long()
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[dst_at] = src[src_at].to(dst.device)


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: list[torch.Tensor],
    dst_ptrs: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    page_size: int,
) -> None:
    """Layer ``layer_id`` of host ``page_first_direct`` K and V into the device's K and V."""
    src_at, dst_at = src_indices.long(), dst_indices.long()
    pages, offsets = src_at // page_size, src_at % page_size
    for src, dst in zip(src_ptrs, dst_ptrs, strict=True):
        dst[dst_at] = src[pages, layer_id, offsets].to(dst.device)


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: list[torch.Tensor],
    dst_ptrs: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Every device layer (all K layers, then all V layers) into host ``page_first_direct`` K
    and V."""
    src_at, dst_at = src_indices.long(), dst_indices.long()
    pages, offsets = dst_at // page_size, dst_at % page_size
    layers = len(src_ptrs) // len(dst_ptrs)
    for kv, dst in enumerate(dst_ptrs):
        for layer in range(layers):
            dst[pages, layer, offsets] = src_ptrs[kv * layers + layer][src_at].to(dst.device)
