"""An installed plugin that fails to import stops only what needs it: a compare of two llmflow dumps
still runs beside a broken format plugin, with a warning naming it; asking for that format by name
gives its import error in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from dump_helpers import dump  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def install_broken_format(site: Path) -> None:
    """A distribution as pip leaves it (a dist-info with entry_points.txt) declaring a format reader
    whose module raises on import."""
    info = site / "broken_reader-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-reader\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[llmflow.formats]\nbrokenfmt = broken_reader:Reader\n")
    (site / "broken_reader.py").write_text("import no_such_module_of_this_plugin\n")


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("dumps")
    dump(tmp, new_tokens=1)
    install_broken_format(tmp / "site")
    return tmp


def llmflow(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmflow.cli", *args], capture_output=True, text=True,
                          timeout=300, cwd=tmp,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp / "site")])})


def test_a_compare_runs_beside_a_broken_format_plugin_and_names_it(dumps: Path) -> None:
    d = str(dumps / "dump")
    proc = llmflow(dumps, "compare", "-gp", d, "-mp", d, "-o", str(dumps / "out"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("PASSED")
    warnings = [ln for ln in proc.stderr.splitlines() if "brokenfmt" in ln]
    assert len(warnings) == 1, proc.stderr
    assert "broken-reader 1.0" in warnings[0] and "no_such_module_of_this_plugin" in warnings[0]


def test_a_dump_no_reader_claims_names_the_broken_plugin(dumps: Path) -> None:
    (dumps / "empty").mkdir(exist_ok=True)
    proc = llmflow(dumps, "inspect", str(dumps / "empty"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    last = (proc.stdout + proc.stderr).strip().splitlines()[-1]
    assert "not a dump of any known format" in last and "'brokenfmt' failed to import" in last, last
