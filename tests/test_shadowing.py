"""The repository's top-level folders never shadow installed packages of the same bare name.

kernels/, client/ and daemon/ are hicache.kernels, hicache.client and hicache.daemon; run from
the repository root (where the README's commands run) they must not answer to ``kernels``
(Hugging Face's, which transformers imports), ``client`` or ``daemon``.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
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


def test_a_bare_name_with_nothing_installed_is_an_empty_namespace():
    """What Python makes of a folder without an ``__init__``: no file, no version, nothing in
    it (what transformers takes for "not installed"); any name asked of it says why."""
    code = (
        "import importlib, sys\n"
        "for name in ('client', 'daemon'):\n"
        "    m = importlib.import_module(name)\n"
        "    print(name, getattr(m, '__file__', None), getattr(m, '__version__', 'N/A'))\n"
        "    try:\n"
        "        m.HiCacheClient\n"
        "    except AttributeError as e:\n"
        "        print('hicache.' + name in str(e))\n"
        "    try:\n"
        "        importlib.import_module(name + '.client')\n"
        "    except ModuleNotFoundError:\n"
        "        print('no submodule')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('client', 'daemon')))\n"
    )
    out = run_python(code, ROOT).splitlines()
    assert out == ["client None N/A", "True", "no submodule", "daemon None N/A", "True",
                   "no submodule", "['client', 'daemon']"]  # fmt: skip


def test_a_bare_name_from_a_clone_nothing_installed_is_an_empty_namespace():
    """No hicache installed (``-S``: no site-packages, no editable install's finder): the
    clone's folders still import under their bare names as empty namespaces (the clone's
    hicache/ maps them), so transformers' check says "not installed" instead of raising."""
    code = (
        "import importlib, importlib.util, sys\n"
        "for name in ('kernels', 'client', 'daemon'):\n"
        "    assert importlib.util.find_spec(name) is not None\n"
        "    m = importlib.import_module(name)\n"
        "    print(name, getattr(m, '__file__', None), m.__spec__.origin)\n"
    )
    done = subprocess.run([sys.executable, "-S", "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["kernels None None", "client None None", "daemon None None"]


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


# ---- environments a user already has: no Hugging Face kernels, hicache installed as a wheel ---
def _filtered_site(dest: Path, drop: tuple[str, ...]) -> Path:
    """This venv's site-packages as links, less the entries whose names start with ``drop``."""
    site = Path(next(p for p in sys.path if p.endswith("site-packages")))
    dest.mkdir()
    for entry in site.iterdir():
        if not entry.name.startswith(drop):
            (dest / entry.name).symlink_to(entry)
    return dest


@pytest.fixture(scope="module")
def user_envs(tmp_path_factory):
    """A venv that sees this one's packages but hicache (installed into it from the clone as
    a regular wheel, as docs/sglang.md says), with and without Hugging Face's ``kernels``."""
    top = tmp_path_factory.mktemp("user-envs")
    ours = ("hicache", "__editable__", "__editable___hicache")
    sites = {
        "with": _filtered_site(top / "with", ours),
        "without": _filtered_site(top / "without", (*ours, "kernels")),
    }
    venv = top / "venv"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv",
                    "--without-pip", str(venv)], check=True, timeout=120)  # fmt: skip
    python = venv / "bin" / "python"
    purelib = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig."
                                   "get_paths()['purelib'])"], capture_output=True, text=True,
                                  check=True).stdout.strip())  # fmt: skip
    pth = purelib / "user-site.pth"

    def use(which: str) -> Path:
        pth.write_text(f"import site; site.addsitedir({str(sites[which])!r})\n")
        return python

    use("with")
    # from a copy of the tracked files: setuptools builds in the source folder, and a build/
    # left there by an earlier install would ship modules the tree no longer has
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True).stdout.decode().split("\0")  # fmt: skip
    source = top / "source"
    for name in filter(None, tracked):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--no-index", str(source)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PIP_NO_CACHE_DIR": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return use, purelib


TRANSFORMERS_CHECK = (
    "import importlib.util\n"
    "from transformers import LlamaConfig\n"
    "from transformers.utils import import_utils\n"
    "print(import_utils._is_package_available('kernels', return_version=True)[0])\n"
    "import hicache, hicache.client, hicache.kernels, hicache.daemon.main\n"
    "print(hicache.__file__)\n"
    "print(hicache.client.HiCacheClient.__module__)\n"
)


@pytest.mark.parametrize("kernels", ["with", "without"])
def test_from_the_clone_a_user_env_imports_transformers_and_the_installed_hicache(
    user_envs, kernels
):
    """From the clone's root (first on sys.path), in an environment with hicache installed as
    a wheel: transformers' own check of Hugging Face's ``kernels`` and its models import,
    and ``hicache`` is the installed one, with and without Hugging Face's package."""
    use, purelib = user_envs
    python = use(kernels)
    for cwd in (ROOT, ROOT / "tests"):
        done = subprocess.run([str(python), "-c", TRANSFORMERS_CHECK], cwd=cwd,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        available, where, client = done.stdout.split()
        assert available == ("True" if kernels == "with" else "False")
        assert Path(where).resolve().is_relative_to(purelib.resolve())
        assert client == "hicache.client.client"
    # a project script run as the README runs them, from the clone
    done = subprocess.run([str(python), "-m", "scripts.bench_vllm", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0 and "usage" in done.stdout, done.stderr[-3000:]
