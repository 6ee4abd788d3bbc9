"""llmflow.models (load_model, devices, dtypes, prompts, greedy generation) and DumpConfig checks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from llmflow.dump import DumpConfig
from llmflow.errors import UserError
from llmflow.models import (
    ByteTokenizer,
    build_tiny,
    encode_prompt,
    greedy_generate,
    load_model,
    resolve_device,
    resolve_dtype,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from dump_helpers import TINY, prompt_ids, tiny  # noqa: E402


def test_devices_and_dtypes():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(UserError, match=r"device 'npu:0': torch_npu is not installed"):
        resolve_device("npu:0")
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match=r"device 'cuda': CUDA is not available"):
            resolve_device("cuda")
    with pytest.raises(UserError, match=r"device 'tpu': unknown device"):
        resolve_device("tpu")
    with pytest.raises(UserError, match=r"device 'cuda:x'"):
        resolve_device("cuda:x")
    with pytest.raises(UserError, match=r"dtype 'fp8': unknown dtype"):
        resolve_dtype("fp8")


def test_tiny_llama_is_seeded_and_configurable():
    a, b = build_tiny("llama", "layers=1,hidden=32,seed=3"), build_tiny("llama", "layers=1,hidden=32,seed=3")
    c = build_tiny("llama", "layers=1,hidden=32,seed=4")
    wa, wb, wc = (m.model.layers[0].mlp.up_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert a.config.num_hidden_layers == 1 and a.config.hidden_size == 32
    for bad in ("layers=x", "depth=3", "vocab=100", "hidden=30,heads=4"):
        with pytest.raises(UserError, match="tiny-llama"):
            build_tiny("llama", bad)


def test_tiny_options_reach_each_familys_own_config_names():
    ds = build_tiny("deepseek-v3", "layers=3,experts=6,top_k=3,intermediate=96")
    assert (ds.config.n_routed_experts, ds.config.num_experts_per_tok) == (6, 3)
    assert ds.config.intermediate_size == ds.config.moe_intermediate_size == 96  # dense and expert MLPs
    assert ds.config.num_key_value_heads == ds.config.num_attention_heads == 4  # latent attention
    assert type(ds.model.layers[0].mlp).__name__ == "DeepseekV3MLP"  # a dense first layer, then MoE
    assert ds.model.layers[1].mlp.shared_experts is not None
    ernie = build_tiny("ernie4.5-moe", "layers=2,experts=6")
    assert (ernie.config.moe_num_experts, ernie.config.moe_k) == (6, 2)
    qwen = build_tiny("qwen2-moe", "layers=1,intermediate=96")
    assert qwen.config.moe_intermediate_size == qwen.config.shared_expert_intermediate_size == 96


def test_load_model_dtype_eval_no_grad():
    lm = load_model(TINY, dtype="bfloat16")
    p = next(lm.model.parameters())
    assert p.dtype is torch.bfloat16 and not p.requires_grad and not lm.model.training
    assert lm.device == torch.device("cpu") and lm.dtype is torch.bfloat16 and lm.spec == TINY


def test_load_model_bad_inputs(tmp_path):
    with pytest.raises(UserError, match="model 'no/such/dir'"):
        load_model("no/such/dir", base_dir=tmp_path)
    (tmp_path / "m.py").write_text(
        "import torch\n"
        "def none():\n    return 42\n"
        "def good():\n    return torch.nn.Linear(2, 2), None\n"
        "def patch_none(model):\n    model.weight.data.zero_()\n"
        "def patch_bad(model):\n    return 'nope'\n"
        "def patch_raises(model):\n    raise ValueError('no such part in Linear\\nsecond line')\n")
    with pytest.raises(UserError, match=r"model 'm.py:none': returned int, not a torch.nn.Module"):
        load_model("m.py:none", base_dir=tmp_path)
    lm = load_model("m.py:good", base_dir=tmp_path, patch="m.py:patch_none")
    assert isinstance(lm.model, torch.nn.Linear) and lm.model.weight.abs().sum() == 0
    with pytest.raises(UserError, match=r"patch 'm.py:patch_bad'"):
        load_model("m.py:good", base_dir=tmp_path, patch="m.py:patch_bad")
    with pytest.raises(UserError) as raised:  # a patch that does not fit the model: its message, one line
        load_model("m.py:good", base_dir=tmp_path, patch="m.py:patch_raises")
    want = "patch 'm.py:patch_raises' failed on Linear: ValueError: no such part in Linear"
    assert str(raised.value) == want
    with pytest.raises(UserError, match="device 'npu'"):
        load_model(TINY, device="npu")


def test_a_model_callable_carries_its_note_and_a_plain_one_has_none(tmp_path):
    """What a user must know about a model (the demo's planted bug) travels as the callable's
    ``note``; the console and the verdict repeat it."""
    (tmp_path / "m.py").write_text(
        "import torch\n"
        "def noted():\n    return torch.nn.Linear(2, 2)\n"
        "noted.note = 'this target carries a planted bug'\n"
        "def plain():\n    return torch.nn.Linear(2, 2)\n")
    assert load_model("m.py:noted", base_dir=tmp_path).note == "this target carries a planted bug"
    assert load_model("m.py:plain", base_dir=tmp_path).note is None
    assert load_model(TINY).note is None


def test_local_hf_directory(tmp_path):
    build_tiny("llama", "layers=1,hidden=32").save_pretrained(tmp_path / "hf")
    lm = load_model(str(tmp_path / "hf"))
    assert type(lm.model).__name__ == "LlamaForCausalLM" and lm.tokenizer is None
    with pytest.raises(UserError, match="prompt"):
        encode_prompt(lm.tokenizer, "hi")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_model_folder_without_tokenizer_files_is_told_to_get_them(tmp_path, family):
    """transformers gives some families' folders without tokenizer files a tokenizer of an empty
    vocabulary (Qwen2's) and others none (Llama's): either way the prompt is refused in one line
    saying which files to put there, never "no tokens to run"."""
    build_tiny(family, "layers=1,hidden=32").save_pretrained(tmp_path / "hf")
    lm = load_model(str(tmp_path / "hf"))
    with pytest.raises(UserError, match=r"^prompt: the model('s tokenizer \(\w+\) encodes it to no tokens|"
                                        r" has no tokenizer).*put its tokenizer files \(tokenizer.json"):
        encode_prompt(lm.tokenizer, "hi")


def test_encode_prompt_and_greedy_generate_agree_with_a_plain_loop():
    tok = ByteTokenizer()
    assert encode_prompt(tok, "hé") == [256, 104, 195, 169] and tok.decode([104, 195, 169, 257]) == "hé"
    lm = tiny()
    ids = prompt_ids("abc")
    new = greedy_generate(lm.model, ids, 5)
    seq = torch.tensor([ids])
    loop = []
    with torch.no_grad():
        for _ in range(5):
            nxt = int(lm.model(seq, use_cache=False).logits[0, -1].argmax())
            loop.append(nxt)
            seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
    assert new == loop

    class Bare(torch.nn.Module):  # no generate(): the plain loop
        def __init__(self):
            super().__init__()
            self.inner = lm.model

        def forward(self, x):
            return self.inner(x, use_cache=False).logits

    assert greedy_generate(Bare(), ids, 5) == loop


class _ChatTok:
    chat_template = "x"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and tokenize and messages[0]["content"] == "hi"
        return {"input_ids": [7, 8, 9]}


def test_encode_prompt_uses_the_chat_template():
    assert encode_prompt(_ChatTok(), "hi") == [7, 8, 9]


def test_dump_config_validation_names_the_field():
    cases = {"token_range": [-1], "tensor_part": 3, "mode": "ops", "data_mode": "summary",
             "max_bytes": 0, "module_list": 5, "device_id": -2, "seed": "x", "dump_weight": "yes",
             "layer_name": 5}
    for name, value in cases.items():
        with pytest.raises(UserError, match=rf"DumpConfig\.{name}"):
            DumpConfig(**{name: value})
    c = DumpConfig(mode="all", token_range="all", layer_name="root.model.layers.1*")
    assert c.mode == ["module", "api"] and c.wants_step(99)
    assert c.wants_name("model.layers.1.mlp") and c.wants_name("model.layers.12")
    assert not c.wants_name("model.layers.2") and not DumpConfig(layer_name="a.b").wants_name("aXb")
    assert DumpConfig(mode="none").mode == [] and DumpConfig(token_range=3).token_range == [3]
