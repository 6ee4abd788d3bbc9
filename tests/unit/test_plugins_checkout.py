"""llmflow run from a source checkout that was never installed still knows its own formats and
stages: they are read from the checkout's pyproject.toml, the one place they are declared."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmflow import plugins

tomllib = pytest.importorskip("tomllib", reason="Python 3.10 reads no pyproject.toml: install the checkout")
ROOT = Path(__file__).resolve().parents[2]
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
