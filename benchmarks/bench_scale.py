"""Benchmark: the shipped bisect recipe as the model grows, in time and in memory.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_scale.py                  # every size, once
    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_scale.py --sizes 300m 1b --repeat 2 \\
        --profile-sizes 300m 1b --json scale.json

Per size, Llama-shaped models with random weights from a seeded config (vocab 32000, the fp32
golden against the bf16 target on the CPU, the target's ``down_proj`` weight of the layer at 2/3
depth scaled by 1.1):

    30m     hidden 384,  intermediate 1024,  4 layers,  6 heads     ~32M parameters
    300m    hidden 1024, intermediate 2816,  18 layers, 16 heads    ~297M
    1b      hidden 2048, intermediate 5632,  16 layers, 16 heads    ~953M
    7b-2l   Llama-2-7B's widths (hidden 4096, intermediate 11008, 32 heads), 2 layers   ~666M
    7b-4l   the same, 4 layers (with 7b-2l: the cost of one 7B-wide layer)             ~1.07B

Each size's checkpoint is written once into ``--work-dir`` (config.json + model.safetensors in
float32 and a byte-level tokenizer, as a user's model directory holds them). The target is that
directory in bfloat16 (``target_model=DIR``, ``target_dtype=bfloat16``: llmflow's own load, which
casts the checkpoint tensor by tensor) with the fault planted by ``target_patch`` (a callable of a
generated ``scale_models.py``); the golden is the same directory in float32, which the bisect
streams layer by layer (``golden_weights: auto``), as it does a user's model directory.

Measured, each ``--repeat`` times:

1. plain: ``load_model`` + ``greedy_generate`` (8 new tokens) of the golden and of the faulty
   target, each in a process of its own: load seconds, generate seconds, the process's peak RSS.
2. recipe: ``python -m llmflow run llama2_bisect --set ...`` in a fresh run dir: the wall time,
   each stage's ``duration_s`` (summary.json), each stage's peak RSS, the whole run's peak RSS
   (``wait4``: the largest process of the tree), the bisect's own phase timings and the verdict
   (right when it names the faulty ``down_proj``, its MLP or its layer).
   The dump stages run in worker subprocesses, the others in the ``llmflow run`` process. A
   sampling thread (every 0.2 s) reads which stages are running from summary.json and every
   process's VmRSS/VmHWM from /proc; the main process's high-water mark is reset at each stage
   change (``/proc/PID/clear_refs``), so its per-stage peak is exact up to one sampling period.
3. with ``--profile-sizes``: the bisect stage once more on that run's dumps, in a process of its
   own under cProfile (the stage runs in a thread of ``llmflow run``, which cProfile does not
   see): every bisect phase's seconds and peak RSS, how many times each model is loaded and how
   long that takes, and the functions that take the time (``<size>-<n>.prof``, pstats format).
   ``--golden-weights whole streamed`` runs it once per way of holding the golden, loaded from
   its checkpoint directory (``golden_weights`` of the bisect): the streamed golden's memory and
   time beside the whole one's, on the same dumps. ``--no-plain`` skips step 1.

Sizes whose models do not fit this machine's available memory are skipped with a message.
Linux only (/proc). The figures and the method: docs/benchmarks.md, "Scale: model size".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Tell me a story about a dragon."
TOKENS = 8
SEED = 1234
FAULT_FACTOR = 1.1
VOCAB = 32000

#: size -> Llama config fields (vocab 32000, as Llama-2's tokenizer)
SIZES: dict[str, dict[str, int]] = {
    "30m": {"hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 6},
    "300m": {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 18,
             "num_attention_heads": 16},
    "1b": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 16,
           "num_attention_heads": 16},
    "7b-2l": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 2,
              "num_attention_heads": 32},
    "7b-4l": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 4,
              "num_attention_heads": 32},
}
DEFAULT_SIZES = ["30m", "300m", "1b", "7b-2l"]

MODEL_FILE = '''"""The target's fault of benchmarks/bench_scale.py (``target_patch``): one down_proj
weight of the layer at 2/3 depth scaled. Written by bench_scale.py."""

import torch

FAULT_LAYERS = {fault_layers!r}
FAULT_FACTOR = {factor!r}


def fault(size):
    """The target's fault: one down_proj weight scaled (the layer at 2/3 depth)."""
    def patch(model):
        with torch.no_grad():
            model.model.layers[FAULT_LAYERS[size]].mlp.down_proj.weight.mul_(FAULT_FACTOR)
    return patch
