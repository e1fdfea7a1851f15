"""A repository checkout's ``hicache/`` never stands in for an installed hicache.

The repository keeps ``hicache.client``, ``hicache.daemon`` and ``hicache.kernels`` in the
top-level folders ``client/``, ``daemon/`` and ``kernels/`` (pyproject's package-dir). When the
clone's root is first on ``sys.path`` (``python -c`` or ``python -m`` started there) Python
finds the clone's ``hicache/`` before the installed one, and that folder alone has no
``hicache.client``. An editable install maps those names back to the folders (its finder
answers for them); a regular install (``pip install /path/to/clone``, as docs/sglang.md says)
does not. So, imported from a checkout that this environment did not install as editable,
``hicache/__init__`` loads the installed distribution in its place (``defer``), and with
none installed it maps the checkout's folders itself (the repository root on its
``__path__``), so that a bare ``import kernels`` there is still an empty namespace.

Imports the standard library only: it runs before anything of hicache.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def _is_folder(entry: object, folder: str) -> bool:
    try:
        return isinstance(entry, str) and os.path.samefile(entry or os.curdir, folder)
    except OSError:  # a missing folder, a zip file
        return False


def defer(init_file: str) -> None:
    """Call first in ``hicache/__init__`` as ``defer(__file__)``: replaces the module being
    imported in ``sys.modules`` by the installed hicache when this one is a checkout's folder
    whose other packages nothing maps (``import`` then returns the installed one). The rest
    of the checkout's ``__init__`` still runs, on a module nobody receives."""
    here = os.path.dirname(os.path.abspath(init_file))
    root = os.path.dirname(here)
    if os.path.isdir(os.path.join(here, "client")):  # laid out as installed: itself
        return
    if not os.path.isfile(os.path.join(root, "kernels", "shadowing.py")):  # not a checkout
        return
    if importlib.util.find_spec("hicache.client") is not None:  # an editable install maps it
        return
    path = [p for p in sys.path if not _is_folder(p, root)]
    spec = importlib.machinery.PathFinder.find_spec("hicache", path)
    if spec is None or spec.loader is None or spec.origin == os.path.abspath(init_file):
        # nothing installed elsewhere: the checkout maps its own folders as pyproject's
        # package-dir does (hicache.kernels is kernels/, which every folder's bare name uses)
        module = sys.modules.get("hicache")
        if module is not None and root not in module.__path__:
            module.__path__.append(root)
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["hicache"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop("hicache", None)
        raise
