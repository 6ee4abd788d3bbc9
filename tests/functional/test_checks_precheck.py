"""`llmflow precheck` and `llmflow run api_precheck` as a user runs them, on tiny Llama and Qwen2
models: a clean bf16 target has no failing call; one wrong fused kernel (a lossy silu, an rms_norm
ignoring eps, a linear accumulating in bf16, an fp16 softmax without max-subtraction) is named
with its module and its repro script reproduces the
error in a fresh interpreter; a registered reference for a custom op is used; perturbation flags
an overflow-prone softmax and not the clean model; bad input exits 2, too little evidence 3."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
FAULTS = TESTS / "precheck_faults.py"
SMALL = "layers=2,hidden=32,heads=4,kv_heads=2,intermediate=64"
LLAMA, QWEN2 = f"tiny-llama:{SMALL}", f"tiny-qwen2:{SMALL}"


def llmflow(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmflow.cli", *args], capture_output=True, text=True,
                          timeout=600, cwd=cwd)


def run_workflow(tmp: Path, model: str, *sets: str, dtype: str = "bfloat16") -> subprocess.CompletedProcess:
    args = ["run", "api_precheck", "--run-dir", str(tmp / "run"), "--progress", "plain",
            "--set", f"model={model}", "--set", f"dtype={dtype}"]
    for s in sets:
        args += ["--set", s]
    return llmflow(*args, cwd=tmp)


def last_line(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout.strip().splitlines()[-1]


def report(out: Path) -> dict:
    return json.loads((out / "precheck.json").read_text())


@pytest.mark.parametrize("model", [LLAMA, QWEN2])
def test_clean_bf16_target_passes(tmp_path, model):
    proc = run_workflow(tmp_path, model, "perturb=true")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert last_line(proc).startswith("PASSED")
    s = json.loads((tmp_path / "run" / "summary.json").read_text())["precheck"]
    assert s["status"] == "pass" and s["totals"]["fail"] == 0 and s["first_fail"] is None
    assert s["totals"]["checked"] > 0.9 * s["totals"]["calls"]  # linears too: the weights are dumped
    assert s["perturbed"] == []  # the clean model has no ill-conditioned call
    html = (tmp_path / "run" / "report" / "report.html").read_text()
    assert "Precheck: PASS: " in html and "Precheck: calls per API" in html
    assert 'href="../precheck/precheck.csv"' in html


def test_a_mixture_of_experts_grouped_matmul_is_checked(tmp_path):
    """transformers computes a MoE layer's experts in one grouped matmul (``torch._grouped_mm``,
    which has no float64 kernel): the built-in reference, a matmul per group, checks each call."""
    proc = run_workflow(tmp_path, f"tiny-mixtral:{SMALL}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert last_line(proc).startswith("PASSED")
    rows = list(csv.DictReader((tmp_path / "run" / "precheck" / "precheck.csv").open(newline="")))
    grouped = [r for r in rows if r["api"].lstrip("_") == "grouped_mm"]
    assert len(grouped) == 4 and all(r["status"] == "pass" for r in grouped), grouped  # 2 layers x 2


# (patch in precheck_faults.py, model options beside SMALL, the call it names, that call's module)
WRONG_KERNELS = {
    "lossy_silu": ("", "model.layers.1.mlp.act_fn/silu.0", "model.layers.1.mlp.act_fn"),
    # eps matters only where mean(x^2) is near it: weights and embeddings of std 0.002
    "rms_norm_without_eps": (",init=0.002", "model.layers.1.input_layernorm/rms_norm.0",
                             "model.layers.1.input_layernorm"),
    "bf16_accumulating_linear": ("", "model.layers.1.mlp.down_proj/linear.0", "model.layers.1.mlp.down_proj"),
}


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("fault", list(WRONG_KERNELS))
def test_one_wrong_kernel_is_named_and_its_repro_reproduces(tmp_path, family, fault):
    options, name, module = WRONG_KERNELS[fault]
    proc = run_workflow(tmp_path, f"{family}:{SMALL}{options}", f"patch={FAULTS}:{fault}")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert name in last_line(proc)
    s = json.loads((tmp_path / "run" / "summary.json").read_text())["precheck"]
    assert s["totals"]["fail"] == 1  # exactly that call: the same op elsewhere and everything else pass
    assert (s["first_fail"]["name"], s["first_fail"]["module"]) == (name, module)
    html = (tmp_path / "run" / "report" / "report.html").read_text()
    assert "Precheck: FAIL: 1 of " in html and f"first {name} (step 0)" in html
    script = tmp_path / "run" / "precheck" / s["repros"][0]["script"]
    fresh = subprocess.run([sys.executable, "-I", str(script)], capture_output=True, text=True, timeout=120,
                           cwd=tmp_path, env={"PATH": "/usr/bin:/bin"})
    assert fresh.returncode == 1, fresh.stdout + fresh.stderr
    assert "REPRODUCED" in fresh.stdout and "llmflow" not in script.read_text()


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[str, Path]:
    """fp16 Llama API dumps: the overflow-prone softmax through the naive kernel and through
    torch's, a custom norm kernel, and a statistics-only dump."""
    sys.path.insert(0, str(TESTS))
    import precheck_faults as pf
    from checks_helpers import real_dump

    tmp = tmp_path_factory.mktemp("precheck")
    out = {}
    for name, patch in (("naive", pf.naive_softmax), ("shifted", pf.shifted_softmax),
                        ("norm", pf.custom_norm), ("ops", pf.ops_softmax)):
        out[name] = real_dump(tmp, dtype="float16", patch=patch, mode="api", new_tokens=1,
                              dump_weight=True, name=name)
    out["stats"] = real_dump(tmp, dtype="bfloat16", mode="api", new_tokens=1, data_mode="statistics",
                             name="stats")
    return out


