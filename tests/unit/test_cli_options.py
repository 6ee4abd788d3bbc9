"""Compare and bisect options are declared once (``llmflow.options``): the stage's parameter schema,
``llmflow compare``'s flags and the dataclass agree on names, defaults, types and help text."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import jsonschema
import pytest
from path_helpers import checkout_path

from llmflow.cli import compare as compare_cli
from llmflow.compare.options import CompareOptions
from llmflow.localize.options import BisectInputs
from llmflow.options import REQUIRED, declared, default_of, flag_names, from_args, from_params, help_texts
from llmflow.stages.bisect import BisectStage
from llmflow.stages.compare import CompareStage

REPO = Path(__file__).resolve().parents[2]
#: stage parameters that are not options of the dataclass: the files and aliases the stage reads
#: the rest from
STAGE_ONLY = {CompareStage: {"golden_dump", "target_dump", "golden", "target", "pairs_file"},
              BisectStage: {"golden_generation", "target_generation", "golden_model_spec",
                            "target_model_spec", "pairs_file", "overflow_report", "compare_summary"}}
OPTIONS = {CompareStage: CompareOptions, BisectStage: BisectInputs}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    compare_cli.configure(parser)
    return parser


def _actions() -> dict[str, argparse.Action]:
    return {a.dest: a for a in _parser()._actions}


def test_every_field_is_declared_once_with_a_help_text():
    for cls in (CompareOptions, BisectInputs):
        assert [f.name for f in declared(cls)] == [f.name for f in fields(cls)]
        assert all(text.strip() and text.endswith(".") for text in help_texts(cls).values())


@pytest.mark.parametrize("stage", [CompareStage, BisectStage], ids=lambda s: s.type)
def test_the_stage_schema_is_the_declaration(stage):
    cls, props = OPTIONS[stage], stage.params_schema["properties"]
    by_name = {f.name: f for f in declared(cls)}
    for name, prop in props.items():
        if name in STAGE_ONLY[stage]:
            assert name not in by_name or not by_name[name].metadata["stage"], name
            continue
        f = by_name[name]  # a parameter the dataclass does not declare fails here
        assert prop["description"] == f.metadata["help"]
        default = default_of(f)
        if default is REQUIRED:
            assert "default" not in prop and name in stage.params_schema["required"]
        else:  # the same default, and it is a value of the declared type
            assert prop["default"] == default
            jsonschema.validate(default, {k: v for k, v in prop.items() if k != "description"})
    declared_for_stage = {f.name for f in declared(cls) if f.metadata["stage"]}
    assert declared_for_stage <= set(props)


def test_the_compare_flags_are_the_declaration():
    actions = _actions()
    defaults = vars(_parser().parse_args(["-gp", "g", "-mp", "t"]))
    flagged = [f for f in declared(CompareOptions) if f.metadata["flags"]]
    assert {f.name for f in flagged} >= {"levels", "stats_only", "algorithms", "mapping", "rank", "xlsx"}
    for f in flagged:
        action = actions[f.name]
        assert tuple(action.option_strings) == f.metadata["flags"]
        assert action.help.replace("%%", "%") == f.metadata["help"]
        assert defaults[f.name] == default_of(f)
    # msit llm compare's short flags are the first name of their option
    short = {f.metadata["flags"][0] for f in flagged}
    assert {"-cl", "-st", "-alg", "-mf", "-r"} <= short
    assert flag_names(CompareOptions)["levels"] == "-cl/--cmp-level"


def test_flags_and_stage_parameters_build_the_same_options():
    """The same settings given as flags and as the stage's parameters give equal options."""
    argv = ["-gp", "g", "-mp", "t", "-cl", "layer", "module", "-st", "-alg", "a.py:f", "-mf", "atb-llama",
            "-r", "1", "--workers", "2", "--steps", "0", "3", "--target-dtype", "float16",
            "--executor", "dask", "--scheduler-address", "tcp://h:8786", "--no-xlsx"]
    from_flags = from_args(CompareOptions, _parser().parse_args(argv), thresholds=None)
    params = {"levels": ["layer", "module"], "stats_only": True, "algorithms": ["a.py:f"],
              "mapping": "atb-llama", "rank": 1, "workers": 2, "steps": [0, 3], "target_dtype": "float16",
              "executor": "dask", "scheduler_address": "tcp://h:8786", "xlsx": False}
    stage_schema = CompareStage.params_schema
    jsonschema.validate({"golden_dump": "g", "target_dump": "t", **params}, stage_schema)
    from_stage = from_params(CompareOptions, params)
    assert from_flags == from_stage
    assert from_flags != CompareOptions()  # every value above differs from its default
    for name, value in params.items():
        assert getattr(CompareOptions(), name) != value, name


def test_an_empty_workflow_default_means_none():
    opts = from_params(CompareOptions, {"mapping": "", "target_dtype": ""})
    assert opts.mapping is None and opts.target_dtype is None


def test_bisect_stage_defaults_build_the_dataclass_defaults():
    stage_defaults = {name: prop["default"] for name, prop in BisectStage.params_schema["properties"].items()
                      if "default" in prop}
    inputs = from_params(BisectInputs, stage_defaults, golden_dump="g", target_dump="t", golden_spec={},
                         target_spec={}, golden_ids=[], target_ids=[])
    assert inputs == BisectInputs("g", "t", {}, {}, [], [])


def test_compare_help_shows_each_flag_with_its_help_text(tmp_path):
    done = subprocess.run([sys.executable, "-m", "llmflow", "compare", "--help"], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": checkout_path(REPO), "NO_COLOR": "1",
                               "COLUMNS": "400"})
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    for f in declared(CompareOptions):
        if f.metadata["flags"]:  # "-cl LEVEL [LEVEL ...], --cmp-level LEVEL [LEVEL ...] Levels to ..."
            at = text.find(" " + f.metadata["help"])
            assert at > 0, f.name
            assert f"{f.metadata['flags'][-1]}" in text[max(at - 60, 0):at].split(" "), f.name
