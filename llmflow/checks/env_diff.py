"""Diff two recorded environments and say which differences can change the numbers.

An environment is the ``env.json`` dict every llmflow dump records (``llmflow.dump.env``):
``{"versions", "env_vars", "torch_settings", "model_config", "generation", "seed", "tokenizer"}``,
each a flat-ish dict. Both sides are flattened to dotted keys (``env_vars.HCCL_DETERMINISTIC``,
``model_config.rope_scaling.factor``) and compared key by key; a key present on one side only is a
difference too (its missing value is reported as ``None`` with ``missing: "golden"|"target"``).

Every difference is classed by ``classify``: numerics-relevant (it can change what the model
computes: deterministic switches, ATB_*/HCCL_DETERMINISTIC, TF32 and matmul precision, dtype,
library versions, the model config, the prompt and sampling settings) or not (paths, hosts,
process ids, timeouts, log levels, the Python executable). The rules are a first-match list,
``RULES``, so a newcomer can read (and extend) the policy in one place.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from llmflow.errors import UserError
from llmflow.redaction import REDACTED, Redactor, is_secret_name
from llmflow.results.checks import EnvDiffBlock, EnvDifference

SECTIONS = ("versions", "env_vars", "torch_settings", "model_config", "generation", "seed", "tokenizer")

# (regex over the dotted key, numerics_relevant, why). First match wins.
RULES: list[tuple[str, bool, str]] = [
    (r"versions\.(torch|torch_npu|transformers|cuda|cann)$", True, "kernel/library version"),
    (r"versions\.", False, "tooling or interpreter version"),
    (r"env_vars\..*(PATH|HOME|DIR|FILE|ROOT)$", False, "a path"),
    (r"env_vars\..*(HOST|_IP|IF_IP|PORT|PID|RANK_TABLE|TIMEOUT|LOG|VISIBLE_DEVICES|DEVICE_ID)", False,
     "placement, networking or logging"),
    (r"env_vars\.(HCCL|LCCL)_DETERMINISTIC$", True, "deterministic collective reduction order"),
    (r"env_vars\.(HCCL|LCCL)_", False, "collective communication tuning (not the reduction order)"),
    (r"env_vars\.ATB_", True, "ATB operator selection/fusion (changes kernels and accumulation)"),
    (r"env_vars\.(NVIDIA_TF32_OVERRIDE|CUBLAS_WORKSPACE_CONFIG|CUBLASLT_.*|CUBLAS_.*)$", True,
     "TF32 / cuBLAS reproducibility"),
    (r"env_vars\..*(DETERMINISTIC|TF32|PRECISION|MATMUL|REDUCE|ALGO|DTYPE|FP16|BF16|FP8|FUSION)", True,
     "numerics switch"),
    (r"env_vars\.OMP_NUM_THREADS$", True, "thread count changes CPU reduction order"),
    (r"env_vars\.PYTHONHASHSEED$", False, "hash seed (no effect on tensor math)"),
    (r"env_vars\.", False, "environment variable without a known numerics effect"),
    (r"torch_settings\.model_device$", True, "device"),
    (r"torch_settings\.", True, "torch numerics switch (determinism, TF32, precision, threads)"),
    (r"model_config\.(_name_or_path|transformers_version|_commit_hash|name_or_path)$", False,
     "a path or tooling version"),
    (r"model_config\.(torch_)?dtype$", True, "model dtype"),
    (r"model_config\.(architectures|model_type|model_class)", True, "model class"),
    (r"model_config\.(output_|return_dict|use_cache|pad_token_id|_attn_implementation_autoset)", False,
     "output plumbing"),
    (r"model_config\.", True, "model hyper-parameter"),
    (r"generation\.max_new_tokens$", False, "only the length of the run"),
    (r"generation\.", True, "prompt or sampling setting"),
    (r"seed\.(seeded|settings_file)", False, "bookkeeping"),
    (r"seed\.", True, "seed or determinism setting"),
    (r"tokenizer\.name_or_path$", False, "a path"),
    (r"tokenizer\.", True, "tokenizer (changes the token ids)"),
]
_COMPILED = [(re.compile(p), rel, why) for p, rel, why in RULES]
_PATHLIKE = re.compile(r"^(/|[A-Za-z]:\\|~/|\./|\.\./)")


def load_env(source: str | Path | dict[str, Any]) -> dict[str, Any]:
    """An environment dict from a dict, an ``env.json`` file, or a dump directory of any format
    whose reader records one (llmflow dumps do). Redacted as a dump's env.json is written
    (``llmflow.redaction``), whoever wrote the file: a diff or a report never shows a secret."""
    return _redacted(_read_env(source))


def _redacted(env: dict[str, Any]) -> dict[str, Any]:
    env = Redactor()(env)  # URL credentials anywhere
    if isinstance(env.get("env_vars"), dict):
        env["env_vars"] = {k: REDACTED if is_secret_name(k) else v for k, v in env["env_vars"].items()}
    return env


def _read_env(source: str | Path | dict[str, Any]) -> dict[str, Any]:
    if isinstance(source, dict):
        return source
    path = Path(source)
    if path.is_file() and path.suffix == ".json" and path.name != "llmflow_dump.json":
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise UserError(f"{path}: not a readable env.json ({exc})") from exc
        if not isinstance(data, dict):
            raise UserError(f"{path}: expected a JSON object with sections {', '.join(SECTIONS)}")
        return data
    from llmflow.formats import open_dump
    from llmflow.formats._safe import path_inside

    path_inside(path.parent if path.is_file() else path, "env.json")  # a link out of the dump: refused
    env = open_dump(path).env()
    if not env:
        raise UserError(f"{path}: this dump recorded no environment (no env.json)")
    return env


def flatten(env: dict[str, Any]) -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists stay values (compared whole)."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = value

    walk("", env)
    return out


def classify(key: str, golden: Any, target: Any) -> tuple[bool, str]:
    """(numerics_relevant, reason) of a difference at dotted ``key``."""
    if any(isinstance(v, str) and _PATHLIKE.match(v) for v in (golden, target)) and \
            not key.startswith(("versions.", "model_config.")):
        return False, "a path"
    for rx, relevant, why in _COMPILED:
        if rx.match(key):
            return relevant, why
    return False, "not a recorded numerics setting"


def diff_envs(golden: dict[str, Any], target: dict[str, Any]) -> list[dict[str, Any]]:
    """Every differing key, numerics-relevant ones first, each
    ``{"key", "section", "golden", "target", "missing", "numerics_relevant", "reason"}``."""
    g, t = flatten(golden), flatten(target)
    items: list[dict[str, Any]] = []
    for key in list(g) + [k for k in t if k not in g]:
        gv, tv = g.get(key), t.get(key)
        if key in g and key in t and gv == tv:
            continue
        relevant, why = classify(key, gv, tv)
        items.append({
            "key": key, "section": key.split(".", 1)[0], "golden": gv, "target": tv,
            "missing": "target" if key not in t else "golden" if key not in g else None,
            "numerics_relevant": relevant, "reason": why,
        })
    items.sort(key=lambda it: not it["numerics_relevant"])  # stable: keeps the file order within
    return items


def env_summary(items: list[dict[str, Any]], limit: int = 50) -> EnvDiffBlock:
    """The ``env_diff`` block of summary.json: counts and the first ``limit`` items."""
    return EnvDiffBlock(differences=len(items),
                        numerics_relevant=sum(1 for it in items if it["numerics_relevant"]),
                        items=[EnvDifference(**it) for it in items[:limit]],
                        truncated=len(items) > limit)
