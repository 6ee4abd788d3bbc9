"""Where the decoder layers of a model are, found from its structure rather than from its names.

Every decoder family keeps its blocks in one list: ``model.layers`` (Llama, Qwen, Mistral, Gemma,
Phi, the MoE models), ``transformer.h`` (GPT-2, Falcon), ``gpt_neox.layers``,
``model.decoder.layers``, ``transformer.encoder.layers`` (ChatGLM-style remote code). Whatever its
name, that list is the container whose children are repeats of one class and which holds most of
the model's parameters (an MoE layer's list of experts repeats a class too, but holds a fraction
of one layer). ``find_layer_stack`` finds it in a live model or in a dump's ``topology.json``.

A module's layer is then exact (``LayerStack.layer_of``); names alone (a dump without topology)
fall back to the first all-digit path segment (``layer_of_name``), which every family above
satisfies. Both live here so that "layer" has one definition.

Inside a block, ``block_roles`` names the attention (in a hybrid family its other token mixer:
linear attention, a convolution, a state space), the MLP (or MoE block), the norms and, for an
MoE block, its router and experts, by class and attribute name: what fault injection and the
MoE-aware replay need. ``find_cache`` finds the KV cache a call reads, by type: its keyword has
changed across transformers releases.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from llmflow.errors import UserError

# The first all-digit dotted segment is the layer index: model.layers.7.mlp -> model.layers.7
_LAYER_RE = re.compile(r"^((?:[^./]+\.)*?\d+)(?=\.|$)")
_ATTENTION_ATTRS = ("self_attn", "attn", "attention", "self_attention", "mixer", "token_mixer")
#: class-name words of a block's token mixer: attention, or in a hybrid family the layers that mix
#: tokens otherwise (Gated DeltaNet linear attention, a short convolution, a Mamba state space)
_ATTENTION_WORDS = ("attention", "attn", "mixer", "deltanet", "shortconv", "mamba")
_MLP_WORDS = ("mlp", "feedforward", "feed_forward", "ffn", "moe", "sparse", "mixture")


def layer_of_name(name: str) -> str | None:
    """The layer of a module from its name alone: ``model.layers.7.mlp`` -> ``model.layers.7``.

    The path up to the first all-digit segment; None outside the layer stack. API names
    (``module/api.n``) use their module part."""
    m = _LAYER_RE.match(name.split("/", 1)[0])
    return m.group(1) if m else None


@dataclass(frozen=True)
class LayerStack:
    """The decoder layers: the list's path, its children's paths in order and their classes."""

    path: str
    layers: tuple[str, ...]
    classes: tuple[str, ...]  # most common first
    _index: dict[str, int] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._index.update({name: i for i, name in enumerate(self.layers)})

    def layer_of(self, name: str) -> str | None:
        """The layer ``name`` (a module path, or an API name ``module/api.n``) belongs to."""
        module = name.split("/", 1)[0]
        if not module.startswith(self.path + "."):
            return None
        head = module[len(self.path) + 1:].split(".", 1)[0]
        layer = f"{self.path}.{head}"
        return layer if layer in self._index else None

    def index_of(self, name: str) -> int | None:
        layer = self.layer_of(name)
        return self._index[layer] if layer is not None else None


def layer_of(name: str, stack: LayerStack | None = None) -> str | None:
    """The decoder layer of a module (or API) name: exact from ``stack``, else from the name."""
    return stack.layer_of(name) if stack is not None else layer_of_name(name)


def layer_index(name: str, stack: LayerStack | None = None) -> int | None:
    """The integer index of ``name``'s layer, or None outside the layer stack."""
    if stack is not None:
        return stack.index_of(name)
    layer = layer_of_name(name)
    return int(layer.rsplit(".", 1)[-1]) if layer else None


#: A module (or a weight) stands out from its siblings, the same role in the other layers, when its
#: error is this many times theirs: the bisect's ranking and the weight check's sibling rule.
DEFAULT_RATIO_THRESHOLD = 3.0


