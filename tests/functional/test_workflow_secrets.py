"""No secret value reaches a file of the run dir, run as a user runs it (``llmflow run`` in a
subprocess): secret-named environment variables (env.json), the same given to stages through
``${env.X}`` (state files, summary.json, the generation file, env.json, the env-check and HTML
reports), and credentials inside URLs. The stages still get the real values, and the cache still
sees a changed one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from path_helpers import checkout_path

from llmflow.models import encode_prompt, load_model

REPO = Path(__file__).resolve().parents[2]
TINY = "tiny-llama:layers=2,hidden=32,heads=4,kv_heads=2,intermediate=64"

#: recorded in env.json by prefix, and redacted there by name
BY_NAME = {"ASCEND_PIN": "pin-90210", "ATB_AUTH": "atb-auth-value", "HCCL_PASS": "hccl-pass-value",
           "TORCH_HUB_TOKEN": "hub-token-value", "ASCEND_LICENSE": "lic-value", "ATB_CERT": "cert-value",
           "ASCEND_PRIVATE_KEY": "pk-value", "HCCL_SESSION": "session-value", "ATB_COOKIE": "cookie-value",
           "ASCEND_PASSPHRASE": "passphrase-value", "ATB_Mixed_Pwd": "mixed-pwd-value"}
#: given to stages through ${env.X}; none carries a recorded prefix (only the reference redacts it).
#: Every value holds a letter outside hex: a bare number could turn up by chance in a hash or an mtime.
BY_REFERENCE = {"HF_TOKEN": "hf_reference_secret", "MY_PIN": "pin-4721",
                "SECRET_PROMPT": "the vault code is 5ab7"}
URL_PASSWORD = "url-pw-3141"
EVERY_VALUE = [*BY_NAME.values(), *BY_REFERENCE.values(), URL_PASSWORD]

ECHO_STAGE = '''
from llmflow.stages.base import Stage


class Login(Stage):
    """Stands for a stage that needs a token: echoes what it was given as outputs."""

    type = "login"
    params_schema = {"type": "object", "additionalProperties": False,
                     "properties": {"token": {"type": "string"}, "flags": {"type": "string"}}}
    outputs = {"token": "the token", "flags": "the flags"}

    def run(self, ctx):
        ctx.summary["login"] = {"used": ctx.params["token"]}
        return dict(ctx.params)
'''


def workflow(tmp: Path) -> Path:
    (tmp / "login.py").write_text(ECHO_STAGE)
    wf = tmp / "wf.yaml"
    wf.write_text(json.dumps({"name": "secrets", "params": {"mirror": {"type": "string", "default": ""}},
                              "stages": {
        "login": {"uses": "login.py:Login", "with": {
            "token": "${env.HF_TOKEN}", "flags": "--pin=${env.MY_PIN} --mirror=${params.mirror}"}},
        "dump": {"uses": "dump", "with": {
            "model": TINY, "prompt": "${env.SECRET_PROMPT}", "max_new_tokens": 2, "token_range": [0]}},
        "env-check": {"uses": "env-check", "needs": ["dump"],
                      "with": {"golden": "${stages.dump.outputs.dump_dir}", "target": "live"}},
        "report": {"uses": "report", "needs": ["dump"],
                   "with": {"golden_dump": "${stages.dump.outputs.dump_dir}"}},
    }}))
    return wf


def llmflow_run(tmp: Path, environ: dict[str, str]) -> subprocess.CompletedProcess:
    mirror = f"https://bob:{URL_PASSWORD}@mirror.example.com/models"
    return subprocess.run([sys.executable, "-m", "llmflow.cli", "run", str(tmp / "wf.yaml"), "--run-dir",
                           str(tmp / "run"), "--progress", "plain", "--set", f"mirror={mirror}"],
                          capture_output=True, text=True, timeout=300, cwd=tmp,
                          env={**os.environ, "PYTHONPATH": checkout_path(REPO), **environ,
                               "TORCH_HUB_MIRROR": f"https://bob:{URL_PASSWORD}@hub.example.com"})


def files_holding(run_dir: Path, values: list[str]) -> list[str]:
    found = []
    for path in sorted(p for p in run_dir.rglob("*") if p.is_file()):
        data = path.read_bytes()
        found += [f"{path.relative_to(run_dir)}: {v}" for v in values if v.encode() in data]
    return found


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    tmp = tmp_path_factory.mktemp("secrets")
    workflow(tmp)
    return tmp, llmflow_run(tmp, {**BY_NAME, **BY_REFERENCE})


def test_no_file_of_the_run_dir_holds_a_secret_value(first_run) -> None:
    tmp, proc = first_run
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    run = tmp / "run"
    assert {p.name for p in run.rglob("*")} >= {"summary.json", ".llmflow-stage.json", "generation.json",
                                                  "env.json", "env_diff.json", "report.html"}
    assert files_holding(run, EVERY_VALUE) == []
    env_vars = json.loads((run / "dump" / "dump" / "env.json").read_text())["env_vars"]
    assert {k: env_vars[k] for k in BY_NAME} == dict.fromkeys(BY_NAME, "<redacted>")  # names kept
    assert env_vars["TORCH_HUB_MIRROR"] == "https://<redacted>@hub.example.com"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["params"]["mirror"] == "https://<redacted>@mirror.example.com/models"
    assert summary["stages"]["login"]["outputs"]["token"] == "<redacted>"
    assert summary["stages"]["login"]["outputs"]["flags"] == (
        "--pin=<redacted> --mirror=https://<redacted>@mirror.example.com/models")
    assert json.loads((run / "dump" / "generation.json").read_text())["prompt"] == "<redacted>"


def test_the_stages_got_the_real_values(first_run) -> None:
    tmp, _ = first_run
    generation = json.loads((tmp / "run" / "dump" / "generation.json").read_text())
    assert generation["input_ids"] == encode_prompt(load_model(TINY).tokenizer, BY_REFERENCE["SECRET_PROMPT"])


def test_a_changed_secret_reruns_its_stage_and_an_unchanged_one_is_cached(first_run) -> None:
    tmp, _ = first_run
    again = llmflow_run(tmp, {**BY_NAME, **BY_REFERENCE})
    assert again.returncode == 0 and "login: cached" in again.stdout and "dump: cached" in again.stdout, \
        again.stdout[-2000:]
    changed = llmflow_run(tmp, {**BY_NAME, **BY_REFERENCE, "HF_TOKEN": "hf_another_secret"})
    assert changed.returncode == 0, changed.stdout[-2000:] + changed.stderr[-2000:]
    assert "login: cached" not in changed.stdout and "dump: cached" in changed.stdout
    assert files_holding(tmp / "run", [*EVERY_VALUE, "hf_another_secret"]) == []
