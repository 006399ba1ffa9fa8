"""pyproject.toml: the `dev` extra, which CI installs, holds every optional feature's packages (but FP8's, whose tests
are skipped without torchao), as each feature's extra names them."""
from __future__ import annotations

import pytest

from tests.helpers import ROOT

tomllib = pytest.importorskip("tomllib")  # Python 3.11+


def test_the_dev_extra_holds_every_features_packages():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    dev = set(extras["dev"])
    for feature, packages in extras.items():
        if feature not in ("dev", "fp8"):
            assert set(packages) <= dev, (feature, set(packages) - dev)
