"""Snapshot: which of the module's attributes a step's state follows, and how their values are copied and compared.

The helpers of :class:`~lightning_sparse_dp.replica.changes.ModuleChanges`: which ``__dict__`` entries are the user's
(:func:`is_followed`, not Lightning's or torch's own: :func:`library_keys`), which objects are the user's own plain
objects whose public attributes are compared before and after a step (:func:`is_plain_object`, :func:`public_state`,
:func:`changed_keys`), when values are one value (:func:`all_same`), and the lists and dicts each replica gets its own
copy of (:func:`is_copied`: lists, and dicts of at most :data:`SHORT` entries, to :data:`DEPTH` levels:
:func:`copy_nested`), with their sizes (:func:`nested_sizes`) and the tensors in them (:func:`nested_tensors`); what a
step changed in what the replicas share with the module, said (:func:`say_shared_changes`).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterable, Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import WarningCache
from torch import Tensor, nn
from torchmetrics import Metric

from lightning_sparse_dp.runtime.compat import update_count
from lightning_sparse_dp.runtime.process import PLAIN_TYPES as PLAIN


def equal_tensors(a: Tensor | None, b: Tensor | None) -> bool:
    """Both ``None``, or tensors of one shape and dtype with equal values (``a`` read on ``b``'s device, so tensors on
    two GPUs compare too)."""
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a.to(b.device), b))


def tensor_mark(t: Tensor) -> int | Tensor | None:
    """What tells later whether ``t`` was changed in place (:func:`changed_in_place`): its version counter, or, for an
    inference tensor (one made under ``torch.inference_mode``, as Lightning runs validation and its hooks), which has
    none (reading it raises), a copy of its values while the calling thread is in inference mode (a validation step),
    else ``None``: outside inference mode torch refuses to change an inference tensor in place ("Inplace update to
    inference tensor outside InferenceMode"), so a training step copies none (a tensor the validation kept on the
    module may be large). A step that enters ``torch.inference_mode()`` itself to change such a tensor is not
    followed."""
    if not t.is_inference():
        return t._version
    return t.clone() if torch.is_inference_mode_enabled() else None


def changed_in_place(t: Tensor, mark: int | Tensor | None) -> bool:
    """Whether ``t`` changed in place since :func:`tensor_mark` gave ``mark``: its version moved, or (an inference
    tensor) its values differ from the copy (a NaN where the copy has one is no change); never for ``None`` (an
    inference tensor marked outside inference mode)."""
    if mark is None:
        return False
    if not isinstance(mark, Tensor):
        return t._version != mark
    if equal_tensors(mark, t):
        return False
    return not (mark.shape == t.shape and mark.dtype == t.dtype and mark.is_floating_point()
                and bool(torch.allclose(mark, t, rtol=0.0, atol=0.0, equal_nan=True)))


@functools.cache
def library_keys() -> frozenset[str]:
    """The ``__dict__`` keys a bare LightningModule has (Lightning's and torch's), its hyperparameters'
    (``save_hyperparameters``), plus what the strategy installs."""
    return frozenset(pl.LightningModule().__dict__) | {"log", "print", "_hparams", "_hparams_initial", "_hparams_name"}


#: values of a module's ``__dict__`` that are not followed: torch's (submodules and parameters are replicated, not copied)
NOT_FOLLOWED = (nn.Module, nn.Parameter)


def is_followed(key: str, value: Any) -> bool:
    """Whether a module's ``__dict__`` entry is the user's: not a :func:`library_keys` key, not a :data:`NOT_FOLLOWED`."""
    return key not in library_keys() and not isinstance(value, NOT_FOLLOWED)


def followed(entries: dict[str, Any]) -> dict[str, Any]:
    """The entries of a module's ``__dict__`` that :func:`is_followed` takes, in their order (one comprehension, no call
    per entry: most of the entries are Lightning's and torch's own, read every step)."""
    library = library_keys()
    return {k: v for k, v in entries.items() if k not in library and not isinstance(v, NOT_FOLLOWED)}


#: the modules whose classes are not the user's plain objects (:func:`is_plain_object`; its answer per type is kept in
#: :data:`~lightning_sparse_dp.runtime.process.PLAIN_TYPES`)
LIBRARIES = ("torch", "lightning", "pytorch_lightning", "lightning_fabric", "torchmetrics", "MinkowskiEngine", "numpy")


def is_plain_object(value: Any) -> bool:
    """Whether ``value`` is an object of a class of the user's (or another library's than torch's, Lightning's, ME's,
    NumPy's) with a ``__dict__``, such as an ``AverageMeter``, or a ``types.SimpleNamespace``: not a tensor, module,
    container, function, module object or class."""
    kind = type(value)
    plain = PLAIN.get(kind)
    if plain is None:
        plain = PLAIN[kind] = kind is SimpleNamespace or (
            hasattr(value, "__dict__") and kind.__module__ not in ("builtins", "types", "functools")
            and not kind.__module__.startswith(LIBRARIES)
            and not isinstance(value, (Tensor, nn.Module, list, dict, tuple, set, type))
        )
    return plain


def public_state(value: Any) -> dict[str, tuple[Any, int]]:
    """An object's public attributes: ``name -> (value, length or -1)``, compared by identity (and length) after the
    step."""
    return {k: (v, len(v) if isinstance(v, (list, dict, set)) else -1) for k, v in vars(value).items() if k[:1] != "_"}


def changed_keys(before: dict[str, tuple[Any, int]], after: dict[str, tuple[Any, int]]) -> list[str]:
    """The attributes that differ between two :func:`public_state`\\ s of one object: added, removed, replaced, or a
    list / dict / set among them of another length."""
    return sorted(k for k in before.keys() | after.keys() if k not in before or k not in after
                  or before[k][0] is not after[k][0] or before[k][1] != after[k][1])


def is_integer(value: Any) -> bool:
    """A Python ``int`` (not a ``bool``) or a 0-dim integer tensor: a count, an index, a maximum; never a value whose
    weighted mean over the replicas means anything."""
    if isinstance(value, Tensor):
        return value.dim() == 0 and not value.is_floating_point() and not value.is_complex() and value.dtype != torch.bool
    return isinstance(value, int) and not isinstance(value, bool)


def all_same(values: Sequence[Any]) -> bool:
    first = values[0]
    for v in values[1:]:
        if v is first:
            continue
        if isinstance(first, Tensor) or isinstance(v, Tensor):
            if not (isinstance(first, Tensor) and isinstance(v, Tensor) and equal_tensors(v, first)):
                return False
            continue
        try:
            if not bool(v == first):
                return False
        except Exception:  # noqa: BLE001  (a value whose == raises or is not a bool cannot be told equal)
            return False
    return True


#: dicts and lists up to this long have the lists and dicts in them copied for each replica too (a dict of per-stage
#: output lists, a counter, one list per dataloader: ``self.outputs[dataloader_idx].append(...)``); a longer list (one
#: that grows each step) is copied itself only, and a longer dict (a per-sample cache, which the replicas fill with
#: their own samples' keys) is shared as it is, so that what a step copies stays proportional to what it may change
SHORT = 16


DEPTH = 8  # nesting levels of lists and dicts copied and merged


def is_container(value: Any) -> bool:
    """A list or dict (a subclass too: ``OrderedDict``, ``defaultdict``, Lightning's ``AttributeDict``) that a step may
    change in place."""
    return isinstance(value, (list, dict))


def is_copied(value: Any) -> bool:
    """Whether :func:`copy_nested` gives each replica its own copy of ``value``: a list, or a dict of at most :data:`SHORT`
    entries."""
    return isinstance(value, list) or (isinstance(value, dict) and len(value) <= SHORT)


def nested_entries(value: Any, depth: int) -> Iterable[tuple[Any, Any]]:
    """The ``(key or index, entry)`` pairs of ``value`` at nesting level ``depth`` whose entries :func:`copy_nested` copies
    too: a dict or list of at most :data:`SHORT` entries above :data:`DEPTH` levels; none for anything else."""
    if depth >= DEPTH or not is_copied(value) or len(value) > SHORT:
        return ()
    return value.items() if isinstance(value, dict) else enumerate(value)


def copy_nested(value: Any, depth: int = 0) -> Any:
    """``value`` (a list or dict) copied for one replica where :func:`is_copied` (else itself): the lists and dicts in a
    dict or list of at most :data:`SHORT` entries copied likewise (to :data:`DEPTH` levels), everything else shared.
    A container that cannot be copied is shared as it is."""
    if not is_copied(value):
        return value
    try:
        copied = list(value) if type(value) is list else copy.copy(value)
    except Exception:  # noqa: BLE001  (an exotic subclass): shared, as before this copy existed
        return value
    for key, entry in nested_entries(value, depth):
        if is_container(entry):
            copied[key] = copy_nested(entry, depth + 1)
    return copied


def nested_sizes(value: Any, depth: int = 0) -> Iterator[tuple[Any, int]]:
    """``(container, len(container))`` for ``value`` (a list or dict that :func:`copy_nested` copies) and every list and dict
    in it that :func:`copy_nested` copies too."""
    if is_copied(value):
        yield value, len(value)
    for _, entry in nested_entries(value, depth):
        if is_container(entry):
            yield from nested_sizes(entry, depth + 1)


def container_metrics(entries: dict[str, Any], keys: Iterable[str]) -> list[tuple[str, Metric]]:
    """``(name, metric)`` of the ``torchmetrics`` metrics in the module's lists and dicts ``entries[k]`` for ``k`` in
    ``keys``, and in the lists and dicts :func:`copy_nested` copies in them (``self.meters = {"loss": MeanMetric()}``:
    no submodule of the module, so no replica gets a copy of its own)."""
    found: list[tuple[str, Metric]] = []

    def read(name: str, value: Any, depth: int) -> None:
        for key, entry in nested_entries(value, depth):
            if isinstance(entry, Metric):
                found.append((f"{name}[{key!r}]", entry))
            else:
                read(f"{name}[{key!r}]", entry, depth + 1)

    for k in keys:
        read(f"self.{k}", entries[k], 0)
    return found


def nested_tensors(value: Any, name: str, depth: int = 0) -> Iterator[tuple[str, Tensor]]:
    """The tensors in ``value`` (itself, or in the dicts and lists :func:`copy_nested` copies with their entries), with their
    paths from ``name``."""
    if isinstance(value, Tensor):
        yield name, value
    for key, entry in nested_entries(value, depth):
        yield from nested_tensors(entry, f"{name}[{key!r}]", depth + 1)


def say_shared_changes(
    versions: list[tuple[str, Tensor, int | Tensor | None]], objects: list[tuple[str, Any, dict[str, tuple[Any, int]]]],
    sizes: dict[str, list[tuple[Any, int]]], warning_cache: WarningCache,
    metrics: Sequence[tuple[str, Metric, int]] = (),
) -> set[str]:
    """After a step, what its replicas changed in what they share with the module, which no merge can undo, said once
    each: a tensor changed in place (``versions``: ``(name, tensor, its mark before)``, :func:`tensor_mark`), a plain
    object's public attributes (``objects``: ``(key, object, its public_state before)``), a list or dict the replicas
    got copies of that changed through the module itself (``sizes``: ``self.<path> -> nested_sizes before``), a metric
    kept in one of them that the step updated (``metrics``: ``(name, metric, its update count before)``). Returns
    the names of those containers (not merged: the module's object holds what the step did)."""
    for name, tensor, version in versions:
        if changed_in_place(tensor, version):
            warning_cache.warn(
                f"sparse_dp: {name} (a tensor of the module) was changed in place in the step: the replicas share "
                "it, so each applied its own chunk's change to it, one after another or at once (a sum adds up to "
                "the whole batch's, but a decay, an average or a copy is applied once per replica, and in-place "
                "changes from several threads may race). Keep such a state in a torchmetrics metric (merged across "
                "the replicas), or change it from the whole batch (the gathered step outputs in on_train_batch_end)."
            )
    for key, value, state in objects:
        changed = changed_keys(state, public_state(value))
        if changed:
            warning_cache.warn(
                f"sparse_dp: self.{key} (a {type(value).__name__}) was changed in the step ({', '.join(changed)}): the "
                "replicas share the module's objects, so each replica's step changed it with its own chunk, one "
                "after another in thread order (and updates from several threads may interleave): a running sum or "
                "count adds up to the whole batch's, but a last value is the last replica's chunk's, and a history "
                "gets one entry per replica, where one device's step changes it once with the whole batch. Keep "
                "such state in a torchmetrics metric (merged across the replicas as one device's: MeanMetric, "
                "SumMetric), or change it from the whole batch in on_train_batch_end(outputs, batch, batch_idx) "
                "(outputs['loss'] is the batch's loss)."
            )
    for name, metric, count in metrics:
        if update_count(metric) != count:
            warning_cache.warn(
                f"sparse_dp: {name} (a torchmetrics {type(metric).__name__} in a plain list or dict of the module, not "
                "an nn.ModuleList / nn.ModuleDict) was updated in the step: the replicas share it, so each updated it "
                "with its own chunk (one update per replica, a mean over the chunks' values), where one device's metric "
                "is updated once with the whole batch. Keep metrics in an nn.ModuleDict / nn.ModuleList (or as "
                "attributes): each replica then updates its own copy, merged into the module's as one device's."
            )
    reached = {name for name, marks in sizes.items() if any(len(c) != n for c, n in marks)}
    for name in reached:
        kind = "list" if isinstance(sizes[name][0][0], list) else "dict"
        warning_cache.warn(
            f"sparse_dp: {name} (a {kind} of the module) changed in the step through the module itself, not "
            "the replica's copy: code that holds the module (a forward hook or closure made with `self`, e.g. "
            "`layer.register_forward_hook(lambda m, i, o: self.features.append(o))`) runs in every replica's step, "
            "so it holds what each replica's chunk gave, in the order their threads ran, where one device's holds "
            "one entry per step. Return such values from the step (outputs are gathered in the batch's order) or "
            "log them, or append through the replica the step runs on."
        )
    return reached
