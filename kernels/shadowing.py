"""The repository's top-level folders never answer to their bare names.

``kernels/``, ``client/`` and ``daemon/`` are the sources of ``hicache.kernels``,
``hicache.client`` and ``hicache.daemon`` (pyproject's package-dir). Whenever the repository root
is on ``sys.path`` (``python -m ...`` or a REPL started there, pytest's rootdir), Python would
also find them as top-level ``kernels``, ``client`` and ``daemon``, names that installed
distributions use (Hugging Face's ``kernels``, which transformers imports; python-daemon's
``daemon``). Each folder's ``__init__`` therefore starts with ``defer_to_installed``: imported
under its bare name, it loads the installed distribution of that name in its place, or fails as
if the folder were not there.

This module lives at the bottom layer (the kernels) and imports only the standard library, so
that every top-level folder can use it without an upward import or a torch import.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def _is_folder(entry: str, folder: str) -> bool:
    try:
        return os.path.samefile(entry or os.curdir, folder)
    except OSError:  # a missing folder, a zip file
        return False


def defer_to_installed(name: str, init_file: str) -> None:
    """Call first in a top-level folder's ``__init__`` as ``defer_to_installed(__name__,
    __file__)``. Under its ``hicache.*`` name it does nothing. Under a bare name it replaces the
    module being imported in ``sys.modules`` (which ``import`` then returns) by the package of
    that name found on ``sys.path`` without the repository root, or raises ModuleNotFoundError.
    The rest of the folder's ``__init__`` still runs, on a module object nobody receives: keep
    it free of work."""
    if name.startswith("hicache."):
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(init_file)))
    path = [p for p in sys.path if isinstance(p, str) and not _is_folder(p, root)]
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(
            f"No module named {name!r} (the repository's {name}/ folder is hicache.{name})",
            name=name,
        )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
