"""Copies that coalesce runs of consecutive pages into single slice copies (the CPU backend).

Pages allocated together are usually consecutive on both sides (the free list hands out runs),
so a backup or load is a handful of large copies instead of a gather and a scatter of every
page. Works on any page view layout: slices of strided views copy correctly, only slower.
"""

from __future__ import annotations

import numpy as np
import torch


def page_runs(src_pages: np.ndarray, dst_pages: np.ndarray) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) for maximal runs consecutive on both sides."""
    n = len(src_pages)
    if n == 0:
        return []
    breaks = np.flatnonzero((np.diff(src_pages) != 1) | (np.diff(dst_pages) != 1)) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [n]])
    return list(
        zip(
            src_pages[starts].tolist(),
            dst_pages[starts].tolist(),
            (ends - starts).tolist(),
            strict=True,
        )
    )


def copy_runs_one_layer(
    src: torch.Tensor, dst: torch.Tensor, runs: list[tuple[int, int, int]], layer: int
) -> None:
    """dst[:, layer, d:d+n] = src[:, layer, s:s+n] for each run (page views, 5-D).

    One copy per K/V part and run: in the host layouts whose pages of a layer are contiguous
    (layer_first) each is one contiguous block, so between a GPU and pinned memory it is one
    asynchronous cudaMemcpy on the current stream (``non_blocking``; the engine's events say
    when it landed), not a synchronous copy of a strided slice through a staging buffer."""
    asynchronous = src.device != dst.device
    for kv in range(src.shape[0]):
        src_part, dst_part = src[kv, layer], dst[kv, layer]
        for s, d, n in runs:
            dst_part[d : d + n].copy_(src_part[s : s + n], non_blocking=asynchronous)


def page_rows(view: torch.Tensor, kv: int, layer: int) -> torch.Tensor | None:
    """view[kv, layer] as a [pages, page_size * width] matrix whose rows (one page each) are
    contiguous, whatever the distance between pages; None when a page is not contiguous."""
    block = view[kv, layer]  # [pages, page_size, width]
    pages, ps, width = block.shape
    if block.stride(2) != 1 or (ps > 1 and block.stride(1) != width):
        return None
    return block.as_strided((pages, ps * width), (block.stride(0), 1))


def gather_scatter_one_layer(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
    layer: int,
) -> bool:
    """Scattered pages as one row gather and one row scatter per K/V buffer; False (nothing
    copied) when a layout's pages are not contiguous rows (page_first interleaves layers)."""
    pairs = []
    for kv in range(src.shape[0]):
        s, d = page_rows(src, kv, layer), page_rows(dst, kv, layer)
        if s is None or d is None:
            return False
        pairs.append((s, d))
    for s, d in pairs:
        d.index_copy_(0, dst_pages, s.index_select(0, src_pages))
    return True
