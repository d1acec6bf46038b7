"""rlhf_dist.files.atomic_write_text: the one way the project writes a file atomically."""

import os

import pytest

from rlhf_dist.files import atomic_write_text


def test_writes_text_and_leaves_no_temporary(tmp_path):
    path = atomic_write_text(tmp_path / "summary.json", "{}\n")
    assert path == tmp_path / "summary.json"
    assert path.read_text(encoding="utf-8") == "{}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_replaces_an_existing_file_whole(tmp_path):
    path = tmp_path / "latest"
    path.write_text("step-000001 and a much longer old text\n", encoding="utf-8")
    atomic_write_text(path, "step-000002\n")
    assert path.read_text(encoding="utf-8") == "step-000002\n"


def test_a_failed_rename_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "config.yaml"
    path.write_text("old\n", encoding="utf-8")

    def killed(*args):
        raise KeyboardInterrupt  # as if the process died between the write and the rename

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        atomic_write_text(path, "new\n")
    assert path.read_text(encoding="utf-8") == "old\n"
