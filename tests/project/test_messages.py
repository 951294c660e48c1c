"""One message style (docs/architecture.md, "Messages"): what the package says while it runs (a warning or an info,
through Lightning's rank-zero helpers or a WarningCache) starts with who says it: ``sparse_dp:``, ``sparse_ddp:``,
``split_batch:`` or the strategy's name filled in (``{strategy}:``). Read from the package's source."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_sparse_dp"
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


def test_replicas_left_idle_by_a_small_batch_are_said_once(caplog):
    """devices=5 with 2 samples a batch: three replicas idle every step, said once (issue 59)."""
    import logging

    from tests.support.helpers import SparseNet, collate_dict, loader, random_samples, trainer

    with caplog.at_level(logging.INFO):
        trainer(strategy="sparse_dp", devices=5, max_steps=2).fit(
            SparseNet(), loader(collate_dict(random_samples(2, seed=1)), collate_dict(random_samples(2, seed=2)))
        )
    said = [r.getMessage() for r in caplog.records if "replica(s) idle" in r.getMessage()]
    assert len(said) == 1 and "a batch of 2 sample(s) ran on 2 of the 5 replicas" in said[0]


def test_an_index_error_after_a_tensor_cut_as_points_names_it_and_the_layout():
    """An integer tensor of row indices into the points, cut as per-point values: the user's step fails with its own
    IndexError, and the error now names the entry and the layout role that fixes it (issue 59)."""
    import pytest
    import torch

    from tests.support.helpers import SparseNet, collate_dict, loader, random_samples, trainer

    class Gathers(SparseNet):
        def training_step(self, batch, batch_idx):
            picked = batch["features"][batch["order"]]  # row indices into the whole batch's points
            return super().training_step({**batch, "features": picked}, batch_idx)

    batch = collate_dict(random_samples(6, seed=3))
    batch["order"] = torch.arange(batch["coordinates"].shape[0]).flip(0)
    with pytest.raises(IndexError) as info:
        trainer(strategy="sparse_dp", devices=3).fit(Gathers(), loader(batch))
    notes = "\n".join(getattr(info.value, "__notes__", ()))
    assert "batch['order'] was cut as one row per point" in notes and "{\"batch['order']\": 'indices'}" in notes
    assert "{\"batch['order']\": 'indices:batch'}" in notes  # a batch vector's role, named too


def _literal_parts(node: ast.expr) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [v.value for v in node.values if isinstance(v, ast.Constant)]
    if isinstance(node, ast.BinOp):
        return _literal_parts(node.left) + _literal_parts(node.right)
    return []


def test_every_message_is_listed_in_troubleshooting_with_its_meaning():
    """docs/troubleshooting.md holds every warning and info the package says (issue 59): each message's literal text
    (24 characters of it at least) appears there, where its meaning and fix are written."""
    doc = (PACKAGE.parent / "docs" / "troubleshooting.md").read_text()
    found, missing = 0, []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            parts = [p.strip() for p in _literal_parts(node.args[0]) if len(p.strip()) >= 24] if name in SAYING else []
            if not parts:
                continue
            found += 1
            if not any(p[i:i + 24] in doc for p in parts for i in range(0, len(p) - 23, 6)):
                missing.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {parts[0][:60]}")
    assert found > 20, "the source reading found too few messages to prove anything"
    assert not missing, missing
