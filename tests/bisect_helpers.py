"""Shared helpers of the bisect and report tests: synthetic verdicts and compare rows, dumps of
tiny models, and a headless Chromium runner with what reads its output (DOM, screenshot pixels)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import pytest

from llmflow.results.verdict import (
    Candidate,
    Cost,
    Inconclusive,
    ModelRuns,
    OpRow,
    ReplayInfo,
    RoutedToken,
    RoutingRow,
    SideText,
    Texts,
    TokenDetail,
    TokenRow,
    Verdict,
)

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


def run_chromium(html: Path, *extra: str, fragment: str = "",
                 timeout: float = 60) -> subprocess.CompletedProcess:
    """Run headless Chromium on a local file (``#fragment`` appended) with a throw-away profile."""
    with tempfile.TemporaryDirectory(prefix="llmflow-chrome-") as profile:
        url = html.as_uri() + (f"#{fragment}" if fragment else "")
        cmd = [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *extra, url]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@dataclass
class Element:
    """One element of a parsed page: its tag, attributes and the text inside it."""

    tag: str
    attrs: dict[str, str]
    text: str = ""
    parent: Element | None = None

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def within(self, tag: str, **attrs: str) -> bool:
        """Whether an ancestor has this tag (and these attribute values)."""
        node = self.parent
        while node is not None:
            if node.tag == tag and all(node.attrs.get(k) == v for k, v in attrs.items()):
                return True
            node = node.parent
        return False


VOID_TAGS = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track",
             "wbr"}


def parse_dom(html: str) -> list[Element]:
    """Every element of ``html`` (e.g. Chromium's ``--dump-dom``) in document order."""
    elements: list[Element] = []
    stack: list[Element] = []

    class Parser(HTMLParser):
        def handle_starttag(self, tag, attrs):
            el = Element(tag, {k: v or "" for k, v in attrs}, parent=stack[-1] if stack else None)
            elements.append(el)
            if tag not in VOID_TAGS:
                stack.append(el)

        def handle_startendtag(self, tag, attrs):
            elements.append(Element(tag, {k: v or "" for k, v in attrs}, parent=stack[-1] if stack else None))

        def handle_endtag(self, tag):
            for i in range(len(stack) - 1, -1, -1):
                if stack[i].tag == tag:
                    del stack[i:]
                    break

        def handle_data(self, data):
            for el in stack:
                el.text += data

    Parser(convert_charrefs=True).feed(html)
    return elements


def find(elements: list[Element], tag: str | None = None, cls: str | None = None,
         **attrs: str) -> list[Element]:
    """The elements with this tag, class and attribute values (``data_name`` for data-name)."""
    return [e for e in elements if (tag is None or e.tag == tag) and (cls is None or cls in e.classes)
            and all(e.attrs.get(k.replace("_", "-")) == v for k, v in attrs.items())]


def children(elements: list[Element], parent: Element) -> list[Element]:
    return [e for e in elements if e.parent is parent]


def side_rows(elements: list[Element]) -> dict[str, Element]:
    """The report's golden/target table: fact (model, dtype, torch, ...) -> its row."""
    return {th.text: th.parent for th in find(elements, "th", scope="row")
            if th.within("table", **{"class": "sides"})}


