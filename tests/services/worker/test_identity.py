"""The node id kept in the data directory."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from services.worker.identity import NODE_ID_FILE, NodeIdError, generate_node_id, node_id


def test_a_new_id_is_created_once_and_kept(tmp_path: Path) -> None:
    first = node_id(tmp_path / "data")
    assert re.fullmatch(r"[a-z0-9_-]+-[0-9a-f]{6}", first)
    assert (tmp_path / "data" / NODE_ID_FILE).read_text().strip() == first
    assert node_id(tmp_path / "data") == first
    # Another data directory is another node, even on the same machine.
    assert node_id(tmp_path / "other") != first


def test_a_requested_id_is_written_and_kept(tmp_path: Path) -> None:
    assert node_id(tmp_path, "gpu-box-1") == "gpu-box-1"
    assert node_id(tmp_path) == "gpu-box-1"


def test_an_explicit_different_id_replaces_the_stored_one(tmp_path: Path) -> None:
    old = node_id(tmp_path)
    assert node_id(tmp_path, "renamed") == "renamed"
    assert node_id(tmp_path) == "renamed" != old
    assert not list(tmp_path.glob(".*tmp"))  # no temporary file left behind


def test_an_empty_file_counts_as_no_id(tmp_path: Path) -> None:
    (tmp_path / NODE_ID_FILE).write_text("\n")
    new = node_id(tmp_path)
    assert new
    assert (tmp_path / NODE_ID_FILE).read_text().strip() == new


@pytest.mark.parametrize("bad", ["", "   ", "two words"])
def test_a_bad_requested_id_is_refused(tmp_path: Path, bad: str) -> None:
    with pytest.raises(NodeIdError):
        node_id(tmp_path, bad)
    assert not (tmp_path / NODE_ID_FILE).exists()


def test_generated_ids_are_plain_tokens() -> None:
    assert generate_node_id("My.Laptop.local").startswith("my-")
    assert generate_node_id("...").startswith("node-")
    assert generate_node_id("a") != generate_node_id("a")
