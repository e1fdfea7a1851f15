"""What the tests need beyond the core: present, or declared absent. Never skipped silently.

scripts/setup.sh installs every optional package and program the tests use. A test that needs
one that is missing fails, naming it, unless it was declared absent: in ``HICACHE_TESTS_WITHOUT``
(comma-separated names, e.g. ``vllm`` for a venv with the extras but without vLLM), or in the
record setup.sh writes of what it could not install (``hicache-tests-without`` in the venv:
Redis without root). Declared ones are skipped, and the run's summary lists them (conftest.py).
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

WITHOUT_ENV = "HICACHE_TESTS_WITHOUT"
RECORD = Path(sys.prefix) / "hicache-tests-without"  # in the venv the tests run in
SKIPPED: dict[str, set[str]] = {}  # declared absent and skipped: name -> what needed it


def declared_absent() -> set[str]:
    names = set(filter(None, os.environ.get(WITHOUT_ENV, "").replace(" ", "").split(",")))
    if RECORD.exists():
        names |= set(RECORD.read_text().split())
    return names


def _missing(name: str, what: str, hint: str) -> None:
    if name in declared_absent():
        SKIPPED.setdefault(name, set()).add(what)
        pytest.skip(
            f"{name} declared absent ({WITHOUT_ENV} or setup's record): {what}",
            allow_module_level=True,
        )
    pytest.fail(
        f"{name} is missing, and {what} needs it: run scripts/setup.sh ({hint}), or declare it "
        f"absent with {WITHOUT_ENV}={name} to run without these tests",
        pytrace=False,
    )


def require_module(module: str, name: str | None = None, what: str = "") -> ModuleType:
    """``import module``, or skip (declared absent) or fail (not declared). ``name``: the
    name to declare (default: the module's top package)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        _missing(name or module.split(".")[0], what or module, f"pip: {exc}")
        raise  # (unreachable: skip and fail raise)


def require_program(program: str, name: str, what: str, path: Path | None = None) -> str:
    """The path of ``program`` (on PATH, or at ``path``), or skip or fail as above."""
    found = str(path) if path is not None and path.exists() else shutil.which(program)
    if found is None:
        _missing(name, what, f"it installs {program}")
    return found  # type: ignore[return-value]
