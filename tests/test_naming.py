"""Generated code names values after the user's variables and modules (issue 14).

``op_named_share`` is the measure the issue sets: the share of the values a function assigns
whose name is an op's name, with or without a counter (``div``, ``getitem_28``, ``linear_5``).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest
import torch

import fxtools
from fxtools.cli import examples
from fxtools.codegen.pycode import SLACK_BYTES
from fxtools.codegen.show import annotated_code

OPS = {n.strip("_") for n in dir(torch.ops.aten)} | {"getitem", "getattr", "mT", "t"}


def assigned_names(code: str) -> list[str]:
    """Every name a value is assigned to (``a, b = ...`` gives two), skipping ``_`` and frees."""
    names = []
    for node in ast.walk(ast.parse(code.strip())):
        if isinstance(node, ast.Assign) and not (isinstance(node.value, ast.Constant) and node.value.value is None):
            for target in node.targets:
                names += [n.id for n in ast.walk(target) if isinstance(n, ast.Name) and n.id != "_"]
    return names


def op_named_share(code: str) -> float:
    names = assigned_names(code)
    return sum(re.sub(r"_\d+$", "", n) in OPS for n in names) / max(len(names), 1)


def attention(q, k, v):
    scores = q @ k.transpose(-2, -1) / 8.0
    weights = torch.softmax(scores, dim=-1)
    out = weights @ v
    return out.sum()


def test_attention_reads_the_users_variables():
    q, k, v = torch.randn(3, 2, 4, 8, dtype=torch.float64).unbind(0)
    gm = fxtools.vjp(attention, q, k, v)
    names = set(assigned_names(gm.code))
    assert {"scores", "weights", "out", "grad_weights", "grad_scores", "grad_out"} <= names, gm.code
    assert not names & {"div", "softmax", "matmul", "matmul_1"}, gm.code
    qs = [t.clone().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(attention(*qs), qs)
    out, grads = gm(q, k, v, torch.tensor(1.0, dtype=torch.float64))
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt"])
def test_demo_models_are_named_after_modules_and_variables(name):
    f, args = examples.example(name, dtype=torch.float64)
    gm = fxtools.grad(f, *args)
    share = op_named_share(gm.code)
    assert share <= 0.25, (share, gm.code)  # about 0.7 when values were named after their ops
    params = {k: v.clone().requires_grad_() for k, v in args[0].items()}
    want = dict(zip(params, torch.autograd.grad(f(params, *args[1:]), list(params.values()))))
    got = gm(*args)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-10, atol=1e-12)


def test_module_values_take_the_shortest_unique_suffix_of_their_path():
    f, args = examples.example("gpt", n_layer=2)
    code = fxtools.grad(f, *args).code
    # ``logits = self.lm_head(...)``: the user's variable beats the module path
    for name in ("h_0_ln_1", "h_1_ln_2", "h_0_attn_c_attn", "h_1_mlp_c_fc", "ln_f", "logits", "wte", "grad_h_0_ln_1"):
        assert re.search(rf"\b{name}\b", code), name
    # the split's parts are the user's q, k, v; layer norm's statistics are named after it
    assert re.search(r"\bq, k, v = h_0_attn_c_attn\.split\(16, dim=2\)", code), code
    assert re.search(r"\bh_0_ln_1, h_0_ln_1_mean, h_0_ln_1_rstd = torch\.native_layer_norm\(", code), code
    assert not re.search(r"\w\[\d\]$", code, re.M), "multi-output ops are unpacked in one statement"


def test_keywords_are_written_as_pep8_writes_them():
    f, args = examples.example("cnn")
    code = fxtools.grad(f, *args).code
    assert "stride=[1, 1]" in code and "stride = " not in code
    assert re.search(r"torch\.sum\(\w+, \[[\d, ]+\], keepdim=True\)", code), code
    # a string holding " = " is user data: it is never rewritten
    gm = fxtools.grad(lambda p: (p["a = b"] * 2).sum(), {"a = b": torch.randn(3)})
    assert "p['a = b']" in gm.code


def test_pep8_keywords_agree_with_tokenize_on_tricky_lines():
    """The scan that finds keyword ``=`` signs against Python's tokenizer (its former way): string
    literals of every kind, escapes, comparisons and comments are left as they are."""
    import io
    import tokenize

    from fxtools.codegen.pycode import _pep8_keywords

    def by_tokenize(text):
        cut, depth = [], 0
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.OP and tok.string in "([{":
                depth += 1
            elif tok.type == tokenize.OP and tok.string in ")]}":
                depth -= 1
            elif tok.type == tokenize.OP and tok.string == "=" and depth > 0:
                cut.append(tok.start[1])
        for col in reversed(cut):
            if text[col - 1 : col] == " " and text[col + 1 : col + 2] == " ":
                text = text[: col - 1] + "=" + text[col + 2 :]
        return text

    lines = [
        "x = torch.sum(y, [1], keepdim = True)\n",
        "x = f(a, s = 'a = (b', k = 1)\n",
        'x = f(a, s = "q\\" = (", k = 1)\n',
        "x = f(a == b, c = d <= e, g = h != i)\n",
        "x = g['k = 1'](y = 2)\n",
        "x = f(y = '''a'' = (''', z = 3)\n",
        "x = f(r'\\' = (', m = 1)  # f(n = 2)\n",
        "x = f(y = b'x = (', w = (a := 1))\n",
        "x = y\n",
    ]
    for line in lines:
        assert _pep8_keywords(line) == by_tokenize(line), line


def test_names_from_source_never_shadow_builtins_arguments_or_torch():
    def f(x, y):
        sum = x * 2  # noqa: A001 - a builtin's name, on purpose
        y = sum.sin() + y
        ﬁ = y.exp()  # noqa: PLC2401 - NFKC normal form is "fi"
        return (ﬁ * x).sum()

    x, y = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    gm = fxtools.grad(f, x, y, argnums=(0, 1))
    names = assigned_names(gm.code)
    assert "sum_" in names and "sum" not in names and "fi" in names and "ﬁ" not in gm.code
    assert "def forward(self, x, y)" in gm.code and "y" not in names and "x" not in names
    xs = [t.clone().requires_grad_() for t in (x, y)]
    want = torch.autograd.grad(f(*xs), xs)
    for g, w in zip(gm(x, y), want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=0)


def test_small_values_are_not_freed_and_large_ones_are():
    def f(x):
        a = x.exp()
        b = a.sin()
        c = b.cos()
        return c.sum()

    small = fxtools.vjp(f, torch.randn(8)).code
    assert "del " not in small and " = None" not in small, small
    x = torch.randn(1024, 1024)  # 4 MiB per value: a program whose every free counts
    gm = fxtools.vjp(f, x)
    assert "del " in gm.code and " = None" not in gm.code, gm.code
    assert "del " not in annotated_code(gm)
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from bench_memory import peak_bytes

    readable, everything = peak_bytes(gm, (x, torch.tensor(1.0)))
    assert readable == everything, (readable, everything)


def test_frees_keep_the_peak_memory_of_freeing_everything():
    """The estimated peak of the code as written equals that of fx's free-everything code up to
    ``SLACK_BYTES``: run both on a GPT block with a live-bytes counter."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from bench_memory import peak_bytes

    f, args = examples.example("gpt", n_layer=2, n_embd=128, n_head=2, batch=4)
    gm = fxtools.grad(f, *args)
    assert "del " in gm.code
    readable, everything = peak_bytes(gm, args)
    assert readable <= everything + SLACK_BYTES, (readable, everything)


