"""The dtype vocabulary: every spelling the readers meet maps to one name and one torch dtype."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from llmflow.dtypes import (
    DEFAULT_THRESHOLDS,
    DTYPE_OF_SAFETENSORS_CODE,
    OP_ERROR_FLOOR,
    SAFETENSORS_CODES,
    SMALL_VALUE,
    SMALL_VALUE_ATOL,
    dtype_class,
    dtype_name,
    quantization_dtype,
    torch_dtype,
)
from llmflow.formats.llmflow_dump import SAFETENSORS_DTYPES


@pytest.mark.parametrize("spelling, name", [
    (torch.bfloat16, "bfloat16"), (torch.float16, "float16"), (torch.half, "float16"),
    (torch.int64, "int64"), (torch.bool, "bool"), (torch.float8_e4m3fn, "float8_e4m3fn"),
    ("torch.bfloat16", "bfloat16"),   # msprobe's dump.json, msit's statistics.csv, repro arguments
    ("bfloat16", "bfloat16"),         # llmflow's own index, env.json's model_dtype
    (" torch.float32 ", "float32"),   # a CSV cell with spaces
    ("half", "float16"), ("torch.half", "float16"), ("float", "float32"), ("double", "float64"),
    ("long", "int64"), ("int", "int32"), ("short", "int16"), ("cfloat", "complex64"),
    (np.dtype("float32"), "float32"), (np.dtype("int8"), "int8"), (np.dtype("bool"), "bool"),
])
def test_dtype_name_of_every_spelling(spelling, name):
    assert dtype_name(spelling) == name


def test_dtype_name_keeps_what_it_does_not_know():
    """A reader keeps what its dump says: an unknown name is not guessed at."""
    assert dtype_name("torch.Float16") == "Float16"
    assert dtype_name("x") == "x"
    assert dtype_name("") == ""


@pytest.mark.parametrize("spelling, dtype", [
    ("torch.float16", torch.float16), ("float16", torch.float16), ("half", torch.float16),
    ("torch.bfloat16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("float8_e5m2", torch.float8_e5m2),
    ("int64", torch.int64), ("long", torch.int64), ("bool", torch.bool), (torch.int8, torch.int8),
    (np.dtype("float64"), torch.float64),
])
def test_torch_dtype_of_every_spelling(spelling, dtype):
    assert torch_dtype(spelling) is dtype


@pytest.mark.parametrize("not_a_dtype", ["Tensor", "torch.contiguous_format", "nn", "", "float99", None,
                                         "__class__"])
def test_torch_dtype_refuses_what_is_not_a_dtype(not_a_dtype):
    assert torch_dtype(not_a_dtype) is None


def test_every_torch_dtype_round_trips_through_its_name():
    for attr in dir(torch):
        dtype = getattr(torch, attr)
        if isinstance(dtype, torch.dtype):
            assert torch_dtype(dtype_name(dtype)) is dtype, attr
            assert dtype_name(dtype) == str(dtype).removeprefix("torch.")


def test_safetensors_codes_name_real_dtypes_and_read_back():
    for name, code in SAFETENSORS_CODES.items():
        assert torch_dtype(name) is not None, name
        assert DTYPE_OF_SAFETENSORS_CODE[code] == name
    # the writer's table holds every code this torch can hold, keyed by torch dtype
    assert SAFETENSORS_DTYPES[torch.bfloat16] == "BF16" and SAFETENSORS_DTYPES[torch.bool] == "BOOL"
    assert SAFETENSORS_DTYPES[torch.float8_e4m3fn] == "F8_E4M3"


@pytest.mark.parametrize("spelling, cls", [
    ("torch.bfloat16", "bfloat16"), (torch.bfloat16, "bfloat16"), ("bf16", "bfloat16"),
    ("half", "float16"), ("torch.half", "float16"), ("FP16", "float16"), ("float8_e5m2", "float8"),
    ("w4a16", "int4"), ("int32", "integer"), ("uint8", "integer"), ("bool", "integer"),
    (None, "float32"), ("complex64", "float32"),
])
def test_dtype_class(spelling, cls):
    assert dtype_class(spelling) == cls


@pytest.mark.parametrize(("types", "judged", "cls"), [
    (["W8A8"], "w8a8", "int8"), (["W8A8_DYNAMIC", "W8A16"], "w8a8", "int8"), (["W8A16"], "w8a16", "int8"),
    (["W8A8", "W4A16"], "w4a16", "int4"), (["w8a8_mix"], "w8a8", "int8"), ([], None, None)])
def test_a_quantized_model_is_judged_at_its_coarsest_weight_type(types, judged, cls):
    assert quantization_dtype(types) == judged
    assert judged is None or dtype_class(judged) == cls


def test_tolerance_tables_are_keyed_by_canonical_names():
    """Each table is looked up with dtype_name(...): a key in another spelling would never match."""
    for table in (OP_ERROR_FLOOR, SMALL_VALUE, SMALL_VALUE_ATOL):
        assert all(dtype_name(k) == k and torch_dtype(k) is not None for k in table)
    assert set(SMALL_VALUE) == set(SMALL_VALUE_ATOL)
    assert all(dtype_class(k) == k for k in DEFAULT_THRESHOLDS)
    # a coarser dtype tolerates more, in every table
    for table in (OP_ERROR_FLOOR, SMALL_VALUE):
        assert table["float64"] < table["float32"] < table["bfloat16"]


def test_importing_the_vocabulary_leaves_torch_unimported():
    """llmflow validate/plan reach this module and start without torch."""
    code = "import sys, llmflow.dtypes; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
