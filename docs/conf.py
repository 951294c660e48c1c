"""Sphinx configuration: the API reference from the package's docstrings, with the user pages (Markdown, MyST).

Build: ``python -m sphinx -W -b html docs docs/_build/html`` (``tests/project/test_docs.py`` runs it with warnings as errors).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

try:  # the reference builds without a compiled MinkowskiEngine too: then its names are Sphinx's mocks
    import MinkowskiEngine  # noqa: F401
except ImportError:
    from sphinx.ext.autodoc.mock import mock

    sys.modules.pop("MinkowskiEngine", None)
    autodoc_mock_imports = ["MinkowskiEngine"]
    with mock(autodoc_mock_imports):
        import lightning_sparse_dp
else:
    import lightning_sparse_dp

project = "lightning-sparse-dp"
author = "The lightning-sparse-dp authors"
release = lightning_sparse_dp.__version__
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "myst_parser"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # the signatures show the annotations' text; types are in the docstrings
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
myst_heading_anchors = 3
suppress_warnings = ["myst.header", "ref.python"]  # headings that skip a level; cross-references to private names
nitpicky = False
html_theme = "alabaster"
