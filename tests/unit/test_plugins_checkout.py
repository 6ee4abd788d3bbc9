"""llmflow run from a source checkout that was never installed still knows its own formats and
stages: they are read from the checkout's pyproject.toml, the one place they are declared."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

from llmflow import plugins
from llmflow.dump import DumpConfig, dump_run

tomllib = pytest.importorskip("tomllib", reason="Python 3.10 reads no pyproject.toml: install the checkout")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # tests/ holds the area's helpers
from dump_helpers import prompt_ids, tiny  # noqa: E402

DECLARED = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]


def test_an_uninstalled_checkout_finds_every_plugin_its_pyproject_declares(tmp_path: Path) -> None:
    checkout = tmp_path / "llmflow-src"
    shutil.copytree(ROOT / "llmflow", checkout / "llmflow",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "pyproject.toml", checkout / "pyproject.toml")
    # -S: no site-packages, so no installed llmflow's metadata; only the checkout on the path
    script = ("import json, sys; sys.path.insert(0, sys.argv[1]); from llmflow.plugins import find_group;"
              "print(json.dumps({g: {n: [r.target, r.source] for n, r in find_group(g).items()}"
              " for g in sys.argv[2:]}))")
    groups = ["llmflow.formats", "llmflow.stages", "llmflow.mappings"]
    out = subprocess.run([sys.executable, "-S", "-c", script, str(checkout), *groups],
                         capture_output=True, text=True, check=True, timeout=60, cwd=tmp_path).stdout
    found = json.loads(out)
    for group in groups:
        assert {n: t for n, (t, _) in found[group].items()} == DECLARED[group]
        sources = {src for _, src in found[group].values()}
        assert sources == {f"llmflow source checkout at {checkout.resolve()}"}, found[group]


def test_installed_metadata_is_used_where_llmflow_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkout's file is read only when no installed llmflow declares the group."""
    read: list[str] = []
    monkeypatch.setattr(plugins, "_checkout_entry_points", lambda group: read.append(group) or [])
    plugins.find_group.cache_clear()
    try:
        refs = plugins.find_group("llmflow.formats")
    finally:
        plugins.find_group.cache_clear()
    assert set(refs) >= set(DECLARED["llmflow.formats"]) and read == []
    assert all(ref.source.startswith("llmflow ") for ref in refs.values())


def _uninstalled_checkout(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A copy of the checkout, and an environment whose packages are this one's but for any
    installed llmflow (its metadata and its editable-install hooks are left out)."""
    checkout = tmp_path / "llmflow-src"
    for part in ("llmflow", "workflows", "schemas", "plugins"):
        shutil.copytree(ROOT / part, checkout / part, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "pyproject.toml", checkout / "pyproject.toml")
    packages = tmp_path / "site-packages"
    packages.mkdir()
    for folder in map(Path, site.getsitepackages()):
        for entry in folder.iterdir():
            name = entry.name.lower()
            if name.startswith(("llmflow", "__editable__")) or name.endswith(".pth") \
                    or (packages / entry.name).exists():
                continue
            (packages / entry.name).symlink_to(entry)
    return checkout, {**os.environ, "PYTHONPATH": f"{checkout}:{packages}"}


def test_the_cli_of_an_uninstalled_checkout_validates_a_workflow_and_compares_dumps(tmp_path: Path) -> None:
    """A user runs ``python -m llmflow`` from a checkout on PYTHONPATH (no pip install): the
    workflow's stages and the dumps' format are known, and the compare of a dump with itself passes."""
    checkout, env = _uninstalled_checkout(tmp_path)
    dump = tmp_path / "dump"
    config = DumpConfig(dump_path=str(dump), token_range="all", data_mode="statistics")
    dump_run(tiny(), prompt_ids(), 2, config)

    def llmflow(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-S", "-m", "llmflow", *args], capture_output=True, text=True,
                              env=env, cwd=tmp_path, timeout=300)

    # (the llmflow imported is the copy, and no llmflow distribution is installed)
    script = ("import llmflow, importlib.metadata as m; print(llmflow.__file__);"
              "print([d.name for d in m.distributions() if d.name == 'llmflow'])")
    probe = subprocess.run([sys.executable, "-S", "-c", script], capture_output=True, text=True, env=env,
                           cwd=tmp_path, timeout=60)
    assert probe.stdout.splitlines() == [str(checkout / "llmflow" / "__init__.py"), "[]"], probe.stderr
    valid = llmflow("validate", str(checkout / "workflows" / "llama2_bisect.yaml"))
    assert valid.returncode == 0 and valid.stdout.strip().splitlines()[-1].startswith("PASSED"), valid.stderr
    compared = llmflow("compare", "-gp", str(dump), "-mp", str(dump), "-o", str(tmp_path / "out"))
    assert compared.returncode == 0, compared.stdout + compared.stderr
    assert compared.stdout.strip().splitlines()[-1].startswith("PASSED"), compared.stdout