@pytest.fixture(scope="module")
def naive_checked(dumps, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, Path]:
    """``llmflow precheck`` of the naive-softmax dump with ``--repro``, run once for the tests that
    read it, into an existing folder holding a file of the user's (notes.txt): that folder, the
    finished process, and a copy of the folder as the precheck left it (a copy keeps each file's
    size and mtime, all llmflow's list of its outputs records)."""
    tmp = tmp_path_factory.mktemp("naive_checked")
    out = tmp / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    proc = llmflow("precheck", str(dumps["naive"]), "-o", str(out), "--repro", cwd=tmp)
    shutil.copytree(out, tmp / "as_written", symlinks=True)
    return out, proc, tmp / "as_written"


def test_fp16_softmax_without_max_subtraction_fails_and_reproduces(tmp_path, naive_checked):
    out, proc, _ = naive_checked
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert last_line(proc).startswith("FAILED: 1 of ")
    r = report(out)
    assert r["first_fail"]["name"] == "model.layers.1.self_attn/softmax.0"
    assert r["first_fail"]["module"] == "model.layers.1.self_attn" and "NaN/Inf" in r["first_fail"]["reason"]
    script = out / r["repros"][0]["script"]
    fresh = subprocess.run([sys.executable, "-I", str(script)], capture_output=True, text=True, timeout=120,
                           cwd=tmp_path)
    assert fresh.returncode == 1 and "REPRODUCED" in fresh.stdout, fresh.stdout + fresh.stderr


