"""Hostile or broken workflows through the CLI: YAML bombs and deep nesting are refused fast with
one short line; validating or planning never executes a local plugin unless --trust-plugins;
seeds outside what PYTHONHASHSEED takes are bad input; a stage calling sys.exit fails in one line."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from llmflow.errors import UserError
from llmflow.seeding import MAX_SEED, apply_settings, determinism_settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from workflow_helpers import REPO, assert_bad_input, llmflow, write_workflow  # noqa: E402

HELLO = str(REPO / "workflows" / "hello.yaml")


def _laughs(levels: int = 9) -> str:
    """A "billion laughs" document: 9 aliases of 9 aliases of ... (409 bytes, 9**9 values)."""
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{i}: &a{i} [{','.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def _timed(*args: str) -> tuple[object, float]:
    t0 = time.monotonic()
    proc = llmflow(*args, timeout=60)
    return proc, time.monotonic() - t0


@pytest.mark.parametrize("command", ["validate", "run", "plan"])
def test_billion_laughs_file_is_refused_fast(tmp_path, command):
    wf = tmp_path / "bomb.yaml"
    wf.write_text("name: bomb\n" + _laughs() + "stages: {}\n")
    assert wf.stat().st_size < 500
    run_dir = ["--run-dir", str(tmp_path / "r")] if command != "validate" else []
    proc, seconds = _timed(command, str(wf), *run_dir)
    assert_bad_input(proc)
    assert seconds < 30 and len(proc.stdout) + len(proc.stderr) < 2000
    said = proc.stdout + proc.stderr
    assert f"{wf}:2:" in said and "more than 100000 values once YAML aliases are expanded" in said


def test_billion_laughs_through_set_is_refused_fast(tmp_path):
    wf = write_workflow(tmp_path, """
        name: p
        params:
          v: {type: array, default: []}
        stages:
          s: {uses: seed}
    """)
    bomb = "[" + ", ".join(line.split(": ", 1)[1] for line in _laughs().splitlines()) + "]"
    proc, seconds = _timed("validate", str(wf), "--set", f"v={bomb}")
    assert_bad_input(proc)
    assert "--set v: more than 100000 values" in proc.stdout
    assert seconds < 30 and len(proc.stdout) + len(proc.stderr) < 2000


@pytest.mark.parametrize("depth", [65, 100_000])
def test_deep_nesting_is_one_error(tmp_path, depth):
    wf = tmp_path / "deep.yaml"
    nested = "[" * depth + "]" * depth
    wf.write_text("name: deep\nstages:\n  s:\n    uses: seed\n    with: {x: " + nested + "}\n")
    proc = llmflow("validate", str(wf))
    assert_bad_input(proc)
    assert f"{wf}:5:" in proc.stdout and "nested deeper than 64 levels" in proc.stdout


def test_a_huge_value_makes_a_short_error(tmp_path):
    wf = write_workflow(tmp_path, """
        name: p
        params:
          n: {type: integer, default: 1}
        stages:
          s: {uses: seed, with: {seed: "${params.n}"}}
    """)
    huge = "[" + ",".join(["123456789"] * 5_000) + "]"
    proc = llmflow("validate", str(wf), "--set", f"n={huge}")
    assert_bad_input(proc)
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith("--set n=[123456789") and "characters)" in lines[0]
    assert max(len(line) for line in lines) <= 500


def test_an_oversized_workflow_file(tmp_path):
    wf = tmp_path / "big.yaml"
    wf.write_text("name: big\n# " + "x" * (3 << 20) + "\nstages: {}\n")
    proc = llmflow("validate", str(wf))
    assert_bad_input(proc)
    assert f"{wf}:1:1: " in proc.stdout and "larger than the 2097152 bytes" in proc.stdout


PLUGIN = '''
from pathlib import Path

from llmflow.stages.base import Stage

Path(__file__).with_name("IMPORTED").write_text("the plugin ran")

SCHEMA = {{"type": "object", "additionalProperties": False,
           "properties": {{"size": {{"type": "integer", "default": 1, "description": "how many"}}}}}}


class Sneaky(Stage):
    """A plugin that leaves a mark when it is imported."""

    type = "sneaky"
    version = "2"
    params_schema = {schema}
    outputs = {{"out": "a file"}}

    def run(self, ctx):
        (ctx.out_dir / "out.txt").write_text("ran")
        return {{"out": str(ctx.out_dir / "out.txt")}}
'''


def _plugin_workflow(tmp_path: Path, schema: str = "SCHEMA", size: object = 3) -> Path:
    (tmp_path / "sneaky.py").write_text(PLUGIN.format(schema=schema))
    return write_workflow(tmp_path, f"""
        name: plug
        stages:
          s: {{uses: sneaky.py:Sneaky, with: {{size: {size}}}}}
          t: {{uses: seed, needs: [s], with: {{seed: "${{stages.s.outputs.out}}"}}}}
    """)


def test_validate_and_plan_read_a_plugin_without_running_it(tmp_path):
    wf = _plugin_workflow(tmp_path)
    proc = llmflow("validate", str(wf))
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == f"PASSED ({wf} is valid)"
    proc = llmflow("plan", str(wf), "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 0 and "new" in proc.stdout
    proc = llmflow("run", str(wf), "--dry-run", "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 0 and "2 stage(s) would run" in proc.stdout
    assert not (tmp_path / "IMPORTED").exists()
    bad = _plugin_workflow(tmp_path, size='"three"')
    proc = llmflow("validate", str(bad))
    assert_bad_input(proc)
    assert "stages.s.with.size: 'three' is not of type 'integer'" in proc.stdout
    assert not (tmp_path / "IMPORTED").exists()
    llmflow("run", str(wf), "--run-dir", str(tmp_path / "run"))  # running a workflow runs its plugins
    assert (tmp_path / "IMPORTED").exists()


@pytest.mark.parametrize(
    ("schema", "why"),
    [
        ("dict(SCHEMA)", "params_schema is computed"),
        ("{**SCHEMA, 'title': str(1)}", "params_schema is computed"),
    ],
)
def test_a_plugin_that_cannot_be_read_needs_trust(tmp_path, schema, why):
    wf = _plugin_workflow(tmp_path, schema=schema)
    proc = llmflow("validate", str(wf))
    last = assert_bad_input(proc)
    assert why in proc.stdout and f"would execute {tmp_path / 'sneaky.py'}" in proc.stdout
    assert "--trust-plugins" in proc.stdout and last == f"FAILED: 1 problem(s) in {wf}"
    assert not (tmp_path / "IMPORTED").exists()
    proc = llmflow("validate", str(wf), "--trust-plugins")
    assert proc.returncode == 0, proc.stdout
    assert (tmp_path / "IMPORTED").exists()


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ("class Sneaky(Base):\n    pass\n", "its base 'Base' is not Stage"),
        ("def make():\n    pass\nSneaky = make()\n", "no top-level class 'Sneaky'"),
        ("class Sneaky:\n    pass\n", "not a llmflow.stages.base.Stage subclass"),
        ("class Sneaky(Stage):\n    def run(self, ctx)\n", "sneaky.py:2: not valid Python"),
    ],
)
def test_plugin_problems_found_statically(tmp_path, source, says):
    (tmp_path / "sneaky.py").write_text(source)
    wf = write_workflow(tmp_path, "name: p\nstages:\n  s: {uses: sneaky.py:Sneaky}\n")
    proc = llmflow("validate", str(wf))
    assert_bad_input(proc)
    assert f"{wf}:3:" in proc.stdout and says in proc.stdout


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        ('{"type": "object", "properties": {"size": {"type": "strin"}}}',
         "params_schema is not a valid JSON Schema at properties.size.type"),
        ('{"type": "object", "properties": {"size": {"type": "string", "pattern": "("}}}',
         "params_schema is not a valid JSON Schema at properties.size.pattern: '(' is not a 'regex'"),
        ('{"type": "object", "properties": {"size": {"type": "integer", "default": "notint"}}}',
         "params_schema.properties.size.default: 'notint' is not of type 'integer'"),
    ],
)
@pytest.mark.parametrize("command", ["validate", "run"])
def test_a_plugin_schema_with_a_typo_is_one_line_naming_it(tmp_path, schema, says, command):
    """The plugin author's most likely mistake, in a trusted run as in a static read: one line
    naming the plugin and the keyword, exit 2, no traceback."""
    wf = _plugin_workflow(tmp_path, schema=schema, size=3)
    extra = ["--run-dir", str(tmp_path / "run")] if command == "run" else []
    proc = llmflow(command, str(wf), *extra)
    assert_bad_input(proc)
    assert "sneaky.py:Sneaky: " + says in proc.stdout, proc.stdout
    assert not (tmp_path / "run" / "s").exists()


@pytest.mark.parametrize("schema", [
    '{"type": "object", "properties": {"size": {"type": ("integer", "null"), "default": 1}}}',
    '{"type": "object", "definitions": {"n": {"type": "integer"}}, '
    '"properties": {"size": {"$ref": "#/definitions/n", "default": 2}}}',
    '{"type": "object", "properties": {"size": True, "label": {"type": "string", "default": None}}}',
])
def test_a_plugin_schema_json_schema_allows_is_taken(tmp_path, schema):
    """Tuples (as Python writes an array), a ``$ref`` to the schema's definitions, a property schema
    of ``true`` and a None default: valid, validated and run."""
    wf = _plugin_workflow(tmp_path, schema=schema, size=3)
    assert llmflow("validate", str(wf), "--trust-plugins").returncode == 0
    proc = llmflow("run", str(wf), "--run-dir", str(tmp_path / "run"))
    assert "s: done" in proc.stdout, proc.stdout + proc.stderr  # (t, a seed, is given s's file: not this)


def test_a_trusted_plugin_that_exits_at_import(tmp_path):
    (tmp_path / "bye.py").write_text("import sys\nsys.exit(3)\n")
    wf = write_workflow(tmp_path, "name: p\nstages:\n  s: {uses: bye.py:Gone}\n")
    proc = llmflow("validate", str(wf), "--trust-plugins")
    assert_bad_input(proc)
    assert "importing it called sys.exit(3)" in proc.stdout


def test_help_says_validation_runs_no_plugin_code():
    for command in ("validate", "plan"):
        out = " ".join(llmflow(command, "--help").stdout.split())
        assert "--trust-plugins" in out and "runs no code from the workflow" in out


@pytest.mark.parametrize("command", ["validate", "run"])
def test_a_seed_past_pythonhashseed_is_bad_input(tmp_path, command):
    extra = ["--run-dir", str(tmp_path / "r")] if command == "run" else []
    proc = llmflow(command, HELLO, "--set", "seed=4294967296", *extra)
    assert_bad_input(proc)
    said = "stages.seed.with.seed: 4294967296 is greater than the maximum of 4294967295"
    assert said in proc.stdout + proc.stderr
    assert not (tmp_path / "r").exists()


def test_the_largest_seed_runs(tmp_path):
    proc = llmflow("run", HELLO, "--set", f"seed={MAX_SEED}", "--run-dir", str(tmp_path / "r"))
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == "PASSED (2 done)"


@pytest.mark.parametrize("seed", [-1, MAX_SEED + 1, 2**64, True, "7"])
def test_seeding_refuses_a_seed_out_of_range(seed):
    with pytest.raises(UserError, match=r"seed .*: must be an integer from 0 to 4294967295"):
        determinism_settings(seed)
    with pytest.raises(UserError, match="must be an integer"):
        apply_settings({"seed": seed, "env": {}})


def test_a_stage_calling_sys_exit_fails_in_one_line(tmp_path):
    wf = write_workflow(tmp_path, """
        name: exits
        stages:
          a: {uses: "{HELPERS}:EchoStage", with: {value: 1}}
          b: {uses: "{HELPERS}:ExitStage", needs: [a], with: {code: 0}}
          c: {uses: "{HELPERS}:EchoStage", needs: [b], with: {value: 2}}
    """)
    proc = llmflow("run", str(wf), "--run-dir", str(tmp_path / "r"))
    assert proc.returncode == 1 and "Traceback" not in proc.stdout + proc.stderr
    said = "stage b failed: the stage called sys.exit(0) instead of returning its outputs or raising"
    assert said in proc.stdout
    assert proc.stdout.splitlines()[-1].startswith("FAILED: stage 'b' failed: the stage called sys.exit(0)")
    assert "c: skipped" in proc.stdout


def test_deep_text_for_a_string_param_is_just_text(tmp_path):
    wf = write_workflow(tmp_path, """
        name: p
        params:
          prompt: {type: string, default: hi}
        stages:
          s: {uses: "{HELPERS}:EchoStage", with: {value: "${params.prompt}"}}
    """)
    text = "[" * 100 + "]" * 100
    proc = llmflow("run", str(wf), "--set", f"prompt={text}", "--run-dir", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "r" / "s" / "value.json").read_text() == f'"{text}"'


def test_a_long_extends_chain_is_one_error(tmp_path):
    for i in range(100):
        (tmp_path / f"r{i}.yaml").write_text(f"extends: r{i + 1}.yaml\n" if i < 99 else "stages: {}\n")
    proc = llmflow("validate", str(tmp_path / "r0.yaml"))
    assert_bad_input(proc)
    assert "include/extends chain deeper than 32 files" in proc.stdout


@pytest.mark.parametrize("text", ["name: empty\nstages: {}\n", "name: empty\n"])
def test_a_workflow_without_stages_is_bad_input_not_a_pass(tmp_path, text):
    wf = tmp_path / "empty.yaml"
    wf.write_text(text)
    proc = llmflow("run", str(wf), "--run-dir", str(tmp_path / "r"))
    assert_bad_input(proc)
    assert f"{wf}:" in proc.stderr and "the workflow has no stages" in proc.stderr, proc.stderr
    assert not (tmp_path / "r" / "summary.json").exists()


LACKING = '''
from llmflow.stages.base import Stage


class Lacking(Stage):
    """Declares an output its run() does not return."""

    type = "lacking"
    params_schema = {"type": "object", "properties": {}}
    outputs = {"x": "the value the next stage reads"}

    def run(self, ctx):
        return None
'''


def test_a_stage_that_returns_no_declared_output_fails_itself_and_keeps_nothing(tmp_path):
    """Its own failure (exit 1, naming the output), not the next stage's bad input; not cached."""
    (tmp_path / "lacking.py").write_text(LACKING)
    wf = write_workflow(tmp_path, """
        name: p
        stages:
          a: {uses: lacking.py:Lacking}
          b: {uses: seed, needs: [a], with: {seed: "${stages.a.outputs.x}"}}
    """)
    for _ in range(2):  # (again: a stage that failed is run again, never read back as done)
        proc = llmflow("run", str(wf), "--run-dir", str(tmp_path / "run"))
        last = proc.stdout.strip().splitlines()[-1]
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert last.startswith("FAILED: stage 'a' failed: ValueError: run() returned no 'x' of the "
                               "outputs it declares (x)"), last
    assert not (tmp_path / "run" / "a").exists()


def test_a_compare_limit_the_wrong_way_round_stops_the_run_before_its_dumps(tmp_path):
    """The compare's thresholds are checked when the run starts, not when the compare stage starts
    after the dumps ahead of it (hours at the size users debug): no dump is made, exit 2."""
    wf = write_workflow(tmp_path, """
        name: mine
        stages:
          golden:
            uses: dump
            with: {model: "tiny-llama:layers=2,hidden=64,seed=0", prompt: hi, max_new_tokens: 2,
                   chat_template: false, dump_dir: golden_dump}
          compare:
            uses: compare
            needs: [golden]
            with:
              golden_dump: ${stages.golden.outputs.dump_dir}
              target_dump: ${stages.golden.outputs.dump_dir}
              thresholds: {cosine_similarity: {warn: 0.5, fail: 0.9}}
    """)
    proc = llmflow("run", str(wf), "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    last = assert_bad_input(proc, "wf.yaml:13:", "thresholds.cosine_similarity: warn 0.5 is below fail 0.9")
    assert "FAILED" in last and not (tmp_path / "golden_dump").exists() and not (tmp_path / "run").exists()
