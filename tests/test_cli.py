"""The command line: ``fxtools grad/vjp/show`` on a model file it has never seen."""

import subprocess
import sys

import pytest
import torch
from conftest import MODEL
from isolated import run_isolated

from fxtools.cli.commands import CliError, build_args, parse_spec
from fxtools.cli.main import main


def test_grad_of_a_module_writes_a_standalone_module(model_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "fxtools", "grad", "model.py:Net", "--arg", "x=f32[4,8]", "--out", "g.py"],
        cwd=model_dir,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "def forward(self, params, x):" in proc.stdout and "# f32[16, 8]" in proc.stdout
    assert "[fxtools]" in proc.stderr  # progress goes to stderr
    text = (model_dir / "g.py").read_text()
    assert "import fxtools" not in text and "from fxtools" not in text
    out = run_isolated(
        """
import torch, g, model
torch.manual_seed(1)
net = model.Net()
x = torch.randn(4, 8)
params = {k: p.detach() for k, p in net.named_parameters()}
got = g.forward(params, x)
want = dict(zip(params, torch.autograd.grad(net(x), list(net.parameters()))))
assert got.keys() == want.keys(), (got.keys(), want.keys())
for k in want:
    torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
print("same gradients:", len(want))
""",
        model_dir,
    )
    assert "same gradients: 6" in out


