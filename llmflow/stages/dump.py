"""The ``dump`` stage: run a model on one prompt and dump it, in a subprocess of its own.

A thin adapter over ``llmflow.dump.worker`` (which calls ``llmflow.dump.run.dump_run``): it hands
the worker its arguments on stdin (with the secret values to keep out of its files), streams its
per-step progress into ``ctx.task``, and turns a user error in the worker (exit status 2,
``{"error": ...}``) back into a one-line ``UserError``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import deque
from pathlib import Path
from typing import Any, ClassVar

from llmflow import interrupts
from llmflow.dump.config import DumpConfig
from llmflow.errors import UserError
from llmflow.results.checks import DumpStageBlock, DumpTotals
from llmflow.results.codec import to_json
from llmflow.stages.base import ChildCrashed, Stage, StageContext

_NULLABLE_STR = {"type": ["string", "null"], "default": None}
# the worker's own OSError for a write that found no room (disk full, quota, file size limit)
_NO_ROOM = re.compile(rf"\[Errno ({errno.ENOSPC}|{errno.EDQUOT}|{errno.EFBIG})\] (.*)")
_EXCEPTION_LINE = re.compile(r"[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b(: |$)")  # a traceback's last line
# the mark a dump stage leaves in the dump_dir it is given, naming the run dir and stage that own
# the dump there: only that stage may write there again
OWNER_FILE = ".llmflow-dump-stage.json"
_OWNER_FORMAT = "llmflow-dump-stage"
_RESULT_KEYS = ("output_ids", "text", "bytes", "entries", "steps", "truncated")  # the worker's result.json


class DumpStage(Stage):
    """Run a model greedily on a prompt and dump its tensors token by token (llmflow format)."""

    type: ClassVar[str] = "dump"
    version: ClassVar[str] = "1"
    writes_to: ClassVar[tuple[str, ...]] = ("dump_dir",)
    params_schema: ClassVar[dict[str, Any]] = {
        "type": "object",
        "additionalProperties": False,
        "required": ["model"],
        "properties": {
            "model": {"type": "string", "description": "smollm2, tiny-llama[:k=v,...], a local Hugging "
                      "Face model directory, or file.py:callable returning a module (and tokenizer)."},
            "device": {"type": "string", "default": "cpu", "description": "cpu, cuda[:N] or npu[:N]."},
            "dtype": {"type": "string", "enum": ["float32", "bfloat16", "float16"], "default": "float32",
                      "description": "The dtype the model runs in."},
            "prompt": {**_NULLABLE_STR, "description": "The prompt text (or give input_ids)."},
            "input_ids": {"type": ["array", "null"], "items": {"type": "integer", "minimum": 0},
                          "default": None, "description": "Prompt token ids, instead of prompt."},
            "chat_template": {"type": "boolean", "default": True,
                              "description": "Wrap the prompt in the tokenizer's chat template."},
            "max_new_tokens": {"type": "integer", "minimum": 1, "default": 20,
                               "description": "Tokens to generate (greedy); one dump step each."},
            "patch": {**_NULLABLE_STR, "description": "file.py:callable applied to the loaded model."},
            "seed_settings": {"type": ["object", "null"], "default": None,
                              "description": "The seed stage's settings, applied in the worker."},
            # the dump settings: declared once, with their defaults, by DumpConfig
            **DumpConfig.stage_properties(),
            "dump_dir": {**_NULLABLE_STR, "description": "Where to write the dump (default: the "
                         "stage's output folder)."},
        },
    }
    outputs: ClassVar[dict[str, str]] = {
        "dump_dir": "the dump directory (llmflow format)",
        "generation_file": "JSON: prompt, input_ids, output_ids, text",
        "text": "the generated text",
        "output_ids": "the generated token ids",
        "model_spec": "dict for load_model(**model_spec): model, device, dtype, patch, base_dir",
    }

    def resources(self, params: dict[str, Any]) -> set[str]:
        device = str(params.get("device", "cpu"))
        return set() if device == "cpu" else {f"device:{device}"}

    def run(self, ctx: StageContext) -> dict[str, Any]:
        p = self.params(ctx)
        if p.get("prompt") is None and p.get("input_ids") is None:
            raise UserError(f"{ctx.stage_id}: prompt: give a prompt or input_ids")
        if p.get("dump_dir"):
            dump_dir = ctx.resolve_path(p["dump_dir"])
            _claim_dump_dir(dump_dir, ctx)
        else:  # (a new folder of the stage's own)
            dump_dir = ctx.out_dir / "dump"
            _check_writable(dump_dir, ctx.stage_id)
        args = {**p, "dump_dir": str(dump_dir), "base_dir": str(ctx.workflow_dir),
                "generation_file": str(ctx.out_dir / "generation.json")}
        result = self._run_worker(ctx, args)
        text = result["text"]
        ctx.summary[ctx.stage_id] = to_json(DumpStageBlock(dump=DumpTotals(
            bytes=result["bytes"], entries=result["entries"], steps=result["steps"], text=text,
            truncated=result["truncated"])))
        ctx.log(f"{ctx.stage_id}: {result['steps']} steps, {result['entries']} entries, "
                f"{result['bytes'] / 1e6:.1f} MB: {text!r}")
        return {
            "dump_dir": str(dump_dir),
            "generation_file": args["generation_file"],
            "text": text,
            "output_ids": result["output_ids"],
            "model_spec": {"model": p["model"], "device": p["device"], "dtype": p["dtype"],
                           "patch": p["patch"], "base_dir": str(ctx.workflow_dir)},
        }

    def _run_worker(self, ctx: StageContext, args: dict[str, Any]) -> dict[str, Any]:
        from llmflow.dump.worker import PHASE_PREFIX, PROGRESS_PREFIX

        result_file = ctx.out_dir / "worker_result.json"
        # on stdin, not in a file of the stage: the arguments hold secret parameters' real values
        args_text = json.dumps({**args, "redact": list(ctx.redact.values)})
        env = dict(os.environ)
        settings = args.get("seed_settings") or {}
        env.update({k: str(v) for k, v in (settings.get("env") or {}).items()})
        env.update(interrupts.child_env())  # the worker dies with this process, even by kill -9
        task = ctx.task(f"{ctx.stage_id}: dump {args['model']}", total=args["max_new_tokens"])
        tail: deque[str] = deque(maxlen=40)
        # stderr goes to a file (no pipe to fill up); stdout carries the progress lines
        with tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace") as err:
            proc = subprocess.Popen([sys.executable, "-m", "llmflow.dump.worker", "-", str(result_file)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                    env=env, cwd=str(ctx.out_dir))
            interrupts.started(proc)  # an interrupted run stops it (interrupts.stop_children)
            try:
                assert proc.stdin is not None and proc.stdout is not None
                try:
                    with proc.stdin:
                        proc.stdin.write(args_text)
                except BrokenPipeError:  # the worker died before reading them: its status says why
                    pass
                for line in proc.stdout:
                    if line.startswith(PROGRESS_PREFIX):
                        task.update(completed=int(line[len(PROGRESS_PREFIX):]) + 1)
                    elif line.startswith(PHASE_PREFIX):
                        ctx.log(f"{ctx.stage_id}: {line[len(PHASE_PREFIX):].rstrip()}")
                    else:
                        tail.append(line.rstrip())
                rc = proc.wait()
            finally:
                interrupts.finished(proc)
            err.seek(0)
            tail.extend(err.read().splitlines()[-40:])
        tail = deque(ctx.redact(list(tail)))  # (a traceback may quote a parameter)
        with contextlib.suppress(OSError):  # a full disk is said below, from the worker's own words
            (ctx.out_dir / "worker.log").write_text("\n".join(tail) + "\n", encoding="utf-8")
        result = _read_result(result_file)
        if rc == 2 and "error" in result:
            raise UserError(f"{ctx.stage_id}: {result['error']}")
        no_room = next((m for m in map(_NO_ROOM.search, reversed(tail)) if m), None)
        if rc != 0 and no_room:
            raise OSError(int(no_room[1]), f"the dump worker could not write: {no_room[2].strip()}")
        if rc != 0:
            log_file = (ctx.failed_dir or ctx.out_dir) / "worker.log"
            message = f"dump worker exited with status {rc}: {_raised(tail)} (its output: {log_file})"
            raise ChildCrashed(message, "\n".join(tail) + "\n")
        if not all(key in result for key in _RESULT_KEYS):
            # status 0 without a result: the user's code ended the process (os._exit skips every
            # handler), which is bad input, not a crash of ours
            user = f"patch {args['patch']!r}" if args.get("patch") else f"model {args['model']!r}"
            raise UserError(f"{ctx.stage_id}: the dump worker exited with status 0 before writing its "
                            f"result: did the {user} call sys.exit or os._exit?")
        return result


def _raised(lines: deque[str]) -> str:
    """What the worker's output says went wrong: the exception line that ends its traceback (a
    patch or model file that raised: ``RuntimeError: ...``), else its last line."""
    text = [line.strip() for line in lines if line.strip()]
    return next((line for line in reversed(text) if _EXCEPTION_LINE.match(line)),
                text[-1] if text else "no output")


def _read_result(path: Path) -> dict[str, Any]:
    """The worker's result.json, or {} when it wrote none (or something that is not one)."""
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return result if isinstance(result, dict) else {}


