"""The package's layers import only downward (docs/ARCHITECTURE.md): cli over workflow over stages
over localize over the checks (one dump or checkpoint) beside and above the dump/compare libraries
over formats/report/native over models, plugins, errors and redaction."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "llmflow"
RANK = {"__main__": 9, "cli": 8, "workflow": 7, "stages": 6, "localize": 5, "checks": 4, "dump": 3,
        "compare": 3, "report": 2, "formats": 2, "native": 2, "streamed": 2, "data": 1, "models": 1,
        "structure": 1, "seeding": 1, "quantized": 0.5, "plugins": 0, "resources": 0, "options": 0,
        "results": 0, "atomic": 0, "interrupts": 0, "dtypes": -0.25, "operators": 0, "safetensors_files": 0,
        "collector": 0, "errors": -1, "redaction": -1, "regular_files": -0.5}
# (regular_files: below safetensors_files, above errors; dtypes: below safetensors_files; quantized:
# below models, above safetensors_files)


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("llmflow."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.ImportFrom) and node.module == "llmflow":  # from llmflow import native
            found |= {a.name for a in node.names if a.name in RANK}  # (not __version__)
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("llmflow.")}
    return found


def test_every_module_and_folder_has_a_layer():
    """A new top-level module or folder must be placed in RANK: unranked, it would be unchecked."""
    names = {p.stem for p in PKG.glob("*.py")} | {p.name for p in PKG.iterdir()
                                                  if p.is_dir() and (p / "__init__.py").exists()}
    assert sorted(names - set(RANK) - {"__init__"}) == []


def test_imports_only_go_down():
    upward = []
    for f in sorted(PKG.rglob("*.py")):
        me = f.relative_to(PKG).with_suffix("").parts[0]
        if me == "__init__":  # the package's public API re-exports from every layer
            continue
        upward += [f"{f.relative_to(PKG)} imports llmflow.{other}" for other in _imports(f)
                   if other != me and RANK[other] >= RANK[me]]
    assert upward == []
