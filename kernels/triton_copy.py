"""Triton page-copy kernels between KV pools of any layout, with their checking wrapper.

Both sides are page views ``[num_kv, num_layers, num_pages, page_size, width]`` (hicache's
pools expose one for every layout: layer_first, page_first, page_first_direct, and MLA with
num_kv = 1), so one kernel serves every layout and direction: only the strides differ. Each
program copies one page of one (layer, kv) pair as ``page_size`` rows of ``width`` contiguous
elements: wide, coalesced accesses on each row. On CUDA the host side is pinned memory, which
the kernel reads and writes directly (no staging copy). The all-layer launch (a backup) and
the per-layer launch (one step of a layer-wise load) are the same kernel over a different
grid. ``kernels/reference.py`` is the oracle; on the CPU the kernel runs under
``TRITON_INTERPRET=1`` (tests only: it is slow).
"""

from __future__ import annotations

import torch

from hicache.kernels.reference import check_page_views

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency, but keep the import soft
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _copy_pages_kernel(
        src_ptr,
        dst_ptr,
        src_pages_ptr,
        dst_pages_ptr,
        first_layer,
        num_kv,
        s_kv,
        s_layer,
        s_page,
        s_tok,
        d_kv,
        d_layer,
        d_page,
        d_tok,
        PAGE_SIZE: tl.constexpr,
        WIDTH: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_W: tl.constexpr,
    ):
        i = tl.program_id(0)  # which page of the list
        lk = tl.program_id(1)  # layer (offset from first_layer) * num_kv + kv
        kv = lk % num_kv
        layer = first_layer + lk // num_kv
        sp = tl.load(src_pages_ptr + i).to(tl.int64)  # int64: offsets pass 2**31 elements
        dp = tl.load(dst_pages_ptr + i).to(tl.int64)
        src = src_ptr + (kv * s_kv + layer * s_layer + sp * s_page)
        dst = dst_ptr + (kv * d_kv + layer * d_layer + dp * d_page)
        for t0 in range(0, PAGE_SIZE, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            for w0 in range(0, WIDTH, BLOCK_W):
                w = w0 + tl.arange(0, BLOCK_W)
                mask = (t[:, None] < PAGE_SIZE) & (w[None, :] < WIDTH)
                rows = tl.load(src + t[:, None] * s_tok + w[None, :], mask=mask)
                tl.store(dst + t[:, None] * d_tok + w[None, :], rows, mask=mask)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def check_copy(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
    layers: range,
) -> None:
    """Raise ValueError / IndexError unless the copy is well formed (devices, dtypes, shapes,
    strides, page bounds, layer range). Reads the page ids (a sync when they are on a GPU)."""
    check_page_views(src, dst, src_pages, dst_pages)  # dims, shapes, dtypes, list lengths
    if src.stride(4) != 1 or dst.stride(4) != 1:
        raise ValueError("the innermost (width) dimension must be contiguous on both sides")
    if src_pages.dtype != torch.int64 or dst_pages.dtype != torch.int64:
        raise ValueError("page ids must be int64")
    if not (0 <= layers.start <= layers.stop <= src.shape[1]) or layers.step != 1:
        raise ValueError(f"layers {layers} outside [0, {src.shape[1]})")
    cuda = [t.device for t in (src, dst) if t.device.type == "cuda"]
    if cuda:
        for t in (src, dst):
            if t.device.type == "cpu" and not t.is_pinned():
                raise ValueError("a host view copied by a CUDA kernel must be pinned memory")
        for p in (src_pages, dst_pages):
            if p.device != cuda[0]:
                raise ValueError(f"page ids must be on {cuda[0]} (got {p.device})")
    elif src.device.type != "cpu" or dst.device.type != "cpu":
        raise ValueError("unsupported devices")
    for pages, view, what in ((src_pages, src, "src"), (dst_pages, dst, "dst")):
        if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= view.shape[2]):
            raise IndexError(f"{what} page outside [0, {view.shape[2]})")


def copy_pages_triton(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
    layers: range | None = None,
    check: bool = True,
) -> None:
    """dst[:, l, dst_pages[i]] = src[:, l, src_pages[i]] for l in ``layers`` (all by default).

    ``check=False`` skips the validation (callers that built the indices themselves); the
    launch is asynchronous on CUDA (the current stream).
    """
    if triton is None:
        raise RuntimeError("triton is not installed")
    layers = range(src.shape[1]) if layers is None else layers
    if check:
        check_copy(src, dst, src_pages, dst_pages, layers)
    n = src_pages.numel()
    if n == 0 or len(layers) == 0:
        return
    num_kv, _, _, page_size, width = src.shape
    block_w = min(_next_pow2(width), 256)
    block_t = max(1, min(_next_pow2(page_size), 4096 // block_w))
    grid = (n, len(layers) * num_kv)
    _copy_pages_kernel[grid](
        src,
        dst,
        src_pages,
        dst_pages,
        layers.start,
        num_kv,
        *src.stride()[:4],
        *dst.stride()[:4],
        PAGE_SIZE=page_size,
        WIDTH=width,
        BLOCK_T=block_t,
        BLOCK_W=block_w,
    )
