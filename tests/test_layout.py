"""The package layout follows the data flow, and imports only go downward.

study -> models -> backends -> measure -> checks -> evidence -> report -> cli, with `core` (paths,
canonical JSON, hashes) below everything and the frozen calculators (`calculator.py`,
`cycle_calculator.py`) importing nothing of ours.
Every import counts, including ones inside functions and under TYPE_CHECKING.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "rollout_lib"
FROZEN = ("calculator", "cycle_calculator")  # pure files pinned by hash: they import nothing of ours
LAYERS = ("core", "study", "models", "backends", "measure", "checks", "evidence", "campaign", "report", "cli")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every rollout_lib module this file imports (absolute names; `from pkg import mod` resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("rollout_lib")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rollout_lib"):
            assert node.level == 0, f"{path}: relative import"
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                is_module = (REPO / Path(*candidate.split("."))).with_suffix(".py").exists() or (
                    REPO / Path(*candidate.split(".")) / "__init__.py").exists()
                found.add(candidate if is_module else node.module)
    return found


FOUNDATION = ("safe_read", "safe_write", "lifetime")  # standard library only, beside core: the same layer


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in FOUNDATION:
        return "core"
    return parts[1] if len(parts) > 1 else "<root>"


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
GRAPH = {name: imports_of(path) for name, path in MODULES.items()}


def test_every_module_lives_in_a_known_layer():
    strays = [m for m in MODULES if layer_of(m) not in (*LAYERS, *FROZEN, "<root>")]
    assert not strays, f"modules outside the layers {LAYERS}: {strays}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_only_go_downward(module):
    if layer_of(module) in (*FROZEN, "<root>"):
        return
    rank = LAYERS.index(layer_of(module))
    upward = [target for target in GRAPH[module]
              if layer_of(target) in LAYERS and LAYERS.index(layer_of(target)) > rank]
    assert not upward, f"{module} (layer {layer_of(module)}) imports upward: {upward}"


@pytest.mark.parametrize("module", [f"rollout_lib.{name}" for name in FROZEN])
def test_the_frozen_calculators_import_nothing_of_ours(module):
    assert GRAPH[module] == set()


def test_no_import_cycle_between_modules():
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(GRAPH.get(node, ())):
            if target not in GRAPH:
                continue
            if state.get(target) == 1:
                cycle = [*stack[stack.index(target):], target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        stack.pop()
        state[node] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module)


def test_the_checker_finds_an_upward_import(tmp_path):
    """The layering rule can fail: a study module that imports the runner is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from rollout_lib.measure.runner import run\n")
    targets = imports_of(bad)
    assert "rollout_lib.measure.runner" in targets
    assert LAYERS.index(layer_of("rollout_lib.measure.runner")) > LAYERS.index("study")


def test_calculator_stays_where_the_preregistration_pins_it():
    from rollout_lib.core import sha256_file
    from rollout_lib.study.prereg import load

    study = load(REPO / "params" / "rollout-runtime-v2.yaml")
    assert study.calculator.path == "rollout_lib/calculator.py"
    assert sha256_file(REPO / study.calculator.path) == study.calculator.sha256


def test_console_script_help_names_every_subcommand():
    out = subprocess.run([sys.executable, "-m", "rollout_lib.cli", "--help"], capture_output=True, text=True,
                         check=True, cwd=REPO).stdout
    for command in ("prereg", "models", "measure", "missing", "publish", "check", "report", "conformance",
                    "refresh", "campaign", "seal"):
        assert f"    {command}" in out, command


@pytest.mark.parametrize("argv, needle", [
    (["prereg", "params/does-not-exist.yaml"], "does not exist"),
    (["measure", "--backend", "nope", "--campaign", "x"], "backend: unknown backend 'nope'"),
    (["models", "digest", "/nonexistent-dir"], "snapshot:"),
])
def test_cli_bad_input_is_one_line_with_exit_code_2(argv, needle):
    out = subprocess.run([sys.executable, "-m", "rollout_lib.cli", *argv], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], out.stderr
    assert "Traceback" not in out.stderr
