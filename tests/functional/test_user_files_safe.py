"""llmflow never destroys what it did not write, driven through the CLI as a user would: ``compare
-o`` into folders holding the user's files (``.``, ``..``, an input), ``--run-dir`` on a folder
that is not a run dir, SIGTERM to ``run`` mid-dump and to ``compare``, a run on a full disk.
Every test hashes the user's files before and checks them byte for byte after."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from path_helpers import checkout_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compare_helpers import as_dump  # noqa: E402
from workflow_helpers import REPO, assert_bad_input, llmflow, write_workflow  # noqa: E402

from llmflow.formats.llmflow_dump import LlmflowDumpReader  # noqa: E402

TINY = "tiny-llama:layers=2,hidden=32,heads=4,kv_heads=2,intermediate=64"


def hashes(root: Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """sha256 of every file under ``root`` (links by their target text), by relative path."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if rel.split(os.sep)[0] in skip:
            continue
        if path.is_symlink():
            out[rel] = "link:" + os.readlink(path)
        elif path.is_file():
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
        elif path.is_dir():
            out[rel] = "dir"
    return out


def assert_kept(before: dict[str, str], root: Path) -> None:
    """Every file of ``before`` is still there, byte-identical."""
    after = hashes(root)
    assert {k: after.get(k) for k in before} == before


def user_files(folder: Path) -> None:
    """A folder of the user's own: notes, a sub folder, a hidden file."""
    (folder / "sub").mkdir(parents=True, exist_ok=True)
    (folder / "notes.txt").write_text("hours of NPU time\n")
    (folder / "sub" / "data.bin").write_bytes(os.urandom(256))
    (folder / ".hidden").write_text("mine")