def png_rows(data: bytes, first: int, count: int) -> tuple[int, list[list[tuple[int, int, int]]]]:
    """(width, rows ``first`` .. ``first + count - 1`` as RGB pixels) of an 8-bit RGB/RGBA,
    non-interlaced PNG such as Chromium's screenshots: enough to check what a region shows."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    assert header is not None
    width, _height, depth, color, _c, _f, interlace = header
    assert depth == 8 and color in (2, 6) and interlace == 0, header
    bpp = 3 if color == 2 else 4
    stride = width * bpp
    raw = zlib.decompress(idat)
    prev = bytearray(stride)
    rows = []
    for y in range(first + count):
        ftype, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if ftype == 1:
                line[i] = (line[i] + a) & 255
            elif ftype == 2:
                line[i] = (line[i] + b) & 255
            elif ftype == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif ftype == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        if y >= first:
            rows.append([tuple(line[x * bpp:x * bpp + 3]) for x in range(width)])
        prev = line
    return width, rows


def synthetic_verdict(n_layers: int = 12, bad_layer: int = 7, *, state: str = "fault") -> Verdict:
    """A verdict shaped like the bisect stage's, with hostile names to test escaping.

    ``state``: "fault" (a module and op blamed, status fail), "pass" (identical outputs),
    "inconclusive" (the texts differ, no module stands out, what to run next), "moe" (a fault
    plus MoE routing differences). ``to_json`` of it is a verdict.json."""
    raw = {str(i): 2e-3 * (1.25 ** i) for i in range(n_layers)}
    iso = {str(i): 3e-3 * (1 + 0.1 * (i % 3)) for i in range(n_layers)}
    iso[str(bad_layer)] = 0.4
    cands = [Candidate(rank=1, name=f"model.layers.{bad_layer}.mlp.down_proj", error=0.4, typical=0.003,
                       score=133.3, anomalous=True, layer=f"model.layers.{bad_layer}")]
    cands += [Candidate(rank=i + 2, name=f"model.layers.{i}.mlp.down_proj", error=0.003, typical=0.003,
                        score=1.0 + i / 100, anomalous=False, layer=f"model.layers.{i}") for i in range(5)]
    cands.append(Candidate(rank=8, name="<script>alert('x')</script>"))
    tokens = ["The", " capital", " is", " Paris", ".", " It", " is", " big", ".", "\n"]
    target = tokens[:3] + [" Lyon", "<&>"] + tokens[5:]
    op = f"model.layers.{bad_layer}.mlp.down_proj"
    v = Verdict(
        status="fail",
        headline=f"fault in model.layers.{bad_layer}.mlp.down_proj/mul.0 <i>(op)</i>",
        first_mismatch_token=3, first_bad_token=1,
        first_bad_layer=f"model.layers.{bad_layer}",
        first_bad_module=f"model.layers.{bad_layer}.mlp.down_proj",
        first_bad_op=f"model.layers.{bad_layer}.mlp.down_proj/mul.0",
        diagnosis=f"model.layers.{bad_layer}.mlp.down_proj's own error is 133x that of the same module "
                  "in other layers & <b>not</b> bf16 noise",
        token_detail=TokenDetail(step=3, golden_token=" Paris", target_token=" Lyon"),
        texts=Texts(golden=SideText(label="fp32 cpu", text="".join(tokens), tokens=tokens),
                    target=SideText(label="bf16 cpu", text="".join(target), tokens=target)),
        curves={"relative error": {"raw": raw, "isolated": iso},
                "cosine distance": {"raw": {i: x / 10 for i, x in raw.items()},
                                    "isolated": {i: x / 10 for i, x in iso.items()}}},
        candidates=cands,
        ops=[OpRow(name=f"{op}/linear.0", golden_api="linear", target_api="linear", raw=0.003, iso=0.003,
                   status="matched"),
             OpRow(name=f"{op}/mul.0", golden_api="mul", target_api="mul", raw=0.5, iso=0.5,
                   status="matched")],
        token_rows=[TokenRow(step=i, target_step=i, golden_text=tok, target_text=target[i],
                             same_token=tok == target[i], kl=1e-4 * (1 + 50 * (i >= 1)),
                             cosine_similarity=0.9999 if i < 1 else 0.9, verdict="pass" if i < 1 else "fail")
                    for i, tok in enumerate(tokens)],
        replay=ReplayInfo(step=0, why="the first step whose logits fail the thresholds", source="dump",
                          replayed=6 * n_layers, not_replayable=2, ratio_threshold=3.0, device="cpu",
                          dtype="bfloat16",
                          reasons={"needs the KV cache of earlier steps": ["model.layers.0.self_attn"],
                                   "<b>no golden inputs</b> dumped": ["lm_head<x>"]}),
        cost=Cost(model_runs=ModelRuns(full_generations=2, models_loaded_by_bisect=1,
                                       golden_layers_recomputed=0, golden_reruns=0, module_replays=72,
                                       op_replays=2),
                  bytes_dumped=1234567, golden_dump_bytes=1000000, target_dump_bytes=234567,
                  full_api_dump_bytes_estimate=98765432, bytes_fraction_of_full_api_dump=0.0125,
                  bisect_seconds=12.5,
                  bisect_phase_seconds={"load target model": 3.0, "module: isolation replay": 9.5}),
    )
    if state == "pass":
        v.status, v.headline = "pass", "the target matches the golden: same tokens, logits within limits"
        v.first_mismatch_token = v.first_bad_token = v.first_bad_layer = v.first_bad_module = None
        v.first_bad_op, v.token_detail, v.ops = None, TokenDetail(), []
        v.diagnosis = "The target matches the golden."
        v.texts.target = SideText(label="bf16 cpu", text="".join(tokens), tokens=tokens)
        for r in v.token_rows:
            r.target_text, r.same_token, r.verdict, r.cosine_similarity = r.golden_text, True, "pass", 0.99999
    elif state == "inconclusive":
        v.status, v.headline = "inconclusive", "the texts differ at token 3 but no module stands out"
        v.diagnosis = "No module's own error stands out from the same module in the other layers."
        v.first_bad_layer = v.first_bad_module = v.first_bad_op = None
        v.ops = []
        v.inconclusive = Inconclusive(reason="the replay covers step 0 (prefill) only; the logits first "
                                             "fail at step 1 <decode>",
                                      next="llmflow run workflows/llama2_bisect.yaml --set replay_step=1")
    elif state == "moe":
        v.routing = [RoutingRow(module=f"model.layers.{bad_layer}.mlp.gate", step=1,
                                tokens=[RoutedToken(position=p, golden_experts=[3, 5], target_experts=[3, 6],
                                                    text=tokens[p]) for p in (4, 9)],
                                output_error_with_target_routing=0.2, output_error_with_golden_routing=0.004,
                                detail="experts {3, 5} -> {3, 6} <top-2>"),
                     RoutingRow(module="model.layers.9.mlp.gate", step=2,
                                tokens=[RoutedToken(position=1, golden_experts=[0, 1], target_experts=[0, 2],
                                                    text=tokens[1])],
                                output_error_with_target_routing=0.1, output_error_with_golden_routing=0.003,
                                detail="{0, 1} -> {0, 2}")]
    elif state != "fault":
        raise ValueError(f"unknown synthetic verdict state {state!r}")
    return v


def synthetic_topology(n_layers: int = 12) -> dict:
    """A Llama-shaped topology.json: embeddings, ``n_layers`` decoder layers (attention with four
    projections, MLP with three and its activation, two norms), the final norm and the LM head."""
    def node(name: str, type_: str, *children: dict) -> dict:
        return {"name": name, "type": type_, "params": {}, "children": list(children)}

    def layer(i: int) -> dict:
        p = f"model.layers.{i}"
        return node(p, "LlamaDecoderLayer",
                    node(f"{p}.self_attn", "LlamaAttention",
                         *(node(f"{p}.self_attn.{x}_proj", "Linear") for x in "qkvo")),
                    node(f"{p}.mlp", "LlamaMLP", *(node(f"{p}.mlp.{x}", "Linear")
                                                  for x in ("gate_proj", "up_proj", "down_proj")),
                         node(f"{p}.mlp.act_fn", "SiLU")),
                    node(f"{p}.input_layernorm", "LlamaRMSNorm"),
                    node(f"{p}.post_attention_layernorm", "LlamaRMSNorm"))

    return node("", "LlamaForCausalLM",
                node("model", "LlamaModel", node("model.embed_tokens", "Embedding"),
                     node("model.layers", "ModuleList", *(layer(i) for i in range(n_layers))),
                     node("model.norm", "LlamaRMSNorm")),
                node("lm_head", "Linear"))


def synthetic_layer_rows(n_steps: int = 8, n_layers: int = 12, *, bad_step: int = 1, bad_layer: int = 7,
                         level: str = "layer", mlp: bool = False) -> list[dict]:
    """Compare rows as the compare stage's CSV holds them (all strings): decoder-layer outputs
    at every step, the error jumping at (bad_step, bad_layer) and carried to every later layer
    and step. ``level="module"`` adds the golden's layer inputs, unmatched (kept for replay), as
    in a bisect's module-level compare, and with ``mlp`` each layer's MLP output."""
    rows = []
    for step in range(n_steps):
        for layer in range(n_layers):
            bad = step >= bad_step and layer >= bad_layer
            err = (0.3 if bad else 2e-3) * (1 + 0.05 * layer) * (1 + 0.1 * step)
            base = {"step": str(step), "target_step": str(step), "rank": "0", "name": f"model.layers.{layer}",
                    "target_name": f"model.layers.{layer}", "kind": "output", "index": "0", "match": "name",
                    "module_type": "LlamaDecoderLayer"}
            rows.append({**base, "cosine_similarity": repr(1 - err * err),
                         "relative_euclidean_distance": repr(err), "max_absolute_error": repr(err * 3),
                         "verdict": "fail" if err > 0.05 else "pass", "reason": ""})
            if level == "module" and mlp:
                names = {"name": f"model.layers.{layer}.mlp", "target_name": f"model.layers.{layer}.mlp",
                         "module_type": "LlamaMLP"}
                rows.append({**base, **names, "cosine_similarity": repr(1 - err * err),
                             "relative_euclidean_distance": repr(err), "max_absolute_error": repr(err * 3),
                             "verdict": "fail" if err > 0.05 else "pass", "reason": ""})
            if level == "module":
                rows.append({**base, "target_name": "", "kind": "input", "match": "unmatched golden",
                             "cosine_similarity": "", "relative_euclidean_distance": "",
                             "max_absolute_error": "", "verdict": "unmatched", "reason": "unmatched golden"})
    return rows


def make_dumps(tmp: Path, model: str, *, patch: str | None = None, prompt: str = "Tell me a story.",
               max_new_tokens: int = 6, golden_dir: Path | None = None, golden_all: bool = False,
               target_device: str = "cpu", target_model: str | None = None,
               target_dtype: str = "bfloat16") -> dict:
    """Golden (fp32, inputs+outputs of the decoder layers at every step, or of every module at
    the prefill with ``golden_all``) and target (``target_dtype``, decoder-layer outputs at every step) dumps
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
    target = load_model(target_model, device=target_device, dtype=target_dtype, patch=patch, base_dir=repo)
    t_dir = tmp / "target"
    t_ids = dump_run(target, ids, max_new_tokens, DumpConfig(dump_path=str(t_dir), token_range="all",
                                                              tensor_part=1, module_list=layer_cls))
    return {"golden_dump": g_dir, "target_dump": t_dir, "golden_ids": g_ids, "target_ids": t_ids,
            "prompt_ids": ids,
            "golden_spec": {"model": model, "device": "cpu", "dtype": "float32"},
            "target_spec": {"model": target_model, "device": target_device, "dtype": target_dtype,
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
    """``run_bisect`` on ``make_dumps``'s result, as verdict.json holds it (JSON values)."""
    from llmflow.localize.bisect import BisectInputs, run_bisect
    from llmflow.results.codec import to_json

    return to_json(run_bisect(BisectInputs(**dumps, **kwargs), log=lambda _m: None))


def save_char_tokenizer(directory: Path) -> None:
    """A character-level tokenizer (ids as the byte tokenizer's: printable ASCII, BOS 256, EOS 257,
    PAD 258) saved beside the model, so the recipe's dump stages can encode a prompt."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(i): i for i in range(32, 127)} | {"<unk>": 0, "<s>": 256, "</s>": 257, "<pad>": 258}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(str(directory))


def tiny_model_dirs(factory, size: str, folder: str = "hf") -> Callable[[str], Path]:
    """A function family -> that family's tiny seeded model of ``size`` saved as a Hugging Face
    directory with a tokenizer, as a user's model comes, made once per family (``factory`` is
    pytest's ``tmp_path_factory``)."""
    from llmflow.models import build_tiny

    made: dict[str, Path] = {}

    def model_dir(family: str) -> Path:
        if family not in made:
            directory = factory.mktemp(family) / folder
            build_tiny(family, size).save_pretrained(str(directory))
            save_char_tokenizer(directory)
            made[family] = directory
        return made[family]
    return model_dir


def run_bisect_recipe(run_dir: Path, *sets: str, max_new_tokens: int) -> subprocess.CompletedProcess:
    """``llmflow run llama2_bisect --set ...`` as a user types it, from ``run_dir``'s parent, with
    this checkout's llmflow importable."""
    from path_helpers import checkout_path

    args = [sys.executable, "-m", "llmflow", "run", "llama2_bisect", "--run-dir", str(run_dir),
            "--progress", "plain", "--set", f"max_new_tokens={max_new_tokens}"]
    for s in sets:
        args += ["--set", s]
    repo = Path(__file__).resolve().parents[1]
    return subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=run_dir.parent,
                          env={**os.environ, "PYTHONPATH": checkout_path(repo)})


def user_dump(directory: Path, model: str, scope: dict, *, dtype: str = "float32", patch: str | None = None,
              prompt: str = "Tell me a story.", max_new_tokens: int = 5) -> Path:
    """What a user's own script writes: ``dump_run`` with every step's tensors, inputs and outputs,
    over ``scope`` (``{}``: every module; ``{"module_list": ["auto"]}``: the decoder layers)."""
    from llmflow.dump.config import DumpConfig
    from llmflow.dump.run import dump_run
    from llmflow.models import encode_prompt, load_model

    loaded = load_model(model, dtype=dtype, patch=patch)
    ids = encode_prompt(loaded.tokenizer, prompt)
    dump_run(loaded, ids, max_new_tokens,
             DumpConfig(dump_path=str(directory), token_range="all", tensor_part=2, **scope))
    return directory


def user_golden_maker(factory) -> Callable[[str, dict], Path]:
    """A function (model spec, scope) -> its fp32 ``user_dump``, made once per pair (``factory`` is
    pytest's ``tmp_path_factory``)."""
    made: dict[tuple[str, str], Path] = {}

    def golden(model: str, scope: dict) -> Path:
        key = (model, repr(scope))
        if key not in made:
            made[key] = user_dump(factory.mktemp("golden"), model, scope)
        return made[key]
    return golden


def recipe_bisect_reusing_golden(tmp_path: Path, family: str, size: str, golden_runs: dict[str, Path],
                                 *sets: str) -> tuple[int, str, dict]:
    """``llmflow run llama2_bisect`` on ``tiny-<family>:<size>`` for golden and target (``sets``:
    more ``NAME=VALUE``), in ``tmp_path/run``; the first run of a family is kept in ``golden_runs``
    and a later one starts from a copy of it, its golden dump reused (checked: cached). Returns
    the exit code, the last line and the verdict."""
    from workflow_helpers import llmflow

    run = tmp_path / "run"
    reused = family in golden_runs
    if reused:
        shutil.copytree(golden_runs[family], run, symlinks=True)
    model = f"tiny-{family}:{size}"
    args = ["--set", f"golden_model={model}", "--set", f"target_model={model}"]
    for s in sets:
        args += ["--set", s]
    proc = llmflow("run", "llama2_bisect", "--run-dir", str(run), "--progress", "plain", *args, timeout=600)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    if reused:
        assert "dump-golden: cached" in proc.stdout, proc.stdout[-3000:]
    elif "dump-golden: done" in proc.stdout:
        golden_runs[family] = run
    verdict = json.loads((run / "bisect" / "verdict.json").read_text())
    return proc.returncode, proc.stdout.strip().splitlines()[-1], verdict
