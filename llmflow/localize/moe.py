"""Mixture-of-experts blocks: replay with the golden routing, routing divergences, the faulty expert.

A router picks each token's top-k experts from its logits. In a low-precision target two nearly
tied experts can swap places: the router is not wrong (its logits are within rounding), yet the
block's output for that token changes completely. Replaying an MoE block as it is would blame it
for that. So:

  the router is judged by its own replay, on its logits (output 0), never by its top-k indices;
    a router that returns its choice too (indices and weights) also on the weights of the tokens
    whose experts agree, and on how many experts it picks a token (``choice_error``);
  the MoE block is replayed with the golden routing forced into its router (the golden router's
    outputs, cast to the target router's dtypes), so its own error is the experts' arithmetic;
  the same block replayed with the target's own routing shows what a flip costs: tokens whose
    expert choice differs, and how much the output moves. A flip that moves the output far beyond
    the block's own rounding is a routing divergence, reported with the tokens it hit;
  a decoder layer replayed whole has the same routing forced into its routers (``routing_forced``);
  fused experts (one module holding every expert's weights, called with the routing) are split by
    expert: each expert's contribution alone, golden against target, names the faulty one;
  a quantized checkpoint's experts, held expert by expert against the golden's fused ones, are
    split further: each expert's Linear layers alone, on the golden expert's own inputs, name the
    projection at fault.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from statistics import median
from typing import Any

import torch
from torch import nn

from llmflow.dtypes import OP_ERROR_FLOOR, dtype_class
from llmflow.dump.memory import Call, flatten_outputs
from llmflow.localize.calls import cast_inputs
from llmflow.localize.own_error import own_error, token_row_errors
from llmflow.quantized import EXPERT_LINEARS, UnfusedExperts, plain_fused_experts
from llmflow.results.verdict import ExpertLinearRow, ExpertRow, RoutedToken, RoutingRow


def router_of(module: nn.Module) -> tuple[str, nn.Module] | None:
    """The router child of an MoE block (``gate``/``router``, or a class named ``*Router``) when
    the block also holds experts; None for any other module."""
    router = None
    experts = False
    for attr, child in module.named_children():
        cls = type(child).__name__.lower()
        if attr in ("gate", "router") or "router" in cls:
            router = (attr, child)
        elif "experts" in attr or cls.endswith("experts"):
            experts = True
    return router if experts else None


def _rebuild(outputs: dict[str, torch.Tensor]) -> Any:
    """A router's call result from its flattened outputs: one tensor, or a flat tuple."""
    if set(outputs) == {"0"}:
        return outputs["0"]
    keys = sorted(outputs, key=lambda k: int(k) if k.isdigit() else -1)
    if not all(k.isdigit() for k in keys) or [int(k) for k in keys] != list(range(len(keys))):
        return None
    return tuple(outputs[k] for k in keys)


@contextmanager
def _router_output(router: nn.Module, replace: Callable[[Any], Any] | None,
                   seen: list[Any]) -> Iterator[None]:
    """While inside: the router's output is recorded into ``seen`` and, with ``replace``,
    replaced by ``replace(output)``."""
    def hook(_m: nn.Module, _args: Any, out: Any) -> Any:
        seen.append(out)
        return replace(out) if replace is not None else None
    handle = router.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _like(golden: Any, target: Any) -> Any:
    """The golden router output in the target's dtypes and device, position by position."""
    if isinstance(golden, torch.Tensor) and isinstance(target, torch.Tensor):
        return golden.to(device=target.device, dtype=target.dtype)
    if isinstance(golden, tuple) and isinstance(target, (tuple, list)) and len(golden) == len(target):
        return tuple(_like(g, t) for g, t in zip(golden, target, strict=True))
    return target