def module_type(name: str, stack: LayerStack | None = None) -> str:
    """The name with its layer index replaced by ``*``: the key modules are compared within.

    ``model.layers.7.mlp.down_proj`` -> ``model.layers.*.mlp.down_proj``; names outside the layer
    stack are their own type.
    """
    layer = layer_of(name, stack)
    if layer is None:
        return name
    prefix, _, _ = layer.rpartition(".")
    return (prefix + "." if prefix else "") + "*" + name[len(layer):]


@dataclass
class _Node:
    name: str
    type: str
    children: list[_Node]
    params: int


def _from_module(module: Any, name: str = "") -> _Node:
    children = [_from_module(m, f"{name}.{n}" if name else n) for n, m in module.named_children()]
    own = sum(p.numel() for p in module.parameters(recurse=False))
    return _Node(name, type(module).__name__, children, own + sum(c.params for c in children))


def _from_topology(node: dict[str, Any]) -> _Node:
    children = [_from_topology(c) for c in node.get("children") or [] if isinstance(c, dict)]
    own = 0
    for shape in (node.get("params") or {}).values():
        n = 1
        for s in shape if isinstance(shape, list) else []:
            n *= int(s) if isinstance(s, int) else 1
        own += n
    return _Node(str(node.get("name", "")), str(node.get("type", "")), children,
                 own + sum(c.params for c in children))


def _walk(node: _Node) -> Iterator[_Node]:
    yield node
    for c in node.children:
        yield from _walk(c)


def _tree(model_or_topology: Any) -> _Node:
    if isinstance(model_or_topology, dict):
        return _from_topology(model_or_topology)
    return _from_module(model_or_topology)


def find_layer_stack(model_or_topology: Any, path: str | None = None) -> LayerStack | None:
    """The decoder-layer list of a ``torch.nn.Module`` or a dump's topology dict; None if the model
    has no list of repeated blocks. ``path`` names the list instead of searching (a recipe's
    override); a path that is not a container of blocks is a ``UserError``."""
    root = _tree(model_or_topology)
    if path:
        node = next((n for n in _walk(root) if n.name == path), None)
        if node is None or len(node.children) < 1:
            raise UserError(f"layers {path!r}: the model has no module list of that name "
                            f"(lists of repeated blocks: {', '.join(_stack_candidates(root)) or 'none'})")
        return _stack(node)
    best: tuple[int, int, _Node] | None = None
    for node in _walk(root):
        if len(node.children) < 2:
            continue
        cls, count = Counter(c.type for c in node.children).most_common(1)[0]
        if count < 2 or count * 2 < len(node.children) or not all(c.name.rsplit(".", 1)[-1].isdigit()
                                                                   for c in node.children):
            continue
        score = (node.params, -node.name.count("."))
        if best is None or score > best[:2]:
            best = (*score, node)
    return _stack(best[2]) if best else None


def _stack(node: _Node) -> LayerStack:
    classes = tuple(c for c, _ in Counter(ch.type for ch in node.children).most_common())
    return LayerStack(node.name, tuple(c.name for c in node.children), classes)


def _stack_candidates(root: _Node) -> list[str]:
    return [n.name for n in _walk(root) if len(n.children) >= 2
            and all(c.name.rsplit(".", 1)[-1].isdigit() for c in n.children)]


def resolve_module_classes(model: Any, names: list[str]) -> list[str]:
    """Module class names for a dump's ``module_list``: ``auto`` becomes the decoder-layer
    class(es) found by ``find_layer_stack``; every other name must be a class in the model.
    A name that matches nothing is a ``UserError`` naming the classes that exist."""
    present = {type(m).__name__ for m in model.modules()}
    out: list[str] = []
    for name in names:
        if name == "auto":
            stack = find_layer_stack(model)
            if stack is None:
                raise UserError(f"layer_class 'auto': {type(model).__name__} has no list of repeated "
                                "blocks to call its decoder layers; set layer_class to one of its "
                                f"classes: {_some(present)}")
            out.extend(c for c in stack.classes if c not in out)
        elif name not in present:
            stack = find_layer_stack(model)
            hint = f" (its decoder layers are {', '.join(stack.classes)})" if stack else ""
            raise UserError(f"layer_class {name!r}: no module of that class in "
                            f"{type(model).__name__}{hint}; classes present: {_some(present)}")
        elif name not in out:
            out.append(name)
    return out


