"""The ``fxtools grad``, ``fxtools vjp``, ``fxtools show`` and ``fxtools bench`` subcommands.

``fxtools grad model.py:Net --arg x=f32[4,8] --arg y=i64[4]%3 --out g.py --check`` loads
``Net`` from ``model.py``, makes example inputs of the given shapes and dtypes, differentiates
and prints the generated code with the shape of every value; ``--out`` writes it as a
standalone module (``fxtools.save``), ``--check`` compares it with ``torch.autograd``.
"""

from __future__ import annotations

import argparse
import ast
import copy
import importlib.util
import inspect
import io
import os
import re
import sys
import time

import torch
from torch.utils import _pytree as pytree

_DTYPES = {
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "f32": torch.float32,
    "f64": torch.float64,
    "c64": torch.complex64,
    "c128": torch.complex128,
    "i8": torch.int8,
    "i16": torch.int16,
    "i32": torch.int32,
    "i64": torch.int64,
    "u8": torch.uint8,
    "b8": torch.bool,
    "bool": torch.bool,
}
_TENSOR_SPEC = re.compile(r"^(?P<dtype>[a-z0-9]+)\[(?P<shape>[0-9,\s]*)\](?:%(?P<high>\d+))?$")
INT_HIGH = 4  # integer tensors get values in [0, INT_HIGH) unless the spec says ``%N``

ARG_HELP = (
    "an example input, NAME=SPEC or SPEC (by position). SPEC is a tensor DTYPE[SHAPE] "
    "(f32[8,16], f64[], i64[8]; dtypes: " + ", ".join(_DTYPES) + "); float tensors are random "
    f"normal, integer tensors random in [0, {INT_HIGH}) or [0, N) with DTYPE[SHAPE]%%N, bool "
    "tensors random; anything else is a Python literal (n=5, scale=0.5, flag=True)"
)


class CliError(Exception):
    """A user error on the command line: printed as one line, exit code 2 (see ``cli.main``)."""


class Parser(argparse.ArgumentParser):
    """argparse with its errors as one line (``fxtools grad: error: ...``), exit code 2."""

    def error(self, message):
        raise CliError(f"{message} (see {self.prog} --help)")


