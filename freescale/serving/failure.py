"""Why a model did not export, in one paragraph instead of torch's trace.

`torch.export` reports a model it cannot trace with a long message and a
longer traceback through its own frames. What the model's author needs is
the exporter's reason (its first lines), and *where* in their model: the
innermost frame of the traceback that runs inside one of the model's
modules, named by its path (``blocks.0``) and its source line.
"""

from __future__ import annotations

import traceback
from types import TracebackType

from torch import nn

_SKIP = ("For more information", "For C++ stack trace", "consider using", "For extended logs",
         "If you suspect", "For more debugging help", "The error above occurred")  # fmt: skip


class ExportError(ValueError):
    """A model `torch.export` cannot trace (one paragraph, no trace)."""


def explain(error: BaseException, model: nn.Module) -> ExportError:
    """The paragraph for ``error`` raised while exporting ``model``."""
    where = _where(error, model)
    reason = _reason(error)
    return ExportError(
        f"{type(model).__name__} cannot be exported{where}: {type(error).__name__}: {reason}. "
        "docs/serving.md says what an exported forward may do (no host reads of tensor "
        "values, no Python loops over samples)"
    )


def _reason(error: BaseException) -> str:
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    kept = [ln for ln in lines if not ln.startswith(_SKIP)]
    text = " ".join(kept[:3]) or type(error).__name__
    return text[:600].rstrip(". ")


def _where(error: BaseException, model: nn.Module) -> str:
    """`` in module PATH (file:line)`` of the innermost model frame, or ``""``."""
    paths = {id(m): path or "(the model)" for path, m in model.named_modules()}
    for tb in _tracebacks(error):  # the root cause first: its frames reach the model
        found = ""
        for frame, line in traceback.walk_tb(tb):  # outermost to innermost
            owner = frame.f_locals.get("self")
            if id(owner) in paths and isinstance(owner, nn.Module):
                code = frame.f_code
                found = f" in module {paths[id(owner)]} ({code.co_filename}:{line}, {code.co_name})"
        if found:
            return found
    return ""


def _tracebacks(error: BaseException) -> list[TracebackType]:
    """Tracebacks of ``error`` and the errors it was raised from, outermost first."""
    chain, seen = [], set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if e.__traceback__ is not None:
            chain.append(e.__traceback__)
        e = e.__cause__ or e.__context__
    return chain[::-1]
