"""Shared helpers of the bisect area's tests: a synthetic verdict and a headless Chromium runner."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage"]


def chromium() -> str:
    """The Chromium binary, or skip the test with the reason."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("headless Chromium is not installed (apt-get install -y chromium)")


def run_chromium(html: Path, *extra: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run headless Chromium on a local file with a throw-away profile."""
    with tempfile.TemporaryDirectory(prefix="llmflow-chrome-") as profile:
        cmd = [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *extra, html.as_uri()]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def synthetic_verdict(n_layers: int = 12, bad_layer: int = 7) -> dict:
    """A verdict shaped like the bisect stage's, with hostile names to test escaping."""
    raw = {i: 2e-3 * (1.25 ** i) for i in range(n_layers)}
    iso = {i: 3e-3 * (1 + 0.1 * (i % 3)) for i in range(n_layers)}
    iso[bad_layer] = 0.4
    cands = [{"rank": 1, "name": f"model.layers.{bad_layer}.mlp.down_proj", "error": 0.4,
              "typical": 0.003, "score": 133.3, "anomalous": True}]
    cands += [{"rank": i + 2, "name": f"model.layers.{i}.mlp.down_proj", "error": 0.003,
               "typical": 0.003, "score": 1.0 + i / 100, "anomalous": False} for i in range(5)]
    cands.append({"rank": 8, "name": "<script>alert('x')</script>", "error": None, "score": None})
    return {
        "first_mismatch_token": 3, "first_bad_token": 1,
        "first_bad_layer": f"model.layers.{bad_layer}",
        "first_bad_module": f"model.layers.{bad_layer}.mlp.down_proj",
        "first_bad_op": f"model.layers.{bad_layer}.mlp.down_proj/mul.0",
        "diagnosis": "model.layers.7.mlp.down_proj's own error is 133x that of the same module "
                     "in other layers & <b>not</b> bf16 noise",
        "token_detail": {"golden_token": " Paris", "target_token": " Lyon"},
        "texts": {"golden": {"label": "fp32 cpu", "tokens": ["The", " capital", " is", " Paris", "."]},
                  "target": {"label": "bf16 cpu", "tokens": ["The", " capital", " is", " Lyon", "<&>"]}},
        "curves": {"relative error": {"raw": raw, "isolated": iso},
                   "cosine distance": {"raw": {i: v / 10 for i, v in raw.items()},
                                       "isolated": {i: v / 10 for i, v in iso.items()}}},
        "candidates": cands,
        "ops": [{"name": f"model.layers.{bad_layer}.mlp.down_proj/linear.0", "error": 0.003},
                {"name": f"model.layers.{bad_layer}.mlp.down_proj/mul.0", "error": 0.5}],
        "cost": {"model_runs": 6, "bytes_dumped": 1234567, "seconds": 12.5,
                 "full_api_dump_bytes_estimate": 98765432},
    }


def make_dumps(tmp: Path, model: str, *, patch: str | None = None, prompt: str = "Tell me a story.",
               max_new_tokens: int = 6, golden_dir: Path | None = None, golden_all: bool = False,
               target_device: str = "cpu", target_model: str | None = None) -> dict:
    """Golden (fp32, inputs+outputs of the decoder layers at every step, or of every module at
    the prefill with ``golden_all``) and target (bf16, decoder-layer outputs at every step) dumps
    written with ``dump_run`` directly, as the recipe's two dump stages write them (the decoder
    layers found from the model's structure, as the recipe's ``layer_class: auto``).

    Pass ``golden_dir`` of an earlier call to reuse its golden dump (the golden never changes);
    ``target_device`` puts the target on an accelerator (the golden stays on the CPU)."""
    from llmflow.dump.config import DumpConfig
    from llmflow.dump.run import dump_run
    from llmflow.models import encode_prompt, load_model

    repo = Path(__file__).resolve().parents[1]
    from llmflow.structure import resolve_module_classes

    golden = load_model(model)
    layer_cls = resolve_module_classes(golden.model, ["auto"])
    ids = encode_prompt(golden.tokenizer, prompt)
    g_dir = golden_dir or tmp / "golden"
    g_ids_file = g_dir.with_name(g_dir.name + ".ids.json")
    if golden_dir is None:
        config = DumpConfig(dump_path=str(g_dir), token_range=[0] if golden_all else "all", tensor_part=2,
                            module_list=[] if golden_all else layer_cls)
        g_ids = dump_run(golden, ids, max_new_tokens, config)
        g_ids_file.write_text(json.dumps(g_ids))
    g_ids = json.loads(g_ids_file.read_text())
    target_model = target_model or model
    target = load_model(target_model, device=target_device, dtype="bfloat16", patch=patch, base_dir=repo)
    t_dir = tmp / "target"
    t_ids = dump_run(target, ids, max_new_tokens, DumpConfig(dump_path=str(t_dir), token_range="all",
                                                              tensor_part=1, module_list=layer_cls))
    return {"golden_dump": g_dir, "target_dump": t_dir, "golden_ids": g_ids, "target_ids": t_ids,
            "prompt_ids": ids,
            "golden_spec": {"model": model, "device": "cpu", "dtype": "float32"},
            "target_spec": {"model": target_model, "device": target_device, "dtype": "bfloat16",
                            "patch": patch, "base_dir": str(repo)}}


def golden_maker(factory, spec) -> Callable[[str], Path]:
    """A function family -> golden dump dir of the model ``spec(family)``, made once per family
    (``factory`` is pytest's ``tmp_path_factory``)."""
    made: dict[str, Path] = {}

    def golden(family: str) -> Path:
        if family not in made:
            made[family] = make_dumps(factory.mktemp(f"golden-{family}"), spec(family))["golden_dump"]
        return made[family]
    return golden


def bisect_dumps(dumps: dict, **kwargs) -> dict:
    """``run_bisect`` on ``make_dumps``'s result."""
    from llmflow.localize.bisect import BisectInputs, run_bisect

    return run_bisect(BisectInputs(**dumps, **kwargs), log=lambda _m: None).to_json()
