"""Repro folders: one failing call of a precheck, standalone, for the kernel team.

``write_repro(call, row, fn, folder)`` writes:

  inputs.safetensors         the call's tensor arguments, keyed by their dump index (``0``, ``kw:mask``)
  target_output.safetensors  the target's recorded outputs, keyed by output index
  call.json                  the API, the call's name and module, the argument structure (tensors
                             by key, dtypes by name), where its replay function comes from
  repro.py                   a script needing torch and safetensors only (no llmflow): runs the
                             op in float64 (the reference) and in the dump's dtype (the benchmark)
                             on the CPU, optionally the op itself on ``--device``, and prints each
                             one's error against the reference beside the recorded target's;
                             exits 1 when the target's error is ``--ratio`` times the benchmark's,
                             or it misses the largest-error or small-value rule as the precheck does

A reference from the registry (a torch_npu op's, a user's) is copied into the script as source,
with the module-level functions it calls; torch ops are looked up by their dotted name.
"""

from __future__ import annotations

import inspect
import json
import re
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from llmflow.checks.op_call import OpCall
from llmflow.checks.precheck import DEFAULT_FAIL_RATIO
from llmflow.dtypes import SMALL_VALUE, SMALL_VALUE_ATOL, dtype_name

_SCRIPT = '''\
"""Repro of {name} ({api}): the target's recorded output against a float64 reference and the
dump-dtype benchmark. Needs torch and safetensors only.

    python repro.py                  # recorded target vs reference and benchmark (CPU)
    python repro.py --device npu:0   # also run the op on that device
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any  # (the annotations of a copied reference)

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent
IMPLEMENTATION = {implementation!r}
FAIL_RATIO = {fail_ratio!r}
SMALL_VALUE = {small_value!r}  # dtype -> (|x| below which a value is small, the error it may miss by)
{reference_source}

def op_function():
    if IMPLEMENTATION == "reference":
        return {reference_name}
    owner, _, attr = IMPLEMENTATION.rpartition(".")
    obj = {{"torch": torch, "torch.nn.functional": F, "Tensor": torch.Tensor}}[owner]
    return getattr(obj, attr)


def device_function(device):
    """The op as the device runs it: torch_npu's kernel for an npu_* API where it imports."""
    if IMPLEMENTATION == "reference" and device.startswith("npu"):
        import torch_npu  # noqa: F401
        return getattr(torch.ops.npu, {api!r})
    return op_function()


def build(node, tensors, convert):
    if isinstance(node, dict):
        if "tensor" in node:
            return convert(tensors[node["tensor"]])
        if "dtype" in node:
            return convert(getattr(torch, node["dtype"]))
        if "device" in node:
            return torch.device(node["device"])
        if "torch_attr" in node:
            return getattr(torch, node["torch_attr"])
        if "slice" in node:
            return slice(*node["slice"])
        if "ellipsis" in node:
            return Ellipsis
        if "tuple" in node:
            return tuple(build(v, tensors, convert) for v in node["tuple"])
        return {{k: build(v, tensors, convert) for k, v in node["dict"].items()}}
    if isinstance(node, list):
        return [build(v, tensors, convert) for v in node]
    return node


def flat(out, prefix=""):
    if isinstance(out, torch.Tensor):
        return {{prefix or "0": out}}
    found = {{}}
    if isinstance(out, (tuple, list)):
        for i, v in enumerate(out):
            found.update(flat(v, f"{{prefix}}.{{i}}" if prefix else str(i)))
    return found


def run(fn, call, tensors, convert):
    args = build(call["args"], tensors, convert)
    kwargs = build(call["kwargs"], tensors, convert)
    with torch.no_grad():
        return flat(fn(*args, **kwargs))


def rel_error(ref, out):
    ref, out = ref.to(torch.float64), out.to(torch.float64).to(ref.device)
    if not out.is_floating_point():
        return 0.0 if torch.equal(ref, out) else math.inf
    ok = torch.isfinite(ref)
    if bool((~torch.isfinite(out) & ok).any()):
        return math.inf
    norm = ref[ok].norm()
    diff = (out - ref)[ok].norm()
    return float(diff / norm) if norm > 0 else float(diff)


def max_abs_error(ref, out):
    ref, out = ref.to(torch.float64), out.to(torch.float64).to(ref.device)
    ok = torch.isfinite(ref) & torch.isfinite(out)
    return float((out - ref)[ok].abs().max()) if bool(ok.any()) else 0.0


def small_value_misses(ref, out, dtype):
    """The share of the elements with |ref| < SMALL that miss it by more than ATOL (msprobe's rule)."""
    small, atol = SMALL_VALUE.get(str(dtype), (1e-6, 1e-9))
    ref, out = ref.to(torch.float64), out.to(torch.float64).to(ref.device)
    mask = torch.isfinite(ref) & torch.isfinite(out) & (ref.abs() < small)
    n = int(mask.sum())
    return float(((out - ref).abs()[mask] > atol).sum()) / n if n else 0.0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="also run the op on this device (cuda, npu:0)")
    parser.add_argument("--ratio", type=float, default=FAIL_RATIO, help="fail above this error ratio")
    a = parser.parse_args()
    call = json.loads((HERE / "call.json").read_text())
    tensors = load_file(str(HERE / "inputs.safetensors")) if (HERE / "inputs.safetensors").exists() else {{}}
    target = load_file(str(HERE / "target_output.safetensors"))

    def to64(x):
        if isinstance(x, torch.dtype):
            return torch.float64 if x.is_floating_point else x
        return x.to(torch.float64) if x.is_floating_point() else x.clone()

    fn = op_function()
    reference = run(fn, call, tensors, to64)
    benchmark = run(fn, call, tensors, lambda x: x if isinstance(x, torch.dtype) else x.clone())
    unit = {{k: torch.finfo(t.dtype).eps / 2 if t.is_floating_point() else 0.0 for k, t in target.items()}}
    worst, misses = 0.0, []
    for key, t in target.items():
        if key not in reference:
            continue
        e_t, e_b = rel_error(reference[key], t), rel_error(reference[key], benchmark[key])
        ratio = e_t / max(e_b, unit[key]) if max(e_b, unit[key]) > 0 else (0.0 if e_t == 0 else math.inf)
        worst = max(worst, ratio)
        print(f"output {{key}}: target error {{e_t:.4g}}, benchmark ({{t.dtype}}, cpu) error {{e_b:.4g}}, "
              f"ratio {{ratio:.3g}}")
        if not t.is_floating_point():
            continue
        ref = reference[key].to(torch.float64)
        scale = float(ref[torch.isfinite(ref)].abs().max()) if bool(torch.isfinite(ref).any()) else 0.0
        m_t, m_b = max_abs_error(ref, t), max_abs_error(ref, benchmark[key])
        floor = max(m_b, unit[key] * scale)
        if m_t > 4 * a.ratio * floor:
            misses.append(f"output {{key}}: largest absolute error {{m_t:.4g}} is {{m_t / floor:.3g}}x the "
                          f"benchmark's {{m_b:.4g}}")
        s_t, s_b = small_value_misses(ref, t, t.dtype), small_value_misses(ref, benchmark[key], t.dtype)
        if s_t > 2 * s_b + 1e-3:
            misses.append(f"output {{key}}: {{s_t:.3%}} of the small values miss (benchmark {{s_b:.3%}})")
    if a.device:
        on_device = run(device_function(a.device), call, tensors,
                        lambda x: x if isinstance(x, torch.dtype) else x.to(a.device))
        for key, t in on_device.items():
            if key in reference:
                print(f"output {{key}}: {{a.device}} error {{rel_error(reference[key], t.cpu()):.4g}}")
    reproduced = worst > a.ratio or bool(misses)
    for miss in misses:
        print(miss)
    print(f"{{'REPRODUCED' if reproduced else 'NOT REPRODUCED'}}: ratio {{worst:.3g}} (limit {{a.ratio}})"
          + (f"; {{len(misses)}} more rule(s) missed" if misses else ""))
    return 1 if reproduced else 0


if __name__ == "__main__":
    sys.exit(main())
'''


