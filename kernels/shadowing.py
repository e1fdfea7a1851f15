"""The repository's top-level folders never answer to their bare names.

``kernels/``, ``client/`` and ``daemon/`` are the sources of ``hicache.kernels``,
``hicache.client`` and ``hicache.daemon`` (pyproject's package-dir). Whenever the repository root
is on ``sys.path`` (``python -m ...`` or a REPL started there, pytest's rootdir), Python would
also find them as top-level ``kernels``, ``client`` and ``daemon``, names that installed
distributions use (Hugging Face's ``kernels``, which transformers imports; python-daemon's
``daemon``). Each folder's ``__init__`` therefore starts with ``defer_to_installed``: imported
under its bare name, it loads the installed distribution of that name in its place; with none
installed, it is an empty namespace package, what Python makes of a folder without an
``__init__``: no ``__file__``, no version, nothing in it. That is what libraries that look for
an optional package take for "not installed" (transformers finds ``kernels`` with
``find_spec``, finds no distribution, imports it for a version, and counts only such a
namespace as absent), and any name asked of it raises AttributeError saying why.

This module lives at the bottom layer (the kernels) and imports only the standard library, so
that every top-level folder can use it without an upward import or a torch import.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import types


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
    With none installed, the module imported is an empty namespace package (``_absent``).
    The rest of the folder's ``__init__`` still runs, on a module object nobody receives: keep
    it free of work."""
    if name.startswith("hicache."):
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(init_file)))
    path = [p for p in sys.path if isinstance(p, str) and not _is_folder(p, root)]
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None or spec.loader is None:
        sys.modules[name] = _absent(name)
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise


def _absent(name: str) -> types.ModuleType:
    """An empty namespace package named ``name`` (what an ``__init__``-less folder imports
    as), whose every attribute is missing with the reason."""
    module = types.ModuleType(name)
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    spec.submodule_search_locations = []  # (a namespace package: no origin, nothing in it)
    module.__spec__ = spec
    module.__path__ = []

    def missing(attr: str) -> object:
        raise AttributeError(
            f"module {name!r} has no attribute {attr!r}: no {name!r} is installed (the "
            f"repository's {name}/ folder is hicache.{name})"
        )

    module.__getattr__ = missing  # type: ignore[method-assign]  # PEP 562: a module attribute
    return module
