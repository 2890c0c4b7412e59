"""Packaging: the console scripts, the trainer extra, and the trainer in a Python without its extra."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.helpers import REPO

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    tomllib = None


def _pyproject() -> dict:
    if tomllib is None:
        pytest.skip("tomllib needs Python 3.11")
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_console_scripts_are_declared_and_installed() -> None:
    scripts = _pyproject()["project"]["scripts"]
    assert scripts == {"pslaunch": "launcher.cli:main", "pslaunch-train-mnist": "trainer.train_mnist:main"}
    script = Path(sys.executable).parent / "pslaunch-train-mnist"
    if not script.exists():
        pytest.skip("this environment was installed before the script existed: rerun scripts/setup.sh")
    r = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60, cwd="/")
    assert r.returncode == 0 and "usage: train_mnist" in r.stdout, r.stderr


def test_the_trainer_extra_keeps_a_torch_installed_first() -> None:
    """A CUDA build installed before ``pip install 'pslaunch[trainer]'`` satisfies the extra, so pip
    keeps it (a pin on the CPU wheel's version would replace it)."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    reqs = [Requirement(r) for r in _pyproject()["project"]["optional-dependencies"]["trainer"]]
    torch = next(r for r in reqs if r.name == "torch")
    for installed in ("2.13.0", "2.13.0+cu126", "2.5.1+cu124", "2.4.0+rocm6.1", "2.2.2+cpu"):
        assert torch.specifier.contains(Version(installed)), (str(torch), installed)
    assert not torch.specifier.contains(Version("1.13.1"))


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Python with the standard library only (a fresh venv): pslaunch installed without extras."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    return str(venv / "bin" / "python")


@pytest.mark.parametrize("role", [None, "server"])
def test_the_trainer_without_torch_is_one_line(bare_python: str, role: str | None) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    for k in list(env):
        if k.startswith(("DMLC_", "PSLAUNCH_")):
            del env[k]
    if role:
        env.update({"DMLC_ROLE": role, "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9",
                    "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1"})
    r = subprocess.run([bare_python, "-m", "trainer.train_mnist", "--kv-store", "dist_sync", "--num-epochs", "1"],
                       capture_output=True, text=True, timeout=60, env=env, cwd="/")
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert lines[0].startswith("train_mnist: error: the trainer needs torch, numpy, pyzmq, which ")
    assert "pip install '.[trainer]' in your clone of pslaunch" in lines[0] and "Traceback" not in r.stderr
    # --help needs none of them
    r = subprocess.run([bare_python, "-m", "trainer.train_mnist", "--help"], capture_output=True, text=True,
                       timeout=60, env=env, cwd="/")
    assert r.returncode == 0 and "--kv-store" in r.stdout, r.stderr


def test_the_wheel_holds_every_package(tmp_path) -> None:
    """A regular (not editable) install has the launcher, the contract package the launcher and
    the trainer import, and the trainer; and runs from a directory that holds none of them."""
    import shutil

    src = tmp_path / "src"  # the checkout's files only: a stale build/ directory here must not count
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, check=True, timeout=60).stdout.decode().split("\0")
    for rel in filter(None, listed):
        if (REPO / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, src / rel)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    import zipfile

    (wheel,) = tmp_path.glob("pslaunch-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for pkg in ("launcher", "pscontract", "trainer"):
        assert f"{pkg}/__init__.py" in names, (pkg, names[:20])
    assert "launcher/node/ssh_wrapper.py" in names and "pscontract/netif.py" in names
    for page in ("page.html", "app.js", "app.css"):  # the job page, package data
        assert f"launcher/ui/static/{page}" in names, (page, [n for n in names if n.startswith("launcher/ui")])
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = "import pscontract, launcher.node, launcher.spec.plan; print(launcher.node.ROOT)"  # (no site: no click)
    r = subprocess.run([sys.executable, "-S", "-c", f"import sys; sys.path.insert(0, {str(site)!r}); {code}"],
                       capture_output=True, text=True, timeout=60, cwd="/", env={"PATH": os.environ["PATH"]})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(site)
