"""Loading: node marks, include/extends merging, include cycles; interpolation; the DAG."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from llmflow.workflow import WorkflowError, dag, load_workflow, validate_workflow
from llmflow.workflow.interpolate import InterpolationError, Ref, parse, resolve

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from workflow_helpers import REPO, write_workflow  # noqa: E402


def test_marks_for_keys_and_values(tmp_path):
    wf = load_workflow(
        write_workflow(
            tmp_path,
            """
        name: m
        stages:
          a:
            uses: seed
            with:
              seed: 3
    """,
        )
    )
    assert str(wf.mark("stages", "a", "with", "seed")) == f"{tmp_path}/wf.yaml:6:13"
    assert str(wf.key_mark("stages", "a", "with", "seed")) == f"{tmp_path}/wf.yaml:6:7"
    assert str(wf.mark("stages", "a", "with", "seed", 99)) == f"{tmp_path}/wf.yaml:6:13"  # nearest ancestor
    assert wf.name == "m" and wf.stages["a"].with_ == {"seed": 3}


def test_extends_merges_params_and_with_per_key(tmp_path):
    write_workflow(
        tmp_path,
        """
        name: base
        description: the base
        params:
          seed: {type: integer, default: 1, description: base seed}
          flag: {type: boolean, default: true}
        stages:
          s:
            uses: seed
            with: {seed: "${params.seed}", deterministic: "${params.flag}"}
          t:
            uses: seed
            with: {seed: 9}
    """,
        name="recipes/base.yaml",
    )
    path = write_workflow(
        tmp_path,
        """
        name: child
        extends: recipes/base.yaml
        params:
          seed: {default: 2}
        stages:
          s:
            with: {deterministic: false}
          t:
            uses: ../plugins_missing.py:Nope
            needs: [s]
    """,
    )
    wf = load_workflow(path)
    assert wf.name == "child" and wf.description == "the base"
    assert wf.params["seed"] == {"type": "integer", "default": 2, "description": "base seed"}
    assert wf.stages["s"].with_ == {"seed": "${params.seed}", "deterministic": False}
    assert wf.stages["t"].uses == "../plugins_missing.py:Nope" and wf.stages["t"].with_ == {}
    assert wf.stages["t"].needs == ["s"]
    # each mark points into the file that defined the node
    assert wf.mark("stages", "s", "with", "seed").file.endswith("recipes/base.yaml")
    assert wf.mark("stages", "s", "with", "deterministic").file.endswith("wf.yaml")
    assert wf.mark("params", "seed", "type").file.endswith("recipes/base.yaml")
    assert wf.mark("params", "seed", "default").line == 4
    assert wf.stages["t"].base_dir == tmp_path  # file refs relative to the file that set `uses`
    assert wf.stages["s"].base_dir == tmp_path / "recipes"


def test_include_conflict_and_cycle(tmp_path):
    write_workflow(
        tmp_path,
        """
        stages:
          a: {uses: seed}
    """,
        name="inc.yaml",
    )
    path = write_workflow(
        tmp_path,
        """
        name: x
        include: [inc.yaml]
        stages:
          a: {uses: seed}
    """,
    )
    errors = [str(e) for e in validate_workflow(path)]
    assert errors == [
        f"{tmp_path}/wf.yaml:4:3: stage 'a' is defined twice (also at {tmp_path}/inc.yaml:2:3, "
        "an include: use extends: to override)"
    ]

    write_workflow(tmp_path, "include: [b.yaml]\n", name="a.yaml")
    write_workflow(tmp_path, "include: [a.yaml]\n", name="b.yaml")
    errors = [str(e) for e in validate_workflow(tmp_path / "a.yaml")]
    assert errors == [f"{tmp_path}/b.yaml:1:11: include cycle: a.yaml -> b.yaml -> a.yaml"]


def test_relative_display_paths_through_includes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_workflow(tmp_path, "stages:\n  r: {uses: seed, with: {nope: 1}}\n", name="wfs/recipes/r.yaml")
    write_workflow(tmp_path, "name: x\ninclude: [recipes/r.yaml]\n", name="wfs/main.yaml")
    assert [str(e) for e in validate_workflow("wfs/main.yaml")] == [
        "wfs/recipes/r.yaml:2:26: unknown key 'nope' in stages.r.with (known: deterministic, seed)"
    ]


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(WorkflowError, match="no such workflow file"):
        load_workflow(tmp_path / "nope.yaml")
    path = write_workflow(tmp_path, "- a\n- b\n")
    assert [e.message for e in validate_workflow(path)] == ["a workflow file must be a mapping"]
    path = write_workflow(tmp_path, "")
    assert [e.message for e in validate_workflow(path)] == ["the file is empty"]
    path = write_workflow(tmp_path, "name: x\nstages:\n  a: {with: {}}\n")
    assert [str(e) for e in validate_workflow(path)] == [
        f"{path}:3:3: stage 'a' has no 'uses:' (a stage type)"
    ]


def test_interpolation_parse_and_resolve(monkeypatch):
    assert parse("a $${x} b") == ["a ${x} b"]
    parts = parse("x${params.p}y")
    assert parts[0] == "x" and parts[2] == "y" and parts[1] == Ref("params", "p", start=1, text="${params.p}")
    assert parse("${stages.d-1.outputs.a.0.b}")[0].keys == ("a", "0", "b")
    assert parse("${env.HOME:-/x}")[0].default == "/x"
    with pytest.raises(InterpolationError) as exc:
        parse("ok ${params.p")
    assert exc.value.offset == 3
    with pytest.raises(InterpolationError, match="bad reference"):
        parse("${params}")
    values = {"n": 3, "l": [1, 2], "s": "t"}

    def lookup(ref):
        return values[ref.name]

    assert resolve("${params.n}", lookup) == 3
    assert resolve({"k": ["${params.l}"]}, lookup) == {"k": [[1, 2]]}
    assert resolve("n=${params.n} l=${params.l} s=${params.s} $${raw}", lookup) == "n=3 l=[1, 2] s=t ${raw}"


def test_dag_order_cycle_and_reachability():
    needs = {"a": [], "b": ["a"], "c": ["a"], "d": ["b", "c"], "e": []}
    assert dag.topological_order(needs) == ["a", "b", "c", "d", "e"]
    assert dag.downstream(needs, ["b"]) == {"b", "d"}
    assert dag.upstream(needs, ["d"]) == {"a", "b", "c"}
    assert dag.find_cycle(needs) is None
    assert dag.find_cycle({"a": ["c"], "b": ["a"], "c": ["b"]}) == ["a", "c", "b", "a"]
    assert dag.find_cycle({"a": ["a"]}) == ["a", "a"]


def test_a_recipes_path_defaults_name_files_beside_the_recipe(tmp_path, monkeypatch):
    """A user's workflow anywhere extending the shipped llama2_bisect: its target_model default,
    ``../plugins/demo_bug.py:...`` beside the recipe, names the shipped plugin from any current
    directory; a name (smollm2) stays a name, and the user's own relative default is theirs."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "port.py").write_text("def f(model):\n    pass\n")
    (mine / "my.yaml").write_text(textwrap.dedent(f"""\
        name: my-bisect
        extends: {REPO / "workflows" / "llama2_bisect.yaml"}
        params:
          golden_model: {{default: port.py:f}}
        """))
    for cwd in (tmp_path, mine, REPO):
        monkeypatch.chdir(cwd)
        params = load_workflow(mine / "my.yaml").params
        demo = f"{REPO / 'plugins' / 'demo_bug.py'}:smollm2_with_planted_bug"
        assert params["target_model"]["default"] == demo
        assert params["golden_model"]["default"] == "port.py:f"
    assert load_workflow(REPO / "workflows" / "llama2_bisect.yaml").params["target_model"]["default"] == \
        "../plugins/demo_bug.py:smollm2_with_planted_bug"
