"""Torch reference copies over page views ``[num_kv, num_layers, num_pages, page_size, width]``.

They are the oracle for every faster kernel and the CPU fallback. ``src_pages[i]`` is copied to
``dst_pages[i]``; page ids are int64 CPU (or same-device) tensors of equal length.
"""

from __future__ import annotations

import torch


def check_page_views(
    src: torch.Tensor, dst: torch.Tensor, src_pages: torch.Tensor, dst_pages: torch.Tensor
) -> None:
    """Raise ValueError unless ``src`` and ``dst`` are 5-D page views of one shape (but for the
    page count) and dtype, and the page lists are 1-D and of equal length."""
    if src.dim() != 5 or dst.dim() != 5:
        raise ValueError("page views must be 5-D [kv, layers, pages, page_size, width]")
    if src.shape[:2] != dst.shape[:2] or src.shape[3:] != dst.shape[3:]:
        raise ValueError(f"page views differ in shape: {tuple(src.shape)} vs {tuple(dst.shape)}")
    if src.dtype != dst.dtype:
        raise ValueError(f"dtype mismatch: {src.dtype} vs {dst.dtype}")
    if src_pages.shape != dst_pages.shape or src_pages.dim() != 1:
        raise ValueError("src_pages and dst_pages must be 1-D and of equal length")


def copy_pages_all_layers(
    src: torch.Tensor, dst: torch.Tensor, src_pages: torch.Tensor, dst_pages: torch.Tensor
) -> None:
    """dst[:, :, dst_pages] = src[:, :, src_pages] for every layer (a backup)."""
    check_page_views(src, dst, src_pages, dst_pages)
    for layer in range(src.shape[1]):
        copy_pages_one_layer(src, dst, src_pages, dst_pages, layer)


def copy_pages_one_layer(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
    layer: int,
) -> None:
    """dst[:, layer, dst_pages] = src[:, layer, src_pages] (one step of a layer-wise load)."""
    if src_pages.numel() == 0:
        return
    src_pages = src_pages.to(src.device)
    dst_pages = dst_pages.to(dst.device)
    rows = src[:, layer].index_select(1, src_pages)
    dst[:, layer].index_copy_(1, dst_pages, rows.to(dst.device))