def test_layer_norm_whose_statistics_nothing_reads_is_written_as_users_write_it():
    model, inputs = examples.gpt(n_layer=1, dtype=torch.float64)
    loss, args = examples.as_loss(model, inputs)
    sp = fxtools.split(loss, *args, policy="recompute_cheap")  # the backward recomputes the statistics
    assert "torch.nn.functional.layer_norm(" in sp.forward.code and "native_layer_norm" not in sp.forward.code
    assert re.search(r"\w+, \w+_mean, \w+_rstd = torch\.native_layer_norm\(", sp.backward.code)
    out, grads = sp.vjp(*args)
    params = {k: v.clone().requires_grad_() for k, v in args[0].items()}
    want = torch.autograd.grad(loss(params, *args[1:]), list(params.values()))
    for got, w in zip(grads[0].values(), want):
        torch.testing.assert_close(got, w, rtol=1e-10, atol=1e-12)


def test_stack_trace_lists_every_user_frame_of_the_call():
    """A node's stack trace (the user's line in errors and names) lists the user's frames from the
    traced program's own frame to the op's line, as ``traceback.extract_stack`` sees them (capture
    reads them from the interpreter's frames rather than symbolizing torch's and fxtools' own too;
    the frames of the script that called fxtools are not part of the program)."""
    import traceback

    from fxtools.errors import is_user_file

    seen = []

    def inner(x):
        seen.append(traceback.extract_stack())
        waved = torch.sin(x)  # the line after the one extract_stack read
        return waved * 2

    sp = fxtools.split(inner, torch.randn(3))
    frames = [f for f in seen[-1] if is_user_file(f.filename)]
    frames = frames[[f.name for f in frames].index("inner") :]
    last = frames[-1]
    frames[-1] = traceback.FrameSummary(last.filename, last.lineno + 1, last.name)
    want = "".join(traceback.StackSummary.from_list(frames).format()).strip()
    (node,) = [n for n in sp.forward.graph.nodes if n.name == "waved"]
    assert node.meta["stack_trace"] == want