def test_a_call_name_from_a_hostile_dump_stays_text_in_its_repro_script(tmp_path, dumps):
    """The repro script's docstring names the call; a name that closes the docstring must not make
    the rest of it code the user runs."""
    dump = tmp_path / "dump"
    shutil.copytree(dumps["naive"], dump)
    payload = '"""; import pathlib; pathlib.Path("pwned").write_text("x"); """\\'
    index = dump / "rank0" / "index.jsonl"
    lines = []
    for line in index.read_text().splitlines():
        record = json.loads(line)
        for row in record["rows"]:
            row[1] = row[1].replace("model.layers.1.self_attn/softmax.0", f"{payload}/softmax.0")
        lines.append(json.dumps(record))
    index.write_text("\n".join(lines) + "\n")
    proc = llmflow("precheck", str(dump), "-o", str(tmp_path / "out"), "--repro", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    r = report(tmp_path / "out")
    assert r["repros"][0]["name"] == f"{payload}/softmax.0"
    fresh = subprocess.run([sys.executable, "-I", str(tmp_path / "out" / r["repros"][0]["script"])],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert fresh.returncode == 1 and "REPRODUCED" in fresh.stdout, fresh.stdout + fresh.stderr
    assert not (tmp_path / "pwned").exists()


def test_an_op_that_overflows_its_dtype_is_a_warning_named_in_the_last_line(tmp_path, dumps):
    """exp of inputs past float16's range gives Inf in the dump and in the float16 benchmark alike
    (faithful to the dtype, so no fail), where float64 is finite: a warning, named, never silent."""
    proc = llmflow("precheck", str(dumps["ops"]), "-o", str(tmp_path / "out"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    with open(tmp_path / "out" / "precheck.csv", newline="", encoding="utf-8") as fh:
        rows = [r for r in csv.DictReader(fh) if r["api"] == "exp"]
    assert rows and all(r["status"] == "warn" and "float16 overflows here" in r["reason"] for r in rows), rows
    last = last_line(proc)
    assert last.startswith("PASSED") and "model.layers.1.self_attn/exp.0" in last, last
    assert "overflows float16" in last, last


def test_perturbation_flags_the_overflow_prone_softmax(tmp_path, dumps):
    proc = llmflow("precheck", str(dumps["shifted"]), "-o", str(tmp_path / "out"), "--perturb", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]  # the kernel is correct
    assert report(tmp_path / "out")["perturbed"] == ["model.layers.1.self_attn/softmax.0"]
    assert "perturbation flags 1 ill-conditioned calls" in last_line(proc)


def test_a_registered_reference_checks_a_custom_op(tmp_path, dumps):
    bare = llmflow("precheck", str(dumps["norm"]), "-o", str(tmp_path / "bare"), cwd=tmp_path)
    assert report(tmp_path / "bare")["counts"]["my_rms_norm"] == {"not checked": 5}, bare.stdout[-2000:]
    proc = llmflow("precheck", str(dumps["norm"]), "-o", str(tmp_path / "out"), "--reference",
                   f"my_rms_norm={FAULTS}:my_rms_norm_reference", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert report(tmp_path / "out")["counts"]["my_rms_norm"] == {"pass": 5}
    csv_text = (tmp_path / "out" / "precheck.csv").read_text()
    assert "my_rms_norm.0" in csv_text and ",reference," in csv_text


@pytest.mark.parametrize("which", [0, -1], ids=["first-data-file", "last-data-file"])
def test_a_damaged_dump_is_never_passed(tmp_path, dumps, which):
    """A copy cut short (its weights' file or a step's): the calls it still holds may all pass,
    the verdict may not."""
    dump = tmp_path / "copy"
    shutil.copytree(dumps["shifted"], dump)
    data = sorted(dump.rglob("data/*.safetensors"))[which]
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    proc = llmflow("precheck", str(dump), "-o", str(tmp_path / "out"), cwd=tmp_path)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert last_line(proc).startswith("INCONCLUSIVE: ")
    assert f"the dump cannot be trusted whole: {data}: truncated" in last_line(proc)
    assert proc.stdout.strip().splitlines()[-2].startswith("next: dump the target again")
    assert report(tmp_path / "out")["status"] == "inconclusive"


def test_statistics_only_dump_is_inconclusive(tmp_path, dumps):
    proc = llmflow("precheck", str(dumps["stats"]), "-o", str(tmp_path / "out"), cwd=tmp_path)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert last_line(proc).startswith("INCONCLUSIVE: only 0 of ") and "statistics only" in last_line(proc)
    assert proc.stdout.strip().splitlines()[-2].startswith(
        "next: dump the target with DumpConfig(mode='api', data_mode='tensor', dump_weight=True)")


@pytest.mark.parametrize("args", [["/nonexistent/dump"], ["{dump}", "--reference", "no_equals_sign"],
                                  ["{dump}", "--reference", "x=missing.py:f"]])
def test_bad_input_is_one_line_and_exit_2(tmp_path, dumps, args):
    args = [a.format(dump=dumps["stats"]) for a in args]
    proc = llmflow("precheck", *args, cwd=tmp_path)
    assert proc.returncode == 2 and last_line(proc).startswith("FAILED: ")
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_o_writes_beside_the_users_files_and_refuses_to_replace_them(tmp_path, dumps, naive_checked):
    # the first precheck, with --repro, into a folder holding the user's notes.txt (the fixture's)
    first_out, first, as_written = naive_checked
    assert first.returncode == 1, first.stdout[-3000:] + first.stderr[-2000:]
    assert (as_written / "repro").is_dir() and f"tables: {first_out / 'precheck.csv'}" in first.stdout
    assert (as_written / "notes.txt").read_text() == "mine"
    out = tmp_path / "out"
    shutil.copytree(as_written, out, symlinks=True)
    # a rerun replaces its own outputs (the repro folder it no longer writes goes), keeps the user's
    again = llmflow("precheck", str(dumps["naive"]), "-o", str(out), cwd=tmp_path)
    assert again.returncode == 1, again.stdout[-3000:] + again.stderr[-2000:]
    assert not (out / "repro").exists() and (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in out.iterdir()) == [".llmflow-outputs.json", "notes.txt", "precheck.csv",
                                                    "precheck.json", "precheck.xlsx"]
    # the user's own precheck.csv or repro folder, -o inside the dump or at a file: refused, untouched
    theirs = tmp_path / "theirs"
    (theirs / "repro").mkdir(parents=True)
    (theirs / "repro" / "case.py").write_text("mine")
    (tmp_path / "file").write_text("mine")
    for where, why in ((theirs, "repro is not what llmflow wrote there"),
                       (dumps["naive"] / "out", "lies inside the dump input"),
                       (tmp_path / "file", "exists and is not a directory")):
        proc = llmflow("precheck", str(dumps["naive"]), "-o", str(where), "--repro", cwd=tmp_path)
        assert proc.returncode == 2 and why in proc.stderr, proc.stdout[-2000:] + proc.stderr
        assert "Traceback" not in proc.stderr and last_line(proc).startswith("FAILED: -o ")
    assert (theirs / "repro" / "case.py").read_text() == "mine" and (tmp_path / "file").read_text() == "mine"
    assert sorted(p.name for p in theirs.iterdir()) == ["repro"] and not (dumps["naive"] / "out").exists()
    # a file the user added to llmflow's repro folder makes it the user's: refused too (the folder
    # as the --repro precheck wrote it)
    shutil.rmtree(out)
    shutil.copytree(as_written, out, symlinks=True)
    (next((out / "repro").iterdir()) / "my_variant.py").write_text("mine")
    proc = llmflow("precheck", str(dumps["naive"]), "-o", str(out), cwd=tmp_path)
    assert proc.returncode == 2 and "repro is not what llmflow wrote there" in proc.stderr
    assert list((out / "repro").glob("*/my_variant.py"))


def test_repro_on_request_for_any_call(tmp_path, dumps):
    wanted = "model.layers.0.self_attn/softmax.0"  # a passing call
    proc = llmflow("precheck", str(dumps["shifted"]), "-o", str(tmp_path / "out"), "--repro-call", wanted,
                   "--repro-call", "model.nowhere/softmax.0", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    r = report(tmp_path / "out")
    assert [(x["name"], x["status"]) for x in r["repros"]] == [(wanted, "pass")]
    assert r["repros_missing"] == [{"name": "model.nowhere/softmax.0",
                                    "why": "no call of this name or record in the dump"}]
    assert "no repro for model.nowhere/softmax.0" in proc.stdout
    fresh = subprocess.run([sys.executable, "-I", str(tmp_path / "out" / r["repros"][0]["script"])],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert fresh.returncode == 0 and "NOT REPRODUCED" in fresh.stdout, fresh.stdout + fresh.stderr


def test_repro_for_all_calls_is_bounded(tmp_path, dumps):
    from llmflow.checks.precheck_files import MAX_REPROS

    proc = llmflow("precheck", str(dumps["shifted"]), "-o", str(tmp_path / "out"), "--repro-call", "all",
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    r = report(tmp_path / "out")
    assert len(r["repros"]) == MAX_REPROS and r["repros_left_out"] == r["totals"]["calls"] - MAX_REPROS
    assert len(list((tmp_path / "out" / "repro").iterdir())) == MAX_REPROS
    assert f"... {MAX_REPROS - 10} more repro folders" in proc.stdout


class _Marker:
    """Unpickled, it would create the file ``path`` (open(path, "w"))."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


@pytest.mark.parametrize("api", ["save", "load"])
def test_a_dump_cannot_make_the_precheck_call_what_is_not_a_tensor_op(tmp_path, dumps, api):
    """A dump from another machine names a call ``save`` (with a path of the user's) or ``load``
    (of a pickle it ships, weights_only=False): the precheck calls neither, lists the call as not
    checked, and every file stays as it was."""
    import pickle

    dump = tmp_path / "dump"
    shutil.copytree(dumps["shifted"], dump)
    victim, marker = tmp_path / "notes.txt", tmp_path / "unpickled"
    victim.write_text("my notes\n")
    shipped = dump / "rank0" / "data" / "notes.bin"
    shipped.write_bytes(pickle.dumps(_Marker(str(marker))))
    index = dump / "rank0" / "index.jsonl"
    lines, renamed = [], 0
    for line in index.read_text().splitlines():
        record = json.loads(line)
        for row in record["rows"]:
            if "/silu.0" not in row[1]:
                continue
            row[1], row[8] = row[1].replace("/silu.0", f"/{api}.0"), api
            renamed += 1
            if api == "save" and row[3] == "kw:inplace":  # torch.save(tensor, path)
                row[3], row[11], row[12] = "1", str(victim), "str"
            elif api == "load" and row[2] == "input" and row[3] == "0":  # load(path, weights_only=False)
                row[6], row[7], row[10] = None, None, False
                row[11], row[12], row[13] = str(shipped), "str", ""
            elif api == "load" and row[3] == "kw:inplace":
                row[3], row[11], row[12] = "kw:weights_only", False, "bool"
        lines.append(json.dumps(record))
    index.write_text("\n".join(lines) + "\n")
    assert renamed
    proc = llmflow("precheck", str(dump), "-o", str(tmp_path / "out"), cwd=tmp_path)
    assert not marker.exists() and victim.read_text() == "my notes\n"
    assert proc.returncode in (0, 3), proc.stdout[-2000:]
    table = (tmp_path / "out" / "precheck.csv").read_text()
    refused = [ln for ln in table.splitlines() if f"/{api}.0," in ln]
    assert len(refused) == 2 and all(f"torch.{api} is not a tensor op" in ln for ln in refused)
