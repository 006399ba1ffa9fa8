"""Documentation that is derived from code stays in step with it."""
from __future__ import annotations

from scripts.config_reference import ROOT, render


def test_configuration_reference_is_current():
    # Regenerating the reference from the schema must give the committed file byte for byte;
    # run `python scripts/config_reference.py` after changing a config field.
    assert (ROOT / "docs" / "configuration.md").read_text() == render()


def test_every_field_is_documented():
    rows = [line for line in render().splitlines() if line.startswith("| `")]
    undocumented = [row.split("|")[1].strip() for row in rows if row.rstrip().endswith("|  |")]
    assert not undocumented, undocumented
