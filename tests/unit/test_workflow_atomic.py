"""``llmflow.atomic``: a file written whole or not at all, in the bytes each writer asked for; a
finished staging file or folder put in place whole, the old one whole until then."""

from __future__ import annotations

import json
import os

import pytest

from llmflow.atomic import atomic_write_json, atomic_write_text, atomic_write_with, install_staged


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


def test_a_library_writing_to_a_path_name_writes_whole_or_not_at_all(tmp_path):
    path = tmp_path / "t.safetensors"
    atomic_write_with(path, lambda tmp: tmp.write_bytes(b"new"))
    assert path.read_bytes() == b"new"

    def half_then_fail(tmp):
        tmp.write_bytes(b"half")
        raise OSError("disk full")
    with pytest.raises(OSError):
        atomic_write_with(path, half_then_fail)
    assert path.read_bytes() == b"new" and sorted(os.listdir(tmp_path)) == ["t.safetensors"]


def test_a_link_is_replaced_not_written_through(tmp_path):
    target = tmp_path / "elsewhere.txt"
    target.write_text("theirs", encoding="utf-8")
    (tmp_path / "a.txt").symlink_to(target)
    atomic_write_text(tmp_path / "a.txt", "ours")
    assert target.read_text(encoding="utf-8") == "theirs"
    written = tmp_path / "a.txt"
    assert not written.is_symlink() and written.read_text(encoding="utf-8") == "ours"


def _folder(path, files):
    path.mkdir(parents=True)
    for name, text in files.items():
        (path / name).write_text(text, encoding="utf-8")
    return path


def _contents(path):
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(path.iterdir())}


def test_a_folder_replaces_a_folder_whole_and_leaves_nothing_aside(tmp_path):
    final = _folder(tmp_path / "stage", {"a.txt": "old a", "gone.txt": "old only"})
    staged = _folder(tmp_path / ".tmp" / "stage-1234", {"a.txt": "new a", "b.txt": "new b"})
    install_staged(staged, final)
    assert _contents(final) == {"a.txt": "new a", "b.txt": "new b"}
    assert os.listdir(tmp_path / ".tmp") == []  # neither the staged folder nor the old one is left


def test_a_file_or_a_new_place_takes_one_rename(tmp_path):
    staging = _folder(tmp_path / "staging", {"x.csv": "new", "y.csv": "first"})
    (tmp_path / "x.csv").write_text("old", encoding="utf-8")
    install_staged(staging / "x.csv", tmp_path / "x.csv")
    install_staged(staging / "y.csv", tmp_path / "y.csv")
    assert (tmp_path / "x.csv").read_text(encoding="utf-8") == "new"
    assert (tmp_path / "y.csv").read_text(encoding="utf-8") == "first"
    assert os.listdir(staging) == []
    staged = _folder(tmp_path / "staging" / "new-stage", {"s.json": "{}"})
    install_staged(staged, tmp_path / "stage")
    assert _contents(tmp_path / "stage") == {"s.json": "{}"}


def test_a_failure_mid_way_leaves_the_old_folder_whole(tmp_path, monkeypatch):
    """The old folder is moved aside, then the new one fails to go in: the old one is put back."""
    final = _folder(tmp_path / "stage", {"a.txt": "old a", "b.txt": "old b"})
    staged = _folder(tmp_path / ".tmp" / "stage-1234", {"a.txt": "new a"})
    real_replace = os.replace
    calls = []

    def replace(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:  # the new folder into place
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="No space"):
        install_staged(staged, final)
    monkeypatch.undo()
    assert calls[1] == (staged, final) and calls[2][1] == final  # moved aside, then back
    assert _contents(final) == {"a.txt": "old a", "b.txt": "old b"}
    assert os.listdir(tmp_path / ".tmp") == ["stage-1234"] and _contents(staged) == {"a.txt": "new a"}


def test_never_removes_or_writes_through_what_is_not_its_own(tmp_path):
    """A link at the target is replaced, never followed; a folder never gives way to a file, nor
    a link or a file to a folder: the user's folder and files stay as they were."""
    theirs = _folder(tmp_path / "theirs", {"keep.txt": "their data"})
    staging = _folder(tmp_path / "staging", {"out.csv": "ours"})
    (tmp_path / "link").symlink_to(theirs)
    install_staged(staging / "out.csv", tmp_path / "link")  # the link goes, not what it points at
    assert not (tmp_path / "link").is_symlink() and (tmp_path / "link").read_text() == "ours"
    (tmp_path / "link2").symlink_to(theirs)
    staged = _folder(staging / "stage", {"s.json": "{}"})
    with pytest.raises(OSError):
        install_staged(staged, tmp_path / "link2")
    (staging / "f.csv").write_text("ours", encoding="utf-8")
    with pytest.raises(OSError):
        install_staged(staging / "f.csv", theirs)
    (tmp_path / "their_file").write_text("their file", encoding="utf-8")
    with pytest.raises(OSError):
        install_staged(staged, tmp_path / "their_file")
    assert _contents(theirs) == {"keep.txt": "their data"} and (tmp_path / "link2").is_symlink()
    assert (tmp_path / "their_file").read_text() == "their file"


class _Loop:
    """A value whose text form fails (json's default=str calls it)."""

    def __str__(self) -> str:
        raise ValueError("no text")