def _owner_mark(ctx: StageContext) -> dict[str, str]:
    """What OWNER_FILE holds in a dump_dir this stage writes: its run dir (resolved: the same
    run dir named another way is still it) and its stage id."""
    return {"format": _OWNER_FORMAT, "run_dir": str(ctx.run_dir.resolve()), "stage": ctx.stage_id}


def _read_owner(path: Path) -> dict[str, Any] | None:
    """The owner mark in ``path`` (a dump_dir), or None (none, a link, not a mark)."""
    mark = path / OWNER_FILE
    try:
        if mark.is_symlink() or not mark.is_file() or mark.stat().st_size > 65536:
            return None
        value = json.loads(mark.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) and value.get("format") == _OWNER_FORMAT else None


def _claim_dump_dir(path: Path, ctx: StageContext) -> None:
    """Make ``path`` this stage's dump_dir before anything is written there: a folder this stage
    marked before (a rerun, a resume) is its own and the new dump replaces the old one; a new or
    empty folder is marked now; anything else (the user's files, a dump a script or another run
    wrote) is refused with a ``UserError`` naming what is in the way, and left as it was."""
    from llmflow.formats.llmflow_dump import is_llmflow_dump  # (imports torch: not at import time)

    mine = _owner_mark(ctx)
    owner = _read_owner(path)
    if owner == mine:
        _check_writable(path, ctx.stage_id)
        return
    try:
        entries = sorted(os.listdir(path))
    except OSError:  # none yet; or not a folder, not readable: the write test below says so
        entries = []
    if entries:
        if owner is not None:
            what = f"holds the dump of stage {owner.get('stage')!r} of run dir {owner.get('run_dir')}"
        elif is_llmflow_dump(path):
            what = "holds an llmflow dump this stage did not write (a script's or another run's)"
        else:
            first = path / entries[0]
            why = "is a symbolic link" if first.is_symlink() else "not written by an llmflow dump"
            more = f" (and {len(entries) - 1} more)" if len(entries) > 1 else ""
            what = f"{first}: {why}{more}"
        raise UserError(f"{ctx.stage_id}: dump_dir {path}: {what}; the dump stage writes only into a new or "
                        "empty folder or its own earlier dump: pick another dump_dir or move it away")
    _check_writable(path, ctx.stage_id)
    try:  # (exclusive: of two stages given one new folder, the second is refused)
        with open(path / OWNER_FILE, "x", encoding="utf-8") as fh:
            json.dump(mine, fh)
    except FileExistsError:
        raise UserError(f"{ctx.stage_id}: dump_dir {path}: another stage began a dump there at the same "
                        "time; give each dump stage a dump_dir of its own") from None
    except OSError as exc:
        raise UserError(f"{ctx.stage_id}: dump_dir {str(path)!r}: not writable "
                        f"({exc.strerror or exc})") from exc


def _check_writable(path: Path, stage_id: str) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".llmflow_write_test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"{stage_id}: dump_dir {str(path)!r}: not writable "
                        f"({exc.strerror or exc})") from exc
