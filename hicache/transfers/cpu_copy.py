"""Scattered page copies between CPU pools in C (hicache/_copy.c), with their checks.

Works for every host layout: a page of one (kv, layer) is ``page_size`` rows of ``width``
elements, contiguous within a row, rows ``stride(3)`` apart (one block in layer-first pools,
interleaved with the other layers in page_first). Large copies are split across threads,
because one thread moves about half of what a plain multithreaded torch copy does.
"""

from __future__ import annotations

import os

import numpy as np
import torch

try:
    import hicache._copy as _copy
except ImportError:  # built without a C compiler: callers fall back to torch
    _copy = None

USE_C = _copy is not None and not os.environ.get("HICACHE_NO_C")
COPY_THREADS = max(1, min(os.cpu_count() or 1, 8))  # threads for one large copy
PARALLEL_MIN_BYTES = 1 << 20  # below this, one thread: starting threads costs more
STREAM_MIN_BYTES = 4 << 20  # from here, non-temporal stores (as memcpy does for large copies)


def available() -> bool:
    return USE_C


def copy_pages_c(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_pages: np.ndarray,
    dst_pages: np.ndarray,
    layers: range | None = None,
) -> bool:
    """dst[kv, l, dst_pages[i]] = src[kv, l, src_pages[i]] for every kv and every l in
    ``layers`` (all by default), for 5-D CPU page views ``[kv, layers, pages, page_size,
    width]`` with contiguous rows. One call, threads started once.

    Returns False, copying nothing, when the C helper is missing or the views do not fit
    (other device, dtype or shape, non-contiguous rows). Raises IndexError, copying nothing,
    for a page or a layer outside either view. Releases the GIL while copying.
    """
    if layers is not None and len(layers) and not 0 <= min(layers) <= max(layers) < src.shape[1]:
        raise IndexError(f"layers {layers} outside the views' {src.shape[1]} layers")
    if not _fits(src, dst, src_pages, dst_pages):
        return False
    for pages, view in ((src_pages, src), (dst_pages, dst)):
        if len(pages) and (int(pages.min()) < 0 or int(pages.max()) >= view.shape[2]):
            raise IndexError("page outside the view")
    layers = range(src.shape[1]) if layers is None else layers
    item = src.element_size()
    _, _, _, tokens, width = src.shape
    bases = _view_addresses(src, dst, layers)
    total = len(bases) * len(src_pages) * tokens * width * item
    _copy.copy_pages(
        bases,
        src.stride(2) * item,
        dst.stride(2) * item,
        src.stride(3) * item,
        dst.stride(3) * item,
        tokens,
        width * item,
        np.ascontiguousarray(src_pages, dtype=np.int64),
        np.ascontiguousarray(dst_pages, dtype=np.int64),
        COPY_THREADS if total >= PARALLEL_MIN_BYTES else 1,
        total >= STREAM_MIN_BYTES,
    )
    return True


def _fits(
    src: torch.Tensor, dst: torch.Tensor, src_pages: np.ndarray, dst_pages: np.ndarray
) -> bool:
    """Whether the C copy can take these views: CPU, 5-D, same shape but for the page count,
    same dtype, contiguous rows, as many source as destination pages."""
    if not USE_C or src.device.type != "cpu" or dst.device.type != "cpu":
        return False
    if src.dim() != 5 or src.shape != dst.shape[:2] + src.shape[2:3] + dst.shape[3:]:
        return False
    if src.dtype != dst.dtype or src.stride(4) != 1 or dst.stride(4) != 1:
        return False
    return len(src_pages) == len(dst_pages)


def _view_addresses(src: torch.Tensor, dst: torch.Tensor, layers: range) -> np.ndarray:
    """(src, dst) byte address of every (layer, kv) view, as the C copy takes them."""
    item = src.element_size()
    s0, d0 = src.data_ptr(), dst.data_ptr()
    return np.array(
        [
            (
                s0 + (kv * src.stride(0) + layer * src.stride(1)) * item,
                d0 + (kv * dst.stride(0) + layer * dst.stride(1)) * item,
            )
            for layer in layers
            for kv in range(src.shape[0])
        ],
        dtype=np.int64,
    )
