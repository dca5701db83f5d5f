"""The folders are layers and imports only point down: the entry points (jpaged.entrypoints: the `jpaged`
command, whose `serve` starts the HTTP server, and `LLM`) -> the OpenAI server (jpaged_server) -> the engine loop
-> the host core and the runner (siblings: neither imports the other) -> models -> kernels, with jpaged's
top-level public types (config, sampling params, outputs) below them all. The host core runs without JAX."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Packages by layer; a module may import from its own package, or from a layer with a lower number.
LAYERS = {
    "jpaged.entrypoints": 6,
    "jpaged_server": 5,
    "jpaged.benchmarks": 5,  # bench serve (any server), bench throughput (an engine) and plan: beside the server
    "jpaged.engine": 4,
    "jpaged.core": 3,
    "jpaged.runner": 3,
    "jpaged.structured": 3,  # grammars and token bitmasks on the host (llguidance, numpy; no JAX)
    "jpaged.models": 2,
    "jpaged.pallas": 1,
    "jpaged": 0,  # the top-level modules: config, sampling_params, outputs, rounding
}


def module_files() -> dict[str, Path]:
    files = {}
    for path in sorted((ROOT / "jpaged").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for path in sorted((ROOT / "server").glob("*.py")):
        files["jpaged_server" + ("" if path.stem == "__init__" else f".{path.stem}")] = path
    return files


def layer_of(module: str) -> str:
    """The package a module belongs to for layering: the longest LAYERS key it is in (top-level modules of
    jpaged, and the pallas kernels' subfolder, belong to the folder they sit in)."""
    return max((name for name in LAYERS if module == name or module.startswith(name + ".")), key=len)


def imported_modules(path: Path) -> set[str]:
    """Every jpaged module a file imports, at the top or inside a function (type-only imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.split(".")[0] in ("jpaged", "jpaged_server")}


def package_of(module: str, files: dict[str, Path]) -> str:
    path = files[module]
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def test_every_import_points_to_the_same_package_or_a_lower_layer():
    files = module_files()
    wrong = []
    for module, path in files.items():
        own = layer_of(package_of(module, files))
        for target in imported_modules(path):
            theirs = layer_of(target)
            if theirs != own and LAYERS[theirs] >= LAYERS[own]:
                wrong.append(f"{module} ({own}) imports {target} ({theirs})")
    assert not wrong, "\n".join(wrong)


def test_the_layering_test_sees_every_package():
    packages = {layer_of(package_of(module, module_files())) for module in module_files()}
    assert packages == set(LAYERS)


def test_the_host_core_imports_without_jax():
    core = sorted(module for module in module_files() if module.startswith("jpaged.core"))
    assert len(core) >= 6
    program = "import sys\n" + "".join(f"import {m}\n" for m in core) + "print('jax' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize(
    "module",
    [
        "jpaged",
        "jpaged.config",
        "jpaged.sampling_params",
        "jpaged.outputs",
        "jpaged.structured",
        # the loop's host work: a step's rows and plain schedule, sampling inputs, outputs, beams, text, request
        # checks, metrics
        "jpaged.engine.scheduled_step",
        "jpaged.engine.step_sampling",
        "jpaged.engine.output_processor",
        "jpaged.engine.beam_driver",
        "jpaged.engine.detokenizer",
        "jpaged.engine.request_checks",
        "jpaged.engine.engine_metrics",
    ],
)
def test_the_public_types_and_the_loops_host_work_import_without_jax(module):
    program = f"import sys, {module}\nprint('jax' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
