"""The C helpers, when built (``_fast.c``: checks, packing, page ids; ``_tree.c``: the tree walk),
and the one switch that uses them: ``USE_C`` (off with ``HICACHE_NO_C=1``, or without a C
compiler at install). Below the tree and memory, which both read it at each call, so that a
test flips one switch for every hot path. Read only (but for tests).
"""

from __future__ import annotations

import os

try:
    import hicache._fast as _fast
    import hicache._tree as _tree
except ImportError:  # built without a C compiler
    _fast = _tree = None

USE_C = _fast is not None and _tree is not None and not os.environ.get("HICACHE_NO_C")
