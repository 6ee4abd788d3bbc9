"""`llmflow validate`: every error class reported as FILE:LINE:COL: message (exit 2)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from llmflow.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from workflow_helpers import write_workflow  # noqa: E402


@pytest.fixture
def validate(tmp_path, monkeypatch, capsys):
    """Write a workflow as wf.yaml in a temp cwd, run `llmflow validate wf.yaml`: (rc, lines)."""
    monkeypatch.chdir(tmp_path)

    def run(text: str, *extra: str) -> tuple[int, list[str]]:
        write_workflow(tmp_path, text)
        rc = main(["validate", "wf.yaml", *extra])
        out = capsys.readouterr()
        return rc, (out.out + out.err).splitlines()

    return run


def test_valid_workflow_passes(validate):
    rc, lines = validate("""
        name: t
        params:
          seed: {type: integer, default: 5}
        stages:
          a: {uses: seed, with: {seed: "${params.seed}"}}
          b:
            uses: seed
            needs: [a]
            with: {seed: "${stages.a.outputs.settings.seed}"}
    """)
    assert rc == 0
    assert lines[-1].startswith("PASSED")


def test_unknown_stage_type_suggests(validate):
    rc, lines = validate("""
        name: t
        stages:
          a:
            uses: sede
    """)
    assert rc == 2
    assert lines[0] == "wf.yaml:4:11: stage 'a': unknown stage type 'sede' (did you mean 'seed'?)"
    assert lines[-1].startswith("FAILED")


def test_unknown_needs(validate):
    rc, lines = validate("""
        name: t
        stages:
          a:
            uses: seed
          b:
            uses: seed
            needs: [a, c]
    """)
    assert rc == 2
    assert lines[0] == "wf.yaml:7:16: stage 'b' needs unknown stage 'c' (known: a, b)"


def test_cycle_is_named(validate):
    rc, lines = validate("""
        name: t
        stages:
          a:
            uses: seed
            needs: [b]
          b:
            uses: seed
            needs: [a]
    """)
    assert rc == 2
    assert lines[0] == "wf.yaml:5:13: dependency cycle: a -> b -> a"


def test_bad_interpolations(validate):
    rc, lines = validate("""
        name: t
        params:
          seed: {type: integer, default: 1}
        stages:
          a:
            uses: seed
          b:
            uses: seed
            with:
              seed: ${params.sed}
              deterministic: ${stages.a.outputs.settings}
          c:
            uses: seed
            with:
              seed: "x ${params.seed"
          d:
            uses: seed
            needs: [a]
            with:
              seed: ${stages.a.outputs.setings.seed}
              deterministic: ${foo.bar}
    """)
    assert rc == 2
    assert lines[:5] == [
        "wf.yaml:10:13: ${params.sed}: unknown param 'sed' (did you mean 'seed'?)",
        "wf.yaml:11:22: ${stages.a.outputs.settings}: stage 'a' is not in the needs of stage 'b' "
        "(add it to needs:)",
        "wf.yaml:15:16: unterminated '${params.seed': missing '}'",
        "wf.yaml:20:13: ${stages.a.outputs.setings.seed}: stage 'a' (seed) has no output 'setings' "
        "(did you mean 'settings'?)",
        "wf.yaml:21:22: bad reference '${foo.bar}': expected ${params.NAME}, ${env.NAME}, "
        "${env.NAME:-default} or ${stages.ID.outputs.KEY}",
    ]
    assert lines[5] == "FAILED: 5 problem(s) in wf.yaml"


def test_embedded_reference_column(validate):
    rc, lines = validate("""
        name: t
        stages:
          a:
            uses: seed
            with: {seed: 1}
            description: x
          b:
            uses: seed
            with:
              deterministic: prefix-${params.nope}-suffix
    """)
    assert lines[0] == "wf.yaml:10:29: ${params.nope}: unknown param 'nope'"


def test_wrong_parameter_types(validate):
    rc, lines = validate("""
        name: t
        params:
          s: {type: string, default: abc}
          n: {type: integer, default: x, minimum: 0}
        stages:
          a:
            uses: seed
            with:
              seed: abc
              deterministic: ${params.s}
    """)
    assert rc == 2
    assert lines[:3] == [
        "wf.yaml:4:31: param 'n' default: 'x' is not of type 'integer'",
        "wf.yaml:9:13: stages.a.with.seed: 'abc' is not of type 'integer'",
        "wf.yaml:10:22: stages.a.with.deterministic: 'abc' is not of type 'boolean'",
    ]


def test_unknown_keys(validate):
    rc, lines = validate("""
        name: t
        stages:
          a:
            uses: seed
            nedds: [b]
    """)
    assert rc == 2
    assert lines[0] == "wf.yaml:5:5: unknown key 'nedds' in stages.a (did you mean 'needs'?)"
    rc, lines = validate("""
        name: t
        stage: {}
    """)
    assert lines[0] == "wf.yaml:2:1: unknown key 'stage' (did you mean 'stages'?)"
    rc, lines = validate("""
        name: t
        stages:
          a:
            uses: seed
            with:
              sed: 1
    """)
    assert lines[0] == "wf.yaml:6:7: unknown key 'sed' in stages.a.with (did you mean 'seed'?)"


def test_missing_include(validate):
    rc, lines = validate("""
        name: t
        include: [recipes/missing.yaml]
        stages: {}
    """)
    assert rc == 2
    assert lines[0].startswith("wf.yaml:2:11: file not found: 'recipes/missing.yaml' (looked for ")


def test_error_in_included_file_points_there(validate, tmp_path):
    write_workflow(
        tmp_path,
        """
        stages:
          r:
            uses: dumpp
    """,
        name="recipes/r.yaml",
    )
    rc, lines = validate("""
        name: t
        include: [recipes/r.yaml]
    """)
    assert rc == 2
    assert lines[0].startswith("recipes/r.yaml:3:11: stage 'r': unknown stage type 'dumpp'")


def test_malformed_yaml(validate):
    rc, lines = validate("""
        name: t
        stages:
          a:
            uses: seed
           with: {}
    """)
    assert rc == 2
    assert lines[0].startswith("wf.yaml:5:4: invalid YAML:")


def test_yaml_merge_keys_and_duplicates_rejected(validate):
    rc, lines = validate("""
        name: t
        base: &b {uses: seed}
        stages:
          a:
            <<: *b
            uses: seed
            uses: seed
    """)
    assert rc == 2
    assert "wf.yaml:5:5: YAML merge keys ('<<') are not supported; use 'extends:'" in lines
    assert "wf.yaml:7:5: duplicate key 'uses' (first defined at line 6)" in lines


def test_set_values_are_typed_and_checked(validate):
    wf = """
        name: t
        params:
          seed: {type: integer, default: 1, minimum: 0}
          prompt: {type: string, default: hi}
        stages:
          a: {uses: seed, with: {seed: "${params.seed}"}}
    """
    assert validate(wf, "--set", "seed=7", "--set", "prompt=yes")[0] == 0
    rc, lines = validate(wf, "--set", "seed=abc")
    assert rc == 2 and lines[0] == "--set seed=abc: 'abc' is not of type 'integer'"
    rc, lines = validate(wf, "--set", "seed=-1")
    assert lines[0] == "--set seed=-1: -1 is less than the minimum of 0"
    rc, lines = validate(wf, "--set", "sed=1")
    assert lines[0] == "--set sed: unknown param 'sed' (did you mean 'seed'?)"
    rc, lines = validate(wf, "--set", "seed")
    assert rc == 2 and "expected NAME=VALUE" in lines[0]


@pytest.mark.parametrize(("typed", "text"), [
    ("line one\nline two", "line one\nline two"),  # a line break typed in bash ($'...')
    ('"line one\\nline two"', "line one\nline two"),  # a YAML escape inside double quotes
    ('"line one\nline two"', "line one\nline two"),  # a typed line break inside quotes: not folded
    ("'it''s'", "it's"), ("'a\nb'", "a\nb"),
    ("yes", "yes"), ("a: b", "a: b"), ("x # y", "x # y"), ("  padded  ", "  padded  "),
    ('"a" or "b"', '"a" or "b"'), ("'a' or 'b'", "'a' or 'b'"), ('"\\q"', '"\\q"'), ('""', ""),
])
def test_a_string_param_takes_the_text_as_typed(typed, text):
    from llmflow.workflow.validate import parse_set_text

    assert parse_set_text(typed) == text


def test_a_valid_workflow_names_the_params_a_run_must_be_given(validate):
    text = """
        name: t
        params:
          dump: {type: string, format: path}
          seed: {type: integer, default: 5}
        stages:
          a: {uses: align, with: {golden_dump: "${params.dump}", target_dump: "${params.dump}"}}
    """
    rc, lines = validate(text)
    assert rc == 0 and lines[-1] == "PASSED (wf.yaml is valid; a run needs --set dump=VALUE)", lines
    rc, lines = validate(text, "--set", "dump=/data/d")
    assert rc == 0 and lines[-1] == "PASSED (wf.yaml is valid)", lines


@pytest.mark.parametrize(("value", "line"), [
    ("thresholds: {cosine_similarity: {warn: 0.5, fail: 0.9}}",
     "wf.yaml:10:19: thresholds.cosine_similarity: warn 0.5 is below fail 0.9; higher is better for "
     "cosine_similarity, so warn >= fail"),
    ("thresholds: {cosine_similarty: {warn: 0.99, fail: 0.9}}",
     "wf.yaml:10:19: thresholds.cosine_similarty: not a metric of this compare"),
    ("target_dtype: ${params.dtype}", "wf.yaml:10:21: compare: target_dtype: unknown dtype 'fp33'"),
    ("jump_ratio: 0.5", "wf.yaml:10:19: compare: jump_ratio: expected 0 (off) or a ratio above 1, got 0.5"),
])
def test_compare_values_the_schema_cannot_judge_are_found_before_the_run(validate, value, line):
    """A limit written the wrong way round, a misspelt metric, an unknown dtype: found by validate
    (and so by run, before the dumps ahead of the compare take their hours), at the line."""
    rc, lines = validate(f"""
        name: t
        params:
          dtype: {{type: string, default: fp33}}
        stages:
          compare:
            uses: compare
            with:
              golden_dump: g
              target_dump: t
              {value}
    """)
    assert rc == 2 and lines[0].startswith(line), lines


def test_compare_values_from_other_stages_wait_for_the_run(validate):
    rc, lines = validate("""
        name: t
        stages:
          a: {uses: seed}
          compare:
            uses: compare
            needs: [a]
            with:
              golden_dump: g
              target_dump: t
              target_dtype: ${stages.a.outputs.settings.seed}
              thresholds: {cosine_similarity: {warn: 0.99, fail: 0.9}}
    """)
    assert rc == 0, lines
