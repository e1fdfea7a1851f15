"""A test fixture, never part of hicache: what SGLang 0.5.23's CPU engine needs of ``sgl_kernel``
on a CPU without Intel AMX, in plain torch.

sgl-kernel's CPU build is published as source only. With ``SGLANG_USE_CPU_ENGINE=1`` SGLang
imports a few names from it when its modules load; without AMX it uses torch-native layers and
attention and calls only ``assign_req_to_token_pool_cpu`` (each batch) and
``copy_all_layer_kv_cache_cpu`` (KV moves). HiCache's ``direct`` io backend uses the copies in
``kvcacheio``. The speculative-decoding names exist so that their modules import; calling one
raises. No ``torch.ops.sgl_kernel`` op is registered, so SGLang never takes the AMX paths.
"""

from __future__ import annotations

import ctypes

import torch

from sgl_kernel import mamba  # noqa: F401  (imported by name by SGLang's linear-attention layers)

__version__ = "0.0.0+cpu-standin"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Row ``req_pool_indices[i]`` of ``req_to_token`` gets, at ``[start_offset[i],
    end_offset[i])``, the next that many entries of ``out_cache_loc`` (requests in order)."""
    at = 0
    rows, starts, ends = req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()
    for row, start, end in zip(rows, starts, ends, strict=True):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[at : at + n].to(req_to_token.dtype)
            at += n


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """In every buffer (base address ``data_ptrs[b]``, rows of ``strides[b]`` bytes) row
    ``src_loc[j]`` is copied to row ``tgt_loc[j]``; every source row is read before any
    target is written."""
    sources, targets = [int(s) for s in src_loc.tolist()], [int(t) for t in tgt_loc.tolist()]
    for base, row in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        base, row = int(base), int(row)
        rows = [ctypes.string_at(base + s * row, row) for s in sources]
        for t, data in zip(targets, rows, strict=True):
            ctypes.memmove(base + t * row, data, row)


def _not_here(name: str):  # noqa: ANN202
    def refuse(*args: object, **kwargs: object) -> None:
        raise NotImplementedError(f"{name}: speculative decoding is not in this CPU stand-in")

    refuse.__name__ = name
    return refuse


assign_draft_cache_locs_contiguous_cpu = _not_here("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _not_here("assign_extend_cache_locs_cpu")
fill_accept_out_cache_loc_cpu = _not_here("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _not_here("fill_bonus_tokens_cpu")
rotate_input_ids_cpu = _not_here("rotate_input_ids_cpu")
build_tree_kernel_efficient_cpu = _not_here("build_tree_kernel_efficient_cpu")
verify_tree_greedy_cpu = _not_here("verify_tree_greedy_cpu")
