"""pip's way: the wheel built from this checkout, installed into a fresh venv, runs the shipped
recipes by name from an empty directory, with nothing of the checkout on the path.

The fresh venv sees the test venv's site-packages through a .pth file, for the dependencies only
(torch, transformers, ...; no second multi-GB install): llmflow itself, its workflows, recipes,
plugins, schemas, C++ sources and entry points can come only from the wheel.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHIPPED = ("workflows", "plugins", "schemas")  # top-level folders the wheel carries under llmflow/_shipped
TINY = "tiny-llama:layers=4,seed=1"
EXIT_CODES = {"PASSED": 0, "FAILED": 1, "INCONCLUSIVE": 3}  # the last line's word -> the exit code


def _clean_env() -> dict:
    """This environment without PYTHONPATH: the checkout must not be importable (nor its metadata
    visible to pip) in what runs the wheel."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def _run(cmd: list, cwd: Path, env: dict, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built offline from a copy of what a source distribution holds."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for folder in ("llmflow", *SHIPPED):
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path_factory.mktemp("dist")
    done = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                 "-q", "-w", dist, src], cwd=src, env=_clean_env())
    assert done.returncode == 0, done.stdout + done.stderr
    (found,) = dist.glob("llmflow-*.whl")
    return found


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv holding the wheel; the test venv's site-packages provide the dependencies."""
    root = tmp_path_factory.mktemp("venv")
    assert _run([sys.executable, "-m", "venv", "--without-pip", root], cwd=root, env=_clean_env(),
                timeout=120).returncode == 0
    done = _run([sys.executable, "-m", "pip", "--python", root / "bin" / "python", "install", "-q",
                 "--no-deps", "--no-index", wheel], cwd=root, env=_clean_env())
    assert done.returncode == 0, done.stdout + done.stderr
    purelib = _run([root / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                   cwd=root, env={}).stdout.strip()
    # appended after the venv's own site-packages: the wheel's llmflow (and its metadata) come first;
    # .pth files inside these folders (the test venv's editable llmflow) are not processed
    Path(purelib, "test-venv-dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return root


@pytest.fixture()
def user_env(tmp_path) -> dict:
    return {**_clean_env(), "LLMFLOW_CACHE": str(tmp_path / "cache"), "LLMFLOW_FUSED": "1"}


def test_the_wheel_holds_every_shipped_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder in SHIPPED:
        missing = {f"llmflow/_shipped/{folder}/{f}" for f in _files(REPO / folder)} - names
        assert missing == set(), f"{folder}/ files missing from the wheel"
    package = {f"llmflow/{f}" for f in _files(REPO / "llmflow")}
    assert package - names == set()
    assert {"llmflow/compare/pass1.cpp", "llmflow/dump/stats.cpp", "llmflow/dump/capture.cpp"} <= names


@pytest.mark.slow
def test_installed_wheel_runs_the_bisect_recipe_by_name_from_an_empty_directory(venv, user_env, tmp_path):
    bin_ = venv / "bin"
    where = _run([bin_ / "python", "-c", "import llmflow, llmflow.resources as r; "
                  "print(llmflow.__file__); print(r.workflows_dir())"], cwd=tmp_path, env=user_env)
    package_file, workflows = where.stdout.split()
    assert Path(package_file).is_relative_to(venv) and Path(workflows).is_relative_to(venv), where.stderr
    assert Path(workflows).parent.name == "_shipped"

    # the C++ kernels, the dump's capture where the venv's Python has its headers, and its tensor
    # reader where torch has its headers too, compile from the sources in the wheel
    built = _run([bin_ / "python", "-m", "llmflow.native"], cwd=tmp_path, env=user_env)
    assert built.returncode == 0, built.stderr
    if any(shutil.which(cc) for cc in ("c++", "g++", "clang++")):
        has_headers = ("import sysconfig, pathlib, torch; "
                       "python = pathlib.Path(sysconfig.get_paths()['include'], 'Python.h').is_file(); "
                       "include = pathlib.Path(torch.__file__).parent / 'include' / 'torch'; "
                       "print(python, python and include.is_dir())")
        python_headers, torch_headers = _run([bin_ / "python", "-c", has_headers], cwd=tmp_path,
                                             env=user_env).stdout.split()
        names = {p.name for p in (tmp_path / "cache").glob("kernels/*/*.so")}
        assert names == {"pass1.so", "stats.so", *(("capture.so",) if python_headers == "True" else ()),
                         *(("tensor_meta.so",) if torch_headers == "True" else ())}, built.stdout

    empty = tmp_path / "empty"
    empty.mkdir()
    listed = _run([bin_ / "llmflow", "workflows"], cwd=empty, env=user_env)
    assert listed.returncode == 0 and "llama2_bisect" in listed.stdout, listed.stdout + listed.stderr

    # the recipe extends recipes/bisect_base.yaml and patches from ../plugins/, both inside the package
    sets = [f"golden_model={TINY}", f"target_model={TINY}", "max_new_tokens=4",
            "target_patch=../plugins/example_faults.py:wrong_act_layer_2"]
    done = _run([bin_ / "llmflow", "run", "llama2_bisect", "--progress", "plain",
                 *[a for s in sets for a in ("--set", s)]], cwd=empty, env=user_env, timeout=600)
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    word = last.split(":")[0].split(" ")[0]
    assert word in EXIT_CODES, done.stdout + done.stderr
    assert done.returncode == EXIT_CODES[word], done.stdout + done.stderr
    run_dir = empty / "runs" / "llama2-bisect"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["verdict"]["first_bad_module"] == "model.layers.2.mlp.act_fn", last
    assert (run_dir / "report" / "report.html").is_file()

    # the demo's target (SmolLM2 with the planted bug from the shipped plugins/demo_bug.py) loads
    demo_env = {k: v for k, v in user_env.items() if k != "LLMFLOW_CACHE"}  # the converted SmolLM2
    demo = _run([bin_ / "python", "-c", "from llmflow.models import load_model; "
                 "from llmflow.resources import plugins_dir; "
                 "print(load_model(f'{plugins_dir()}/demo_bug.py:smollm2_with_planted_bug', "
                 "dtype='bfloat16').note)"], cwd=empty, env=demo_env)
    assert demo.returncode == 0 and "planted bug" in demo.stdout, demo.stdout + demo.stderr

    # the repository's path form works there too, and nothing is written outside the run dir
    hello = _run([bin_ / "llmflow", "run", "workflows/hello.yaml", "--progress", "plain"], cwd=empty,
                 env=user_env)
    assert hello.returncode == 0 and hello.stdout.strip().splitlines()[-1].startswith("PASSED"), hello.stderr
    assert sorted(p.name for p in empty.iterdir()) == ["runs"]