@contextmanager
def routing_forced(model: nn.Module, layers: Collection[str],
                   router_call: Callable[[str], Call | None]) -> Iterator[int]:
    """While inside: every MoE block's router inside ``layers`` of ``model`` gives the output of
    ``router_call(its name)`` (a recorded call of that router) wherever the shapes agree, so a
    decoder layer replayed whole is judged on its arithmetic, not on near-tied experts that its
    rounding routed elsewhere (the routers' own replays judge the routing). Yields how many
    routers were forced."""
    handles = [handle for name, module in model.named_modules()
               if router_of(module) is not None and any(name.startswith(layer + ".") for layer in layers)
               and (handle := _force_router(name, module, router_call)) is not None]
    try:
        yield len(handles)
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def block_routing_forced(name: str, block: nn.Module, recorded: dict[str, torch.Tensor]
                         ) -> Iterator[list[int]]:
    """While inside: MoE block ``name``'s router gives the ``recorded`` outputs (index -> tensor)
    wherever the shapes agree. Yields a list that holds one entry per call it forced."""
    fired: list[int] = []
    handle = _force_router(name, block, lambda _n: Call(name, outputs=recorded), fired)
    try:
        yield fired
    finally:
        if handle is not None:
            handle.remove()


def _force_router(name: str, block: nn.Module, router_call: Callable[[str], Call | None],
                  fired: list[int] | None = None) -> Any:
    """A forward hook on MoE block ``name``'s router that returns its recorded call's output
    wherever the shapes agree (noted in ``fired``); None where no call is recorded."""
    attr, router = router_of(block)  # type: ignore[misc]
    call = router_call(f"{name}.{attr}")
    forced = _rebuild(call.outputs) if call is not None and call.outputs else None
    if forced is None:
        return None

    def hook(_m: nn.Module, _args: Any, out: Any) -> Any:
        if not _same_shapes(forced, out):
            return None
        if fired is not None:
            fired.append(1)
        return _like(forced, out)
    return router.register_forward_hook(hook)


#: at most this share of a call's tokens (one at least) routed to other experts than the golden
#: router picks on the same input, for the difference to be rounding's near ties
NEAR_TIE_SHARE = 0.05
#: the routing weights of the tokens whose experts agree may differ by this many times one op's
#: rounding in the target's dtype (``OP_ERROR_FLOOR``: a softmax over rounded logits)
ROUTING_WEIGHTS_ROUNDING = 10.0


def rounding_flips(golden: dict[str, torch.Tensor], target: dict[str, torch.Tensor], dtype: str) -> bool:
    """Whether the target's recorded routing differs from the golden router's own, on the same
    input, as rounding's near ties do: a few tokens sent to other experts (at most
    ``NEAR_TIE_SHARE`` of them, one at least) while the routing weights of the tokens whose experts
    agree match within ``ROUTING_WEIGHTS_ROUNDING`` times the rounding of ``dtype`` (the target's
    model dtype: its router may compute in float32 from logits rounded there). A router that
    forgot its score-correction bias or its weights' normalisation, or a top-k gone wrong, differs
    in more; then the block is judged with the golden router's routing, which shows it.
    ``golden``/``target``: the routers' flattened outputs (index -> tensor)."""
    key = next((k for k, t in golden.items() if not t.is_floating_point() and t.dim() == 2), None)
    if key is None or target.get(key) is None or target[key].shape != golden[key].shape:
        return False
    g_choice = golden[key].sort(dim=-1).values
    t_choice = target[key].to(g_choice.device).sort(dim=-1).values
    flips = int((g_choice != t_choice).any(dim=-1).sum())
    if flips == 0 or flips > max(1, int(NEAR_TIE_SHARE * g_choice.shape[0])):
        return False
    choice = choice_error(golden, target)
    if choice is None:
        return False
    return choice["rel_l2"] <= ROUTING_WEIGHTS_ROUNDING * OP_ERROR_FLOOR.get(dtype_class(dtype), 1e-6)


