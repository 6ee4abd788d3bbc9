"""``dump_run``: one prompt, one dump. Hook the model, generate greedily, close the dump.

This is what the dump stage's worker calls; it is also the shortest way to take a dump from
Python when you already hold a ``LoadedModel``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmflow.dump.config import DumpConfig
from llmflow.dump.env import collect_env
from llmflow.dump.hooks import DumpHandle
from llmflow.models import LoadedModel, greedy_generate
from llmflow.redaction import Redactor


def dump_run(loaded: LoadedModel, input_ids: list[int], max_new_tokens: int, config: DumpConfig, *,
             seed: dict[str, Any] | None = None, generation: dict[str, Any] | None = None,
             on_step: Callable[[int], None] | None = None, redact: Redactor | None = None) -> list[int]:
    """Greedy-generate ``max_new_tokens`` after ``input_ids`` while dumping into
    ``config.dump_path`` (the dump directory itself). Returns the new token ids. env.json is
    written through ``redact`` (secret values the caller knows of; URL credentials always).

    The dump is marked complete only if generation finishes; an exception leaves it readable but
    ``complete: false``.
    """
    gen = {"do_sample": False, "max_new_tokens": max_new_tokens, "prompt_tokens": len(input_ids),
           **(generation or {})}

    def env() -> dict[str, Any]:
        return (redact or Redactor())(collect_env(loaded.model, generation=gen, tokenizer=loaded.tokenizer,
                                                  seed=seed, quantized=loaded.quantized))

    handle = DumpHandle(loaded.model, config, exact_dir=config.dump_path, env_factory=env)
    handle.on_step = on_step
    handle.open_next()  # the dump exists even if generation fails before its first step
    ok = False
    try:
        eos = getattr(loaded.tokenizer, "eos_token_id", None)
        new_ids = greedy_generate(loaded.model, input_ids, max_new_tokens, eos_token_id=eos)
        ok = True
    finally:
        try:
            if handle.session is not None:
                handle.session.close(complete=ok)
        finally:  # a close that raises (a write failed) must not leave the hooks on the model
            handle.remove()
    return new_ids
