"""Packages a CLI process loads when it uses them, not when a dependency merely imports them.

nats-py imports aiohttp when it is imported, for a WebSocket transport (``ws://`` URLs) that a
``nats://`` or ``tls://`` connection never uses: ~100 ms of every CLI process's ~0.45 s start-up
on this 2-core machine (``python -X importtime``), paid by each ``run``, ``publish`` and
``collect``. We use aiohttp ourselves only for the gateway and for HTTPS model endpoints. So in
the processes the CLI owns it is a deferred module: ``import aiohttp`` binds it at once, and the
package runs on the first name anyone reads from it (PEP 562 ``__getattr__``), in whichever
process and thread that happens, as an import would have. A trainer that imports gym_runtime keeps
its own import behaviour.

Why not ``importlib.util.LazyLoader``: the import system reads ``__spec__`` of a module it finds in
``sys.modules`` on every later ``import`` statement, and a ``LazyLoader`` module loads on any
attribute read, that one included, so nats-py's own ``import aiohttp`` loaded it.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

DEFERRED = ("aiohttp",)


def defer_imports(names: tuple[str, ...] = DEFERRED) -> None:
    """Put ``names`` in ``sys.modules`` as deferred modules, unless already imported or not installed."""
    for name in names:
        if name in sys.modules:
            continue
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            continue
        sys.modules[name] = deferred(spec)


def deferred(spec: ModuleSpec) -> ModuleType:
    """A module for ``spec`` whose code runs on the first name read from it that it does not hold yet.

    It holds what the import system reads (``__spec__``, ``__name__``, ``__loader__``) but not the
    package's ``__path__``, so that importing one of its submodules runs the package first, as it would
    have. While its code runs, a name it reads from itself before defining it is an ``AttributeError``
    (as in any module being imported) and another thread reading a name waits until it has run."""
    module = importlib.util.module_from_spec(spec)
    path = module.__dict__.pop("__path__", None)
    lock = threading.RLock()
    loading: list[bool] = []

    def __getattr__(attr: str) -> Any:
        with lock:
            if module.__dict__.get("__getattr__") is __getattr__:
                if loading:  # the package's own code, before it defines the name
                    raise AttributeError(f"partially initialized module {spec.name!r} has no attribute {attr!r}")
                loading.append(True)
                try:
                    if path is not None:
                        module.__path__ = path
                    assert spec.loader is not None
                    spec.loader.exec_module(module)
                except BaseException:
                    if sys.modules.get(spec.name) is module:  # as a failed import leaves it: not imported
                        del sys.modules[spec.name]
                    raise
                finally:
                    if module.__dict__.get("__getattr__") is __getattr__:  # unless the package defines its own
                        del module.__dict__["__getattr__"]
        return getattr(module, attr)

    module.__dict__["__getattr__"] = __getattr__
    return module
