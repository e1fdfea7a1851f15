"""Copy kernels between KV pools: a torch reference (the oracle and the CPU path).

Imports nothing from hicache: callers hand in plain tensors and index tensors. Names are imported
on first use, so that importing a submodule (``shadowing``, which every top-level folder's
``__init__`` uses) never pays for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hicache.kernels.shadowing import defer_to_installed

defer_to_installed(__name__, __file__)

_EXPORTS = {
    "copy_pages_all_layers": "reference",
    "copy_pages_one_layer": "reference",
    "copy_runs_one_layer": "runs",
    "gather_scatter_one_layer": "runs",
    "page_rows": "runs",
    "page_runs": "runs",
}
__all__ = [
    "copy_pages_all_layers",
    "copy_pages_one_layer",
    "copy_runs_one_layer",
    "gather_scatter_one_layer",
    "page_rows",
    "page_runs",
]

if TYPE_CHECKING:
    from hicache.kernels.reference import copy_pages_all_layers, copy_pages_one_layer
    from hicache.kernels.runs import (
        copy_runs_one_layer,
        gather_scatter_one_layer,
        page_rows,
        page_runs,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hicache.kernels' has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(f"hicache.kernels.{module}"), name)
    return value
