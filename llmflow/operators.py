"""How a Python operator on tensors is named in a dump, in every format: like the function it
computes, so that ``x.add(y)``, ``torch.add(x, y)`` and ``x + y`` line up across two dumps
(llmflow's API mode sees ``Tensor.__add__``, msprobe records ``Tensor.__add__.3.forward``).

``a + b`` and ``b + a`` are both ``add``; ``a += b`` is ``add_``. A reflected operator whose
result depends on the order of its operands keeps an ``r``: ``1 - x`` calls ``x.__rsub__(1)``,
whose recorded arguments ``(x, 1)`` are those of ``x - 1``, so naming it ``sub`` would have a
replay from the dump (the precheck) compute ``x - 1`` and call a correct op wrong. ``rsub`` is
also torch's own name for it (``torch.rsub(x, 1) == 1 - x``); the others (``rdiv``, ``rpow``,
``rfloordiv``, ...) are replayed through the Tensor method itself (``tensor_method``).
"""

from __future__ import annotations

# binary operators, by their dunder's core (``__add__`` -> ``add``)
BINARY = frozenset("add sub mul matmul truediv floordiv mod pow and or xor lshift rshift div".split())
# those whose reflected form (``__rsub__``) computes something else than the plain one from the
# same arguments (not ``add``, ``mul`` and the bitwise and/or/xor)
ORDERED = frozenset("sub matmul truediv floordiv mod pow lshift rshift div".split())
# dunders named like the torch function that computes the same (``~x`` is ``bitwise_not``)
_RENAMED = {"truediv": "div", "invert": "bitwise_not", "pos": "positive"}
UNARY_AND_COMPARISONS = frozenset("neg invert abs pos lt le gt ge eq ne".split())


def operator_name(dunder: str) -> str | None:
    """``__add__``/``__radd__`` -> ``add``, ``__iadd__`` -> ``add_``, ``__rsub__`` -> ``rsub``,
    ``__rtruediv__`` -> ``rdiv``, ``__invert__`` -> ``bitwise_not``; None for a name that is not
    an operator dunder (``__reduce__``, ``__getitem__``, ``matmul``)."""
    if not (dunder.startswith("__") and dunder.endswith("__") and len(dunder) > 4):
        return None
    core, prefix, suffix = dunder[2:-2], "", ""
    if core not in BINARY and core not in UNARY_AND_COMPARISONS:
        if core[:1] == "r" and core[1:] in BINARY:
            core = core[1:]
            prefix = "r" if core in ORDERED else ""
        elif core[:1] == "i" and core[1:] in BINARY:
            core, suffix = core[1:], "_"
        else:
            return None
    return prefix + _RENAMED.get(core, core) + suffix


def tensor_method(api: str) -> str | None:
    """The Tensor dunder that computes an operator's recorded name where torch has no function of
    that name (``rdiv`` -> ``__rtruediv__``, ``floordiv`` -> ``__floordiv__``, ``and_`` ->
    ``__iand__``); None for other names."""
    core, prefix, suffix = api, "", ""
    if core.endswith("_"):
        core, suffix = core[:-1], "_"
    if core not in BINARY and core[:1] == "r" and core[1:] in ORDERED and not suffix:
        core, prefix = core[1:], "r"
    if core not in BINARY:
        return None
    core = "truediv" if core == "div" else core
    return f"__{'i' if suffix else prefix}{core}__"
