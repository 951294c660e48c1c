"""Namespaces: the same package for modules written against the standalone ``pytorch_lightning``.

Lightning ships ``lightning.pytorch`` and ``pytorch_lightning`` as one source under two names, with classes that
are not each other's: ``pytorch_lightning.Trainer`` accepts only ``pytorch_lightning`` strategies, and its
registry is its own. ME's ``multigpu_lightning.py`` and most published ME modules import ``pytorch_lightning``.
So this package is loaded a second time, as ``lightning_sparse_dp.pl``, from the same files: an import hook
(:class:`MirrorFinder`) reads each module's source and rewrites its imports (``lightning.pytorch`` ->
``pytorch_lightning``, ``lightning.fabric`` -> ``lightning_fabric``, ``lightning_sparse_dp.`` ->
``lightning_sparse_dp.pl.``) before compiling it, so there is one source and nothing to keep in step.
``import lightning_sparse_dp`` imports nothing the process did not: the mirror is imported (registering ``"sparse_dp"``
and ``"sparse_ddp"`` in ``pytorch_lightning``'s strategy registry) once the process imports ``pytorch_lightning``
(at once if it already has; else right after that import: :class:`AfterImport`), or when
``lightning_sparse_dp.pl`` is first read.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from types import ModuleType

PACKAGE = __name__.split(".", 1)[0]  # "lightning_sparse_dp"
MIRROR = f"{PACKAGE}.pl"
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package's folder
_THIS = os.path.abspath(__file__)
_REWRITES = (
    (re.compile(r"\blightning\.pytorch\b"), "pytorch_lightning"),
    (re.compile(r"\blightning\.fabric\b"), "lightning_fabric"),
    (re.compile(rf"\b{PACKAGE}\.(?!pl\b)"), f"{MIRROR}."),
)


def _source_path(fullname: str) -> tuple[str, bool] | None:
    """The file of the package module that ``fullname`` (under :data:`MIRROR`) mirrors, and whether it is a package."""
    parts = fullname[len(MIRROR):].lstrip(".").split(".") if fullname != MIRROR else []
    base = os.path.join(_ROOT, *parts)
    if os.path.isfile(os.path.join(base, "__init__.py")):
        return os.path.join(base, "__init__.py"), True
    if parts and os.path.isfile(base + ".py") and os.path.abspath(base + ".py") != _THIS:
        return base + ".py", False
    return None


def rewrite(source: str) -> str:
    """A module's source as the ``pytorch_lightning`` mirror runs it."""
    for pattern, replacement in _REWRITES:
        source = pattern.sub(replacement, source)
    return source


class MirrorFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds and loads ``lightning_sparse_dp.pl[.*]`` from this package's own files, imports rewritten."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != MIRROR and not fullname.startswith(MIRROR + "."):
            return None
        found = _source_path(fullname)
        if found is None:
            return None
        origin, is_package = found
        spec = importlib.util.spec_from_loader(fullname, self, origin=origin, is_package=is_package)
        assert spec is not None
        spec.has_location = True
        if is_package:
            spec.submodule_search_locations = [os.path.dirname(origin)]
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        origin = module.__spec__.origin  # type: ignore[union-attr]
        assert origin is not None
        with open(origin, encoding="utf-8") as f:
            code = compile(rewrite(f.read()), origin, "exec")  # the original file name: tracebacks point at it
        module.__file__ = origin
        exec(code, module.__dict__)  # noqa: S102  (this package's own source)


class AfterImport(importlib.abc.MetaPathFinder):
    """Imports the mirror right after the process imports ``pytorch_lightning`` (once), so that its strategy registry
    holds ``"sparse_dp"`` before the user's ``pytorch_lightning.Trainer(strategy="sparse_dp")``, without this package
    importing ``pytorch_lightning`` itself (which changes Lightning: its deprecation warnings' class, among others).
    It finds nothing itself: it wraps the loader the other finders give ``pytorch_lightning``."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "pytorch_lightning":
            return None
        with suppress(ValueError):
            sys.meta_path.remove(self)  # once, and not for the lookup below
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _ThenMirror(spec.loader)
        return spec


class _ThenMirror(importlib.abc.Loader):
    """``loader``, then the mirror imported once the module it loaded has run."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        import_mirror()

    def __getattr__(self, name: str) -> object:  # the wrapped loader's other methods (get_resource_reader, ...)
        return getattr(self.loader, name)


def import_when_imported() -> None:
    """Import the mirror now if ``pytorch_lightning`` is imported already, else once it is (:class:`AfterImport`)."""
    if "pytorch_lightning" in sys.modules:
        import_mirror()
    elif importlib.util.find_spec("pytorch_lightning") is not None and not any(
        isinstance(f, AfterImport) for f in sys.meta_path
    ):
        sys.meta_path.insert(0, AfterImport())


def install() -> None:
    """Put :class:`MirrorFinder` on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, MirrorFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MirrorFinder())


def import_mirror() -> ModuleType | None:
    """``lightning_sparse_dp.pl`` when ``pytorch_lightning`` is installed (registering its strategies there), else
    ``None``."""
    if importlib.util.find_spec("pytorch_lightning") is None:
        return None
    install()
    with kept_rank_zero_logger():
        return importlib.import_module(MIRROR)


@contextmanager
def kept_rank_zero_logger() -> Iterator[None]:
    """The ``with`` body's imports leave Lightning's rank-zero messages where they went before.

    ``lightning_utilities``' rank-zero functions log to one module-level logger, which ``lightning.pytorch`` and
    ``pytorch_lightning`` each set to their own when imported: importing the other would move every Lightning
    info line (``GPU available: ...``, this package's) to a logger the user did not configure.
    """
    import lightning_utilities.core.rank_zero as rank_zero

    before = rank_zero.log
    try:
        yield
    finally:
        if before.name.endswith(".utilities.rank_zero"):  # a Lightning package's, set by an earlier import
            rank_zero.log = before


__all__ = [
    "MIRROR", "AfterImport", "MirrorFinder", "import_mirror", "import_when_imported", "install", "kept_rank_zero_logger",
    "rewrite",
]
