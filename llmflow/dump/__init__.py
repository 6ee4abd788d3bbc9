"""Capture: hook a model, dump what every module (and op) computed, token by token.

msit llm compatible (switch with one import line)::

    from llmflow import DumpConfig, register_hook, set_dump_path, save
    handle = register_hook(model, DumpConfig(dump_path="./dump", token_range=[0, 1]))
    model.generate(...)
    handle.remove()  # optional: a dump is also finished when the process exits or the model is freed

Map of this package:
  config.py    DumpConfig: fields, validation, the filters the hooks ask
  recorder.py  Recorder: the one capture core (module stack, op naming, the walk over values),
               sending calls to a sink: the disk dump, memory, or a byte counter
  api.py       API mode (TorchFunctionMode): torch.*, F.*, Tensor methods and operators
  hooks.py     register_hook / set_dump_path / save; steps and dialogue turns
  capture.py   DumpSession: the disk sink, one dump directory; index rows
  copies.py    copies of a tensor as it was at capture (device or host), version counters
  memory.py    the memory sinks: module calls and op calls kept for replay
  stats.py     statistics computed on the tensor's device
  writer.py    background writer thread: batches tensors into safetensors files
  env.py       env.json; topology.py: topology.json
  run.py       dump_run(): load -> hook -> greedy generate -> close, used by the dump stage
  worker.py    the dump stage's subprocess entry point
The on-disk format itself lives in llmflow/formats/llmflow_dump.py.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> module that defines it, imported on first use: the dump stage's schema (DumpConfig's
# fields) is read by `llmflow validate` and `plan`, which must not pay for importing torch
_LAZY = {"DumpConfig": "llmflow.dump.config", "DumpHandle": "llmflow.dump.hooks",
         "register_hook": "llmflow.dump.hooks", "save": "llmflow.dump.hooks",
         "set_dump_path": "llmflow.dump.hooks", "dump_run": "llmflow.dump.run"}

__all__ = ["DumpConfig", "DumpHandle", "dump_run", "register_hook", "save", "set_dump_path"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'llmflow.dump' has no attribute {name!r}")
