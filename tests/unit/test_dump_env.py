"""env.json (llmflow.dump.env): what a dump records about its process, and never a secret's value."""

from __future__ import annotations

import pytest

from llmflow.dump.env import collect_env, recorded_env_vars
from llmflow.redaction import REDACTED, Redactor, is_secret_name, redact_urls

SECRETS = {
    "TORCH_HUB_TOKEN": "t0ken",
    "ASCEND_PASSWORD": "pa55",
    "ATB_SECRET": "s3cret",
    "HCCL_API_KEY": "k3y",
    "CUDA_CREDENTIALS_FILE_CONTENT": "cr3d",
    "ATB_auth_Token": "m1xed-case",
}
PLAIN = {"ATB_MATMUL_SHUFFLE_K_ENABLE": "0", "HCCL_DETERMINISTIC": "true", "PYTHONHASHSEED": "7",
         "TORCH_HOME": "/data/torch"}
URL_VAR = ("TORCH_HUB_MIRROR", "https://alice:hunter22@mirror.example.com/hub")


@pytest.fixture
def environ(monkeypatch):
    for name, value in {**SECRETS, **PLAIN, "HF_TOKEN": "hf", "UNRELATED": "x", **dict([URL_VAR])}.items():
        monkeypatch.setenv(name, value)


def test_secret_values_are_redacted_names_kept(environ):
    env_vars = collect_env()["env_vars"]
    assert {k: env_vars[k] for k in SECRETS} == dict.fromkeys(SECRETS, REDACTED)
    assert {k: env_vars[k] for k in PLAIN} == PLAIN  # numerics switches stay readable
    assert "HF_TOKEN" not in env_vars and "UNRELATED" not in env_vars  # outside the recorded prefixes
    assert not set(SECRETS.values()) & {str(v) for v in env_vars.values()}
    assert env_vars[URL_VAR[0]] == "https://<redacted>@mirror.example.com/hub"


def test_recorded_env_vars_on_a_given_environment():
    environ = {"ATB_KEY_ID": "a", "ATB_LLM_LCOC_ENABLE": "0", "OMP_NUM_THREADS": "4", "PATH": "/x"}
    got = recorded_env_vars(environ)
    assert got == {"ATB_KEY_ID": REDACTED, "ATB_LLM_LCOC_ENABLE": "0", "OMP_NUM_THREADS": "4"}


@pytest.mark.parametrize("name", [
    "HF_TOKEN", "hf_token", "TORCH_HUB_TOKEN", "ASCEND_PASSWORD", "ATB_PASSPHRASE", "HCCL_PASS", "PWD",
    "MY_PIN", "ASCEND_PIN", "ATB_AUTH", "ATB_AUTH_HEADER", "ASCEND_LICENSE_FILE", "HCCL_CERT_PATH",
    "ATB_PRIVATE_KEY", "ASCEND_SESSION_ID", "TORCH_COOKIE", "HCCL_API_KEY", "CUDA_CREDENTIALS",
    "ATB_SECRETS", "HFTOKEN", "ATB_DBPASSWORD", "MY-APIKEY", "my.session",
])
def test_secret_names(name):
    assert is_secret_name(name)


@pytest.mark.parametrize("name", [
    "PATH", "LD_LIBRARY_PATH", "KEEP_ALIVE", "ATB_KEEP_CACHE", "SPINE", "HCCL_SPINE_MODE", "KEYBOARD",
    "TOKENIZERS_PARALLELISM", "MAX_NEW_TOKENS", "ATB_MATMUL_SHUFFLE_K_ENABLE", "OLDPWD_HINT_X",
    "HCCL_BYPASS_MODE", "ASCEND_OPP_PATH", "TORCH_COMPILE_DEBUG", "HCCL_DETERMINISTIC", "PINNED",
])
def test_plain_names(name):
    assert not is_secret_name(name)


@pytest.mark.parametrize(("text", "redacted"), [
    ("https://user:pass@host/x", "https://<redacted>@host/x"),
    ("git clone https://ghp_tok@github.com/o/r and ssh://a:b@c:22/p", "git clone "
     "https://<redacted>@github.com/o/r and ssh://<redacted>@c:22/p"),
    ("https://u:p@ss@host/path@x", "https://<redacted>@host/path@x"),  # an "@" in the password
    ("https://host/path?q=a@b", "https://host/path?q=a@b"), ("no url: a@b", "no url: a@b"),
])
def test_url_credentials(text, redacted):
    assert redact_urls(text) == redacted


def test_known_values_are_redacted_whole_or_inside_longer_strings():
    redact = Redactor(["s3cr3t-value", "7"])
    value = {"a": "s3cr3t-value", "b": ["--token=s3cr3t-value", "7", "17"], "s3cr3t-value": 3, "c": 7}
    assert redact(value) == {"a": REDACTED, "b": [f"--token={REDACTED}", REDACTED, "17"], REDACTED: 3,
                             "c": 7}
    assert value["a"] == "s3cr3t-value"  # a copy: the argument is unchanged
