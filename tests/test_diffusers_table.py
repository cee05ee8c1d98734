"""docs/diffusers.md's table of every offloadable diffusers pipeline is what the generator gives."""

from __future__ import annotations

import pathlib

import pytest

pytest.importorskip("diffusers")

from residency.app.diffusers_table import TESTED, pipeline_classes, table

DOC = pathlib.Path(__file__).parent.parent / "docs" / "diffusers.md"
BEGIN, END = "<!-- begin generated table -->\n", "<!-- end generated table -->"


def test_the_committed_table_is_the_generated_one():
    text = DOC.read_text()
    committed = text[text.index(BEGIN) + len(BEGIN):text.index(END)]
    assert committed == table(), (
        "docs/diffusers.md's table is stale: run python -m residency.app.diffusers_table "
        "and paste its output between the markers"
    )


@pytest.mark.fast
def test_every_tested_pipeline_is_in_the_table():
    names = {cls.__name__ for cls in pipeline_classes()}
    assert set(TESTED) <= names and len(names) > 200
