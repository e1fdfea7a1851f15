"""The repository's top-level folders never shadow installed packages of the same bare name.

kernels/, client/ and daemon/ are hicache.kernels, hicache.client and hicache.daemon; run from
the repository root (where the README's commands run) they must not answer to ``kernels``
(Hugging Face's, which transformers imports), ``client`` or ``daemon``.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BARE = ("kernels", "client", "daemon")


def run_python(code: str, cwd: Path, **env: str) -> str:
    """Runs ``python -c code`` in ``cwd`` (so that ``cwd`` is first on sys.path); its stdout."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_hugging_face_kernels_is_installed():
    """The test extra installs it, so that the next test meets the real collision."""
    assert importlib.metadata.version("kernels")


@pytest.mark.parametrize("cwd", [ROOT, ROOT / "tests"], ids=["root", "tests"])
def test_a_transformers_model_imports_and_runs_beside_the_kernels_folder(cwd):
    out = run_python(
        "import sys, torch, kernels\n"
        "print(kernels.__file__)\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,\n"
        "    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)\n"
        "model = LlamaForCausalLM(config).eval()\n"
        "with torch.no_grad():\n"
        "    logits = model(torch.tensor([[1, 2, 3]])).logits\n"
        "print(tuple(logits.shape))\n",
        cwd,
        PYTHONPATH=str(ROOT),  # as pytest's rootdir handling does from tests/
    )
    kernels_file, shape = out.splitlines()
    assert not Path(kernels_file).resolve().is_relative_to(ROOT / "kernels")
    assert shape == "(1, 3, 64)"


def test_in_this_process_kernels_is_the_installed_package():
    """pytest put the repository root on sys.path; ``kernels`` is still Hugging Face's."""
    assert str(ROOT) in [os.path.abspath(p or os.curdir) for p in sys.path]
    import kernels

    assert not Path(kernels.__file__).resolve().is_relative_to(ROOT / "kernels")
    assert Path(sys.modules["kernels"].__file__) == Path(kernels.__file__)


def test_a_bare_name_with_nothing_installed_is_not_found():
    code = (
        "import importlib\n"
        "for name in ('client', 'daemon'):\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ModuleNotFoundError as e:\n"
        "        print(name, e.name)\n"
        "import sys\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('client', 'daemon')))\n"
    )
    out = run_python(code, ROOT).splitlines()
    assert out == ["client client", "daemon daemon", "[]"]


def test_a_bare_name_is_the_installed_distribution_of_that_name(tmp_path):
    """An installed ``daemon`` or ``client`` (python-daemon, say) is found past the root."""
    for name in BARE[1:]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"WHO = 'installed {name}'\n")
        (tmp_path / name / "part.py").write_text("PART = True\n")
    code = (
        "import client, daemon, daemon.part\n"
        "print(client.WHO); print(daemon.WHO); print(daemon.part.PART)\n"
        "import hicache.client, hicache.daemon\n"
        "print(hicache.client.HiCacheClient.__name__)\n"
    )
    out = run_python(code, ROOT, PYTHONPATH=str(tmp_path)).splitlines()
    assert out == ["installed client", "installed daemon", "True", "HiCacheClient"]


def test_the_hicache_names_still_import_from_the_folders():
    code = (
        "import hicache.kernels, hicache.client, hicache.daemon\n"
        "print(hicache.kernels.page_runs.__module__)\n"
        "print(hicache.client.__file__)\n"
    )
    module, client_file = run_python(code, Path("/")).split()
    assert module == "hicache.kernels.runs"
    assert Path(client_file).resolve() == ROOT / "client" / "__init__.py"


def test_the_cli_does_not_import_torch():
    """The bare-name guard sits in hicache.kernels, whose __init__ must stay light."""
    out = run_python("import sys, hicache.client.cli; print('torch' in sys.modules)", Path("/"))
    assert out.split() == ["False"]


@pytest.mark.parametrize("name", ["scripts", "tests"])
def test_no_installed_distribution_claims_the_scripts_and_tests_names(name):
    """scripts/ and tests/ are imported by those names from the root only (never installed): a
    distribution in the lock that shipped a top-level package of the same name would be
    shadowed there. A refresh of the lock that brings one in fails here, naming it."""
    claims = importlib.metadata.packages_distributions().get(name, [])
    assert claims == [], f"{claims} install a top-level {name!r} package"
