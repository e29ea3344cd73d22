"""The wheel ships every package folder: a non-editable install must not lose a subpackage."""

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_in_the_wheel():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = tool["package-dir"]
    assert set(tool["packages"]) == set(dirs)
    shipped = {str((ROOT / folder).resolve()) for folder in dirs.values()}
    folders = {str(init.parent.resolve()) for top in {d.split("/")[0] for d in dirs.values()}
               for init in (ROOT / top).rglob("__init__.py")}
    assert folders - shipped == set(), "package folders missing from pyproject's packages / package-dir"
