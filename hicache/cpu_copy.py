"""Scattered page copies between CPU pools in C (hicache/_copy.c), with their checks.

Works for every host layout: a page of one (kv, layer) is ``page_size`` rows of ``width``
elements, contiguous within a row, rows ``stride(1)`` apart (one block in layer-first pools,
interleaved with the other layers in page_first). Large copies are split across threads,
because one thread moves about half of what a plain multithreaded torch copy does.
"""

from __future__ import annotations

import os

import numpy as np
import torch

try:
    from hicache import _copy
except ImportError:  # built without a C compiler: callers fall back to torch
    _copy = None

USE_C = _copy is not None and not os.environ.get("HICACHE_NO_C")
COPY_THREADS = max(1, min(os.cpu_count() or 1, 8))  # threads for one large copy
PARALLEL_MIN_BYTES = 1 << 20  # below this, one thread: starting threads costs more


def available() -> bool:
    return USE_C


def copy_pages_c(
    src: torch.Tensor, dst: torch.Tensor, src_pages: np.ndarray, dst_pages: np.ndarray
) -> bool:
    """dst[dst_pages[i]] = src[src_pages[i]] for 3-D CPU page views ``[pages, page_size,
    width]`` (one kv, one layer) with contiguous rows.

    Returns False, copying nothing, when the C helper is missing or the views do not fit
    (other device, dtype or shape, non-contiguous rows). Raises IndexError, copying nothing,
    for a page outside either view. Releases the GIL while copying.
    """
    if not USE_C or src.device.type != "cpu" or dst.device.type != "cpu":
        return False
    if src.dim() != 3 or src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
        return False
    if src.stride(2) != 1 or dst.stride(2) != 1 or len(src_pages) != len(dst_pages):
        return False
    for pages, view in ((src_pages, src), (dst_pages, dst)):
        if len(pages) and (int(pages.min()) < 0 or int(pages.max()) >= view.shape[0]):
            raise IndexError("page outside the view")
    item = src.element_size()
    _, tokens, width = src.shape
    total = len(src_pages) * tokens * width * item
    _copy.copy_pages(
        src.data_ptr(),
        dst.data_ptr(),
        src.stride(0) * item,
        dst.stride(0) * item,
        src.stride(1) * item,
        dst.stride(1) * item,
        tokens,
        width * item,
        np.ascontiguousarray(src_pages, dtype=np.int64),
        np.ascontiguousarray(dst_pages, dtype=np.int64),
        COPY_THREADS if total >= PARALLEL_MIN_BYTES else 1,
    )
    return True