def test_tensor_meta_made_once_per_metadata_is_what_make_fx_records():
    """Capture gives nodes of equal metadata one ``tensor_meta`` record (made once per trace); each
    node's is still the one ``_extract_tensor_metadata`` gives its value: contiguous, channels-last,
    transposed and offset views, integer and grad-requiring values alike. Whether an op's input
    values are kept (asked once per op) is make_fx's answer for each node."""
    from torch.fx.experimental.proxy_tensor import _should_save_eager_input_vals
    from torch.fx.passes.shape_prop import _extract_tensor_metadata

    from fxtools.capture.trace import capture

    def f(x, w):
        a = torch.sin(x)  # (2, 3, 4, 5) contiguous, twice
        b = torch.cos(x)
        c = a.transpose(1, 3) * 2  # strided
        d = x.to(memory_format=torch.channels_last) + 1
        e = b[1:].argmax(-1)  # an offset view's reduction: integer values
        return (c.sum() + d.sum() + e.sum() + (w * w).sum(),)

    x = torch.randn(2, 3, 4, 5)
    cap = capture(f, (x, torch.randn(3, requires_grad=True)))
    checked = 0
    for node in cap.gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            assert node.meta["tensor_meta"] == _extract_tensor_metadata(val), node.name
            checked += 1
        if node.op == "call_function":
            want = _should_save_eager_input_vals(node.target, (node.args, node.kwargs))
            assert ("eager_input_vals" in node.meta) == want, node.name
    assert checked >= 10
    sin, cos = (n for n in cap.gm.graph.nodes if n.name in ("a", "b"))
    assert sin.meta["tensor_meta"] is cos.meta["tensor_meta"]


def test_inputs_are_recorded_as_make_fx_records_them():
    """fxtools' traces record their inputs with make_fx's pre-dispatch torch-function mode set aside
    (it passes metadata reads through; ``capture/trace.py``): each placeholder's value snapshot and
    ``tensor_meta`` are still the ones a plain pre-dispatch make_fx trace of the same function
    records, for strided, channels-last, transposed, integer and grad-requiring inputs, and the trace's
    own ops (the mode's grad-mode nodes included) are unchanged."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxtools.capture.trace import trace_flat
    from fxtools.transforms.retrace import example_mode, fake_example

    def f(x, y, z, i, w):
        with torch.no_grad():
            s = x.sum()
        return (y * w).sum() + z.sum() + s + i.sum()

    x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    y = torch.randn(4, 6).t()  # transposed
    z = torch.randn(10)[3:]
    i = torch.arange(6)
    w = torch.randn(6, 4, requires_grad=True)
    vals = [x, y, z, i, w]

    def examples():
        mode = example_mode(vals)
        return [fake_example(v, mode, keep_strides=True) for v in vals]

    ours = trace_flat(f, examples(), record_stack_traces=False)
    plain = make_fx(f, pre_dispatch=True, tracing_mode="fake", _allow_non_fake_inputs=True)(*examples())

    def records(gm):
        out = []
        for node in gm.graph.nodes:
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                out.append(
                    (
                        node.op,
                        str(node.target),
                        tuple(val.shape),
                        val.stride(),
                        val.storage_offset(),
                        val.dtype,
                        val.requires_grad,
                        node.meta.get("tensor_meta"),
                    )
                )
            else:
                out.append((node.op, str(node.target)))
        return out

    got, want = records(ours), records(plain)
    assert got == want
    assert sum(1 for r in got if r[0] == "placeholder") == 5
    assert any(r[1] == str(torch._C._set_grad_enabled) for r in got)  # the mode still records what it does
