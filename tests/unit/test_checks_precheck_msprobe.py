"""An msprobe dump.json written by hand, its values in every form msprobe writes them (slices, an
ellipsis, a torch.Size, a dtype, ``null``, an object it could not describe): each API call is
rebuilt and replayed through the callable its group names (``Tensor.__rsub__`` is ``2 - x``)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import torch

from llmflow.checks.precheck import precheck
from llmflow.checks.references import resolve
from llmflow.formats import open_dump


def tensor(folder: Path, name: str, t: torch.Tensor) -> dict:
    torch.save(t, folder / "dump_tensor_data" / name)
    return {"type": "torch.Tensor", "dtype": str(t.dtype), "shape": list(t.shape), "Max": None, "Min": None,
            "Mean": None, "Norm": None, "requires_grad": False, "data_name": name}


def scalar(kind: str, value) -> dict:
    return {"type": kind, "value": value}


def write_dump(root: Path) -> Path:
    folder = root / "step0" / "rank0"
    (folder / "dump_tensor_data").mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, generator=g)
    a, b = torch.randn(4, 16, generator=g), torch.randn(16, 8, generator=g)
    records = {
        "Tensor.__rsub__.0.forward": {
            "input_args": [tensor(folder, "rsub.in.pt", x), scalar("int", 2)], "input_kwargs": {},
            "output": [tensor(folder, "rsub.out.pt", 2 - x)]},
        "Tensor.__getitem__.0.forward": {
            "input_args": [tensor(folder, "getitem.in.pt", x), [scalar("ellipsis", "..."),
                                                                scalar("slice", [None, 2, None])]],
            "input_kwargs": {}, "output": [tensor(folder, "getitem.out.pt", x[..., :2])]},
        "Tensor.view.0.forward": {
            "input_args": [tensor(folder, "view.in.pt", x), scalar("torch.Size", [8, 4])], "input_kwargs": {},
            "output": [tensor(folder, "view.out.pt", x.view(8, 4))]},
        "Tensor.to.0.forward": {
            "input_args": [tensor(folder, "to.in.pt", x)],
            "input_kwargs": {"dtype": scalar("torch.dtype", "torch.float16"), "copy": scalar("bool", False)},
            "output": [tensor(folder, "to.out.pt", x.to(torch.float16))]},
        "Functional.linear.0.forward": {  # bias None: written as null, the argument keeps its place
            "input_args": [tensor(folder, "linear.in.pt", a), tensor(folder, "linear.w.pt", b.T.contiguous()),
                           None],
            "input_kwargs": {}, "output": [tensor(folder, "linear.out.pt", a @ b)]},
        "Torch.matmul.0.forward": {  # a kernel that is 1% off
            "input_args": [tensor(folder, "matmul.a.pt", a), tensor(folder, "matmul.b.pt", b)],
            "input_kwargs": {}, "output": [tensor(folder, "matmul.out.pt", (a @ b) * 1.01)]},
        "Functional.layer_norm.0.forward": {  # an argument msprobe could not describe
            "input_args": [tensor(folder, "ln.in.pt", x), {}], "input_kwargs": {},
            "output": [tensor(folder, "ln.out.pt", x)]},
    }
    (folder / "dump.json").write_text(json.dumps({"task": "tensor", "level": "L1", "framework": "pytorch",
                                                  "dump_data_dir": "", "data": records}))
    (folder / "construct.json").write_text("{}")
    return root


def test_every_value_form_is_rebuilt_and_replayed_by_its_group(tmp_path):
    result = precheck(open_dump(write_dump(tmp_path / "dump")))
    rows = {r["record"]: r for r in result["rows"]}
    for record in ("Tensor.__rsub__.0.forward", "Tensor.__getitem__.0.forward", "Tensor.view.0.forward",
                   "Tensor.to.0.forward", "Functional.linear.0.forward"):
        assert rows[record]["status"] == "pass", rows[record]
    assert rows["Tensor.__rsub__.0.forward"]["implementation"] == "Tensor.__rsub__"  # not torch.sub(x, 2)
    assert rows["Torch.matmul.0.forward"]["status"] == "fail"
    assert rows["Torch.matmul.0.forward"]["implementation"] == "torch.matmul"
    assert result["first_fail"]["name"] == "/matmul.0"
    unknown = rows["Functional.layer_norm.0.forward"]
    assert unknown["status"] == "not checked" and "msprobe could not describe" in unknown["reason"]


def test_a_repro_on_request_by_msprobe_record_name(tmp_path):
    from llmflow.checks.precheck_files import run_precheck
    from llmflow.checks.precheck_options import PrecheckOptions

    result = run_precheck(write_dump(tmp_path / "dump"), tmp_path / "out", PrecheckOptions(),
                          repro_calls=["Tensor.__rsub__.0.forward"])
    assert [(r["name"], r["status"]) for r in result["repros"]] == [("/rsub.0", "pass")]
    script = tmp_path / "out" / result["repros"][0]["script"]
    fresh = subprocess.run([sys.executable, "-I", str(script)], capture_output=True, text=True, timeout=120)
    assert fresh.returncode == 0 and "NOT REPRODUCED" in fresh.stdout, fresh.stdout + fresh.stderr
    errors = re.search(r"target error (\S+), benchmark \(torch.float32, cpu\) error (\S+),", fresh.stdout)
    assert errors and errors[1] == errors[2]  # the script computes 2 - x, as the dump recorded


def test_the_group_named_callable_comes_after_the_references():
    def mine(x, y):
        return x
    assert resolve("sub", [torch.ones(1)], {}, "Tensor.__rsub__")[1] == "Tensor.__rsub__"
    assert resolve("sub", [torch.ones(1)], {"sub": mine}, "Tensor.__rsub__")[0] is mine
    assert resolve("npu_swiglu", [], {}, None)[0] is None  # (an NPU group: by API name only)