def compare(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return llmflow("compare", *args, "--workers", "1", cwd=cwd)


@pytest.fixture
def dumps(tmp_path: Path) -> tuple[Path, Path]:
    return as_dump(tmp_path / "dumps", "g"), as_dump(tmp_path / "dumps", "t", noise=1e-3)


# -- compare -o ----------------------------------------------------------------------------------

def test_compare_into_a_folder_of_the_users_files(tmp_path, dumps):
    g, t = dumps
    results = tmp_path / "results"
    user_files(results)
    before = hashes(tmp_path)
    proc = compare("-gp", str(g), "-mp", str(t), "-o", "results", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_kept(before, tmp_path)
    ours = {"compare_logits.csv", "compare_layer.csv", "compare_module.csv", "compare.xlsx",
            "compare_summary.json", ".llmflow-outputs.json"}
    assert {p.name for p in results.iterdir()} == ours | {"notes.txt", "sub", ".hidden"}
    # a rerun that writes fewer tables replaces its own and removes the ones it no longer writes
    proc = compare("-gp", str(g), "-mp", str(t), "-o", "results", "-cl", "layer", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_kept(before, tmp_path)
    left = {"compare_layer.csv", "compare.xlsx", "compare_summary.json", ".llmflow-outputs.json"}
    assert {p.name for p in results.iterdir()} == left | {"notes.txt", "sub", ".hidden"}
    summary = json.loads((results / "compare_summary.json").read_text())
    assert list(summary["csv"]) == ["layer"]
    # a file at one of llmflow's names that it did not write is refused, not replaced
    (results / "compare_module.csv").write_text("the user's own table\n")
    before = hashes(tmp_path)
    proc = compare("-gp", str(g), "-mp", str(t), "-o", "results", cwd=tmp_path)
    assert_bad_input(proc, "compare_module.csv", "not what llmflow wrote")
    assert hashes(tmp_path) == before


@pytest.mark.parametrize("out", [".", "./"])
def test_compare_dot_in_the_folder_holding_the_dumps_writes_beside_them(tmp_path, dumps, out):
    """msit's habit: ``-o ./`` where the dumps are sub folders. The tables go at the top, the
    dumps and the user's files stay as they were."""
    work = tmp_path / "dumps"
    user_files(work)
    before = hashes(tmp_path)
    proc = compare("-gp", "g", "-mp", "t", "-o", out, cwd=work)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert (work / "compare_summary.json").is_file() and (work / ".llmflow-outputs.json").is_file()
    assert_kept(before, tmp_path)
    again = compare("-gp", "g", "-mp", "t", "-o", out, cwd=work)  # a rerun replaces its own tables
    assert again.returncode == 0, again.stdout + again.stderr
    assert_kept(before, tmp_path)


def test_compare_dot_and_dotdot_elsewhere_write_beside_the_users_files(tmp_path, dumps):
    g, t = dumps
    here = tmp_path / "a" / "b"
    user_files(here)
    user_files(tmp_path / "a")
    before = hashes(tmp_path)
    for out, where in ((".", here), ("./", here), ("..", tmp_path / "a")):
        proc = compare("-gp", str(g), "-mp", str(t), "-o", out, cwd=here)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "Traceback" not in proc.stderr
        assert (where / "compare_summary.json").is_file()
        assert not [p for p in where.iterdir() if p.name.startswith(".llmflow-staging")]
        assert_kept(before, tmp_path)
    # .. that holds the dumps: written beside them, the dumps untouched
    inside = tmp_path / "dumps" / "sub"
    inside.mkdir()
    before = hashes(tmp_path)
    proc = compare("-gp", str(g), "-mp", str(t), "-o", "..", cwd=inside)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "dumps" / "compare_summary.json").is_file()
    assert_kept(before, tmp_path)


@pytest.mark.parametrize(("out", "says"), [
    ("g", "is the -gp input"), ("t", "is the -mp input"), ("g/rank0", "lies inside the -gp input"),
    ("t/new", "lies inside the -mp input"),
])
def test_compare_output_that_is_or_lies_inside_an_input_is_refused(tmp_path, dumps, out, says):
    work = tmp_path / "dumps"
    before = hashes(tmp_path)
    assert_bad_input(compare("-gp", "g", "-mp", "t", "-o", out, cwd=work), says)
    assert hashes(tmp_path) == before


def test_compare_output_inside_any_dump_is_refused_and_beside_one_is_not(tmp_path, dumps):
    """A dump that is not an input is as much the user's: tables are never written into one (an
    llmflow dump's rank folder, an msit dump, an msprobe rank folder), while a folder beside a dump
    in the folder it was written under (msit's dump_path) is the user's to use."""
    from format_writers import write_msit_dump

    work = tmp_path / "dumps"
    other = as_dump(work, "other")
    one_call = {"model": {"inputs": (torch.ones(2),), "output": torch.ones(2)}}
    msit = write_msit_dump(work / "msit_out", {0: one_call}, timestamp="20250101_000000")
    probe = work / "probe" / "step0" / "rank0"
    probe.mkdir(parents=True)
    (probe / "dump.json").write_text(json.dumps({"task": "statistics", "level": "L1", "data": {}}))
    before = hashes(tmp_path)
    for out, says in ((other / "rank0", f"lies inside the llmflow dump {other}"),
                      (msit / "new", f"lies inside the msit dump {msit}"),
                      (probe, f"is the msprobe dump {probe}")):
        assert_bad_input(compare("-gp", "g", "-mp", "t", "-o", str(out), cwd=work), says)
        assert hashes(tmp_path) == before
    proc = compare("-gp", "g", "-mp", "t", "-o", "msit_out/tables", cwd=work)
    assert proc.returncode == 0, proc.stdout
    assert (work / "msit_out" / "tables" / "compare_summary.json").is_file()


# A metric that is slow from the moment the compare's first table shows in its staging folder:
# the test signals then, and the compare has many slow pairs left whatever the machine's load
# (a metric slow throughout leaves a race: all rows of one chunk come at once, near the end).
SLOW_ALG = """import glob
import time


def slow(golden, target):
    time.sleep(0.5 if glob.glob("out/.llmflow-staging-*/compare_*.csv") else 0.02)
    return 0.0, ''
"""


def _no_process_mentions(text: str, timeout: float = 10) -> list[str]:
    """Command lines of live processes that mention ``text``, after waiting up to ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        found = []
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit() and int(proc.name) != os.getpid():
                try:
                    cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    zombie = "\nState:\tZ" in (proc / "status").read_text()
                except OSError:
                    continue
                if text in cmd and not zombie:
                    found.append(cmd)
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def _popen(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "llmflow.cli", *args], cwd=cwd,
                            env={**os.environ, **(env or {}), "PYTHONPATH": checkout_path(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(check, what: str, proc: subprocess.Popen | None, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: llmflow ended first: {proc.communicate()}")
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_sigterm_to_compare_removes_its_temporaries_and_keeps_the_old_tables(tmp_path):
    steps = range(20)  # five chunks of pairs: the later ones run after the first table is written
    g, t = as_dump(tmp_path / "dumps", "g", steps), as_dump(tmp_path / "dumps", "t", steps, noise=1e-3)
    out = tmp_path / "out"
    user_files(out)
    assert compare("-gp", str(g), "-mp", str(t), "-o", str(out), cwd=tmp_path).returncode == 0
    before = hashes(tmp_path)
    (tmp_path / "slow.py").write_text(SLOW_ALG)
    proc = _popen("compare", "-gp", str(g), "-mp", str(t), "-o", str(out), "-alg", "slow.py:slow",
                  "--workers", "2", cwd=tmp_path)
    _wait_for(lambda: list(out.glob(".llmflow-staging-*/compare_*.csv")), "the compare never started writing",
              proc)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, (stdout, stderr)
    assert stdout.strip().splitlines()[-1] == "FAILED: terminated (SIGTERM)" and "Traceback" not in stderr
    assert hashes(tmp_path, skip=("slow.py",)) == {k: v for k, v in before.items()}
    assert _no_process_mentions(str(g)) == []


# -- --run-dir -----------------------------------------------------------------------------------

ECHO = """
    name: echo
    stages:
      a: {uses: "{HELPERS}:EchoStage", with: {value: 1}}
      b: {uses: "{HELPERS}:EchoStage", needs: [a], with: {value: 2}}
"""


@pytest.mark.parametrize("where", ["folder", "."])
def test_a_folder_of_the_users_files_is_not_taken_as_a_run_dir(tmp_path, where):
    wf = write_workflow(tmp_path / "wf", ECHO)
    home = tmp_path / "home"
    user_files(home)
    for name in (".tmp", "a"):  # named like llmflow's own entries
        (home / name).mkdir()
        (home / name / "keep.txt").write_text(name)
    before = hashes(tmp_path)
    rd = str(home) if where == "folder" else "."
    proc = llmflow("run", str(wf), "--run-dir", rd, cwd=home)
    assert_bad_input(proc, "is not an llmflow run dir", "--adopt-run-dir")
    assert hashes(tmp_path) == before
    proc = llmflow("run", str(wf), "--run-dir", rd, "--adopt-run-dir", cwd=home)
    assert_bad_input(proc, "is in the way")  # .tmp: llmflow's name, the user's folder
    assert hashes(tmp_path) == before


def test_an_adopted_folder_keeps_the_users_files(tmp_path):
    wf = write_workflow(tmp_path / "wf", ECHO)
    home = tmp_path / "home"
    user_files(home)
    before = hashes(tmp_path)
    proc = llmflow("run", str(wf), "--run-dir", str(home), "--adopt-run-dir")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_kept(before, tmp_path)
    assert (home / ".llmflow-run-dir").is_file() and (home / "b" / "value.json").is_file()
    # marked now: a rerun needs no flag; a user's folder at a stage's name is refused, not replaced
    assert llmflow("run", str(wf), "--run-dir", str(home), "--force").returncode == 0
    shutil.rmtree(home / "b")
    (home / "b").mkdir()
    (home / "b" / "mine.txt").write_text("mine")
    before = hashes(tmp_path)
    assert_bad_input(llmflow("run", str(wf), "--run-dir", str(home)), "b is not a stage folder llmflow wrote")
    assert hashes(tmp_path) == before


def test_empty_folders_and_run_dirs_of_earlier_versions_are_run_dirs(tmp_path):
    wf = write_workflow(tmp_path / "wf", ECHO)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert llmflow("run", str(wf), "--run-dir", str(empty)).returncode == 0
    (empty / ".llmflow-run-dir").unlink()  # as an llmflow without the mark left it
    proc = llmflow("run", str(wf), "--run-dir", str(empty))
    assert proc.returncode == 0 and proc.stdout.strip().endswith("PASSED (2 cached)"), proc.stdout
    assert (empty / ".llmflow-run-dir").is_file()


# -- SIGTERM and kill -9 during a dump ---------------------------------------------------------

HOLD_PATCH = '''
import os
import time
from pathlib import Path


def hold_mid_dump(model):
    """At the second forward, wait while $HOLD_FILE exists (so a test can signal mid-dump)."""
    calls = []

    def hook(module, args):
        calls.append(1)
        hold = os.environ.get("HOLD_FILE")
        if len(calls) == 2 and hold and os.path.exists(hold):
            Path(hold + ".reached").write_text(str(os.getpid()))
            while os.path.exists(hold):
                time.sleep(0.05)

    model.register_forward_pre_hook(hook)
'''


def _dump_workflow(tmp_path: Path, dump_dir: str | None = None) -> Path:
    """A seed stage and a dump stage (held mid-dump where $HOLD_FILE exists), in ``tmp_path``; its
    dump goes to the stage's own folder, or to ``dump_dir`` (relative to ``tmp_path``) if given."""
    (tmp_path / "hold.py").write_text(HOLD_PATCH)
    dump = {"model": TINY, "prompt": "hello there", "max_new_tokens": 4, "patch": "hold.py:hold_mid_dump",
            "seed_settings": "${stages.seed.outputs.settings}"}
    if dump_dir is not None:
        dump["dump_dir"] = dump_dir
    wf = tmp_path / "wf.yaml"
    wf.write_text(json.dumps({"name": "dump-term", "stages": {
        "seed": {"uses": "seed", "with": {"seed": 7}},
        "dump": {"uses": "dump", "needs": ["seed"], "with": dump},
    }}))
    return wf


def _gone(pid: int) -> bool:
    """No process ``pid``, or only its zombie (dead, waiting for its parent to read its status)."""
    try:
        return "\nState:\tZ" in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True


def _same_dump(a: Path, b: Path) -> None:
    ra, rb = LlmflowDumpReader(a), LlmflowDumpReader(b)
    ea, eb = ra.entries(), rb.entries()
    assert [(e.step, e.name, e.kind, e.index, e.shape) for e in ea] == \
        [(e.step, e.name, e.kind, e.index, e.shape) for e in eb]
    for x, y in zip(ea, eb, strict=True):
        if x.has_data:
            assert torch.equal(ra.load(x), rb.load(y)), x.name


@pytest.fixture(scope="module")
def first_dump(tmp_path_factory) -> tuple[Path, Path]:
    """The dump workflow run once, uninterrupted, with ``--run-dir run`` and its dump into
    ``mydump``, a new folder beside it: the folder it ran in (for the one test that dumps there
    again), and a copy of its dump (what a rerun after a signal must dump; where a dump is written
    changes none of its entries or tensors)."""
    tmp = tmp_path_factory.mktemp("first")
    wf = _dump_workflow(tmp, "mydump")
    first = llmflow("run", str(wf), "--run-dir", "run", cwd=tmp)
    assert first.returncode == 0, first.stdout + first.stderr
    reference = tmp_path_factory.mktemp("reference") / "dump"
    shutil.copytree(tmp / "mydump", reference, symlinks=True)
    return tmp, reference


@pytest.fixture(scope="module")
def reference_dump(first_dump) -> Path:
    """What the dump workflow dumps, run uninterrupted: what a rerun after a signal must dump."""
    return first_dump[1]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_signal_mid_dump_stops_the_worker_too_and_a_rerun_dumps_the_same(tmp_path, sig, reference_dump):
    wf = _dump_workflow(tmp_path)
    rd = tmp_path / "run"
    hold = tmp_path / "hold"
    hold.write_text("")
    proc = _popen("run", str(wf), "--run-dir", str(rd), cwd=tmp_path, env={"HOLD_FILE": str(hold)})
    _wait_for(lambda: Path(str(hold) + ".reached").exists(), "the dump never reached its second step", proc)
    worker = int(Path(str(hold) + ".reached").read_text())
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=60)
    if sig == signal.SIGTERM:
        assert proc.returncode == 143, (stdout, stderr)
        assert stdout.strip().splitlines()[-1] == "FAILED: terminated (SIGTERM)" and "Traceback" not in stderr
        summary = json.loads((rd / "summary.json").read_text())
        assert summary["status"] == "failed" and summary["stages"]["dump"]["error"] == "interrupted"
    else:
        assert proc.returncode == -signal.SIGKILL
    assert _no_process_mentions(str(rd)) == [], "a dump worker outlived llmflow"
    # the kernel delivers the parent-death signal as the parent exits: under load the worker may
    # take a moment to be gone
    _wait_for(lambda: _gone(worker), f"the dump worker {worker} outlived llmflow", None, timeout=20)
    hold.unlink()
    rerun = llmflow("run", str(wf), "--run-dir", str(rd), cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    _same_dump(rd / "dump" / "dump", reference_dump)


# -- a dump into a folder that holds an earlier dump ---------------------------------------------

def _redump_workflow(tmp_path: Path) -> Path:
    """A workflow whose dump stage writes into ``mydump`` beside it (the stage's dump_dir)."""
    return _dump_workflow(tmp_path, "mydump")


def test_a_new_dump_replaces_the_old_one_and_keeps_the_users_files_beside_it(first_dump):
    # the fixture ran the workflow once (exit 0), its dump into mydump, a new folder then
    work = first_dump[0]
    wf = work / "wf.yaml"
    dump = work / "mydump"
    old_files = {p.relative_to(dump) for p in (dump / "rank0").rglob("*")}
    # the user's notes next to the earlier dump, inside its rank folder and its data folder
    (dump / "rank0" / "notes.txt").write_text("this dump was taken on the NPU\n")
    user_files(dump / "rank0" / "data")
    before = {k: v for k, v in hashes(dump).items() if "notes" in k or "sub" in k or "hidden" in k}
    rerun = llmflow("run", str(wf), "--run-dir", "run", "--force", cwd=work)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert_kept(before, dump)
    assert {p.relative_to(dump) for p in (dump / "rank0").rglob("*")} == old_files | {Path(k) for k in before}
    reader = LlmflowDumpReader(dump)
    assert reader.meta()["complete"] and reader.problems() == []
    assert reader.steps() == [0, 1, 2, 3]


def test_a_dump_refuses_a_rank_folder_that_is_a_link_and_leaves_its_target_alone(tmp_path):
    wf = _redump_workflow(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    user_files(elsewhere)
    before = hashes(elsewhere)
    (tmp_path / "mydump").mkdir()
    (tmp_path / "mydump" / "rank0").symlink_to(elsewhere)
    proc = llmflow("run", str(wf), "--run-dir", "run", cwd=tmp_path)
    assert_bad_input(proc, "mydump/rank0", "symbolic link")
    assert hashes(elsewhere) == before


def test_a_dump_refuses_a_rank_folder_with_a_dumps_file_names_no_llmflow_dump_wrote(tmp_path):
    """Files named as a dump names its own (another tool's ``rank0/index.jsonl``, a data file)
    in a folder without llmflow's manifest: bad input naming one, every file kept as it was."""
    wf = _redump_workflow(tmp_path)
    rank = tmp_path / "mydump" / "rank0"
    (rank / "data").mkdir(parents=True)
    (rank / "index.jsonl").write_text('{"their": "index"}\n')
    (rank / "data" / "000001.safetensors").write_bytes(b"their bytes")
    before = hashes(tmp_path / "mydump")
    proc = llmflow("run", str(wf), "--run-dir", "run", cwd=tmp_path)
    assert_bad_input(proc, "mydump/rank0", "not written by an llmflow dump")
    assert hashes(tmp_path / "mydump") == before


# -- a full disk ---------------------------------------------------------------------------------

@pytest.fixture
def tiny_disk(tmp_path: Path):
    """A 96 KiB tmpfs (root only; the 0.2 MB dump below does not fit); yields it and a function
    that gives it room (64 MiB)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(mnt)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill (needs root): {done.stderr.strip()}")

    def grow() -> None:
        subprocess.run(["mount", "-o", "remount,size=64m", str(mnt)], check=True)

    try:
        yield mnt, grow
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_run_on_a_full_disk_fails_cleanly_and_a_rerun_with_room_completes(tmp_path, tiny_disk):
    mnt, grow = tiny_disk
    wf = tmp_path / "wf.yaml"
    wf.write_text(json.dumps({"name": "full", "stages": {
        "dump": {"uses": "dump", "with": {"model": TINY, "prompt": "hello there", "max_new_tokens": 8,
                                          "mode": "all"}},
    }}))
    rd = mnt / "run"
    proc = llmflow("run", str(wf), "--run-dir", str(rd), cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("FAILED: ") and sum(line.startswith("FAILED") for line in lines) == 1, lines
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "No space left on device" in proc.stdout
    summary = json.loads((rd / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["stages"]["dump"]["status"] == "failed"
    grow()
    rerun = llmflow("run", str(wf), "--run-dir", str(rd), cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert json.loads((rd / "summary.json").read_text())["status"] == "passed"
    assert LlmflowDumpReader(rd / "dump" / "dump").meta()["complete"]


# -- other paths a user gives ------------------------------------------------------------------

@pytest.mark.parametrize(("args", "says"), [
    (["-o", "adir"], "-o adir: is a directory"),
    (["--check", "-o", "adir"], "-o adir: is a directory"),
    (["-o", "afile/x.json"], "-o afile/x.json: afile is a file, not a directory"),
    (["-o", "/proc/llmflow.json"], "-o /proc/llmflow.json: cannot write it"),
    (["-o", "/dev/null"], "-o /dev/null: not a regular file"),
])
def test_schema_output_that_cannot_be_written_is_one_line(tmp_path, monkeypatch, capsys, args, says):
    from llmflow.cli import main
    from llmflow.workflow import schema

    monkeypatch.setattr(schema, "generate", lambda: "{}\n")  # the schema itself is not under test
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("the user's")
    before = hashes(tmp_path)
    assert main(["schema", *args]) == 2
    out, err = capsys.readouterr()
    assert err.strip() == f"error: {says}" or err.startswith(f"error: {says}"), err
    assert len(err.strip().splitlines()) == 1 and out.strip().splitlines()[-1].startswith(f"FAILED: {says}")
    assert hashes(tmp_path) == before


def test_schema_output_is_replaced_whole(tmp_path, monkeypatch, capsys):
    from llmflow.cli import main
    from llmflow.workflow import schema

    monkeypatch.setattr(schema, "generate", lambda: '{"title": "new"}\n')
    (tmp_path / "s.json").write_text('{"title": "new", "an older copy": true}')
    assert main(["schema", "-o", str(tmp_path / "s.json")]) == 0
    assert (tmp_path / "s.json").read_text() == '{"title": "new"}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["s.json"]


@pytest.mark.parametrize(("kind", "mine"), [("workflow", '{"mine": 1}'), ("summary", "notes\n"),
                                            ("verdict", None)])
def test_schema_output_never_replaces_a_file_that_is_not_that_schema(tmp_path, monkeypatch, capsys, kind,
                                                                     mine):
    """A file of the user's at -o (or another kind of schema) is refused in one line and kept."""
    from llmflow.cli import main

    monkeypatch.chdir(tmp_path)
    if mine is None:  # the workflow schema where the verdict schema is asked for
        assert main(["schema", "-o", "s.json"]) == 0
        mine = (tmp_path / "s.json").read_text()
    else:
        (tmp_path / "s.json").write_text(mine)
    capsys.readouterr()
    assert main(["schema", "--kind", kind, "-o", "s.json"]) == 2
    out, err = capsys.readouterr()
    assert err.strip() == (f"error: -o s.json: exists and is not an llmflow {kind} schema; refusing to "
                           "replace it (give a new file name)")
    assert out.strip().splitlines()[-1].startswith("FAILED: -o s.json")
    assert (tmp_path / "s.json").read_text() == mine


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found |= {int(c) for c in (task / "children").read_text().split()}
        except OSError:
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


POOLED_COMPARE = """
import sys
from llmflow.compare import engine
from llmflow.cli import main

if __name__ == "__main__":
    engine.POOL_START_SECONDS, engine.CHUNK_PAIRS = 0, 2  # a pool of processes even for a small compare
    sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads child processes from /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_signalled_compare_takes_its_pool_workers_along(tmp_path, dumps, sig):
    g, t = dumps
    (tmp_path / "slow.py").write_text(SLOW_ALG)
    (tmp_path / "pooled.py").write_text(POOLED_COMPARE)
    out = tmp_path / "out"
    args = ["compare", "-gp", str(g), "-mp", str(t), "-o", str(out), "-alg", "slow.py:slow", "--workers", "2"]
    proc = subprocess.Popen([sys.executable, "pooled.py", *args], cwd=tmp_path, text=True,
                            env={**os.environ, "PYTHONPATH": checkout_path(REPO)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    _wait_for(lambda: len(_children(proc.pid)) >= 2 and list(out.glob(".llmflow-staging-*/compare_*.csv")),
              "the pool never started", proc)
    workers = _children(proc.pid)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == (143 if sig == signal.SIGTERM else -signal.SIGKILL), (stdout, stderr)
    deadline = time.monotonic() + 10
    while any(map(_alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, workers)), "a compare worker outlived llmflow"
    if sig == signal.SIGTERM:
        assert "Traceback" not in stderr and not out.exists()  # its own folder, empty: removed
