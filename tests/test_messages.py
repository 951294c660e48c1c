"""One message style (docs/architecture.md, "Messages"): what the package says while it runs (a warning or an info,
through Lightning's rank-zero helpers or a WarningCache) starts with who says it: ``sparse_dp:``, ``sparse_ddp:``,
``split_batch:`` or the strategy's name filled in (``{strategy}:``). Read from the package's source."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_sparse_dp"
SPEAKERS = ("sparse_dp:", "sparse_ddp:", "split_batch:", "{strategy}:")
SAYING = {"rank_zero_warn", "rank_zero_info", "warn", "info"}


def _first_text(node: ast.expr) -> str | None:
    """The literal start of a message argument (a string, an f-string, or the first of implicitly joined ones)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values:
        first = node.values[0]
        if isinstance(first, ast.Constant):
            return first.value
        if isinstance(first, ast.FormattedValue) and isinstance(first.value, ast.Name):
            return "{" + first.value.id + "}" + (_first_text(ast.JoinedStr(node.values[1:])) or "")
    return None


def _messages():
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            text = _first_text(node.args[0]) if name in SAYING else None
            if text is not None:
                yield f"{path.relative_to(PACKAGE)}:{node.lineno}", text


def test_every_warning_and_info_says_who_says_it():
    messages = list(_messages())
    assert len(messages) > 20, "the source reading found too few messages to prove anything"
    unsigned = [(where, text[:60]) for where, text in messages if not text.startswith(SPEAKERS)]
    assert not unsigned, unsigned
