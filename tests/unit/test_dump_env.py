"""env.json (llmflow.dump.env): what a dump records about its process, and never a secret's value."""

from __future__ import annotations

import pytest

from llmflow.dump.env import REDACTED, collect_env, recorded_env_vars

SECRETS = {
    "TORCH_HUB_TOKEN": "t0ken",
    "ASCEND_PASSWORD": "pa55",
    "ATB_SECRET": "s3cret",
    "HCCL_API_KEY": "k3y",
    "CUDA_CREDENTIALS_FILE_CONTENT": "cr3d",
    "ATB_auth_Token": "m1xed-case",
}
PLAIN = {"ATB_MATMUL_SHUFFLE_K_ENABLE": "0", "HCCL_DETERMINISTIC": "true", "PYTHONHASHSEED": "7"}


@pytest.fixture
def environ(monkeypatch):
    for name, value in {**SECRETS, **PLAIN, "HF_TOKEN": "hf", "UNRELATED": "x"}.items():
        monkeypatch.setenv(name, value)


def test_secret_values_are_redacted_names_kept(environ):
    env_vars = collect_env()["env_vars"]
    assert {k: env_vars[k] for k in SECRETS} == dict.fromkeys(SECRETS, REDACTED)
    assert {k: env_vars[k] for k in PLAIN} == PLAIN  # numerics switches stay readable
    assert "HF_TOKEN" not in env_vars and "UNRELATED" not in env_vars  # outside the recorded prefixes
    assert not set(SECRETS.values()) & {str(v) for v in env_vars.values()}


def test_recorded_env_vars_on_a_given_environment():
    environ = {"ATB_KEY_ID": "a", "ATB_LLM_LCOC_ENABLE": "0", "OMP_NUM_THREADS": "4", "PATH": "/x"}
    got = recorded_env_vars(environ)
    assert got == {"ATB_KEY_ID": REDACTED, "ATB_LLM_LCOC_ENABLE": "0", "OMP_NUM_THREADS": "4"}