def progress(msg: str) -> None:
    print(f"[fxtools] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Example inputs from specs
# ---------------------------------------------------------------------------------------------


def parse_spec(spec: str, generator: torch.Generator):
    """A tensor (random, of the given dtype and shape) or a Python value from its text."""
    m = _TENSOR_SPEC.match(spec.strip())
    if m:
        if m["dtype"] not in _DTYPES:
            raise CliError(f"unknown dtype {m['dtype']!r} in {spec!r}; use one of {', '.join(_DTYPES)}")
        dtype = _DTYPES[m["dtype"]]
        shape = tuple(int(s) for s in m["shape"].replace(" ", "").split(",") if s)
        if dtype == torch.bool:
            return _make(spec, lambda: torch.randint(0, 2, shape, generator=generator).bool())
        if dtype.is_floating_point or dtype.is_complex:
            if m["high"]:
                raise CliError(f"%N only applies to integer tensors: {spec!r}")
            return _make(spec, lambda: torch.randn(shape, generator=generator, dtype=dtype))
        high = int(m["high"]) if m["high"] else INT_HIGH
        if high < 1:
            raise CliError(f"{spec!r}: %N draws integers in [0, N), so N must be at least 1")
        return _make(spec, lambda: torch.randint(0, high, shape, generator=generator, dtype=dtype))
    try:
        return ast.literal_eval(spec)
    except (ValueError, SyntaxError):
        raise CliError(
            f"cannot read the example input {spec!r}: expected DTYPE[SHAPE] such as f32[8,16] or a Python literal such as 5"
        ) from None


def _make(spec: str, make):
    """A random example tensor, or a CliError if it cannot be made (too large for memory)."""
    try:
        return make()
    except (RuntimeError, TypeError, OverflowError, MemoryError) as exc:
        raise CliError(f"cannot make the example input {spec!r}: {str(exc).strip().splitlines()[0]}") from None


def _positional_params(fn) -> list[inspect.Parameter]:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return []
    return [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def build_args(fn, specs: list[str], generator) -> tuple:
    """Positional example arguments for ``fn`` from ``--arg`` specs (named or by position)."""
    params = _positional_params(fn)
    names = [p.name for p in params]
    positional, named = [], {}
    for spec in specs:
        name, sep, text = spec.partition("=")
        if sep and name.isidentifier() and not _TENSOR_SPEC.match(spec):
            if name in named:
                raise CliError(f"--arg {name} given twice")
            named[name] = parse_spec(text, generator)
        else:
            if named:
                raise CliError(f"positional --arg {spec!r} after named ones")
            positional.append(parse_spec(spec, generator))
    args = list(positional)
    for name in named:
        if name not in names:
            raise CliError(
                f"--arg {name}: the function has no positional parameter {name!r} (its parameters: {', '.join(names) or 'none'})"
            )
    for p in params[len(positional) :]:
        if p.name in named:
            args.append(named.pop(p.name))
        elif p.default is not inspect.Parameter.empty:
            if named:  # a later argument was given: fill this one with its default
                args.append(p.default)
            else:
                break
        else:
            if named:
                raise CliError(f"missing --arg {p.name}=SPEC (the parameters are: {', '.join(names)})")
            break
    missing = [p.name for p in params[len(args) :] if p.default is inspect.Parameter.empty]
    if missing:
        example = " ".join(f"--arg {m}=f32[4]" for m in missing)
        raise CliError(f"missing --arg for {', '.join(missing)}: give each an example, e.g. {example} (see --help)")
    return tuple(args)


# ---------------------------------------------------------------------------------------------
# Loading path/to/file.py:name
# ---------------------------------------------------------------------------------------------


def load_target(target: str):
    """The object ``name`` defined in ``file.py`` for ``file.py:name``."""
    path, sep, name = target.rpartition(":")
    if not sep or not path or not name:
        raise CliError(f"expected path/to/file.py:NAME, got {target!r}")
    if not os.path.isfile(path):
        raise CliError(f"no such file: {path}")
    path = os.path.abspath(path)
    module_name = "_fxtools_target_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(path))  # the file's own imports of its neighbours
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - the user's file failed: one line naming its line
        raise CliError(f"running {os.path.basename(path)} failed: {user_error(exc)}") from exc
    except SystemExit as exc:  # sys.exit() at import: the file is a script, not a module to load from
        from ..errors import user_frame

        code = "" if exc.code is None else repr(exc.code)
        raise CliError(
            f"running {os.path.basename(path)} stopped at sys.exit({code}) "
            f"({user_frame(exc.__traceback__) or 'while importing it'}), so {name!r} could not be loaded from it; "
            "put the script's own code under `if __name__ == '__main__':`"
        ) from exc
    finally:
        sys.path.remove(os.path.dirname(path))
    obj = module
    for part in name.split("."):
        if not hasattr(obj, part):
            raise CliError(f"{os.path.basename(path)} defines no {name!r}")
        obj = getattr(obj, part)
    return obj


def user_error(exc: BaseException) -> str:
    """``file:line: code: Type: message`` for an exception raised in (or through) user code."""
    from ..errors import user_frame

    where = user_frame(exc.__traceback__)
    if isinstance(exc, SyntaxError) and exc.filename:
        where = f"{exc.filename}:{exc.lineno}: {(exc.text or '').strip()}"
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{where + ': ' if where else ''}{type(exc).__name__}: {first}"


def check_output_path(path: str | None, suffix: str, option: str) -> None:
    """A CliError unless ``path`` ends in ``suffix`` and its folder exists (checked before any work)."""
    if path is None:
        return
    if not path.endswith(suffix):
        raise CliError(f"{option} {path}: the file name must end in {suffix}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise CliError(f"{option} {path}: no such folder {os.path.dirname(path) or '.'}")
    if os.path.isdir(path):
        raise CliError(f"{option} {path} is a folder")


def parse_argnums(text: str, nargs: int):
    """``--argnums 0`` or ``0,2`` as an int or a tuple of argument positions (a CliError if invalid)."""
    try:
        nums = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise CliError(f"--argnums {text!r}: expected argument positions such as 0 or 0,2") from None
    if not nums:
        raise CliError("--argnums: expected at least one argument position")
    for a in nums:
        if not -nargs <= a < nargs:
            raise CliError(f"--argnums {a}: the function takes {nargs} positional argument{'s' * (nargs != 1)}")
    return nums[0] if len(nums) == 1 else nums


def _cast(args, dtype):
    """Floating-point tensors of ``args`` in ``dtype`` (unchanged if dtype is None)."""
    if dtype is None:
        return args
    return pytree.tree_map(lambda v: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v, args)


class Target:
    """What the CLI differentiates: ``fn(*args)``, with ``model`` set for nn.Modules."""

    def __init__(self, obj, specs, seed, dtype):
        from ..functional import functional

        generator = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        self.model = None
        if isinstance(obj, type) and issubclass(obj, torch.nn.Module):
            try:
                obj = obj()
            except Exception as exc:  # noqa: BLE001 - the user's constructor failed: one line naming its line
                raise CliError(f"cannot instantiate {obj.__name__}() with no arguments: {user_error(exc)}") from None
        if isinstance(obj, torch.nn.Module):
            if dtype is not None:
                obj = obj.to(dtype)
            self.model = obj
            self.fn = functional(obj)
            inputs = _cast(build_args(obj.forward, specs, generator), dtype)
            params = {n: p.detach() for n, p in obj.named_parameters()}
            self.args = (params, *inputs)
            self.kind = f"{type(obj).__name__} with respect to its parameters"
        elif callable(obj):
            self.fn = obj
            self.args = _cast(build_args(obj, specs, generator), dtype)
            self.kind = getattr(obj, "__name__", repr(obj))
        else:
            raise CliError(f"{obj!r} is neither a function nor an nn.Module")


# ---------------------------------------------------------------------------------------------
# Checks against autograd
# ---------------------------------------------------------------------------------------------


def _tolerances(args):
    dtypes = {v.dtype for v in pytree.tree_leaves(args) if isinstance(v, torch.Tensor) and v.is_floating_point()}
    if dtypes and dtypes <= {torch.float64}:
        return dict(rtol=1e-9, atol=1e-10)
    if dtypes & {torch.float16, torch.bfloat16}:
        return dict(rtol=2e-2, atol=2e-2)
    return dict(rtol=1e-4, atol=1e-5)


def _float(v):
    return isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())


def reference_grads(fn, args, argnums: tuple, model=None, seed=0):
    """torch.autograd's gradient of scalar ``fn(*args)`` w.r.t. the float leaves of ``args[argnums]``.

    A model runs on a deep copy so that its buffers are untouched.
    """
    if model is not None:
        from ..functional import functional

        fn = functional(copy.deepcopy(model))
    args = list(args)
    leaves_of = {}
    for a in argnums:
        leaves, spec = pytree.tree_flatten(args[a])
        leaves = [v.detach().clone().requires_grad_(True) if _float(v) else v for v in leaves]
        leaves_of[a] = leaves
        args[a] = pytree.tree_unflatten(leaves, spec)
    torch.manual_seed(seed)
    loss = fn(*args)
    inputs = [v for a in argnums for v in leaves_of[a] if _float(v)]
    grads = iter(torch.autograd.grad(loss, inputs, allow_unused=True))
    return [[next(grads) if _float(v) else None for v in leaves_of[a]] for a in argnums]


def check_grad(target: Target, gm, argnums) -> str:
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    want = reference_grads(target.fn, target.args, nums, target.model)
    torch.manual_seed(0)
    got = gm(*target.args)
    got = (got,) if isinstance(argnums, int) else got
    tol = _tolerances(target.args)
    worst = 0.0
    for a, g, w in zip(nums, got, want):
        g_leaves = pytree.tree_leaves(g, is_leaf=lambda v: v is None)
        if len(g_leaves) != len(w):
            raise AssertionError(f"argument {a}: {len(g_leaves)} gradient leaves, autograd has {len(w)}")
        for i, (gl, wl) in enumerate(zip(g_leaves, w)):
            if wl is None and gl is None:
                continue
            wl = torch.zeros_like(gl) if wl is None else wl
            torch.testing.assert_close(gl, wl, **tol, msg=lambda m: f"argument {a}, leaf {i}: {m}")
            if wl.numel():
                worst = max(worst, (gl - wl).abs().max().item())
    return f"max abs difference {worst:.3g}, tolerance rtol={tol['rtol']:g} atol={tol['atol']:g}"


# ---------------------------------------------------------------------------------------------
# Subcommands
# ---------------------------------------------------------------------------------------------


def _target_parser(prog: str, description: str, epilog: str) -> argparse.ArgumentParser:
    """A command's parser with its TARGET and --arg options (the commands that load a target)."""
    p = Parser(prog=prog, description=description, epilog=epilog)
    p.add_argument("target", metavar="TARGET", help="path/to/file.py:function_or_module")
    p.add_argument("--arg", action="append", default=[], metavar="[NAME=]SPEC", help=ARG_HELP)
    return p


def _dtype_and_seed(p: argparse.ArgumentParser, dtype_help: str) -> None:
    p.add_argument("--dtype", choices=[k for k, v in _DTYPES.items() if v.is_floating_point], help=dtype_help)
    p.add_argument("--seed", type=int, default=0, help="seed of the random example inputs (default 0)")


def _load(a, argnums_text, default):
    """The target of parsed arguments ``a`` and its argnums (``default`` unless given for a function)."""
    target = Target(load_target(a.target), a.arg, a.seed, _DTYPES[a.dtype] if a.dtype else None)
    if argnums_text is not None and target.model is None:
        return target, parse_argnums(argnums_text, len(target.args))
    return target, default


def _transform_parser(kind: str) -> argparse.ArgumentParser:
    what = {
        "grad": "the gradient of a scalar-valued function or model loss",
        "vjp": "the vector-Jacobian product (out, grads = forward(*args, grad_out))",
        "jvp": "the Jacobian-vector product (out, out_tangent = forward(*args, *tangents))",
        "split": "separate forward and backward graphs (forward(*leaves) -> (out, saved); "
        "backward(*saved, *cotangents) -> grads) and what the forward saves",
    }[kind]
    p = _target_parser(
        f"fxtools {kind}",
        f"Print {what} as readable PyTorch code, with the shape of every value. "
        "TARGET is path/to/file.py:NAME where NAME is a function or an nn.Module class "
        "(instantiated with no arguments and differentiated with respect to its parameters; "
        "the --arg values are then the inputs of its forward).",
        f"example: fxtools {kind} model.py:Net --arg x=f32[4,8] --arg y=i64[4]%3 --out g.py --check",  # not %-formatted
    )
    p.set_defaults(policy=None)
    if kind == "grad":
        p.add_argument(
            "--argnums",
            default="0",
            help="for a function: the argument(s) to differentiate, "
            "e.g. 0 or 0,2 (default 0); a module is differentiated w.r.t. its parameters",
        )
    if kind == "split":
        p.add_argument(
            "--policy", default="recompute_cheap", help="what to save: recompute_cheap (default), save_all or dots_saveable"
        )
    _dtype_and_seed(p, "cast the module's parameters and every floating-point --arg tensor to this dtype")
    p.add_argument("--out", metavar="FILE.py", help="also write the code as a standalone module (imports only torch)")
    p.add_argument(
        "--svg",
        metavar="FILE.svg",
        help="also draw the graphs (forward, backward, recomputed, saved) "
        "as an SVG picture (needs pydot and Graphviz: pip install 'fxtools[draw]')",
    )
    p.add_argument("--check", action="store_true", help="compare with torch.autograd on the example inputs")
    p.add_argument("--quiet", action="store_true", help="do not print the code")
    return p


def parse_transform_args(kind: str, argv):
    """The parsed arguments of ``fxtools KIND``; ``model.py Net`` (TARGET in two words) is answered
    with the one-word form ``model.py:Net``."""
    p = _transform_parser(kind)
    a, extra = p.parse_known_args(argv)
    if extra and a.target.endswith(".py") and extra[0].isidentifier():
        raise CliError(f"TARGET is one word, FILE.py:NAME: write {a.target}:{extra[0]} (not {a.target} {extra[0]})")
    if extra:
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    return a


def _run_transform(kind: str, argv) -> int:
    """``fxtools grad|vjp|jvp|split TARGET``: load the target, transform it, print the code, then
    write the module and the drawing and check against torch.autograd as asked."""
    a = parse_transform_args(kind, argv)
    check_output_path(a.out, ".py", "--out")
    check_output_path(a.svg, ".svg", "--svg")
    progress(f"loading {a.target}")
    target, argnums = _load(a, a.argnums if kind == "grad" else None, 0)
    gm = _transform(kind, target, argnums, a.policy)
    if not a.quiet:
        _print_code(kind, a.target, target, gm)
    _write_outputs(kind, a, target, gm)
    if a.check:
        return _check_against_autograd(kind, target, gm, argnums, a.seed)
    return 0


def _transform(kind: str, target, argnums, policy):
    """The module (or split) the command makes, timed and sized on stderr."""
    from ..graph.nodes import count_compute_nodes
    from ..transforms.vjp import grad, vjp

    progress(f"tracing and differentiating {target.kind} ...")
    start = time.perf_counter()
    if kind == "grad":
        gm = grad(target.fn, *target.args, argnums=argnums)
    elif kind == "vjp":
        gm = vjp(target.fn, *target.args)
    elif kind == "jvp":
        from ..transforms.forward import jvp

        gm = jvp(target.fn, *target.args)
    else:
        from ..training.partition import split

        gm = split(target.fn, *target.args, policy=policy)
    elapsed = time.perf_counter() - start
    nodes = (
        f"{count_compute_nodes(gm.forward)} + {count_compute_nodes(gm.backward)}" if kind == "split" else count_compute_nodes(gm)
    )
    progress(f"done in {elapsed:.2f} s: {nodes} compute nodes")
    return gm


def _print_code(kind: str, path: str, target, gm) -> None:
    """The generated code on stdout, annotated with the user's lines (a split: its report, then both graphs)."""
    from ..codegen.show import annotated_code

    print(f"# fxtools {kind} of {path}: {target.kind}")
    if kind == "split":
        print("# " + gm.report(file=io.StringIO()).rstrip().replace("\n", "\n# "))
        print("# --- forward")
        print(annotated_code(gm.forward).rstrip())
        print("# --- backward")
        print(annotated_code(gm.backward).rstrip())
    else:
        print(annotated_code(gm).rstrip())


def _write_outputs(kind: str, a, target, gm) -> None:
    """The standalone module (``--out``) and the drawing (``--svg``), if asked."""
    if a.out:
        from ..codegen.export import save

        save(gm, a.out, name=f"`fxtools {kind} {os.path.basename(a.target)}`: {target.kind}")
        progress(f"wrote {a.out}" + (" (+ .pt constants)" if os.path.exists(a.out[:-3] + ".pt") else ""))
    if a.svg:
        from ..codegen.draw import draw

        draw(
            gm, a.svg, title=f"fxtools {kind} {os.path.basename(a.target)}" + (f" (policy {a.policy})" if kind == "split" else "")
        )  # a DrawError is one line (cli.main)
        progress(f"wrote {a.svg}")


def _check_against_autograd(kind: str, target, gm, argnums, seed) -> int:
    """``--check``: the module against torch.autograd; the exit status (1 and the mismatch on stderr if it differs)."""
    from ..transforms.check import check_vjp

    progress("checking against torch.autograd ...")
    try:
        if kind == "grad":
            detail = check_grad(target, gm, argnums)
        elif kind == "jvp":
            detail = check_jvp(target, gm, seed)
        else:
            tol = _tolerances(target.args)
            check_vjp(target.fn, *target.args, gm=_split_as_vjp(gm) if kind == "split" else gm, **tol)
            detail = f"tolerance rtol={tol['rtol']:g} atol={tol['atol']:g}"
    except AssertionError as exc:
        print(f"check against torch.autograd: FAILED\n{exc}", file=sys.stderr)
        return 1
    print(f"# check against torch.autograd: ok ({detail})")
    return 0


def _split_as_vjp(s):
    """``gm(*args, grad_out) -> (out, grads)`` computed by a split's forward and backward."""

    def run(*args_and_ct):
        *args, ct = args_and_ct
        out, saved = s.forward(*s.flatten(*args))
        return out, s.backward(*saved, *s.flatten_cotangent(ct))

    return run


def check_jvp(target: Target, gm, seed) -> str:
    """<ct, J t> from the generated code against <J^T ct, t> from torch.autograd (random t and ct)."""
    from ..transforms.check import random_cotangent

    gen = torch.Generator().manual_seed(seed + 1)
    tangents = pytree.tree_map(lambda v: torch.randn(v.shape, dtype=v.dtype, generator=gen) if _float(v) else None, target.args)
    torch.manual_seed(seed)
    out, out_t = gm(*target.args, *tangents)
    ct = random_cotangent(out, gen)
    jt = sum((c * o).sum() for c, o in zip(pytree.tree_leaves(ct), pytree.tree_leaves(out_t)) if c is not None and o is not None)
    leaves, spec = pytree.tree_flatten(target.args)
    ref = [v.detach().clone().requires_grad_(True) if _float(v) else v for v in leaves]
    fn = target.fn
    if target.model is not None:
        from ..functional import functional

        fn = functional(copy.deepcopy(target.model))
    torch.manual_seed(seed)
    ref_out = fn(*pytree.tree_unflatten(ref, spec))
    pairs = [(o, c) for o, c in zip(pytree.tree_leaves(ref_out), pytree.tree_leaves(ct)) if c is not None]
    inputs = [v for v in ref if _float(v)]
    grads = torch.autograd.grad([o for o, _ in pairs], inputs, [c for _, c in pairs], allow_unused=True)
    t_leaves = [t for t in pytree.tree_leaves(tangents) if t is not None]
    jtc = sum((g * t).sum() for g, t in zip(grads, t_leaves) if g is not None)
    jt, jtc = torch.as_tensor(jt, dtype=torch.float64), torch.as_tensor(jtc, dtype=torch.float64)
    tol = _tolerances(target.args)
    torch.testing.assert_close(jt, jtc, rtol=max(tol["rtol"], 1e-7) * 10, atol=tol["atol"] * 10)
    return f"<ct, J t> = {jt.item():.8g}, autograd <J^T ct, t> = {jtc.item():.8g}"


def grad_command(argv) -> int:
    return _run_transform("grad", argv)


def vjp_command(argv) -> int:
    return _run_transform("vjp", argv)


def jvp_command(argv) -> int:
    return _run_transform("jvp", argv)


def split_command(argv) -> int:
    return _run_transform("split", argv)


def show_command(argv) -> int:
    p = Parser(
        prog="fxtools show",
        description="Print generated code: a module written by fxtools.save / --out (FILE.py), or the "
        "tensors of a .pt file (the constants saved beside such a module) with their shapes. "
        "A .pt file is loaded with torch.load(..., weights_only=True): nothing in it can run code, "
        "so a GraphModule saved with torch.save is refused (write it with fxtools.save instead).",
        epilog="example: fxtools show g.py",
    )
    p.add_argument("file", metavar="FILE", help="FILE.py (a module written by fxtools.save) or FILE.pt (tensors)")
    p.add_argument("--code-only", action="store_true", help="for FILE.py: leave out the docstring and constants")
    a = p.parse_args(argv)
    if not os.path.isfile(a.file):
        raise CliError(f"no such file: {a.file}")
    if a.file.endswith(".py"):
        with open(a.file, encoding="utf-8") as fh:
            text = fh.read()
        if a.code_only:
            from ..codegen.export import GUARDS_MARKER

            start = text.find("\ndef forward(")
            text = text[start + 1 :] if start >= 0 else text
            text = text.split(GUARDS_MARKER)[0]
        print(text.rstrip())
        return 0
    try:
        obj = torch.load(a.file, weights_only=True, map_location="cpu")
    except Exception:  # noqa: BLE001 - anything that is not a plain file of tensors
        raise CliError(
            f"{a.file} is not a file of tensors that torch.load(..., weights_only=True) can read; fxtools "
            "never loads a pickle that could run code (a GraphModule saved with torch.save is one). "
            "Write generated code with fxtools.save(gm, 'g.py') (or --out g.py) and run fxtools show g.py"
        ) from None
    from ..codegen.show import describe

    leaves = pytree.tree_flatten_with_path(obj)[0]
    for path, leaf in leaves:
        name = pytree.keystr(path) if path else "(the file)"
        print(f"{name}: {describe(leaf) or type(leaf).__name__}")
    return 0


def bench_command(argv) -> int:
    """Run benchmarks/bench.py from the source checkout."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(here))), "benchmarks", "bench.py")
    if not os.path.isfile(path):
        print(
            "fxtools bench: error: benchmarks/bench.py not found; the benchmarks run from a source checkout (pip install -e .)",
            file=sys.stderr,
        )
        return 2
    spec = importlib.util.spec_from_file_location("_fxtools_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def nan_command(argv) -> int:
    """``fxtools nan FILE.py:NAME --arg ...``: the first non-finite value of the value and gradient
    (``fxtools.find_nonfinite``), printed; exit status 1 if there is one, 0 if every value is finite."""
    from ..training.nonfinite import find_nonfinite

    p = _target_parser(
        "fxtools nan",
        "Run the value and the gradient of TARGET (path/to/file.py:NAME, a function or an nn.Module "
        "class instantiated with no arguments) once on the --arg inputs and print the first NaN or unintended "
        "infinity: its name in the generated code, your line that made it, its operands and hints. "
        "Exit status 1 if there is one, 0 if every value is finite.",
        "example: fxtools nan model.py:loss --arg x=f32[4,8] --arg eps=0.0",
    )
    p.add_argument("--argnums", help="for a function: the argument(s) to differentiate, e.g. 0 or 0,2 (default: all)")
    _dtype_and_seed(p, "cast float inputs")
    a = p.parse_args(argv)
    target, argnums = _load(a, a.argnums, None)
    report = find_nonfinite(target.fn, *target.args, argnums=argnums)
    if report is None:
        print(f"# fxtools nan of {a.target}: every value of the forward and the backward is finite")
        return 0
    print(f"# fxtools nan of {a.target}: {target.kind}")
    print(report)
    return 1
