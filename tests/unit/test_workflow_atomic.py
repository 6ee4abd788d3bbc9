"""``llmflow.atomic``: a file written whole or not at all, in the bytes each writer asked for."""

from __future__ import annotations

import json
import os

import pytest

from llmflow.atomic import atomic_write_json, atomic_write_text


def test_json_compact_or_indented_with_a_newline(tmp_path):
    path = tmp_path / "a.json"
    atomic_write_json(path, {"x": [1, 2], "p": tmp_path})
    assert path.read_text(encoding="utf-8") == json.dumps({"x": [1, 2], "p": str(tmp_path)})
    atomic_write_json(path, {"x": 1}, indent=2, durable=True)
    assert path.read_text(encoding="utf-8") == '{\n  "x": 1\n}\n'
    assert sorted(os.listdir(tmp_path)) == ["a.json"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "a.json"
    atomic_write_text(path, "old")
    with pytest.raises(ValueError):
        atomic_write_json(path, {"x": float("nan"), "loop": _Loop()})
    assert path.read_text(encoding="utf-8") == "old"
    assert sorted(os.listdir(tmp_path)) == ["a.json"]


def test_a_link_is_replaced_not_written_through(tmp_path):
    target = tmp_path / "elsewhere.txt"
    target.write_text("theirs", encoding="utf-8")
    (tmp_path / "a.txt").symlink_to(target)
    atomic_write_text(tmp_path / "a.txt", "ours")
    assert target.read_text(encoding="utf-8") == "theirs"
    written = tmp_path / "a.txt"
    assert not written.is_symlink() and written.read_text(encoding="utf-8") == "ours"


class _Loop:
    """A value whose text form fails (json's default=str calls it)."""

    def __str__(self) -> str:
        raise ValueError("no text")
