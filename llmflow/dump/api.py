"""API mode: capture tensor operations (torch.*, torch.nn.functional.*, Tensor methods and
operators) through ``torch.overrides.TorchFunctionMode``; nothing in torch is monkeypatched.

Each captured call is named ``<calling module path>/<api name>.<n>``: the calling module is the
innermost module whose forward is running (the recorder keeps the stack), ``n`` counts calls of
that api within that module within the step. The same names serve the disk dump, op replay in
memory and the API-dump cost estimate, so all three line up. Operator dunders are named like the
function they compute (``a @ b`` -> ``matmul``, ``a + b`` / ``b + a`` -> ``add``, ``a += b`` ->
``add_``, ``1 - x`` -> ``rsub``: ``llmflow.operators``), so ``x.add(y)``, ``torch.add(x, y)`` and
``x + y`` line up across two dumps.

Passed through without a record (documented in ``SKIPPED``): metadata queries (``size``, ``dim``,
property reads via ``__get__``...), host conversions (``item``, ``tolist``), and pure layout/view
ops (``view``, ``reshape``, ``transpose``, ``__getitem__``, ``contiguous``...), and allocations of
uninitialised memory (``empty``, ``empty_like``...: their contents are whatever was there until an
op writes them, so two runs' "outputs" would be compared as garbage). Layout ops move no
arithmetic, so they cannot introduce a numerical error; skipping them keeps API mode cheap. Private
torch callables (one leading underscore: ``_set_grad_enabled``, ``_assert``...) are bookkeeping and
passed through too, except the private matmuls listed in ``PRIVATE_ARITHMETIC`` (``_grouped_mm``,
``_scaled_mm``, the int8/int4 weight-packed matmuls...): transformers computes mixture-of-experts
layers with ``torch._grouped_mm`` and FP8/quantized linears with ``torch._scaled_mm`` and kin, and
those calls carry the layer's weights, so an expert's or a quantized weight's error shows up in
them and nowhere else. Every
argument of an API call is recorded: tensors, and scalars (``dim=-1``, an eps, a dtype) as index
rows without data, so a call can be replayed from the dump (``llmflow.checks.precheck``).
Parameters passed to an op (``F.linear``'s weight) are recorded by dtype, shape and parameter
name only: they do not change between steps, ``dump_weight`` writes them once.

While an op runs inside ``__torch_function__`` the mode is popped, so torch functions that call
other torch functions are captured once, at the outermost call, and our own copies never recurse.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Protocol

from torch.overrides import TorchFunctionMode

from llmflow import native
from llmflow.operators import operator_name

SKIPPED = frozenset("""
    __get__ __set__ __delete__ size dim ndimension numel nelement stride storage_offset is_contiguous
    data_ptr element_size is_floating_point is_complex is_signed get_device __len__ __iter__ __bool__
    __format__ __repr__ __hash__ __index__ __int__ __float__ __reduce_ex__ __deepcopy__ __setstate__
    __array__ __contains__ __dlpack__ item tolist type untyped_storage requires_grad_ is_nonzero
    view view_as reshape reshape_as transpose transpose_ permute t unsqueeze squeeze expand expand_as
    flatten unflatten narrow contiguous __getitem__ __setitem__ split chunk unbind select detach
    clone is_inference is_same_size dim_order numpy cpu cuda npu pin_memory share_memory_
    __torch_function__ _is_view has_names
    empty empty_like new_empty empty_strided new_empty_strided
""".split())
# private torch callables that compute (recorded, unlike other single-underscore names): grouped
# (mixture-of-experts), scaled (FP8) and weight-packed (int8/int4) matmuls, as transformers' MoE and
# quantized paths call them
PRIVATE_ARITHMETIC = frozenset("""
    _grouped_mm _scaled_mm _scaled_mm_v2 _scaled_grouped_mm _scaled_grouped_mm_v2 _int_mm
    _weight_int8pack_mm _weight_int4pack_mm _weight_int4pack_mm_for_cpu
    _weight_int4pack_mm_with_scales_and_zeros _dyn_quant_matmul_4bit _mixed_dtypes_linear
""".split())
#: operator libraries whose ops keep their bare name (``torch.ops.aten.add`` records ``add``;
#: torch_npu's ``npu_rms_norm``, which the precheck's built-in references know by that name)
TORCH_NAMESPACES = frozenset({"aten", "prims", "npu"})


def api_name(func: Callable[..., Any]) -> str | None:
    """The recorded name of a torch callable, or None for calls that are passed through. An op of
    another library (``torch.ops.mylib.rms_norm``, a custom kernel) is named with its namespace
    (``mylib::rms_norm``): its bare name may be a torch function's, which computes something else."""
    qualified = getattr(func, "_qualified_op_name", None)  # torch.ops.NS.OP
    if qualified is None and isinstance(getattr(func, "namespace", None), str):  # torch.ops.NS.OP.overload
        qualified = getattr(getattr(func, "_schema", None), "name", None)
    if isinstance(qualified, str) and "::" in qualified:
        if qualified.partition("::")[0] not in TORCH_NAMESPACES:
            return qualified
    name = getattr(func, "__name__", None) or str(func)
    if name in PRIVATE_ARITHMETIC:
        return name
    if name in SKIPPED or (name.startswith("_") and not name.startswith("__")):
        return None  # other private helpers (_set_grad_enabled, ...) are bookkeeping, not arithmetic
    if name.startswith("__") and name.endswith("__"):
        return operator_name(name)  # (other dunders, __reduce__, __setstate__..., compute nothing)
    return name