def _encode(value: Any, tensors: dict[str, torch.Tensor], label: str) -> Any:
    """The argument structure as JSON: tensors saved under their dump index."""
    if isinstance(value, torch.Tensor):
        tensors[label] = value.contiguous().clone()  # (safetensors refuses tensors sharing memory)
        return {"tensor": label}
    if isinstance(value, torch.dtype):
        return {"dtype": dtype_name(value)}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, (torch.memory_format, torch.layout)):
        return {"torch_attr": str(value).removeprefix("torch.")}
    if isinstance(value, slice):
        return {"slice": [value.start, value.stop, value.step]}
    if value is Ellipsis:
        return {"ellipsis": True}
    if isinstance(value, tuple):
        return {"tuple": [_encode(v, tensors, f"{label}.{i}") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, tensors, f"{label}.{i}") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {"dict": {k: _encode(v, tensors, f"{label}.{k}") for k, v in value.items()}}
    return value


def _source_with_helpers(fn: Callable[..., Any]) -> str:
    """``fn``'s source and that of the module-level functions it calls, recursively (the
    reference's own module is not imported by the script)."""
    module = inspect.getmodule(fn)
    seen: dict[str, str] = {}

    def add(f: Callable[..., Any]) -> None:
        name = f.__name__
        if name in seen:
            return
        seen[name] = textwrap.dedent(inspect.getsource(f))
        for used in f.__code__.co_names:
            helper = getattr(module, used, None)
            if inspect.isfunction(helper) and inspect.getmodule(helper) is module:
                add(helper)
    add(fn)
    return "\n\n".join(reversed(list(seen.values())))


def _in_docstring(text: str) -> str:
    """``text`` as the inside of a string literal: a dump's names come from another machine, and a
    quote, backslash or newline in one must not end the script's docstring (and what follows it
    run as code when the user runs the script)."""
    return json.dumps(text)[1:-1]


def folder_name(number: int, name: str) -> str:
    """``003_model.layers.1.mlp.act_fn-silu.0``: a file-safe folder name for a call."""
    return f"{number:03d}_" + re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-")[:120]


def write_repro(call: OpCall, fn: Callable[..., Any], implementation: str, folder: Path,
                fail_ratio: float = DEFAULT_FAIL_RATIO) -> Path:
    """Write the repro folder of one call (module docstring); returns the script's path."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    args = [_encode(v, tensors, str(i)) for i, v in enumerate(call.args)]
    kwargs = {"dict": {k: _encode(v, tensors, f"kw:{k}") for k, v in call.kwargs.items()}}
    if tensors:
        save_file(tensors, str(folder / "inputs.safetensors"))
    outputs = {k: v.contiguous().clone() for k, v in call.outputs.items()}
    save_file(outputs, str(folder / "target_output.safetensors"))
    (folder / "call.json").write_text(json.dumps(
        {"name": call.name, "record": call.record, "module": call.module, "api": call.api, "step": call.step,
         "rank": call.rank,
         "implementation": implementation, "args": args, "kwargs": kwargs}, indent=1), encoding="utf-8")
    source, ref_name = "", "None"
    if implementation == "reference":
        source, ref_name = "\n\n" + _source_with_helpers(fn) + "\n", fn.__name__
    script = folder / "repro.py"
    small_value = {f"torch.{name}": (SMALL_VALUE[name], SMALL_VALUE_ATOL[name]) for name in SMALL_VALUE}
    script.write_text(_SCRIPT.format(name=_in_docstring(call.name), api=_in_docstring(call.api),
                                     implementation=implementation,
                                     fail_ratio=fail_ratio, small_value=small_value, reference_source=source,
                                     reference_name=ref_name), encoding="utf-8")
    return script
