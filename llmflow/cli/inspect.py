"""Show what a dump holds, or one of its tensors (as Polygraphy's inspect data does).

  llmflow inspect DUMP                       steps, ranks and per level: entries, names, kinds
                                             (exit 1 when the dump is damaged, its problems
                                             listed, or holds nothing)
  llmflow inspect DUMP NAME [--step N] [--index I] [--kind input|output] [--rank R] [--full]

NAME is a module path (``model.layers.3.mlp``), ``logits``, an API name, or a locator from a
compare row (``golden_data_path``/``target_data_path``: ``rank0/data/000003.safetensors:12``, an
msit ``.pth`` or ATB ``.bin`` path). Several entries matching are listed; one is shown: dtype,
shape, where it lies, the statistics its dump recorded and those of the loaded tensor, and its
values (summarised; ``--full`` prints every value). A row that joins several target tensors (a
tensor-parallel target's ranks, a mapping's terms: ``rank0/...:12+rank1/...:12``) shows each.

  llmflow inspect FILE.safetensors [KEY] [--full]

A plain safetensors file that no dump format claims (the bisect's ``first_bad_op.safetensors``)
is read as a flat set of named tensors: its keys and metadata, or one key's tensor.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from llmflow.cli.common import console, verdict_line
from llmflow.errors import EXIT_FAILED, EXIT_PASSED, UserError


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dump", help="a dump directory of any format (or the folder holding one)")
    parser.add_argument("name", nargs="?", default=None,
                        help="an entry name or a compare row's locator (default: summarise the dump)")
    parser.add_argument("--step", type=int, default=None, help="only this step")
    parser.add_argument("--index", default=None, help="only this input/output index (0, 1, 1.0, kw:mask)")
    parser.add_argument("--kind", choices=("input", "output", "weight"), default=None,
                        help="only inputs, outputs or weights")
    parser.add_argument("--rank", type=int, default=None, help="only this rank")
    parser.add_argument("--full", action="store_true", help="print every value of the tensor")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return "" if v is None else str(v)


def execute(args: argparse.Namespace) -> int:
    from llmflow.formats import open_dump, reader_types
    from llmflow.formats.describe import describe, find_entries, summarize

    con = console()
    path = Path(args.dump)
    if path.suffix == ".safetensors" and path.is_file() and not any(
            cls.detect(path) for cls in reader_types().values()):
        return _plain_safetensors(con, path, args.name, full=args.full)
    reader = open_dump(args.dump)
    if args.name is None:
        s = summarize(reader)
        steps = f"{s['steps'][0]}..{s['steps'][-1]}" if s["steps"] else "none"
        con.print(f"{s['path']}: {s['format']} dump, {s['entries']} entries, steps {steps}, "
                  f"ranks {', '.join(map(str, s['ranks'])) or 'none'}")
        for level, d in s["levels"].items():
            kinds = ", ".join(f"{n} {k}" for k, n in d["kinds"].items())
            held = ", ".join(f"{d[k]} {what}" for k, what in (("tensors", "tensors"), ("statistics_only",
                             "statistics only"), ("values", "other values")) if d[k])
            con.print(f"  {level}: {d['entries']} entries ({kinds}), {d['names']} names, steps {d['steps']}; "
                      f"{held}; e.g. {', '.join(d['first_names'])}")
        for p in s["problems"]:
            con.print(f"problem: {p}")
        if s["problems"]:  # (as a compare of it never passes)
            verdict_line(False, f"the dump cannot be trusted whole: {len(s['problems'])} problem(s) above; "
                                f"{s['entries']} entries readable")
            return EXIT_FAILED
        if not s["entries"]:  # (what a debugger leaves when it started but no forward ran: as a
            # compare of it pairs nothing, it never passes)
            verdict_line(False, "the dump holds no entries: nothing was recorded (no forward pass ran "
                                "between the debugger's start and stop, or every module was filtered out)")
            return EXIT_FAILED
        verdict_line(True, f"{s['entries']} entries in {len(s['levels'])} levels")
        return EXIT_PASSED
    problems = reader.problems()
    for p in problems:  # (what is asked for may be among what the damage lost)
        con.print(f"problem: {p}")
    try:
        found = find_entries(reader, args.name, step=args.step, index=args.index, kind=args.kind,
                             rank=args.rank)
    except UserError as exc:
        parts = _joined_parts(args.name)
        if parts:
            return _show_parts(con, reader, parts, full=args.full)
        if not problems:
            raise
        verdict_line(False, f"{exc}; the dump cannot be trusted whole ({len(problems)} problem(s) above): "
                            "what you asked for may be among the entries it lost")
        return EXIT_FAILED
    same_data = len({(e.key, e.rank) for e in found}) == 1 and found[0].has_data
    if len(found) > 1 and not same_data:
        con.print(f"{len(found)} entries match {args.name!r} (--step, --index, --kind pick one):")
        for e in found:
            d = describe(reader, e, load=False)
            con.print(f"  step {e.step} rank {e.rank} {e.kind} {e.index} ({e.level}) {_fmt(e.dtype)} "
                      f"{_fmt(d['shape'])} {_fmt(d['locator'])}")
        verdict_line(True, f"{len(found)} entries listed")
        return EXIT_PASSED
    d = describe(reader, found[0])
    _show(con, d, full=args.full)
    if len(found) > 1:  # one tensor recorded as several entries (an unchanged repeat)
        con.print("the same tensor is also: " + ", ".join(
            f"{e.name} {e.kind} {e.index}" + (" (its last position: llmflow inspect DUMP logits)"
                                              if e.extra.get("position") == "last" else "")
            for e in found[1:]))
    verdict_line(True, f"{d['name']} {d['kind']} {d['index']}, step {d['step']}")
    return EXIT_PASSED


def _joined_parts(name: str) -> list[str]:
    """The locators a compare row joins with ``+`` (empty when ``name`` joins none)."""
    from llmflow.compare.shards import PARTS_JOIN

    parts = name.split(PARTS_JOIN)
    return parts if len(parts) > 1 and all(parts) else []


def _show_parts(con: Any, reader: Any, parts: list[str], *, full: bool) -> int:
    """Each tensor of a compare row's joined locator, in the row's order."""
    from llmflow.formats.describe import describe, find_entries

    found = [find_entries(reader, part)[0] for part in parts]  # every part found before any is shown
    for i, entry in enumerate(found):
        con.print(f"part {i + 1} of {len(parts)}:")
        _show(con, describe(reader, entry), full=full)
    verdict_line(True, f"{len(parts)} tensors a compare row joins (its shards column says how: concatenated, "
                       "summed or replicated; a mapping's terms are summed)")
    return EXIT_PASSED


def _plain_safetensors(con: Any, path: Path, key: str | None, *, full: bool) -> int:
    """List a plain safetensors file's keys (dtype, shape) and metadata, or show one key's tensor."""
    from safetensors import SafetensorError, safe_open

    from llmflow.formats.describe import tensor_stats

    try:  # (reading only: an error while printing is not the file's)
        with safe_open(str(path), framework="pt") as fh:
            keys, metadata = list(fh.keys()), fh.metadata() or {}
            if key is None:
                listing = []
                for k in keys:
                    part = fh.get_slice(k)
                    listing.append((k, part.get_dtype(), list(part.get_shape())))
            elif key in keys:
                tensor = fh.get_tensor(key)
    except (SafetensorError, OSError) as exc:
        raise UserError(f"{path}: not a readable safetensors file: {exc}") from exc
    if key is None:
        con.print(f"{path}: safetensors file, {len(keys)} tensors"
                  + "".join(f", {k} {v}" for k, v in sorted(metadata.items())))
        for k, dtype, shape in listing:
            con.print(f"  {k}: {dtype} {shape}")
        verdict_line(True, f"{len(keys)} tensors")
        return EXIT_PASSED
    if key not in keys:
        raise UserError(f"{path}: no tensor {key!r} (it holds {', '.join(keys) or 'none'})")
    op = metadata.get("op")
    _show(con, {"name": key, "kind": "tensor", "index": f"of {path.name}", "step": metadata.get("step", "-"),
                "rank": 0, "level": "file", "module_type": f"op {op}" if op else None,
                "dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
                "locator": None, "recorded": None, "has_data": True, "stats": tensor_stats(tensor),
                "tensor": tensor}, full=full)
    verdict_line(True, f"{key} of {path.name}")
    return EXIT_PASSED


def _show(con: Any, d: dict[str, Any], full: bool) -> None:
    import torch

    con.print(f"{d['name']} {d['kind']} {d['index']} (step {d['step']}, rank {d['rank']}, level {d['level']}"
              + (f", {d['module_type']}" if d["module_type"] else "") + ")")
    con.print(f"  dtype {d['dtype']}, shape {d['shape']}")
    if d["locator"]:
        con.print(f"  locator {d['locator']}  ({d['file']})")
    if d["recorded"]:
        con.print("  recorded: " + ", ".join(f"{k}={_fmt(v)}" for k, v in d["recorded"].items()))
    if d.get("stats"):
        con.print("  stats: " + ", ".join(f"{k}={_fmt(v)}" for k, v in d["stats"].items()))
    if "tensor" in d:
        t = d["tensor"]
        opts = {"threshold": 2**63 - 1} if full else {"threshold": 64, "edgeitems": 3}
        torch.set_printoptions(precision=6, linewidth=110, **opts)
        try:
            con.print(str(t), markup=False, highlight=False)
        finally:
            torch.set_printoptions(profile="default")
    elif not d["has_data"]:
        what = f"a {d['pytype']} value: {d['value']!r}" if d["pytype"] else "statistics only, no tensor data"
        con.print(f"  {what}")
