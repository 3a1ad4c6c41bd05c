"""One way to name user code in a config: ``module:qualname``.

A model factory, a data source factory and a partitioner are all named so,
on the command line (``--set balance=mymodule:plan``), in config files and
in the configs that `freescale.train` builds from Python objects. The name
is what a spawned rank imports: it must resolve there to the same object.
Standard library only, so that every package may use it.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

FORM = "module:qualname"


def is_named(spec: str) -> bool:
    """Whether ``spec`` has the form ``module:qualname`` (both parts non-empty)."""
    module, sep, qualname = spec.partition(":")
    return bool(sep and module and qualname)


def load_named(spec: str, what: str) -> Any:
    """The callable ``module:qualname`` names; one-line ValueError otherwise.

    ``what`` is the config key, for the message. Importing runs the module's
    code: name only code you trust (docs/security.md).
    """
    if not is_named(spec):
        raise ValueError(f"{what}={spec!r} must look like {FORM}")
    module_name, _, qualname = spec.partition(":")
    if os.getcwd() not in sys.path:  # as `python -m` and uvicorn do: the user's own code
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"{what}={spec!r}: cannot import {module_name!r} ({e}){_where(e, module_name)}"
        ) from None
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if obj is None or not callable(obj):
        raise ValueError(f"{what}={spec!r}: {module_name} has no callable {qualname!r}")
    return obj


def _where(error: ImportError, module_name: str) -> str:
    """Where Python looked for ``module_name`` when it (or its package) is not
    found (the usual cause: a run started from another directory)."""
    missing = getattr(error, "name", None) or ""
    found = not (module_name + ".").startswith(missing + ".")
    if not isinstance(error, ModuleNotFoundError) or not missing or found:
        return ""  # found, but its own imports failed: the error says which
    path = os.environ.get("PYTHONPATH") or "unset"
    return (
        f"; Python looked in the working directory {os.getcwd()}, PYTHONPATH ({path}) and "
        f"the installed packages: run from the directory that holds {missing}.py (or "
        f"{missing}/), or add that directory to PYTHONPATH"
    )


def python_name(obj: Any) -> str:
    """``module:qualname`` of a function or class (of an object's class otherwise)."""
    named = obj if hasattr(obj, "__qualname__") else type(obj)
    return f"{getattr(named, '__module__', '__main__')}:{named.__qualname__}"


def name_of_callable(obj: Any, what: str) -> str:
    """``module:qualname`` that resolves back to ``obj`` itself (a function or
    an object defined at a module's top level); one-line ValueError otherwise."""
    name = python_name(obj)
    if not hasattr(obj, "__qualname__") or "<" in name:  # an instance, a lambda, a closure
        raise ValueError(
            f"{what}={obj!r} has no {FORM} name that imports it: define it at the top"
            f" level of a module, or pass its name as a string ('mymodule:name')"
        )
    return name
