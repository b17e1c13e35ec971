"""The LICENSE file is the Apache License 2.0 that pyproject.toml declares, and the wheel ships it."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[2]


def test_license_file_is_the_full_apache_2_text_pyproject_declares():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]  # setuptools puts it in the wheel's dist-info/licenses
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in text
    # The whole text: the nine sections of the terms and the appendix, not a header pointing elsewhere.
    assert "9. Accepting Warranty or Additional Liability." in text and "END OF TERMS AND CONDITIONS" in text
    assert "APPENDIX: How to apply the Apache License to your work." in text
