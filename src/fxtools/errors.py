"""Exceptions fxtools raises, and how they find the line of user code responsible."""

from __future__ import annotations

import functools
import linecache
import os
import traceback
from typing import Any

import torch

_TORCH_DIR = os.path.dirname(torch.__file__)
FXTOOLS_DIR = os.path.dirname(__file__)


class FxtoolsError(Exception):
    """Base class for errors raised by fxtools."""


class MissingRuleError(FxtoolsError):
    """An op has no VJP rule, no decomposition and no PyTorch derivative to derive one from."""


class RuleRefusal(FxtoolsError):
    """A derivative rule refuses the call it is given (the transform adds the user's line)."""


class DataDependentError(FxtoolsError):
    """Python control flow depended on the *value* of a tensor, which a trace cannot capture."""


class NonFiniteError(FxtoolsError):
    """A step of a module made with ``check_finite=True`` computed a NaN or an unintended infinity;
    ``.report`` says which value first, from which line of the user's (``fxtools.find_nonfinite``'s report)."""

    def __init__(self, report):
        super().__init__(str(report))
        self.report = report


_EXAMPLES = os.path.join(FXTOOLS_DIR, "cli", "examples.py")  # the demo's programs are user code


def is_data_dependent(exc: BaseException) -> bool:
    """Whether ``exc`` is PyTorch saying a trace needed the value of a tensor."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, PendingUnbackedSymbolNotFound

    # PendingUnbackedSymbolNotFound: a value read with .item() became an offset or size that
    # make_fx cannot bind (torch.narrow with a tensor start)
    return isinstance(
        exc,
        (GuardOnDataDependentSymNode, DataDependentOutputException, DynamicOutputShapeException, PendingUnbackedSymbolNotFound),
    )


@functools.lru_cache(maxsize=4096)  # asked for every frame of every traced call's stack
def is_user_file(filename: str) -> bool:
    return filename == _EXAMPLES or not (
        filename.startswith(_TORCH_DIR)
        or filename.startswith(FXTOOLS_DIR)
        or filename.startswith("<")
        or ("/site-packages/" in filename and "/torch/" in filename)
    )


def user_frame(tb) -> str | None:
    """'file:line: code' of the innermost frame of a traceback that is in user code."""
    frames = [f for f in traceback.extract_tb(tb) if is_user_file(f.filename)]
    if not frames:
        return None
    f = frames[-1]
    return f"{f.filename}:{f.lineno}: {(f.line or '').strip()}"


def generated_frame(tb) -> str | None:
    """Where the innermost frame of a traceback that runs a generated module's code is: the user's
    line of the node it executes (the module's ``_lineno_map``), else 'line N of a generated
    module's code: code'."""
    found = None
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename.startswith("<eval_with_key"):
            found = (tb.tb_frame, tb.tb_lineno)
        tb = tb.tb_next
    if found is None:
        return None
    frame, lineno = found
    gm = frame.f_locals.get("self")
    index = (getattr(gm, "_lineno_map", None) or {}).get(lineno - getattr(gm, "_prologue_start", 0))
    nodes = list(gm.graph.nodes) if index is not None and hasattr(gm, "graph") else []
    where = user_line_of(nodes[index]) if index is not None and index < len(nodes) else None
    if where is not None:
        return where
    text = linecache.getline(frame.f_code.co_filename, lineno).strip()
    return f"line {lineno} of a generated module's code: {text}"


def current_user_line() -> str:
    """'file:line: code' of the innermost user frame of the running code (library frames skipped)."""
    import sysconfig

    stdlib = sysconfig.get_paths()["stdlib"]
    frames = [f for f in traceback.extract_stack() if is_user_file(f.filename) and not f.filename.startswith(stdlib)]
    if not frames:
        return "an unknown line of user code"
    f = frames[-1]
    return f"{f.filename}:{f.lineno}: {(f.line or '').strip()}"


def user_frame_of(node) -> tuple[str, int, str] | None:
    """``(filename, lineno, code)`` of the user call that produced FX ``node``, from its recorded stack trace."""
    stack = user_stack_of(node)
    return stack[-1] if stack else None


def user_stack_of(node) -> list[tuple[str, int, str]]:
    """The user's frames ``(filename, lineno, code)`` of the call that produced FX ``node``,
    innermost last: a helper's line and the calls that reached it (which of two calls of the helper)."""
    trace = node.meta.get("stack_trace") if node is not None else None
    lines = trace.strip().splitlines() if trace else []
    stack = []
    for i, line in enumerate(lines):
        line = line.strip()
        if line.startswith('File "'):
            filename = line.split('"')[1]
            if is_user_file(filename):
                lineno = int(line.split("line ")[1].split(",")[0])
                code = lines[i + 1].strip() if i + 1 < len(lines) else ""
                if not stack or stack[-1] != (filename, lineno, code):  # a comprehension's frame: its line again
                    stack.append((filename, lineno, code))
    return stack


def user_line_of(node) -> str | None:
    """'file:line: code' of the user call that produced FX `node`, from its recorded stack trace."""
    frame = user_frame_of(node)
    return None if frame is None else f"{frame[0]}:{frame[1]}: {frame[2]}"


def is_program_file(filename: str) -> bool:
    """Whether code of ``filename`` is the user's program for ``decision_line``: user files, and
    also code without a file (``exec``, ``python -c``), but not torch, fxtools, the standard
    library, or code torch.fx generated."""
    import sysconfig

    if filename.startswith("<"):
        return not filename.startswith(("<eval_with_key", "<frozen", "<fxtools"))
    return is_user_file(filename) and not filename.startswith(sysconfig.get_paths()["stdlib"])


PROGRAM_ENTRIES: set[int] = set()  # ids of the code objects that call the user's program while capturing (capture/trace.py);
# ids, since a code object whose constants hold a dict (as Dynamo makes) cannot be hashed


def decision_line(skip: int = 0) -> str:
    """Where the decision being recorded now was made: ``file:line: code`` of the innermost
    program frame (``is_program_file``) called by the capture (a code in ``PROGRAM_ENTRIES``),
    else fxtools' own line (a rule or pass deciding on a size while differentiating).
    ``skip``: the caller's own frames to leave out."""
    import sys

    frame: Any = sys._getframe(1 + skip)
    inner = []
    while frame is not None and id(frame.f_code) not in PROGRAM_ENTRIES:
        inner.append(frame)
        frame = frame.f_back
    user = [f for f in inner if is_program_file(f.f_code.co_filename)] if frame is not None else []
    if user:
        f = user[0]
        line = linecache.getline(f.f_code.co_filename, f.f_lineno).strip()
        return f"{f.f_code.co_filename}:{f.f_lineno}: {line}"
    own = [f for f in inner if f.f_code.co_filename.startswith(FXTOOLS_DIR)]
    if own:
        f = own[0]
        return f"fxtools' derivative code ({os.path.relpath(f.f_code.co_filename, os.path.dirname(FXTOOLS_DIR))}:{f.f_lineno})"
    return "an unknown line"
