"""Paths like every CLI: relative paths resolve against the working directory; the defaults come from
the project root, the nearest folder upwards that holds params/ (as git finds .git), never from where
the package is installed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_lib.core import ProjectRootNotFound, find_project_root, project_root

from .conftest import PREREG, REPO, SMOKE


def rollout(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollout_lib.cli", *argv], capture_output=True, text=True, cwd=cwd,
                          env=dict(os.environ, TQDM_DISABLE="1", PYTHONPATH=str(REPO)), timeout=300)


@pytest.fixture()
def project(tmp_path) -> Path:
    """A project that is not this checkout: params/ only (no rollout_lib/, no notebooks/)."""
    root = tmp_path / "proj"
    (root / "params" / "profiles").mkdir(parents=True)
    shutil.copy(PREREG, root / "params" / PREREG.name)
    shutil.copy(SMOKE, root / "params" / "profiles" / SMOKE.name)
    (root / "deep" / "er").mkdir(parents=True)
    return root


def test_the_root_is_found_walking_up_from_a_subdirectory(project):
    assert find_project_root(project / "deep" / "er") == project.resolve()
    assert find_project_root(project) == project.resolve()
    assert find_project_root(REPO / "rollout_lib" / "measure") == REPO.resolve()


def test_outside_any_project_there_is_no_root_and_the_error_names_params(tmp_path):
    assert find_project_root(tmp_path) is None
    with pytest.raises(ProjectRootNotFound, match=r"project root: no params/ folder in .* or any folder above it"):
        project_root(tmp_path)


def test_cli_defaults_come_from_the_project_root_of_the_working_directory(project):
    out = rollout("prereg", cwd=project / "deep" / "er")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("valid: ../../params/rollout-runtime-v2.yaml (sha256 "), out.stdout
    # the default output tree is this project's, not the checkout the package was installed from
    refused = rollout("publish", "--campaign", "c1", cwd=project / "deep")
    assert refused.returncode == 2 and "has no raw files under ../outputs/raw" in refused.stderr, refused.stderr
    assert not (project / "outputs").exists()


def test_relative_paths_resolve_against_the_working_directory(project):
    out = rollout("prereg", "../params/profiles/smoke.yaml", cwd=project / "deep")
    assert out.returncode == 0 and out.stdout.startswith("valid: ../params/profiles/smoke.yaml (sha256 "), out.stderr


def test_the_measure_notebook_is_located_from_the_project_root(project):
    before = sorted(project.rglob("*"))
    out = rollout("measure", "--backend", "hf_cached", "--campaign", "c1", "--params", "params/profiles/smoke.yaml",
                  "--cells", "p16-r8-n1-greedy", "--device", "cpu", cwd=project)
    assert out.returncode == 2, out.stderr
    assert "notebook: notebooks/measure.ipynb not found under the project root" in out.stderr.strip().splitlines()[-1]
    assert sorted(project.rglob("*")) == before  # refused before any folder or file


def test_outside_a_project_a_default_is_refused_in_one_line_and_explicit_paths_work(tmp_path):
    out = rollout("prereg", cwd=tmp_path)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == (f"rollout prereg: error: project root: no params/ folder in {tmp_path.resolve()} "
                                  "or any folder above it; run inside a project (a checkout with params/) or give "
                                  "every path explicitly (--params, --output-dir)")
    explicit = rollout("prereg", str(SMOKE), cwd=tmp_path)
    assert explicit.returncode == 0 and explicit.stdout.startswith(f"valid: {SMOKE} (sha256 ")
    assert list(tmp_path.iterdir()) == []


def test_the_snapshot_cache_follows_the_project_never_the_installed_package(tmp_path, monkeypatch):
    """Synthetic snapshots (GBs) are built under the project found from the working directory, under
    $ROLLOUT_CACHE_DIR when set, and under the user's cache outside any project: never beside the package."""
    from rollout_lib.models.synthetic import default_cache_dir

    project = tmp_path / "project"
    (project / "params").mkdir(parents=True)
    (project / "sub").mkdir()
    monkeypatch.delenv("ROLLOUT_CACHE_DIR", raising=False)
    monkeypatch.chdir(project / "sub")
    assert default_cache_dir() == project.resolve() / ".cache" / "snapshots"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    monkeypatch.chdir(outside)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "rollout-runtime" / "snapshots"
    monkeypatch.setenv("ROLLOUT_CACHE_DIR", str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine"
