"""The ``fxtools`` command line: ``fxtools demo`` (more subcommands are added per feature)."""

from __future__ import annotations

import inspect
import os
import sys
import textwrap
import time
import traceback

import torch


def _source(fn) -> str:
    target = getattr(fn, "__fxtools_module__", None)
    target = type(target).forward if target is not None else fn
    try:
        return textwrap.dedent(inspect.getsource(target))
    except (OSError, TypeError):
        return f"<source of {fn!r} not available>\n"


def _autograd_param_grads(fn, args):
    """Eager autograd's parameter gradients, on a copy of the model (its buffers stay untouched)."""
    import copy

    model = copy.deepcopy(fn.__fxtools_module__)
    model(*args[1:]).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def _demo_one(name: str, full: bool, out) -> bool:
    from ..codegen.show import annotated_code
    from ..graph.nodes import count_compute_nodes
    from ..transforms.check import check_vjp
    from ..transforms.vjp import grad, vjp
    from . import examples

    fn, args = examples.example(name, dtype=torch.float64)
    is_model = hasattr(fn, "__fxtools_module__")
    print(f"=== {name}: {(fn.__doc__ or '').strip().splitlines()[0] if fn.__doc__ else ''}", file=out)
    print("--- source", file=out)
    print(_source(fn).rstrip(), file=out)
    start = time.perf_counter()
    gm = grad(fn, *args) if is_model else vjp(fn, *args)
    elapsed = time.perf_counter() - start
    kind = "grad with respect to the parameters" if is_model else "vjp"
    print(f"--- generated {kind} ({count_compute_nodes(gm)} compute nodes, {elapsed * 1e3:.0f} ms)", file=out)
    code = annotated_code(gm).rstrip().splitlines()
    limit = None if full or len(code) <= 60 else 40
    print("\n".join(code[:limit]), file=out)
    if limit:
        print(f"    ... {len(code) - limit} more lines (fxtools demo {name} --full)", file=out)
    try:
        if is_model:
            want = _autograd_param_grads(fn, args)
            got = gm(*args)
            for k in want:
                torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-10)
        else:
            check_vjp(fn, *args, gm=gm, rtol=1e-10, atol=1e-10)
    except AssertionError as exc:
        print(f"--- check against torch.autograd (float64): FAILED\n{exc}", file=out)
        return False
    print("--- check against torch.autograd (float64, 1e-10): ok", file=out)
    print(file=out)
    return True


def demo(argv) -> int:
    from . import examples
    from .commands import Parser

    p = Parser(
        prog="fxtools demo",
        description="Differentiate the built-in examples and print source, generated code and a check against torch.autograd.",
    )
    p.add_argument("names", nargs="*", help=f"examples to run (default: all of {', '.join(examples.EXAMPLES)})")
    p.add_argument("--full", action="store_true", help="print long generated code in full")
    a = p.parse_args(argv)
    ok = all([_demo_one(n, a.full, sys.stdout) for n in (a.names or list(examples.EXAMPLES))])
    return 0 if ok else 1


def ops(argv) -> int:
    """``fxtools ops``: which mechanism differentiates each op of PyTorch's OpInfo samples."""
    from .coverage import main as coverage_main

    return coverage_main(argv)


COMMANDS = {"demo": demo, "ops": ops}

from .commands import bench_command, grad_command, jvp_command, nan_command, show_command, split_command, vjp_command  # noqa: E402

COMMANDS.update(grad=grad_command, vjp=vjp_command, jvp=jvp_command, split=split_command, show=show_command, bench=bench_command)
COMMANDS.update(nan=nan_command)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(
            "usage: fxtools {" + ",".join(COMMANDS) + "} [--help]\n\n"
            "  demo   differentiate the built-in examples and check them against torch.autograd\n"
            "  grad   the gradient of FILE.py:NAME (a function or nn.Module) as code; --out writes a standalone module\n"
            "  vjp    the vector-Jacobian product of FILE.py:NAME as code\n"
            "  jvp    the Jacobian-vector product of FILE.py:NAME as code\n"
            "  split  forward and backward graphs of FILE.py:NAME and what the forward saves\n"
            "  nan    where the first NaN (or unintended inf) of FILE.py:NAME's value and gradient comes from\n"
            "  show   print a module written by fxtools.save / --out, or the tensors of a .pt file\n"
            "  bench  benchmarks against PyTorch (AOTAutograd, make_fx, eager autograd)\n"
            "  ops    coverage: how each op of PyTorch's OpInfo samples is differentiated (rule, decomposition, derived)"
        )
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    try:
        return COMMANDS[argv[0]](argv[1:])
    except BrokenPipeError:  # `fxtools show g.py | head`: the reader has gone, as with any Unix tool
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 141  # 128 + SIGPIPE, what a shell reports for a command ended by a closed pipe
    except Exception as exc:  # noqa: BLE001 - user errors become one line; fxtools' own bugs keep their traceback
        message = user_error_message(exc)
        if message is None or os.environ.get("FXTOOLS_TRACEBACK"):
            raise
        print(f"fxtools {argv[0]}: error: {message}", file=sys.stderr)
        return 2


def user_error_message(exc: BaseException) -> str | None:
    """One line for an error that is the user's to fix, None for a bug of fxtools (kept as a traceback).

    The user's: bad command-line arguments (CliError), an FxtoolsError (the library's errors for
    programs it cannot handle, naming the user's line), a ValueError raised by fxtools' own argument
    checks, an OSError writing an output, and an exception raised by the user's code or by torch
    under it while it is traced (named by the user's line; raised in fxtools' own code, it is a
    bug and keeps its traceback). ``FXTOOLS_TRACEBACK=1`` shows the traceback anyway.
    """
    from ..errors import FXTOOLS_DIR, FxtoolsError, is_user_file
    from .commands import CliError, user_error

    if isinstance(exc, (CliError, FxtoolsError)):
        return " ".join(str(exc).split())
    if isinstance(exc, OSError):
        return f"{exc.strerror or exc}: {exc.filename}" if exc.filename else str(exc)
    frames = traceback.extract_tb(exc.__traceback__)
    if isinstance(exc, ValueError) and frames and frames[-1].filename.startswith(FXTOOLS_DIR):
        return " ".join(str(exc).split())
    if any(is_user_file(f.filename) for f in frames) and not frames[-1].filename.startswith(FXTOOLS_DIR):
        return user_error(exc) + " (FXTOOLS_TRACEBACK=1 shows the traceback)"  # raised by the user's code
    return None


if __name__ == "__main__":
    sys.exit(main())
