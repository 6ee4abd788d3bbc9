"""The dump stage's subprocess: ``python -m llmflow.dump.worker <args.json|-> <result.json>``.

Running each dump in a fresh process means a golden and a target dump share no state (seeded
generators, determinism flags, monkeypatches, device memory). The worker applies the seed
settings, loads the model, encodes the prompt, dumps a greedy generation and writes:

* ``result.json``: ``{"output_ids", "text", "bytes", "entries", "steps", "prompt_tokens"}`` on
  success; ``{"error": "<one-line message>"}`` with exit status 2 on a user error (a ``sys.exit``
  from the user's model or patch is one); written whole or not at all;
* ``<dump_dir>/../generation.json``: prompt, input_ids, output_ids, text;
* progress lines ``LLMFLOW_STEP <n>`` on stdout, one per generated step.

The arguments come on stdin (``-``), not in a file: they hold the real values of secret
parameters, and ``redact`` lists those values, kept out of everything the worker writes.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

from llmflow.atomic import atomic_write_json
from llmflow.errors import UserError
from llmflow.redaction import Redactor

PROGRESS_PREFIX = "LLMFLOW_STEP "
PHASE_PREFIX = "LLMFLOW_PHASE "  # a progress line of a slow phase (model conversion, model load)


class _PhaseLines(logging.Handler):
    """``llmflow.models``' progress lines, sent to the stage on stdout (its console shows them)."""

    def emit(self, record: logging.LogRecord) -> None:
        print(f"{PHASE_PREFIX}{record.getMessage()}", flush=True)


def run(args: dict[str, Any]) -> dict[str, Any]:
    """Do one dump as described by ``args`` (the stage's params plus dump_dir, base_dir, redact)."""
    redact = Redactor(args.get("redact") or ())
    settings = args.get("seed_settings")
    if settings:
        from llmflow.seeding import apply_settings

        settings = apply_settings(settings)
    from llmflow.dump.run import dump_run
    from llmflow.models import check_context, encode_prompt, load_model
    from llmflow.models import log as models_log

    models_log.addHandler(_PhaseLines())
    models_log.setLevel(logging.INFO)
    loaded = load_model(args["model"], device=args.get("device", "cpu"), dtype=args.get("dtype", "float32"),
                        patch=args.get("patch"), base_dir=args.get("base_dir", "."))
    prompt = args.get("prompt")
    if args.get("input_ids") is not None:
        input_ids = [int(i) for i in args["input_ids"]]
        field = "input_ids"
    else:
        input_ids = encode_prompt(loaded.tokenizer, prompt, bool(args.get("chat_template", True)))
        field = "prompt"
    if not input_ids:
        raise UserError(f"{field}: no tokens to run")
    max_new = int(args.get("max_new_tokens", 20))
    check_context(loaded, len(input_ids), max_new, field)
    vocab = getattr(getattr(loaded.model, "config", None), "vocab_size", None)
    if isinstance(vocab, int) and any(not 0 <= i < vocab for i in input_ids):
        raise UserError(f"{field}: token ids must be in [0, {vocab}) for this model")
    if args.get("module_list"):  # "auto" -> the decoder-layer classes; unknown classes are an error
        from llmflow.structure import resolve_module_classes

        args = {**args, "module_list": resolve_module_classes(loaded.model, list(args["module_list"]))}
    from llmflow.dump.config import DumpConfig

    config = DumpConfig.from_params(args, args["dump_dir"])

    def progress(step: int) -> None:
        print(f"{PROGRESS_PREFIX}{step}", flush=True)

    generation = {"chat_template": bool(args.get("chat_template", True)), "prompt": prompt,
                  "model": args["model"], "device": args.get("device", "cpu"),
                  "dtype": args.get("dtype", "float32"), "patch": args.get("patch")}
    output_ids = dump_run(loaded, input_ids, max_new, config, seed=settings or {},
                          generation=generation, on_step=progress, redact=redact)
    tok = loaded.tokenizer
    text = tok.decode(output_ids, skip_special_tokens=True) if tok is not None else ""
    gen_record = {"prompt": prompt, "input_ids": input_ids, "output_ids": output_ids, "text": text}
    Path(args["generation_file"]).write_text(json.dumps(redact(gen_record), indent=1), encoding="utf-8")
    ranks = [json.loads(p.read_text()) for p in Path(args["dump_dir"]).glob("rank*/rank.json")]
    return {"output_ids": output_ids, "text": redact(text), "bytes": _dir_bytes(Path(args["dump_dir"])),
            "entries": sum(r.get("entries", 0) for r in ranks), "steps": len(output_ids),
            "prompt_tokens": len(input_ids), "truncated": any(r.get("truncated") for r in ranks)}


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    from llmflow import interrupts

    interrupts.die_with_parent()  # a worker holding a device's memory must not outlive llmflow
    argv = sys.argv[1:] if argv is None else argv
    result_file = Path(argv[1])
    args = json.loads(sys.stdin.read() if argv[0] == "-" else Path(argv[0]).read_text(encoding="utf-8"))
    redact = Redactor(args.get("redact") or ())
    try:
        result = run(args)
    except UserError as exc:
        _write_result(result_file, {"error": redact(str(exc))})
        return 2
    except SystemExit as exc:  # user code (the model's file.py:callable, a patch) ended the run
        _write_result(result_file, {"error": redact(f"{_user_code(args)} called sys.exit({exc.code!r}) "
                                                    "before the dump finished")})
        return 2
    _write_result(result_file, result)
    return 0


def _user_code(args: dict[str, Any]) -> str:
    """The user's code a worker runs, for messages: the patch, else a file.py:callable model."""
    if args.get("patch"):
        return f"patch {args['patch']!r}"
    return f"model {args.get('model')!r}"


def _write_result(path: Path, result: dict[str, Any]) -> None:
    """result.json, whole or not at all (the stage reads a missing file as "no result")."""
    atomic_write_json(path, result)


if __name__ == "__main__":
    sys.exit(main())