class OpSink(Protocol):
    """What an ``ApiMode`` sends a call to: the op side of ``recorder.Sink``."""

    active: bool
    exec_order: list[str] | None

    def wants_op(self, module: str) -> bool: ...  # (asked once per module: the answer must not change)

    def op_inputs(self, name: str, api: str, func: Callable[..., Any], args: tuple, kwargs: dict) -> None: ...

    def op_output(self, name: str, api: str, func: Callable[..., Any], output: Any) -> None: ...


class OpNamer(Protocol):
    """What an ``ApiMode`` reads to name a call: the running modules and the calls counted so far
    (a ``recorder.Recorder``; declared here so that the recorder imports this module and not the
    other way round)."""

    prefix: str
    stack: list[str]  # modules whose forward is running, innermost last
    op_counts: dict[str, int]  # "<module>/<api>" -> calls so far this step

    @property
    def sink(self) -> OpSink | None: ...  # (read only here: a Recorder's Sink is an OpSink)


# The dispatch below in C (``capture.cpp``'s ``Dispatch``: the same steps, ~3x faster a call, on
# every torch call of an API dump), where it is built; this class's own method otherwise.
_NATIVE = None if native.disabled() else native.CAPTURE.extension("llmflow_capture")
_DISPATCH_BASE: type = _NATIVE.Dispatch if _NATIVE is not None else object


class ApiMode(TorchFunctionMode, _DISPATCH_BASE):
    """Sends every computing torch call made while it is entered to its recorder's sink, named
    ``<innermost running module>/<api>.<n>``."""

    def __init__(self, recorder: OpNamer):
        super().__init__()
        self.recorder = recorder
        self._names: dict[Any, str | None] = {}  # callable -> recorded name (None: passed through)
        # module -> sink.wants_op(module), for the sink _wanted_sink refers to (asked once per
        # module for a sink's life: a Python call on every recorded op was ~3% of an API dump)
        self._wanted: dict[str, bool] = {}
        self._wanted_sink: Callable[[], Any] = lambda: None
        if _NATIVE is not None:
            self._setup_dispatch(recorder, self._names, api_name)

    def _dispatch(self, func: Callable[..., Any], types: Any, args: tuple = (),
                  kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        try:
            name = self._names[func]
        except (KeyError, TypeError):
            name = api_name(func)
            try:
                self._names[func] = name
            except TypeError:  # an unhashable callable: name it every time
                pass
        recorder = self.recorder
        sink = recorder.sink
        if name is None or sink is None or not sink.active:
            return func(*args, **kwargs)
        stack = recorder.stack
        module = stack[-1] if stack else recorder.prefix
        if self._wanted_sink() is not sink:
            self._wanted.clear()
            try:
                self._wanted_sink = weakref.ref(sink)
            except TypeError:  # a sink without weak references: asked every time
                self._wanted_sink = lambda: None
        wanted = self._wanted.get(module)
        if wanted is None:
            wanted = bool(sink.wants_op(module))
            if self._wanted_sink() is sink:
                self._wanted[module] = wanted
        if not wanted:
            return func(*args, **kwargs)
        key = f"{module}/{name}"
        counts = recorder.op_counts
        n = counts.get(key, 0)
        counts[key] = n + 1
        full = f"{key}.{n}"
        if sink.exec_order is not None:
            sink.exec_order.append(full)
        sink.op_inputs(full, name, func, args, kwargs)
        out = func(*args, **kwargs)
        sink.op_output(full, name, func, out)
        return out

    __torch_function__ = _dispatch  # (the compiled one where it is built: ``use_compiled_dispatch``)


def use_compiled_dispatch(on: bool = True) -> bool:
    """API mode's ``__torch_function__``: the compiled dispatch (``on``, where it is built: the
    default) or ``ApiMode._dispatch``; returns whether the compiled one is in use now (see
    ``capture.use_compiled_capture``, which switches both)."""
    compiled = on and _NATIVE is not None
    ApiMode.__torch_function__ = _NATIVE.Dispatch.__torch_function__ if compiled else ApiMode._dispatch
    return compiled


use_compiled_dispatch(True)
