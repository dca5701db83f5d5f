"""deploy/Dockerfile without a Docker daemon: hadolint's rules, its pins and user, and its install step
(deploy/install-jpaged.sh) run in a fresh venv, the way the image runs it."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
INSTALL = ROOT / "deploy" / "install-jpaged.sh"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def test_hadolint_finds_nothing_to_fix():
    hadolint = Path(sys.executable).parent / "hadolint"
    result = subprocess.run([str(hadolint), str(DOCKERFILE)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_base_image_names_a_version_and_the_image_runs_as_a_user():
    args = dict(arg.split("=", 1) for kind, arg in instructions() if kind == "ARG" and "=" in arg)
    bases = [arg.split()[0] for kind, arg in instructions() if kind == "FROM"]
    for base in bases:
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
        name, _, tag = image.partition(":")
        assert tag and tag != "latest" and re.search(r"\d+\.\d+\.\d+", tag), image
    users = [arg for kind, arg in instructions() if kind == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")


def test_no_secret_is_baked_into_the_image():
    for kind, arg in instructions():
        if kind in ("ENV", "ARG"):
            assert not re.search(r"(API_KEY|HF_TOKEN|PASSWORD|SECRET)\s*=", arg), arg


def test_every_accelerator_variant_is_a_jax_extra_and_the_pinned_jax_satisfies_the_package():
    script = INSTALL.read_text()
    variants = re.search(r"^\s*(cuda\S*(?: \| \S+)*)\)", script, re.MULTILINE).group(1).split(" | ")
    assert set(variants) == {"cuda12", "cuda13", "tpu"}
    assert set(variants) <= set(importlib.metadata.metadata("jax").get_all("Provides-Extra"))
    pinned = re.search(r"^jax_version=(\S+)", script, re.MULTILINE).group(1)
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (jax,) = [Requirement(d) for d in dependencies if Requirement(d).name == "jax"]
    assert jax.specifier.contains(pinned)
    default_arg = next(a for k, a in instructions() if k == "ARG" and a.startswith("ACCELERATOR="))
    assert default_arg.split("=", 1)[1] in variants


def test_the_image_copies_every_package_directory_the_project_installs():
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    tops = {name.split(".")[0] for name in packages["packages"]} | set(packages["package-dir"].values())
    tops -= {"jpaged_server"}
    copied = {arg.split()[0] for kind, arg in instructions() if kind == "COPY" and "--from" not in arg}
    assert tops <= copied
    assert "RUN ./deploy/install-jpaged.sh" in " ".join(f"{k} {a}" for k, a in instructions())


@pytest.mark.slow
def test_the_install_step_gives_a_working_jpaged_serve_in_a_fresh_venv(tmp_path):
    """The image's own install command, for the CPU build (the accelerator builds differ only in JAX's extra)."""
    venv = tmp_path / "image"
    result = subprocess.run(
        ["sh", str(INSTALL), str(venv), "cpu", "1"], capture_output=True, text=True, check=False, timeout=1800
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    probe = "from jpaged.models.default_model import default_model_path; print(default_model_path().exists())"
    shown = subprocess.run(
        [str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True, check=True
    )
    assert shown.stdout.strip() == "True"  # `jpaged serve` with no model serves the embedded SmolLM2