def choice_error(golden: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> dict[str, Any] | None:
    """A router's own error in what it chooses, beyond its logits: the routing weights of the
    tokens whose experts agree (a top-k whose weights are renormalised, scaled or computed
    otherwise), and a number of experts a token that differs from the golden's. None for a
    module whose outputs hold no expert indices (a router returning its logits alone: the MoE
    block computes the rest, and its own replay judges it).

    ``golden``/``target``: the two calls' flattened outputs (index -> tensor). Returns ``rel_l2``
    (1.0 where the number of experts differs) and ``detail``."""
    key = next((k for k, t in golden.items() if not t.is_floating_point() and t.dim() == 2), None)
    if key is None:
        return None
    g_idx, t_idx = golden[key], target.get(key)
    if t_idx is None:
        return None
    if t_idx.shape[-1] != g_idx.shape[-1]:
        return {"rel_l2": 1.0, "detail": f"chooses {t_idx.shape[-1]} expert(s) a token where the golden "
                                         f"chooses {g_idx.shape[-1]}"}
    weights = next((k for k, t in golden.items() if t.is_floating_point() and t.shape == g_idx.shape), None)
    if weights is None or target.get(weights) is None or target[weights].shape != g_idx.shape:
        return None
    g_sorted, g_order = g_idx.sort(dim=-1)
    t_sorted, t_order = t_idx.to(g_idx.device).sort(dim=-1)
    agree = (g_sorted == t_sorted).all(dim=-1)  # a token whose experts flipped is the logits' matter
    if not bool(agree.any()):
        return None
    g_w = golden[weights].gather(-1, g_order)[agree]
    t_w = target[weights].to(g_w.device).gather(-1, t_order)[agree]
    err = own_error(g_w, t_w)["rel_l2"]
    return {"rel_l2": err, "detail": f"routing weights of the {int(agree.sum())} token(s) whose experts "
                                     f"agree: rel_l2 {err:.3g}"}


def _same_shapes(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape
    if isinstance(a, tuple) and isinstance(b, (tuple, list)) and len(a) == len(b):
        return all(_same_shapes(x, y) for x, y in zip(a, b, strict=True))
    return False


def _choices(out: Any) -> torch.Tensor | None:
    """The router's selected experts per token (the integer output), sorted per row."""
    flat = flatten_outputs(out)
    idx = [t for t in flat.values() if not t.is_floating_point() and t.dim() == 2]
    return idx[-1].detach().cpu().sort(dim=-1).values if idx else None


@torch.no_grad()
def replay_moe_block(module: nn.Module, name: str, call: Call, context: dict[str, Call], *,
                     device: torch.device, dtype: torch.dtype) -> tuple[Any, dict[str, Any]] | None:
    """Replay an MoE block with the golden routing forced; None when ``module`` is not one or the
    golden router call is missing. Returns the forced output and the routing facts: ``flips`` (token
    positions whose experts differ under the target's own routing, with both choices) and
    ``own_routing_output`` (the block's output with the target's routing)."""
    found = router_of(module)
    if found is None:
        return None
    attr, router = found
    golden_router = context.get(f"{name}.{attr}")
    if golden_router is None or not golden_router.outputs:
        return None
    forced = _rebuild(golden_router.outputs)
    if forced is None:
        return None
    args = cast_inputs(call.args, device, dtype, module)
    kwargs = cast_inputs(call.kwargs, device, dtype, module)
    seen: list[Any] = []
    with _router_output(router, None, seen):
        own = module(*args, **kwargs)
    target_routing = seen[0] if seen else None
    with _router_output(router, lambda out: _like(forced, out), []):
        out = module(*args, **kwargs)
    facts: dict[str, Any] = {"own_routing_output": own, "flips": []}
    g_choice, t_choice = _choices(forced), _choices(target_routing)
    if g_choice is not None and t_choice is not None and g_choice.shape == t_choice.shape:
        differ = (g_choice != t_choice).any(dim=-1).nonzero().flatten().tolist()
        facts["flips"] = [{"position": int(p), "golden_experts": g_choice[p].tolist(),
                           "target_experts": t_choice[p].tolist()} for p in differ]
    return out, facts


def routing_divergences(rows: list[dict[str, Any]], step: int, token_text: Callable[[int], str],
                        ratio: float = 3.0) -> list[RoutingRow]:
    """Routing flips that move an MoE block's output well beyond its own rounding: one entry per
    block, with the tokens they hit."""
    out = []
    for r in rows:
        flips = r.get("routing_flips")
        if not flips or r.get("rel_l2") is None:
            continue
        with_own = r.get("own_routing_rel_l2") or 0.0
        floor = max(r["rel_l2"], 1e-6)
        if with_own < ratio * floor:
            continue
        out.append(RoutingRow(
            module=r["name"], step=step,
            tokens=[RoutedToken(**f, text=token_text(f["position"])) for f in flips],
            output_error_with_target_routing=with_own, output_error_with_golden_routing=r["rel_l2"],
            detail=f"{len(flips)} token(s) routed to other experts; the block's output moves "
                   f"{with_own:.3g} (relative) against {r['rel_l2']:.3g} with the golden routing"))
    return out


def is_fused_experts(module: nn.Module, call: Call) -> bool:
    """One module holding every expert, called with the routing: (hidden, indices, weights)."""
    cls = type(module).__name__.lower()
    ints = [a for a in call.args if isinstance(a, torch.Tensor) and not a.is_floating_point()]
    return cls.endswith("experts") and len(ints) == 1 and ints[0].dim() == 2


def _routing_args(call: Call) -> tuple[int, int] | None:
    """Where a fused-experts call holds its top-k expert indices and their weights."""
    pos = next((i for i, a in enumerate(call.args)
                if isinstance(a, torch.Tensor) and not a.is_floating_point()), None)
    if pos is None:
        return None
    index = call.args[pos]
    w_pos = next((i for i, a in enumerate(call.args) if isinstance(a, torch.Tensor) and a.is_floating_point()
                  and a.shape == index.shape), None)
    return None if w_pos is None else (pos, w_pos)


#: how far apart (L2, unit rows) one token's copies may be in an expert-major call: its routing
#: scores scale each copy in the model's dtype, which rounds each element (bf16: ~0.4% each)
EXPERT_MAJOR_SPREAD = 0.05


def _expert_major(module: nn.Module, call: Call) -> torch.Tensor | None:
    """Each input row's expert (-1: a copy of a token the router did not send there, zero in and
    zero out) of a fused experts module called on its tokens repeated once per expert, expert by
    expert, each copy scaled by the token's routing score there, as Llama 4's MoE calls its
    experts; None for another call."""
    n = getattr(module, "num_experts", None)
    x = call.args[0] if len(call.args) == 1 and not call.kwargs else None
    if not (type(module).__name__.lower().endswith("experts") and isinstance(n, int) and n > 1
            and isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() == 2
            and x.shape[0] % n == 0 and x.shape[0]):
        return None
    # told by its rows, not by its shape (JetMoE's experts take rows grouped by expert, of uneven
    # sizes): each token's copies are one row scaled, and at least one is zero (top-k < experts)
    copies = x.detach().to("cpu", torch.float32).reshape(n, x.shape[0] // n, -1)
    norms = copies.norm(dim=-1)
    routed = norms > 0
    if bool(routed.all(dim=0).any()):
        return None
    unit = copies / norms.clamp(min=1e-30).unsqueeze(-1)
    first = unit[routed.int().argmax(dim=0), torch.arange(unit.shape[1])]  # each token's first copy
    spread = (unit - first).norm(dim=-1)[routed]
    if spread.numel() and float(spread.max()) >= EXPERT_MAJOR_SPREAD:
        return None
    expert = torch.arange(n).unsqueeze(-1).expand_as(routed)
    return torch.where(routed, expert, -1).reshape(-1)


def _expert_grouped(module: nn.Module, call: Call) -> torch.Tensor | None:
    """Each input row's expert of an experts module called on rows grouped by expert with the
    groups' sizes, ``(rows, sizes)``, as JetMoE calls its ``input_linear`` and ``output_linear``
    (the first ``sizes[0]`` rows expert 0's, and so on); None for another call."""
    n = getattr(module, "num_experts", None)
    if (not type(module).__name__.lower().endswith("experts") or len(call.args) != 2 or call.kwargs
            or not isinstance(n, int) or n < 2):
        return None
    x, sizes = call.args
    if isinstance(sizes, torch.Tensor) and sizes.dim() == 1 and not sizes.is_floating_point():
        sizes = sizes.tolist()
    if not (isinstance(x, torch.Tensor) and x.dim() == 2 and isinstance(sizes, (list, tuple))
            and len(sizes) == n and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                        for s in sizes)
            and sum(sizes) == x.shape[0]):
        return None
    return torch.repeat_interleave(torch.arange(n), torch.tensor(sizes, dtype=torch.long))


def _row_experts(module: nn.Module, call: Call) -> torch.Tensor | None:
    """The experts each row of a fused experts module's output went through, one row of expert
    indices per output row: the routing's top-k indices where the call is given them (one row per
    token); for an expert-major call (``_expert_major``) the row's expert, -1 for a copy of a token
    the router did not send there (zero in, zero out); for rows grouped by expert
    (``_expert_grouped``) the row's expert. None for another module or call."""
    found = _routing_args(call)
    if found is not None and is_fused_experts(module, call):
        return call.args[found[0]].to("cpu")
    experts = _expert_major(module, call)
    if experts is None:
        experts = _expert_grouped(module, call)
    return experts.unsqueeze(-1) if experts is not None else None


#: the share of the most excess error an expert's tokens must hold to be the one named
EXPERT_EXCESS_SHARE = 0.9


def expert_token_error(golden: torch.Tensor, target: torch.Tensor, module: nn.Module,
                       call: Call) -> tuple[int, float, float, float | None] | None:
    """The expert whose tokens' outputs err most, the mean and the median error of its tokens, and
    the median of the tokens it does not reach (None where it reaches every one): per token, its
    output row's relative error (a row's norm floored as ``own_error`` floors it). One expert of
    many at fault moves only its tokens: measured over every token (whole or the token mean) a
    fault in an expert that 5 of 31 tokens reach is diluted to a sixth, and one expert of 128 (top
    8) to a sixteenth. The expert is the one whose tokens hold the most error above the median
    token's, not the one whose tokens' mean is largest: an expert that one bad token also reaches
    (routed to the faulty one and to it) has a mean of that token's whole error, the faulty expert
    every bad token. None where the output has no token rows to match the routing's (the rows of
    ``_row_experts``)."""
    index = _row_experts(module, call)
    rel = token_row_errors(golden, target) if index is not None else None
    if rel is None or index is None or rel.shape[0] != index.shape[0]:
        return None
    routed = (index >= 0).any(dim=-1)  # (an expert-major call's rows of tokens not sent there: out)
    rel, index = rel[routed], index[routed]
    if not rel.numel():
        return None
    excess = (rel - rel.median()).clamp(min=0)
    reached = {int(e): (index == e).any(dim=-1) for e in index.unique().tolist() if e >= 0}
    if not reached:
        return None
    held = {e: float(excess[m].sum()) for e, m in reached.items()}
    mean = {e: float(rel[m].mean()) for e, m in reached.items()}
    # of the experts holding (nearly) all the excess, the one whose tokens are all bad: an expert
    # reached by the bad tokens and some good ones holds as much, over more tokens
    most = max(held.values())
    worst = max((e for e in reached if held[e] >= EXPERT_EXCESS_SHARE * most), key=lambda e: (mean[e], -e))
    rest = ~reached[worst]
    return (worst, mean[worst], float(rel[reached[worst]].median()),
            float(rel[rest].median()) if bool(rest.any()) else None)


def add_expert_error(row: dict[str, Any], module: nn.Module, call: Call, golden: torch.Tensor,
                     target: torch.Tensor) -> None:
    """Where ``module`` is a fused experts module, its own-error ``row`` (``golden`` against
    ``target``, its output) given its worst expert's tokens' error (``expert_token_error``):
    ``expert_rel``, ``expert_worst``, ``expert_median_rel`` and ``expert_rest_rel`` (its tokens'
    median and the other tokens'), and ``rel_l2`` the larger of its own and that."""
    worst = expert_token_error(golden, target, module, call)
    if worst is not None and math.isfinite(row.get("rel_l2", math.inf)):
        row["expert_worst"], row["expert_rel"], row["expert_median_rel"], row["expert_rest_rel"] = worst
        row["rel_l2"] = max(row["rel_l2"], worst[1])


@torch.no_grad()
def expert_errors(golden_module: nn.Module, target_module: nn.Module, call: Call, *, golden: Any,
                  target: Any) -> list[ExpertRow]:
    """Each expert's contribution alone (the routing weights of every other expert zeroed),
    golden against target: one row per expert the golden routing used."""
    found = _routing_args(call)
    if found is None:
        return []
    pos, w_pos = found
    index = call.args[pos]
    rows = []
    for e in sorted(set(index.flatten().tolist())):
        args = list(call.args)
        args[w_pos] = call.args[w_pos] * (index == e)
        outs = []
        for side, module in ((golden, golden_module), (target, target_module)):
            a = cast_inputs(args, side.device, side.dtype, module)
            k = cast_inputs(call.kwargs, side.device, side.dtype, module)
            outs.append(flatten_outputs(module(*a, **k))["0"])
        err = own_error(outs[0], outs[1])
        rows.append(ExpertRow(expert=int(e), tokens=int((index == e).any(dim=-1).sum()), **err))
    return rows


def worst_expert(rows: list[ExpertRow], ratio: float) -> int | None:
    """The expert whose own error stands out from the module's other experts; None when none
    does (every expert alike: the fault is shared, e.g. a wrong kernel for all of them)."""
    if len(rows) < 2:
        return None
    worst = max(rows, key=lambda r: r.rel_l2)
    others = [r.rel_l2 for r in rows if r is not worst]
    typical = max(median(others), 1e-9)
    worst.score = worst.rel_l2 / typical
    return worst.expert if worst.score >= ratio else None


@torch.no_grad()
def expert_linear_errors(golden_module: nn.Module, target_module: nn.Module, call: Call, *, name: str,
                         golden: Any, target: Any, expert: int
                         ) -> tuple[list[ExpertLinearRow], dict[str, torch.Tensor]]:
    """Each Linear layer of each expert of a target holding its experts as Linear layers
    (``UnfusedExperts``, a quantized checkpoint) against the golden's fused experts, replayed alone
    on the golden expert's input: the tokens routed to the expert for its gate and up projections,
    the golden's SwiGLU of them for its down projection. Each scored against the same projection
    in the module's other experts. With the inputs of ``expert``'s Linear layers (by name), in the
    target's dtype, for what a quantized layer says of its input (``W8A8Linear.explain``).
    Empty where the two sides are not such a pair."""
    found = _routing_args(call)
    paired = isinstance(target_module, UnfusedExperts) and plain_fused_experts(golden_module)
    if found is None or not paired:
        return [], {}
    index = call.args[found[0]]
    hidden = next(a for a in call.args if isinstance(a, torch.Tensor) and a.is_floating_point())
    g_hidden = cast_inputs(hidden, golden.device, golden.dtype)
    inter = golden_module.down_proj.shape[-1]
    rows: list[ExpertLinearRow] = []
    inputs: dict[str, torch.Tensor] = {}
    for e in sorted(set(index.flatten().tolist())):
        token = torch.where(index == e)[0].to(g_hidden.device)
        x = g_hidden[token]
        gate_up = golden_module.gate_up_proj[e]
        gate, up = nn.functional.linear(x, gate_up[:inter]), nn.functional.linear(x, gate_up[inter:])
        h = golden_module.act_fn(gate) * up
        reference = {EXPERT_LINEARS[0]: (x, gate), EXPERT_LINEARS[1]: (x, up),
                     EXPERT_LINEARS[2]: (h, nn.functional.linear(h, golden_module.down_proj[e]))}
        child = getattr(target_module, str(e))
        for projection, own_name in zip(EXPERT_LINEARS, target_module.names, strict=True):
            given, out = reference[projection]
            given = cast_inputs(given, target.device, target.dtype)
            err = own_error(out, getattr(child, own_name)(given))
            linear = f"{name}.{e}.{own_name}"
            rows.append(ExpertLinearRow(name=linear, expert=int(e), projection=projection,
                                        tokens=int(token.numel()), rel_l2=err["rel_l2"]))
            if e == expert:
                inputs[linear] = given
    floor = OP_ERROR_FLOOR.get(dtype_class(target.dtype), OP_ERROR_FLOOR["float32"])  # (rounding alone)
    for row in rows:
        others = [r.rel_l2 for r in rows if r.projection == row.projection and r.expert != row.expert]
        if others:
            row.typical = median(others)
            row.score = row.rel_l2 / max(row.typical, floor)
    return rows, inputs


#: how many times the bisect's ratio an expert's Linear layer must stand out from the same
#: projection in the other experts to be named: experts see few tokens each (2 against 20 in a
#: tiny MoE), so an honest quantization's projections already spread 4-5x around their median,
#: where a wrong scale stands out 16-60x
EXPERT_LINEAR_MARGIN = 2.0


def worst_expert_linear(rows: list[ExpertLinearRow], expert: int, ratio: float) -> ExpertLinearRow | None:
    """``expert``'s Linear layer that stands out from the same projection in the other experts
    the most, where one stands out ``ratio`` x ``EXPERT_LINEAR_MARGIN`` times; None when its
    Linear layers err alike."""
    own = [r for r in rows if r.expert == expert and r.score is not None]
    worst = max(own, key=lambda r: r.score or 0.0, default=None)
    return worst if worst is not None and (worst.score or 0.0) >= ratio * EXPERT_LINEAR_MARGIN else None
