"""Patch: attributes of torch replaced while any step needs them, shared by the threads that run steps.

The term capture (:mod:`~lightning_sparse_dp.loss.capture`: torch's losses as triggers), the mean counts
(:mod:`~lightning_sparse_dp.means`: ``torch.mean`` / ``Tensor.mean`` wrapped) and ``sparse_ddp``'s watch on the
step's own collectives (:mod:`~lightning_sparse_dp.loss.collectives`) replace module or class attributes for as long as
at least one replica thread (or ``sparse_ddp`` rank) runs a step that needs them, and
put torch's own back when the last one ends: :class:`SharedPatch` counts its users under a lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any


class SharedPatch:
    """``replacements[(owner, name)]`` set as ``owner.name`` while :meth:`held` by anyone (reference-counted).

    The replacement objects are made once, so every holder, and whoever reads the attribute meanwhile, sees the
    same object; torch's own are read when the first holder enters and put back when the last one leaves.
    """

    def __init__(self, replacements: Mapping[tuple[Any, str], Any]) -> None:
        self._replacements = dict(replacements)
        self._saved: dict[tuple[Any, str], Any] = {}
        self._lock = threading.Lock()
        self._users = 0

    def _install(self) -> None:
        for (owner, name), replacement in self._replacements.items():
            setattr(owner, name, replacement)

    def _restore(self) -> None:
        for (owner, name), original in self._saved.items():
            setattr(owner, name, original)

    @contextmanager
    def held(self) -> Iterator[None]:
        """The replacements are in place for the ``with`` body (and while any other holder's body runs)."""
        with self._lock:
            if self._users == 0:
                self._saved = {key: getattr(*key) for key in self._replacements}
                self._install()
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    self._restore()

    @contextmanager
    def suspended(self) -> Iterator[None]:
        """The originals for the ``with`` body, where the patch is held (for code that must not see the
        replacements, in a process where no other thread runs a step meanwhile)."""
        with self._lock:
            held = self._users > 0
            if held:
                self._restore()
        try:
            yield
        finally:
            if held:
                with self._lock:
                    self._install()


__all__ = ["SharedPatch"]
