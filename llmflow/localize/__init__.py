"""Fault localisation: from "the texts differ" to the first bad token, layer, module and op.

The bisect stage is a thin adapter over this package. Each module does one step of the
coarse-to-fine narrowing:

  tokens.py   per-step logits of the two dumps -> first mismatching token, first bad token
  golden.py   the golden inputs of every module: from the dump, or re-run from dumped layer inputs
  replay.py   isolation replay: each module of the TARGET model run on the GOLDEN inputs
  rank.py     own error against the same module type in the other layers -> ranked candidates
  ops.py      the chosen module replayed op by op (torch API calls) on both sides -> first bad op
  cost.py     bytes and model runs spent, against an estimate of a full API-level dump
  moe.py      in fused experts, which expert
  conclude.py the verdict: pass / fail / inconclusive, with what the evidence covers
  (the verdict's types, written to verdict.json, are llmflow.results.verdict)
  bisect.py   glues the steps together (``run_bisect``); options.py declares its inputs
  badcase.py  many prompts on both sides, no dump: which prompt drifts most (the badcase stage)
"""
