"""``DumpConfig`` is the one declaration of the dump settings: the dump stage's parameters, the
worker's config and the record in llmflow_dump.json all come from it, with the same defaults."""

from __future__ import annotations

import dataclasses

import jsonschema
import pytest

from llmflow.dump.config import DumpConfig
from llmflow.errors import UserError
from llmflow.stages.dump import DumpStage

STAGE_ONLY = {"model", "device", "dtype", "prompt", "input_ids", "chat_template", "max_new_tokens", "patch",
              "seed_settings", "dump_dir"}


def test_the_stage_offers_the_configs_fields_with_its_defaults() -> None:
    props = DumpStage.params_schema["properties"]
    settings = {name: spec for name, spec in props.items() if name not in STAGE_ONLY}
    assert settings == DumpConfig.stage_properties()
    defaults = DumpConfig().to_json()
    for name, spec in settings.items():
        assert DumpConfig(**{name: spec["default"]}).to_json()[name] == defaults[name], name
        assert spec["description"] == DumpConfig.describe()[name]
    assert props["token_range"]["default"] == [0] == DumpConfig().token_range  # msit's default
    # what the stage does not offer, it decides itself (dump_dir, the seed stage) or always wants
    assert set(DumpConfig.describe()) - set(settings) == {"dump_path", "device_id", "seed", "logits"}


def test_the_worker_builds_the_config_from_the_stage_parameters_alone(tmp_path) -> None:
    props = DumpStage.params_schema["properties"]
    stage_defaults = {name: spec.get("default") for name, spec in props.items()}
    built = DumpConfig.from_params({**stage_defaults, "model": "tiny-llama"}, str(tmp_path))
    assert built.to_json() == DumpConfig(dump_path=str(tmp_path)).to_json()
    given = {"token_range": "all", "mode": "all", "crc32": True, "data_mode": "statistics", "max_bytes": 10,
             "layer_name": "model.layers.1*", "module_list": ["LlamaMLP"], "tensor_part": 1,
             "dump_weight": True, "dump_last_logits": True}
    jsonschema.validate({"model": "m", **given}, DumpStage.params_schema)  # crc32 is a stage parameter
    cfg = DumpConfig.from_params({**stage_defaults, **given}, str(tmp_path))
    assert cfg.dump_path == str(tmp_path)
    assert cfg.to_json() == {**DumpConfig().to_json(), **given, "mode": ["module", "api"]}
    with pytest.raises(UserError, match="DumpConfig.tensor_part"):
        DumpConfig.from_params({"tensor_part": 7}, str(tmp_path))


def test_to_json_records_every_field_but_the_path() -> None:
    names = [f.name for f in dataclasses.fields(DumpConfig)]
    assert list(DumpConfig().to_json()) == [n for n in names if n != "dump_path"]
    assert DumpConfig(module_list=[__import__("torch").nn.Linear, "LlamaMLP"]).to_json()["module_list"] == \
        ["Linear", "LlamaMLP"]


def test_msits_none_means_the_default_and_one_module_name_is_a_list() -> None:
    """msit's fields default to None: a script passing its unset flags through gets the defaults."""
    cfg = DumpConfig(dump_path=None, token_range=None, module_list=None, mode=None)
    assert (cfg.dump_path, cfg.token_range, cfg.module_list, cfg.mode) == (".", [0], [], ["module"])
    assert DumpConfig(module_list="auto").module_list == ["auto"]
    assert DumpConfig(module_list="LlamaDecoderLayer").module_list == ["LlamaDecoderLayer"]


def test_a_module_list_that_matches_no_module_warns_when_hooked(tmp_path, caplog) -> None:
    """A typo in a class name would dump the logits alone: the hook says so at once."""
    from llmflow.dump import register_hook
    from llmflow.models import load_model

    model = load_model("tiny-llama:layers=2,hidden=32,heads=4,kv_heads=2,intermediate=64").model
    with caplog.at_level("WARNING", logger="llmflow.dump"):
        register_hook(model, DumpConfig(dump_path=str(tmp_path / "a"), module_list=["LlamaDecoderLayr"])
                      ).remove()
    assert "module_list ['LlamaDecoderLayr'] / layer_name None match no module" in caplog.text
    assert "LlamaDecoderLayer" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="llmflow.dump"):
        register_hook(model, DumpConfig(dump_path=str(tmp_path / "b"), module_list=["LlamaDecoderLayer"])
                      ).remove()
    assert "match no module" not in caplog.text
