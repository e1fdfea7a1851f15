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
