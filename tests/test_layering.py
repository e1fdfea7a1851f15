"""The dependency rule, read from the source: daemon -> core -> kernels, client -> core; the
client never imports the daemon nor the daemon the client; the core imports neither and opens
no sockets (zmq only for CurveZMQ's key files); the kernels import nothing of the rest."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

PACKAGE = {"core": "hicache", "daemon": "hicache.daemon", "client": "hicache.client",
           "kernels": "hicache.kernels"}  # fmt: skip
MAY_IMPORT = {
    "core": {"core", "kernels"},
    "daemon": {"daemon", "core", "kernels"},
    "client": {"client", "core", "kernels"},
    "kernels": {"kernels"},
}


def _room_of(module: str) -> str | None:
    """The room an absolute module name belongs to (None: not hicache's)."""
    for room in ("daemon", "client", "kernels"):
        if module == PACKAGE[room] or module.startswith(PACKAGE[room] + "."):
            return room
    return "core" if module == "hicache" or module.startswith("hicache.") else None


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``path`` (relative ones made absolute)."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the file's own package
                raise AssertionError(f"{path}:{node.lineno}: relative import (use absolute)")
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def _folder(room: str) -> Path:
    """Where the room's package is imported from (the repository's folder, or the package's
    own in a copy laid out as installed)."""
    spec = importlib.util.find_spec(PACKAGE[room])
    assert spec is not None and spec.origin is not None, room
    return Path(spec.origin).parent


def _files(room: str) -> list[Path]:
    folder = _folder(room)  # (less the other rooms inside it: the core's, installed)
    others = [o for o in map(_folder, PACKAGE) if o != folder and not folder.is_relative_to(o)]
    return [
        p
        for p in folder.rglob("*.py")
        if "__pycache__" not in p.parts and not any(p.is_relative_to(o) for o in others)
    ]


@pytest.mark.parametrize("room", list(PACKAGE))
def test_each_room_imports_only_what_it_may(room):
    wrong = []
    for path in _files(room):
        for line, module in _imports(path):
            other = _room_of(module)
            if other is not None and other not in MAY_IMPORT[room]:
                wrong.append(f"{path}:{line}: {module} ({other})")
            if room == "core" and module.split(".")[0] == "zmq" and module != "zmq.auth":
                wrong.append(f"{path}:{line}: {module} (sockets)")
    assert not wrong, "imports against the dependency rule:\n" + "\n".join(wrong)


def test_the_rule_is_read_right():
    """The reader sees a violation where there is one (the test above can fail)."""
    assert _room_of("hicache.client.connection") == "client"
    assert _room_of("hicache.daemon") == "daemon"
    assert _room_of("hicache.kernels.copy") == "kernels"
    assert _room_of("hicache.tree") == "core" and _room_of("numpy") is None
    assert "client" not in MAY_IMPORT["daemon"] and "daemon" not in MAY_IMPORT["client"]
    assert all(len(_files(room)) > 1 for room in PACKAGE)  # (each room is read)


# inside the core, floors that only import down: a module of a floor imports nothing of a
# higher one (TYPE_CHECKING imports included: a reader follows those too)
CORE_FLOORS = [
    ("memory", "hicache.memory"),  # where KV lives, who owns which page
    ("tree", "hicache.tree"),  # the radix tree over token ids (uses the page states)
    ("cache", "hicache.cache"),  # HiRadixCache, composing both (and what sits above it)
]


def _core_floor(module: str) -> int | None:
    for i, (_, name) in enumerate(CORE_FLOORS):
        if module == name or module.startswith(name + "."):
            return i
    return None


def test_memory_imports_nothing_of_the_tree_and_the_tree_nothing_of_the_cache():
    wrong = []
    for path in _files("core"):
        package = ".".join(("hicache", *path.relative_to(_folder("core")).with_suffix("").parts))
        mine = _core_floor(package)
        if mine is None:
            continue
        for line, module in _imports(path):
            theirs = _core_floor(module)
            if theirs is not None and theirs > mine:
                wrong.append(f"{path}:{line}: {module} ({CORE_FLOORS[theirs][0]})")
    assert not wrong, "the core's floors import upwards:\n" + "\n".join(wrong)
    assert _core_floor("hicache.tree.fastpath") == 1 and _core_floor("hicache.cache") == 2
