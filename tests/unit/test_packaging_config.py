"""pyproject.toml against the code: every package is listed, every shipped folder is mapped, and the
declared dependencies are the ones the code imports (no dead ones, none missing)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+")
REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]

# distribution name -> the module it is imported as, where they differ
IMPORT_NAMES = {"pyyaml": "yaml", "mindstudio-probe": "msprobe", "dask[distributed]": "dask"}
# declared but imported by a dependency, not by llmflow itself
INDIRECT = {"gguf": "transformers reads the SmolLM2 GGUF file with it (models.py: gguf_file=)",
            "accelerate": "transformers refuses to load a GGUF file without it"}
# imported by llmflow but optional, each where it is used behind an ImportError guard
OPTIONAL = {"torch_npu", "msprobe", "dask"}


def _requirement_name(req: str) -> str:
    for sep in "<>=!~; ":
        req = req.split(sep)[0]
    return req.strip().lower()


def _third_party_imports(root: Path) -> set[str]:
    found = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    return {m for m in found if m not in sys.stdlib_module_names and m != "llmflow"}


def test_every_package_under_llmflow_is_listed():
    listed = set(SETUPTOOLS["packages"])
    on_disk = {
        ".".join(d.relative_to(REPO).parts)
        for d in [REPO / "llmflow", *(REPO / "llmflow").rglob("*")]
        if d.is_dir() and d.name != "__pycache__" and any(f.is_file() for f in d.iterdir())
    }
    assert on_disk - listed == set(), "add these to [tool.setuptools] packages"
    assert {p for p in listed if not p.startswith("llmflow._shipped")} == on_disk


def test_shipped_folders_are_mapped_not_copied():
    mapped = SETUPTOOLS["package-dir"]
    assert mapped == {"llmflow._shipped.workflows": "workflows", "llmflow._shipped.plugins": "plugins",
                      "llmflow._shipped.schemas": "schemas"}
    for package, folder in mapped.items():
        assert (REPO / folder).is_dir() and package in SETUPTOOLS["packages"]
    assert "llmflow._shipped.workflows.recipes" in SETUPTOOLS["packages"]
    assert not (REPO / "llmflow" / "_shipped").exists()  # the wheel builds it; the repo has one copy


def test_declared_dependencies_are_the_imported_ones():
    declared = {_requirement_name(r) for r in PYPROJECT["project"]["dependencies"]}
    as_modules = {IMPORT_NAMES.get(d, d) for d in declared}
    imported = _third_party_imports(REPO / "llmflow")
    assert imported - as_modules - OPTIONAL == set(), "imported but not declared"
    assert as_modules - imported - set(INDIRECT) == set(), "declared but never imported"


def test_optional_imports_are_extras():
    extras = PYPROJECT["project"]["optional-dependencies"]
    names = {IMPORT_NAMES.get(_requirement_name(r), _requirement_name(r))
             for reqs in extras.values() for r in reqs}
    assert OPTIONAL <= names | {"torch_npu"}
    # an extra naming torch_npu would let pip replace the user's torch with the one it pins
    assert not any(_requirement_name(r) == "torch_npu" for reqs in extras.values() for r in reqs)
    assert extras["msprobe"] == ["mindstudio-probe>=26.2,<27"]


def test_torch_floor_matches_the_oldest_test():
    """The lowest torch and transformers in pyproject are the ones `make test-oldest` installs."""
    deps = {_requirement_name(r): r for r in PYPROJECT["project"]["dependencies"]}
    script = (REPO / "scripts" / "test_oldest.sh").read_text(encoding="utf-8")
    torch_oldest = script.split("TORCH_OLDEST:-")[1].split("}")[0]
    transformers_oldest = script.split("TRANSFORMERS_OLDEST:-")[1].split("}")[0]
    assert deps["torch"] == "torch>=" + ".".join(torch_oldest.split(".")[:2])
    assert deps["transformers"] == "transformers>=" + ".".join(transformers_oldest.split(".")[:2])


@pytest.mark.parametrize(("torch_version", "expected"), [
    ("2.1.0+cpu", ["torch==2.1.0+cpu", "transformers<4.56", "numpy<2"]),
    ("2.1.2", ["torch==2.1.2", "transformers<4.56", "numpy<2"]),
    ("2.2.2", ["torch==2.2.2", "numpy<2"]),
    ("2.3.1", ["torch==2.3.1"]),
    ("2.5.0a0+e000cf0ad9.nv24.10", ["torch==2.5.0a0+e000cf0ad9.nv24.10"]),
    ("2.13.0+cpu", ["torch==2.13.0+cpu"]),
])
def test_install_constraints_keep_the_torch_and_hold_what_it_needs(torch_version, expected):
    """What scripts/install.sh installs llmflow under, run the way it runs it."""
    import subprocess

    done = subprocess.run([sys.executable, str(REPO / "scripts" / "torch_constraints.py"), torch_version],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == expected