'''

MODEL_FILE_SIZE = '''

fault_{ident} = fault("{size}")
'''


def ident(size: str) -> str:
    return size.replace("-", "_")


def fault_layer(size: str) -> int:
    return (2 * SIZES[size]["num_hidden_layers"]) // 3


def param_count(size: str) -> int:
    c = SIZES[size]
    h, i, n = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    per_layer = 4 * h * h + 3 * h * i + 2 * h
    return 2 * VOCAB * h + n * per_layer + h


def gib(n: float) -> float:
    return round(n / 2**30, 2)


# -- /proc ----------------------------------------------------------------------------------------

def proc_status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of a process in bytes ({} once it is gone)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def reset_hwm(pid: int) -> None:
    """Reset a process's VmHWM to its current RSS (Linux >= 4.0)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            found.append(c)
            todo.append(c)
    return found


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def run_measured(cmd: list[str], env: dict[str, str], log: Path,
                 on_tick: Any = None) -> tuple[int, float, int]:
    """Run ``cmd``; (exit code, wall seconds, peak RSS in bytes of the largest process of its tree)."""
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=str(log.parent))
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.2):
                on_tick(proc.pid)
        ticker = threading.Thread(target=sample, daemon=True) if on_tick is not None else None
        if ticker is not None:
            ticker.start()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        stop.set()
        if ticker is not None:
            ticker.join()
    return proc.returncode, time.monotonic() - t0, usage.ru_maxrss * 1024


# -- the models -------------------------------------------------------------------------------------

def write_models(work: Path, sizes: list[str]) -> Path:
    """The checkpoints (once per size), their tokenizers and scale_models.py."""
    for size in sizes:
        folder = work / size
        if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
            if not (folder / "tokenizer.json").is_file():  # a checkpoint an older version wrote
                write_tokenizer(folder)
            continue
        print(f"[{size}] writing the seeded random checkpoint ({param_count(size) / 1e6:.0f}M parameters)",
              flush=True)
        code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); "
                f"from benchmarks.bench_scale import build_checkpoint; "
                f"build_checkpoint({size!r}, {str(folder)!r})")
        subprocess.run([sys.executable, "-c", code], check=True)
    text = MODEL_FILE.format(fault_layers={s: fault_layer(s) for s in SIZES}, factor=FAULT_FACTOR)
    text += "".join(MODEL_FILE_SIZE.format(ident=ident(s), size=s) for s in SIZES)
    path = work / "scale_models.py"
    path.write_text(text)
    return path


def build_checkpoint(size: str, folder: str) -> None:
    """A seeded random Llama of ``size`` saved as config.json + safetensors (written beside, then
    renamed into place)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmflow.models import ByteTokenizer

    config = LlamaConfig(vocab_size=VOCAB, num_key_value_heads=SIZES[size]["num_attention_heads"],
                         max_position_embeddings=2048, bos_token_id=ByteTokenizer.bos_token_id,
                         eos_token_id=ByteTokenizer.eos_token_id, pad_token_id=ByteTokenizer.pad_token_id,
                         tie_word_embeddings=False, **SIZES[size])
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    tmp = Path(folder + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    write_tokenizer(tmp)
    os.replace(tmp, folder)


def write_tokenizer(folder: Path) -> None:
    """A tokenizer that encodes ASCII text as llmflow's ByteTokenizer does (each character's byte,
    BOS 256 first; EOS 257, PAD 258), so the golden callable and the target directory read the
    prompt as the same ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from llmflow.models import ByteTokenizer

    vocab = {chr(i): i for i in range(32, 127)} | {"<unk>": 0, "<s>": ByteTokenizer.bos_token_id,
                                                   "</s>": ByteTokenizer.eos_token_id,
                                                   "<pad>": ByteTokenizer.pad_token_id}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", vocab["<s>"])])
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(str(folder))


# -- 1. plain generations ------------------------------------------------------------------------

def plain_worker(spec: str, dtype: str, patch: str, out: str) -> None:
    """One plain generation in this process, as the dump stage's worker loads and runs the model."""
    from llmflow.models import encode_prompt, greedy_generate, load_model
    from llmflow.seeding import seed_all

    seed_all(SEED)
    t0 = time.monotonic()
    loaded = load_model(spec, dtype=dtype, patch=patch or None)
    t1 = time.monotonic()
    # RSS counts the checkpoint's memory-mapped pages too (RssFile): what the process holds of
    # its own is RssAnon
    after_load = {k: gib(v) for k, v in proc_status(os.getpid()).items()}
    ids = encode_prompt(loaded.tokenizer, PROMPT)
    new = greedy_generate(loaded.model, ids, TOKENS, eos_token_id=loaded.tokenizer.eos_token_id)
    t2 = time.monotonic()
    after_generate = {k: gib(v) for k, v in proc_status(os.getpid()).items()}
    Path(out).write_text(json.dumps({"load_s": round(t1 - t0, 2), "generate_s": round(t2 - t1, 2),
                                     "prompt_tokens": len(ids), "output_ids": new,
                                     "rss_after_load_gib": after_load,
                                     "rss_after_generate_gib": after_generate}))


def run_plain(work: Path, size: str, side: str, tag: str) -> dict[str, Any]:
    models = work / "scale_models.py"
    spec = str(work / size)
    dtype = "float32" if side == "golden" else "bfloat16"
    patch = f"{models}:fault_{ident(size)}" if side == "target" else ""
    out = work / f"plain-{size}-{side}-{tag}.json"
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); "
            f"from benchmarks.bench_scale import plain_worker; "
            f"plain_worker({spec!r}, {dtype!r}, {patch!r}, {str(out)!r})")
    log = work / f"plain-{size}-{side}-{tag}.log"
    rc, wall, peak = run_measured([sys.executable, "-c", code], os.environ.copy(), log)
    if rc != 0:
        raise SystemExit(f"[{size}] plain {side} run failed (exit {rc}): see {log}")
    res = json.loads(out.read_text())
    res.update(wall_s=round(wall, 2), peak_rss_gib=gib(peak))
    return res


# -- 2. the recipe ----------------------------------------------------------------------------------

class StageSampler:
    """Per stage: the peak RSS of the llmflow run process and of the dump workers."""

    def __init__(self, run_dir: Path):
        self.summary = run_dir / "summary.json"
        self.running: tuple[str, ...] = ()
        self.peaks: dict[str, dict[str, int]] = {}  # stage -> {"main": bytes, "worker": bytes}

    def _running(self) -> tuple[str, ...]:
        try:
            stages = json.loads(self.summary.read_text()).get("stages", {})
        except (OSError, ValueError):
            return self.running
        return tuple(sid for sid, s in stages.items() if s.get("status") == "running")

    def _note(self, stages: tuple[str, ...], who: str, value: int) -> None:
        for sid in stages:
            peak = self.peaks.setdefault(sid, {})
            peak[who] = max(peak.get(who, 0), value)

    def tick(self, root: int) -> None:
        running = self._running()
        main = proc_status(root)
        if running != self.running:
            # the high-water mark since the last change belongs to the stages that were running
            self._note(self.running, "main", main.get("VmHWM", 0))
            reset_hwm(root)
            self.running = running
        self._note(running, "main", main.get("VmRSS", 0))
        for pid in descendants(root):
            self._note(running, "worker", proc_status(pid).get("VmHWM", 0))

    def finish(self, root_peak: int) -> None:
        self._note(self.running, "main", root_peak)


def run_recipe(work: Path, size: str, tag: str) -> dict[str, Any]:
    models = work / "scale_models.py"
    run_dir = work / "runs" / f"{size}-{tag}"
    shutil.rmtree(run_dir, ignore_errors=True)  # this benchmark's own earlier run
    sets = {"golden_model": str(work / size),
            "target_model": str(work / size), "target_dtype": "bfloat16",
            "target_patch": f"{models}:fault_{ident(size)}", "max_new_tokens": str(TOKENS),
            "prompt": PROMPT, "seed": str(SEED)}
    cmd = [sys.executable, "-m", "llmflow", "run", "llama2_bisect", "--run-dir", str(run_dir),
           "--progress", "plain"]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    sampler = StageSampler(run_dir)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    rc, wall, peak = run_measured(cmd, env, work / "runs" / f"{size}-{tag}.log", on_tick=sampler.tick)
    sampler.finish(0)
    summary = json.loads((run_dir / "summary.json").read_text())
    verdict = summary.get("verdict") or {}
    cost = verdict.get("cost") or {}
    expected = f"model.layers.{fault_layer(size)}.mlp.down_proj"
    named = verdict.get("first_bad_module") or ""
    stages = {sid: {"seconds": s.get("duration_s"),
                    "peak_rss_gib": {k: gib(v) for k, v in sampler.peaks.get(sid, {}).items()}}
              for sid, s in summary.get("stages", {}).items()}
    return {"exit_code": rc, "wall_s": round(wall, 1), "peak_rss_gib": gib(peak), "stages": stages,
            "bisect_phase_seconds": cost.get("bisect_phase_seconds"), "model_runs": cost.get("model_runs"),
            "status": verdict.get("status"), "headline": verdict.get("headline"),
            "first_bad_module": named, "first_bad_op": verdict.get("first_bad_op"),
            "replay": (verdict.get("replay") or {}).get("steps_tried"),
            "texts": verdict.get("texts"), "expected_module": expected,
            "right": bool(named) and (expected == named or expected.startswith(named + ".")
                                      and named.count(".") >= 2),
            "run_dir": str(run_dir)}


# -- 3. the bisect alone, profiled --------------------------------------------------------------------

def profile_worker(run_dir: str, out_prefix: str, golden_weights: str | None = None,
                   golden_dir: str | None = None) -> None:
    """The bisect stage of a finished run once more, in this process's main thread under cProfile:
    the stage's own code path (``run_bisect`` on the stage's recorded parameters). With
    ``golden_weights`` the golden is loaded from its checkpoint directory ``golden_dir`` (the
    same fp32 weights the run's golden callable loads) whole or streamed layer by layer."""
    import cProfile
    import pstats

    import llmflow.models as models_mod
    import llmflow.streamed as streamed_mod
    from llmflow.localize import bisect as bisect_mod
    from llmflow.workflow.state import read_state

    state = read_state(Path(run_dir) / "bisect")
    assert state is not None, f"{run_dir}: the bisect stage did not complete"
    params = state.params
    gen = {side: json.loads(Path(params[f"{side}_generation"]).read_text()) for side in ("golden", "target")}
    inputs = bisect_mod.BisectInputs(
        golden_dump=params["golden_dump"], target_dump=params["target_dump"],
        golden_spec=params["golden_model_spec"], target_spec=params["target_model_spec"],
        golden_ids=list(gen["golden"]["output_ids"]), target_ids=list(gen["target"]["output_ids"]),
        prompt_ids=list(gen["golden"]["input_ids"]),
        pairs=json.loads(Path(params["pairs_file"]).read_text()) if params.get("pairs_file") else None,
        replay_step=params.get("replay_step"), ratio_threshold=params["ratio_threshold"],
        layers=params.get("layers") or None)
    if golden_weights:
        inputs.golden_spec = {"model": golden_dir, "device": "cpu", "dtype": "float32"}
        inputs.golden_weights = golden_weights

    pid = os.getpid()
    phases: list[dict[str, Any]] = []
    loads: list[dict[str, Any]] = []
    real_phase, real_load = bisect_mod._Bisect.phase, models_mod.load_model
    real_streamed = streamed_mod.load_streamed

    def phase(self: Any, name: str, detail: str = "") -> None:
        real_phase(self, name, detail)
        st = proc_status(pid)
        phases.append({"phase": name, "end_s": round(time.monotonic() - t0, 2),
                       "peak_rss_gib": gib(st.get("VmHWM", 0)), "rss_at_end_gib": gib(st.get("VmRSS", 0)),
                       "anon_at_end_gib": gib(st.get("RssAnon", 0)),
                       "file_at_end_gib": gib(st.get("RssFile", 0))})
        reset_hwm(pid)

    def load_model(model: str, **kw: Any) -> Any:
        t = time.monotonic()
        loaded = real_load(model, **kw)
        loads.append({"model": model.rsplit(":", 1)[-1], "dtype": kw.get("dtype"),
                      "seconds": round(time.monotonic() - t, 2), "at_s": round(t - t0, 2)})
        return loaded

    def load_streamed(model: str, **kw: Any) -> Any:
        t = time.monotonic()
        loaded = real_streamed(model, **kw)
        loads.append({"model": model.rsplit("/", 1)[-1] + " (streamed)", "dtype": kw.get("dtype"),
                      "seconds": round(time.monotonic() - t, 2), "at_s": round(t - t0, 2)})
        return loaded

    bisect_mod._Bisect.phase = phase  # type: ignore[method-assign]
    models_mod.load_model = load_model  # type: ignore[assignment]
    streamed_mod.load_streamed = load_streamed  # type: ignore[assignment]
    reset_hwm(pid)
    start_rss = proc_status(pid).get("VmRSS", 0)
    prof = cProfile.Profile()
    t0 = time.monotonic()
    prof.enable()
    result = bisect_mod.run_bisect(inputs, log=lambda _m: None)
    prof.disable()
    total = time.monotonic() - t0
    prof.dump_stats(out_prefix + ".prof")
    stats = pstats.Stats(prof)
    watched = {}
    for (file, _line, func), (_cc, nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if "llmflow" in file or func in ("from_pretrained", "generate", "_apply", "load_state_dict"):
            key = f"{Path(file).parent.name}/{Path(file).name}:{func}"
            if ct >= 0.5 or "llmflow" in file and nc >= 50:
                watched[key] = {"calls": nc, "cumulative_s": round(ct, 2), "own_s": round(tt, 2)}
    top = dict(sorted(watched.items(), key=lambda kv: -kv[1]["cumulative_s"])[:40])
    Path(out_prefix + ".json").write_text(json.dumps({
        "seconds": round(total, 1), "status": result.status, "headline": result.headline,
        "golden_weights": result.cost.model_runs.golden_weights,
        "first_bad_module": result.first_bad_module,
        "start_rss_gib": gib(start_rss), "phases": phases, "model_loads": loads, "functions": top}, indent=1))


def run_profile(work: Path, size: str, tag: str, run_dir: str, golden_weights: str | None = None
                ) -> dict[str, Any]:
    prefix = str(work / (f"profile-{size}-{tag}" + (f"-{golden_weights}" if golden_weights else "")))
    golden_dir = str(work / size) if golden_weights else None
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); "
            f"from benchmarks.bench_scale import profile_worker; "
            f"profile_worker({run_dir!r}, {prefix!r}, {golden_weights!r}, {golden_dir!r})")
    rc, wall, peak = run_measured([sys.executable, "-c", code], os.environ.copy(),
                                  Path(prefix + ".log"))
    if rc != 0:
        return {"error": f"exit {rc}: see {prefix}.log"}
    res = json.loads(Path(prefix + ".json").read_text())
    res.update(wall_s=round(wall, 1), peak_rss_gib=gib(peak), pstats=prefix + ".prof")
    return res


# -- main -----------------------------------------------------------------------------------------------

def fits(size: str) -> tuple[bool, str]:
    """The recipe's largest process holds the fp32 golden and the bf16 target (6 bytes a
    parameter) plus working memory: ask for 7 bytes a parameter, and for the checkpoint's write."""
    need = 7 * param_count(size)
    have = available_bytes()
    return need <= have, f"needs ~{gib(need)} GiB, {gib(have)} GiB available"


def print_size(size: str, res: dict[str, Any]) -> None:
    n = param_count(size)
    print(f"\n== {size}: {n / 1e6:.0f}M parameters, fp32 weights {gib(4 * n)} GiB")
    for p in res["plain"]:
        print(f"plain {p['side']:6s} load {p['load_s']:6.1f} s  generate {p['generate_s']:6.1f} s  "
              f"peak {p['peak_rss_gib']:.2f} GiB")
    for r in res["recipe"]:
        stages = "  ".join(f"{sid} {s['seconds']}s/{max(s['peak_rss_gib'].values(), default=0)}G"
                           for sid, s in r["stages"].items())
        print(f"recipe {r['wall_s']} s, peak {r['peak_rss_gib']} GiB, {r['status']} "
              f"({'right' if r['right'] else 'WRONG'}: {r['first_bad_module']}): {stages}")
        print(f"  bisect phases: {r['bisect_phase_seconds']}")
    for p in res.get("profile", []):
        print(f"profile ({p.get('golden_weights')} golden): bisect {p.get('seconds')} s, "
              f"peak {p.get('peak_rss_gib')} GiB, loads "
              f"{[(x['model'], x['seconds']) for x in p.get('model_loads', [])]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=DEFAULT_SIZES, choices=list(SIZES))
    ap.add_argument("--repeat", type=int, default=1, help="runs of each measurement (default 1)")
    ap.add_argument("--profile-sizes", nargs="*", default=[], choices=list(SIZES),
                    help="sizes whose bisect is re-run under cProfile after each recipe run")
    ap.add_argument("--golden-weights", nargs="+", default=[], choices=["whole", "streamed"],
                    help="profile the bisect with the golden loaded from its checkpoint directory this "
                    "way (each in turn, on the same dumps) instead of through the golden callable")
    ap.add_argument("--no-plain", action="store_true", help="skip the plain generations")
    ap.add_argument("--work-dir", default=None, help="checkpoints, runs and profiles (default: a "
                    "temporary directory, removed unless --keep); checkpoints found there are reused")
    ap.add_argument("--keep", action="store_true", help="keep the temporary work directory")
    ap.add_argument("--json", default=None, help="write every figure here")
    args = ap.parse_args(argv)
    import tempfile

    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="llmflow-bench-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    sizes = []
    for size in args.sizes:
        ok, why = fits(size)
        if ok:
            sizes.append(size)
        else:
            print(f"[{size}] skipped: does not fit this machine ({why})", flush=True)
    figures: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "load_avg_start": os.getloadavg()},
                               "sizes": {}}
    try:
        write_models(work, sizes)
        for size in sizes:
            res: dict[str, Any] = {"params": param_count(size), "config": SIZES[size],
                                   "fault_layer": fault_layer(size), "plain": [], "recipe": [], "profile": []}
            figures["sizes"][size] = res

            def save() -> None:  # after every measurement: a long run stopped early keeps its figures
                if args.json:
                    Path(args.json).write_text(json.dumps(figures, indent=1))
            for n in range(args.repeat):
                for side in () if args.no_plain else ("golden", "target"):
                    print(f"[{size}] plain {side} #{n + 1}", flush=True)
                    res["plain"].append({"side": side, **run_plain(work, size, side, str(n))})
                    save()
                print(f"[{size}] recipe #{n + 1}", flush=True)
                rec = run_recipe(work, size, str(n))
                res["recipe"].append(rec)
                save()
                if size in args.profile_sizes:
                    print(f"[{size}] bisect under cProfile #{n + 1}", flush=True)
                    for weights in args.golden_weights or [None]:
                        res["profile"].append(run_profile(work, size, str(n), rec["run_dir"], weights))
                        save()
            print_size(size, res)
    finally:
        figures["machine"]["load_avg_end"] = os.getloadavg()
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=1))
        if not args.work_dir and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r["right"] for s in figures["sizes"].values() for r in s["recipe"]) else 1


if __name__ == "__main__":
    sys.exit(main())
