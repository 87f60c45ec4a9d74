"""The classic causes of a NaN, each planted in a small program, and what finds them.

``python examples/nan_causes.py`` prints, for each program, the report of
``fxtools.find_nonfinite`` and what ``torch.autograd.detect_anomaly`` says about the same
program (its warning and error, or nothing): the output docs/nonfinite.md shows.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

import fxtools


def log_at_zero(p):
    logp = torch.log(p)
    return -logp.mean()


def sqrt_at_zero(x):
    r = torch.sqrt(x * x)
    return r.sum()


def pow_at_zero(x):
    r = x**0.5
    return r.sum()


def zero_over_zero(a, b):
    q = a / b
    return q.sum()


def normalize(x):
    u = x / x.norm()
    return (u * u).sum()


def softmax_all_masked(scores, keep):
    scores = scores.masked_fill(~keep, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    return p[:, 0].sum()


def exp_overflow(x):
    e = torch.exp(x)
    return torch.log(e.sum())


def acos_at_one(x):
    angle = torch.acos(x)
    return angle.sum()


def where_unselected(x):
    y = torch.where(x > 0, torch.log(x), 0.0)
    return y.sum()


CAUSES = {
    "log at 0": (log_at_zero, (torch.tensor([0.5, 0.0, 0.5]),)),
    "sqrt at 0 (in the backward)": (sqrt_at_zero, (torch.tensor([1.0, 0.0]),)),
    "pow at 0 (in the backward)": (pow_at_zero, (torch.tensor([4.0, 0.0]),)),
    "0/0": (zero_over_zero, (torch.tensor([1.0, 0.0]), torch.tensor([2.0, 0.0]))),
    "x / x.norm() at 0": (normalize, (torch.zeros(3),)),
    "softmax over a row that is all -inf": (
        softmax_all_masked,
        (torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[True, True], [False, False]])),
    ),
    "exp overflow in float32": (exp_overflow, (torch.tensor([1.0, 90.0]),)),
    "acos at 1 (in the backward)": (acos_at_one, (torch.tensor([0.5, 1.0]),)),
    "torch.where with a non-finite unselected branch": (where_unselected, (torch.tensor([2.0, 0.0]),)),
}


def anomaly(fn, args) -> str:
    """What ``torch.autograd.detect_anomaly`` reports for ``fn(*args).backward()``."""
    args = [a.clone().requires_grad_() if a.is_floating_point() else a for a in args]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torch.autograd.detect_anomaly():
                loss = fn(*args)
                loss.backward()
        except RuntimeError as exc:
            said = [
                str(w.message) for w in caught if "anomaly" not in str(w.message).lower() or "Error detected" in str(w.message)
            ]
            return "\n".join([*said, f"RuntimeError: {exc}"])
    grads = [a.grad for a in args if isinstance(a, torch.Tensor) and a.grad is not None]
    bad = sum(int((~torch.isfinite(g)).sum()) for g in grads)
    return f"(no warning, no error) loss = {loss.item()}, {bad} non-finite gradient entries"


def _short(text: str) -> str:
    """Paths relative to the repository; of a traceback, only the program's own frame."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    lines = text.replace(root, "").splitlines()
    frames = [i for i, line in enumerate(lines) if line.strip().startswith('File "')]
    if frames:
        last = frames[-1]
        lines = lines[: frames[0]] + lines[last : last + 2] + [x for x in lines[last + 2 :] if "Triggered internally" not in x]
    return "\n".join(lines)


def main() -> None:
    for title, (fn, args) in CAUSES.items():
        print(f"### {title}\n")
        print(f"--- fxtools.find_nonfinite({fn.__name__}, ...)")
        print(_short(str(fxtools.find_nonfinite(fn, *args))))
        print("--- torch.autograd.detect_anomaly")
        print(_short(anomaly(fn, args)))
        print()


if __name__ == "__main__":
    sys.exit(main())
