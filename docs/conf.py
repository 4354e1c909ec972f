"""Sphinx configuration: MyST Markdown pages, the API reference from docstrings.

Build: `pip install -r docs/requirements.txt` into a venv where dask-pyspy (its
compiled extension included) is installed, then
`sphinx-build -W --keep-going -b html docs docs/_build/html` (as `ci/test.sh` does).
"""

from __future__ import annotations

import sys
from pathlib import Path

# Document this checkout's sources where its extension is built in place (`maturin
# develop` puts `dask_pyspy/_native*.so` there); else the dask-pyspy the venv installed.
ROOT = Path(__file__).resolve().parent.parent
if any((ROOT / "dask_pyspy").glob("_native*.so")):
    sys.path.insert(0, str(ROOT))

import dask_pyspy  # noqa: E402

project = "dask-pyspy"
author = "dask-pyspy contributors"
release = dask_pyspy.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]

source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "requirements.txt"]
root_doc = "index"

# `[text](page.md#a-heading)` and `[text](#a-heading)` resolve to headings, as on GitHub.
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence", "deflist"]

autodoc_member_order = "bysource"
# distributed's plugin hooks we override (`setup`, `transition`, ...) are not our API, and
# their inherited docstrings refer to distributed's own docs pages.
autodoc_inherit_docstrings = False
autodoc_typehints = "description"
autodoc_default_options = {"members": True}
# Docstrings write `name` for code, as Markdown does: show it as code, never as a
# cross-reference that could not resolve.
default_role = "code"

html_theme = "furo"
html_title = f"dask-pyspy {release}"
html_show_copyright = False  # no holder is named anywhere; the license is in pyproject.toml
