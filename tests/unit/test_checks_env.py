"""env_diff: flattening, differences on either side, and the numerics-relevant classification."""

from __future__ import annotations

import json

import pytest

from llmflow.checks.env_diff import classify, diff_envs, env_summary, flatten, load_env
from llmflow.errors import UserError
from llmflow.results.checks import EnvDiffBlock


def _env(**over: dict) -> dict:
    env = {
        "versions": {"python": "3.11.7", "torch": "2.4.0", "transformers": "4.46.0", "torch_npu": None,
                     "executable": "/usr/bin/python3", "platform": "Linux-x"},
        "env_vars": {"HCCL_DETERMINISTIC": "true", "ASCEND_HOME_PATH": "/usr/local/Ascend",
                     "HCCL_IF_IP": "10.0.0.1", "ATB_LLM_LCOC_ENABLE": "0"},
        "torch_settings": {"deterministic_algorithms": True, "float32_matmul_precision": "highest"},
        "model_config": {"torch_dtype": "float16", "_name_or_path": "/models/a",
                         "rope_scaling": {"factor": 2}},
        "generation": {"do_sample": False, "max_new_tokens": 20},
        "seed": {"seed": 1234},
        "tokenizer": {"class": "LlamaTokenizer", "name_or_path": "/models/a"},
    }
    for section, values in over.items():
        env[section] = {**env[section], **values}
    return env


def test_identical_envs_have_no_difference():
    assert diff_envs(_env(), _env()) == []
    assert env_summary([]) == EnvDiffBlock(differences=0, numerics_relevant=0, items=[], truncated=False)


def test_deterministic_and_precision_switches_are_numerics_relevant():
    target = _env(env_vars={"HCCL_DETERMINISTIC": "false", "ASCEND_HOME_PATH": "/opt/Ascend",
                            "HCCL_IF_IP": "10.0.0.2"},
                  torch_settings={"deterministic_algorithms": False, "float32_matmul_precision": "high"},
                  versions={"executable": "/venv/bin/python", "torch": "2.5.0"})
    items = {it["key"]: it for it in diff_envs(_env(), target)}
    relevant = {k for k, it in items.items() if it["numerics_relevant"]}
    assert relevant == {"env_vars.HCCL_DETERMINISTIC", "torch_settings.deterministic_algorithms",
                        "torch_settings.float32_matmul_precision", "versions.torch"}
    assert set(items) - relevant == {"env_vars.ASCEND_HOME_PATH", "env_vars.HCCL_IF_IP",
                                     "versions.executable"}
    assert items["env_vars.HCCL_DETERMINISTIC"]["golden"] == "true"
    assert items["env_vars.HCCL_DETERMINISTIC"]["target"] == "false"
    ordered = diff_envs(_env(), target)
    assert all(it["numerics_relevant"] for it in ordered[:4]) and not ordered[-1]["numerics_relevant"]
    s = env_summary(ordered)
    assert (s.differences, s.numerics_relevant) == (7, 4)


def test_a_key_on_one_side_only_is_reported():
    target = _env(env_vars={"ATB_MATMUL_SHUFFLE_K_ENABLE": "1"})
    golden = _env()
    del golden["model_config"]["rope_scaling"]
    items = {it["key"]: it for it in diff_envs(golden, target)}
    shuffle = items["env_vars.ATB_MATMUL_SHUFFLE_K_ENABLE"]
    assert shuffle["missing"] == "golden" and shuffle["golden"] is None and shuffle["numerics_relevant"]
    rope = items["model_config.rope_scaling.factor"]
    assert rope["missing"] == "golden" and rope["numerics_relevant"]


@pytest.mark.parametrize(("key", "golden", "target", "relevant"), [
    ("model_config.torch_dtype", "float16", "bfloat16", True),
    ("model_config._name_or_path", "/a", "/b", False),
    ("model_config.rms_norm_eps", 1e-6, 1e-5, True),
    ("env_vars.NVIDIA_TF32_OVERRIDE", "0", "1", True),
    ("env_vars.OMP_NUM_THREADS", "4", "8", True),
    ("env_vars.PYTHONHASHSEED", "0", "1", False),
    ("env_vars.CUDA_VISIBLE_DEVICES", "0", "1", False),
    ("env_vars.TORCH_HOME", "/a", "/b", False),
    ("env_vars.LCCL_DETERMINISTIC", "0", "1", True),
    ("env_vars.HCCL_CONNECT_TIMEOUT", "120", "600", False),
    ("env_vars.ATB_HOME_PATH", "/a", "/b", False),
    ("torch_settings.cuda_matmul_allow_tf32", False, True, True),
    ("versions.python", "3.10", "3.11", False),
    ("versions.torch_npu", "2.1.0", None, True),
    ("generation.max_new_tokens", 20, 30, False),
    ("generation.do_sample", False, True, True),
    ("tokenizer.vocab_size", 32000, 32001, True),
    ("seed.seed", 1, 2, True),
])
def test_classification(key, golden, target, relevant):
    assert classify(key, golden, target)[0] is relevant


def test_flatten_nests_with_dots_and_keeps_lists():
    assert flatten({"a": {"b": {"c": 1}, "d": [1, 2]}, "e": {}}) == {"a.b.c": 1, "a.d": [1, 2], "e": {}}


def test_load_env_from_a_file_and_errors(tmp_path):
    f = tmp_path / "env.json"
    f.write_text(json.dumps(_env()))
    assert load_env(f)["seed"] == {"seed": 1234}
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(UserError, match="bad.json"):
        load_env(bad)
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(UserError, match="broken.json"):
        load_env(broken)