def test_python_m_fxtools_is_the_command():
    proc = subprocess.run([sys.executable, "-m", "fxtools", "--help"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: fxtools {demo,") and "  grad " in proc.stdout


def test_check_and_show(model_dir, capsys, monkeypatch):
    monkeypatch.chdir(model_dir)
    assert main(["grad", "model.py:Net", "--arg", "x=f64[5,8]", "--dtype", "f64", "--check", "--quiet"]) == 0
    assert "check against torch.autograd: ok" in capsys.readouterr().out
    assert (
        main(
            [
                "vjp",
                "model.py:embed",
                "--arg",
                "table=f64[10,4]",
                "--arg",
                "idx=i64[6]%10",
                "--arg",
                "n=3",
                "--check",
                "--out",
                "v.py",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "def forward(self, table, idx, n, grad_loss):" in out and "check against torch.autograd: ok" in out
    assert main(["show", "v.py"]) == 0
    shown = capsys.readouterr().out
    assert "def forward(table, idx, n, grad_loss):" in shown and "table: f64[10, 4]" in shown
    assert main(["grad", "model.py:embed", "--arg", "f32[10,4]", "--arg", "i64[3]%10", "--arg", "2.0", "--check", "--quiet"]) == 0


def test_errors_are_short(model_dir, capsys, monkeypatch):
    monkeypatch.chdir(model_dir)
    assert main(["grad", "model.py:Nope", "--arg", "x=f32[4,8]"]) == 2
    assert "defines no 'Nope'" in capsys.readouterr().err
    assert main(["grad", "model.py:Net", "--arg", "y=f32[4,8]"]) == 2
    assert "no positional parameter 'y'" in capsys.readouterr().err
    assert main(["grad", "missing.py:f"]) == 2


def test_jvp_and_split(model_dir, capsys, monkeypatch):
    monkeypatch.chdir(model_dir)
    assert main(["jvp", "model.py:embed", "--arg", "table=f64[10,4]", "--arg", "idx=i64[6]%10", "--arg", "n=3", "--check"]) == 0
    out = capsys.readouterr().out
    assert "tangent_table" in out and "check against torch.autograd: ok" in out
    assert main(["split", "model.py:Net", "--arg", "x=f64[4,8]", "--dtype", "f64", "--check", "--out", "s.py"]) == 0
    out = capsys.readouterr().out
    assert "# --- forward" in out and "# --- backward" in out and "saved values" in out
    assert "check against torch.autograd: ok" in out
    text = (model_dir / "s.py").read_text()
    assert "def forward(" in text and "def backward(" in text and "saved values" in text


@pytest.mark.parametrize("command", ["grad", "vjp", "jvp", "split", "show", "demo"])
def test_help(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    assert f"fxtools {command}" in capsys.readouterr().out


def test_specs():
    g = torch.Generator().manual_seed(0)
    assert parse_spec("f32[8,16]", g).shape == (8, 16)
    assert parse_spec("f64[]", g).dtype == torch.float64
    idx = parse_spec("i64[100]%7", g)
    assert idx.dtype == torch.int64 and 0 <= idx.min() and idx.max() < 7
    assert parse_spec("b8[3]", g).dtype == torch.bool
    assert parse_spec("5", g) == 5 and parse_spec("0.5", g) == 0.5
    with pytest.raises(CliError):
        parse_spec("q32[3]", g)

    def f(a, b, c=2):
        return a

    args = build_args(f, ["b=f32[2]", "a=f32[3]"], g)
    assert [t.shape for t in args] == [(3,), (2,)]
    assert build_args(f, ["f32[1]", "f32[1]", "c=7"], g)[2] == 7


class _Payload:
    """Unpickling this runs ``open(marker, 'w')``: what a crafted .pt file can do to torch.load."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def test_show_never_runs_code_from_a_pt_file(tmp_path, capsys, monkeypatch):
    """``fxtools show g.pt`` loads with weights_only=True: a crafted file's payload does not run,
    a torch.save'd GraphModule (whose unpickling executes its code) is refused, pointing to
    fxtools.save; a file of tensors (the constants beside a saved module) is listed with shapes."""
    import fxtools

    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "payload_ran"
    torch.save({"gm": _Payload(marker)}, "evil.pt")
    assert main(["show", "evil.pt"]) == 2
    err = capsys.readouterr().err
    assert not marker.exists(), "loading the file ran its payload"
    assert err.count("\n") == 1 and "weights_only=True" in err and "fxtools.save" in err

    gm = fxtools.grad(lambda p, x: (x @ p["w"]).tanh().sum(), {"w": torch.randn(8, 3)}, torch.randn(4, 8))
    torch.save(gm, "g.pt")
    assert main(["show", "g.pt"]) == 2
    assert "fxtools.save(gm, 'g.py')" in capsys.readouterr().err

    torch.save({"w": torch.randn(8, 3), "b": torch.zeros(3, dtype=torch.float64)}, "constants.pt")
    assert main(["show", "constants.pt"]) == 0
    assert capsys.readouterr().out.splitlines() == ["['w']: f32[8, 3]", "['b']: f64[3]"]


def test_shapes_of_a_graph_module_the_user_loads_themselves(tmp_path):
    """torch.save keeps no shapes; for a file the user trusts and loads themselves, ``show``'s
    ``propagate_shapes`` runs the graph on FakeTensors of the recorded (or given) inputs."""
    import fxtools
    from fxtools.codegen.show import annotated_code, propagate_shapes

    gm = fxtools.grad(lambda p, x: (x @ p["w"]).tanh().sum(), {"w": torch.randn(8, 3)}, torch.randn(4, 8))
    torch.save(gm, tmp_path / "g.pt")
    loaded = torch.load(tmp_path / "g.pt", weights_only=False)  # the user's own, trusted file
    out = annotated_code(propagate_shapes(loaded))
    assert "p['w']  # f32[8, 3]" in out and "# f32[4, 3]" in out
    plain = torch.fx.symbolic_trace(lambda x, y: torch.relu(x @ y).sum(0))
    out = annotated_code(propagate_shapes(plain, torch.randn(4, 8), torch.randn(8, 3)))
    assert "# x: f32[4, 8], y: f32[8, 3]" in out and "relu = torch.relu(matmul)  # f32[4, 3]" in out


BAD_INVOCATIONS = {  # arguments -> what the one line says
    "out into a missing folder": (["grad", "model.py:Net", "--arg", "x=f32[4,8]", "--out", "nodir/g.py"], "no such folder nodir"),
    "out not a .py file": (["grad", "model.py:Net", "--arg", "x=f32[4,8]", "--out", "g.txt"], "must end in .py"),
    "svg into a missing folder": (["vjp", "model.py:Net", "--arg", "x=f32[4,8]", "--svg", "nodir/g.svg"], "no such folder"),
    "integers in [0, 0)": (
        ["grad", "model.py:embed", "--arg", "table=f32[10,4]", "--arg", "idx=i64[4]%0", "--arg", "n=2"],
        "N must be at least 1",
    ),
    "argnums not a number": (
        ["grad", "model.py:embed", "--arg", "f32[10,4]", "--arg", "i64[3]%10", "--arg", "2", "--argnums", "a"],
        "--argnums 'a'",
    ),
    "argnums out of range": (
        ["grad", "model.py:embed", "--arg", "f32[10,4]", "--arg", "i64[3]%10", "--arg", "2", "--argnums", "0,5"],
        "takes 3 positional arguments",
    ),
    "bad spec": (["grad", "model.py:Net", "--arg", "x=f32[4,8"], "cannot read the example input"),
    "shape too large": (["grad", "model.py:Net", "--arg", "x=f32[99999999999999999999,8]"], "cannot make the example input"),
    "missing file": (["grad", "missing.py:f"], "no such file: missing.py"),
    "missing attribute": (["vjp", "model.py:Nope"], "defines no 'Nope'"),
    "unknown option": (["jvp", "model.py:Net", "--bogus"], "unrecognized arguments: --bogus"),
    "grad of a vector": (["grad", "model.py:vector", "--arg", "x=f32[3]"], "single floating-point tensor"),
    "shapes that do not fit": (["vjp", "model.py:Net", "--arg", "x=f32[4,5]"], "model.py:16: h = F.gelu"),
    "file that fails to import": (["grad", "broken.py:f"], "broken.py:2: x = undefined_name"),
    "unknown example": (["demo", "nosuch"], "unknown example 'nosuch'"),
    "show of a missing file": (["show", "nothing.pt"], "no such file: nothing.pt"),
}


@pytest.mark.parametrize("case", list(BAD_INVOCATIONS))
def test_every_cli_error_is_one_line(case, model_dir, capsys, monkeypatch):
    """A bad argument, file or input: one line on stderr (besides progress), exit code 2, no traceback."""
    monkeypatch.chdir(model_dir)
    (model_dir / "model.py").write_text(MODEL + "\n\ndef vector(x):\n    return x.sin()\n")
    (model_dir / "broken.py").write_text("import torch\nx = undefined_name\n")
    argv, says = BAD_INVOCATIONS[case]
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("[fxtools]")]
    assert len(err) == 1, err
    assert err[0].startswith(f"fxtools {argv[0]}: error: ") and says in err[0], err[0]


def test_internal_errors_keep_their_traceback(model_dir, monkeypatch):
    """A bug of fxtools itself (an exception raised in its own code) is not dressed up as a user error."""
    import fxtools.cli.commands as commands
    from fxtools.signature.naming import unique

    monkeypatch.chdir(model_dir)
    monkeypatch.setattr(commands, "load_target", lambda target: unique(None))  # fails inside fxtools
    with pytest.raises(TypeError):
        main(["grad", "model.py:Net", "--arg", "x=f32[4,8]"])
