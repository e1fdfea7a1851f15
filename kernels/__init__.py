"""Copy kernels between KV pools: a torch reference (the oracle and the CPU path).

Imports nothing from hicache: callers hand in plain tensors and index tensors.
"""

from hicache.kernels.reference import copy_pages_all_layers, copy_pages_one_layer
from hicache.kernels.runs import (
    copy_runs_one_layer,
    gather_scatter_one_layer,
    page_rows,
    page_runs,
)

__all__ = [
    "copy_pages_all_layers",
    "copy_pages_one_layer",
    "copy_runs_one_layer",
    "gather_scatter_one_layer",
    "page_rows",
    "page_runs",
]
