"""A non-editable install works from any directory: the configs ship inside the package."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile

import pytest

from conftest import REPO


def _copy_of_the_source(dest):
    """What the wheel is built from: the checkout's top-level files (pyproject.toml, README.md, ...) with maxtrain/
    and configs/. pip builds a local directory in place, writing build/ and maxtrain.egg-info there; a copy keeps
    the checkout as it was (.ci/run installs maxtrain, editable, into other virtualenvs meanwhile, and each of those
    installs writes maxtrain.egg-info in the checkout)."""
    dest.mkdir()
    for entry in os.scandir(REPO):
        if entry.is_file():
            shutil.copy2(entry.path, dest / entry.name)
    for package_dir in ("maxtrain", "configs"):
        shutil.copytree(os.path.join(REPO, package_dir), dest / package_dir,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return str(dest)


@pytest.mark.slow
def test_the_wheel_trains_two_steps_from_another_directory(tmp_path):
    """Build the wheel, install it (no editable link to this checkout) into a fresh venv, and run
    `python -m maxtrain.train base.yml ...` from an empty directory: base.yml and the presets are found
    inside the installed package. The venv borrows this environment's dependencies (jax, orbax, ...)
    through a .pth file, so the test needs no network; maxtrain itself comes only from the wheel."""
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
                    _copy_of_the_source(tmp_path / "source")], check=True, capture_output=True)
    wheel = next(dist.glob("maxtrain-*.whl"))
    with zipfile.ZipFile(wheel) as archive:  # the GPU targets compile/targets.py compiles for
        assert "maxtrain/compile/gpu_targets/h100_sxm.txtpb" in archive.namelist()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    venv_site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip()
    here = {sysconfig.get_paths()["purelib"], *site.getsitepackages()}
    with open(os.path.join(venv_site, "borrowed_dependencies.pth"), "w") as f:
        f.write("\n".join(sorted(here)) + "\n")  # its own .pth files (our editable link) are not processed
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", venv_site, str(wheel)],
                   check=True, capture_output=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    where = subprocess.run([python, "-c", "import maxtrain; print(maxtrain.__file__)"], cwd=elsewhere, env=env,
                           check=True, capture_output=True, text=True).stdout.strip()
    assert where.startswith(venv_site), where  # the wheel's copy, not this checkout
    run = subprocess.run([python, "-m", "maxtrain.train", "base.yml", "model_name=gemma3-1b", "base_emb_dim=64",
                          "base_mlp_dim=128", "base_num_decoder_layers=2", "vocab_size=512", "head_dim=32",
                          "dataset_type=synthetic", "steps=2", "per_device_batch_size=1", "max_target_length=32",
                          "max_new_tokens=0", "eval_interval=-1", "enable_checkpointing=false", "run_name=wheel"],
                         cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "model: gemma3-1b (gemma3)" in run.stdout and "done in" in run.stdout
    assert (elsewhere / "outputs" / "wheel" / "metadata" / "config.yml").is_file()


def test_every_package_directory_is_listed_for_the_wheel():
    """pyproject.toml lists the packages explicitly (configs/ installs as maxtrain.configs, which automatic
    discovery cannot map): every directory of maxtrain/ with an __init__.py must be among them, or a
    non-editable install lacks it (a new model family's folder, a new shared mechanism)."""
    import tomllib  # pylint: disable=import-outside-toplevel

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    found = {os.path.relpath(d, REPO).replace(os.sep, ".") for d, _, names in os.walk(os.path.join(REPO, "maxtrain"))
             if "__init__.py" in names}
    assert not found - listed, f"add {sorted(found - listed)} to pyproject.toml's [tool.setuptools] packages"
    assert not (listed - found - {"maxtrain.configs"}), f"pyproject.toml lists {sorted(listed - found)}: no such package"