def _some(names: set[str], limit: int = 25) -> str:
    shown = sorted(names)
    return ", ".join(shown[:limit]) + (f", ... ({len(shown)} in all)" if len(shown) > limit else "")


def _role_of(attr: str, cls: str) -> str | None:
    """attention, norm or mlp, from a block child's attribute and class names (lowercase)."""
    a, c = attr.lower(), cls.lower()
    if "dropout" in c or c == "identity":
        return None  # no arithmetic of its own
    if any(w in c for w in _ATTENTION_WORDS) or a in _ATTENTION_ATTRS:
        return "attention"
    if "norm" in c or "norm" in a or re.fullmatch(r"ln(_\w*|\d*|f)", a):
        return "norm"
    if any(w in c or w in a for w in _MLP_WORDS):
        return "mlp"
    return None


def block_roles(block: Any, prefix: str = "") -> dict[str, list[str]]:
    """The parts of one decoder block by role: ``attention``, ``mlp``, ``norm`` (its direct
    children), and for a mixture-of-experts block ``moe`` with its ``router`` and ``experts``.
    Names are ``prefix.child`` paths; a role the block lacks is absent."""
    roles: dict[str, list[str]] = {}
    pre = f"{prefix}." if prefix else ""
    for attr, child in block.named_children():
        role = _role_of(attr, type(child).__name__)
        if role in ("mlp", None) and _moe_parts(child):
            role = "moe"
        if role is not None:
            roles.setdefault(role, []).append(pre + attr)
        if role == "moe":
            for part, names in _moe_parts(child).items():
                roles.setdefault(part, []).extend(f"{pre}{attr}.{n}" for n in names)
    return roles


def is_router(name: str, module_type: str | None = None) -> bool:
    """Is module ``name`` (of class ``module_type``) an MoE router, from what a dump records?
    The same rule as ``block_roles``: an attribute ``gate``/``router`` or a router class."""
    last = name.rsplit(".", 1)[-1].lower()
    cls = (module_type or "").lower()
    return last in ("gate", "router") or "router" in cls


def is_experts(name: str, module_type: str | None = None) -> bool:
    """Is module ``name`` (of class ``module_type``) an MoE block's experts (a list or a fused
    module)? The same rule as ``block_roles``."""
    return "experts" in name.rsplit(".", 1)[-1].lower() or (module_type or "").lower().endswith("experts")


def _moe_parts(module: Any) -> dict[str, list[str]]:
    """``{"router": [...], "experts": [...]}`` when ``module`` routes tokens to experts."""
    parts: dict[str, list[str]] = {}
    for attr, child in module.named_children():
        if is_router(attr, type(child).__name__):
            parts.setdefault("router", []).append(attr)
        elif is_experts(attr, type(child).__name__):
            parts.setdefault("experts", []).append(attr)
    return parts if "router" in parts and "experts" in parts else {}


# -- the KV cache a module reads ---------------------------------------------------------------
#: the keywords transformers passes the KV cache under, newest first (``cache`` since 5.24)
CACHE_KEYWORDS = ("cache", "past_key_values", "past_key_value", "layer_past")


def is_cache(value: Any) -> bool:
    """A KV-cache object: a transformers ``Cache``, or anything with ``update`` and
    ``get_seq_length`` (the interface attention modules call)."""
    if isinstance(value, (tuple, list, dict, str, int, float, bool, type(None))):
        return False
    torch = sys.modules.get("torch")  # (a tensor exists only where torch is imported)
    if torch is not None and isinstance(value, torch.Tensor):
        return False
    return callable(getattr(value, "update", None)) and callable(getattr(value, "get_seq_length", None))


def find_cache(args: tuple, kwargs: dict) -> tuple[str | int, Any] | None:
    """Where a call's KV cache is (a keyword or a position) and the cache, or None.

    By type rather than by name: the keyword changed across transformers releases
    (``layer_past``, ``past_key_value``, ``past_key_values``, ``cache``) and remote-code models
    pass it positionally."""
    for key in CACHE_KEYWORDS:
        if is_cache(kwargs.get(key)):
            return key, kwargs[key]
    for key, value in kwargs.items():
        if is_cache(value):
            return key, value
    for i, value in enumerate(args):
        if is_cache(value):
            return i, value
    return None
