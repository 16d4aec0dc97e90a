"""A module imported on first attribute access (for the command line's start-up time)."""

from __future__ import annotations

import importlib
import types
from typing import Any


class _LazyModule(types.ModuleType):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__dict__["_hydra_target"] = None

    def __getattr__(self, attr: str) -> Any:
        mod = self.__dict__["_hydra_target"]
        if mod is None:
            mod = importlib.import_module(self.__name__)
            self.__dict__["_hydra_target"] = mod
        return getattr(mod, attr)


def lazy_module(name: str) -> Any:
    """A stand-in for module ``name`` that imports it when an attribute is first read."""
    return _LazyModule(name)
