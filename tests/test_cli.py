"""The command line: ``fxtools grad/vjp/show`` on a model file it has never seen."""
import subprocess
import sys

import pytest
import torch

from fxtools.cli import main
from fxtools.cli_commands import CliError, build_args, parse_spec
from isolated import run_isolated

def test_grad_of_a_module_writes_a_standalone_module(model_dir):
    proc = subprocess.run([sys.executable, "-m", "fxtools", "grad", "model.py:Net", "--arg", "x=f32[4,8]",
                           "--out", "g.py"], cwd=model_dir, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "def forward(self, params, x):" in proc.stdout and "# f32[16, 8]" in proc.stdout
    assert "[fxtools]" in proc.stderr  # progress goes to stderr
    text = (model_dir / "g.py").read_text()
    assert "import fxtools" not in text and "from fxtools" not in text
    out = run_isolated("""
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
""", model_dir)
    assert "same gradients: 6" in out


def test_python_m_fxtools_is_the_command():
    proc = subprocess.run([sys.executable, "-m", "fxtools", "--help"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: fxtools {demo,") and "  grad " in proc.stdout


def test_check_and_show(model_dir, capsys, monkeypatch):
    monkeypatch.chdir(model_dir)
    assert main(["grad", "model.py:Net", "--arg", "x=f64[5,8]", "--dtype", "f64", "--check", "--quiet"]) == 0
    assert "check against torch.autograd: ok" in capsys.readouterr().out
    assert main(["vjp", "model.py:embed", "--arg", "table=f64[10,4]", "--arg", "idx=i64[6]%10", "--arg", "n=3",
                 "--check", "--out", "v.py"]) == 0
    out = capsys.readouterr().out
    assert "def forward(self, table, idx, n, grad_out):" in out and "check against torch.autograd: ok" in out
    assert main(["show", "v.py"]) == 0
    shown = capsys.readouterr().out
    assert "def forward(table, idx, n, grad_out):" in shown and "table: f64[10, 4]" in shown
    assert main(["grad", "model.py:embed", "--arg", "f32[10,4]", "--arg", "i64[3]%10", "--arg", "2.0",
                 "--check", "--quiet"]) == 0


def test_errors_are_short(model_dir, capsys, monkeypatch):
    monkeypatch.chdir(model_dir)
    assert main(["grad", "model.py:Nope", "--arg", "x=f32[4,8]"]) == 2
    assert "defines no 'Nope'" in capsys.readouterr().err
    assert main(["grad", "model.py:Net", "--arg", "y=f32[4,8]"]) == 2
    assert "no positional parameter 'y'" in capsys.readouterr().err
    assert main(["grad", "missing.py:f"]) == 2


def test_jvp_and_split(model_dir, capsys, monkeypatch):
    monkeypatch.chdir(model_dir)
    assert main(["jvp", "model.py:embed", "--arg", "table=f64[10,4]", "--arg", "idx=i64[6]%10", "--arg", "n=3",
                 "--check"]) == 0
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


def test_show_a_torch_saved_graph_module_with_shapes(tmp_path, capsys, monkeypatch):
    """torch.save keeps no shapes: show runs the graph on FakeTensors of recorded or --arg inputs."""
    import fxtools
    monkeypatch.chdir(tmp_path)
    params = {"w": torch.randn(8, 3)}
    gm = fxtools.grad(lambda p, x: (x @ p["w"]).tanh().sum(), params, torch.randn(4, 8))
    torch.save(gm, "g.pt")
    assert main(["show", "g.pt"]) == 0  # from the inputs fxtools recorded in the module
    out = capsys.readouterr().out
    assert "p['w']  # f32[8, 3]" in out and "# f32[4, 3]" in out
    assert main(["show", "g.pt", "--arg", "x=f32[2,8]"]) == 2  # params cannot be given as a spec
    assert "missing --arg" in capsys.readouterr().err

    plain = torch.fx.symbolic_trace(lambda x, y: torch.relu(x @ y).sum(0))
    torch.save(plain, "plain.pt")
    assert main(["show", "plain.pt"]) == 0  # nothing recorded: the code, and a hint
    captured = capsys.readouterr()
    assert "# f32" not in captured.out and "pass --arg" in captured.err
    assert main(["show", "plain.pt", "--arg", "x=f32[4,8]", "--arg", "y=f32[5,3]"]) == 2
    assert "cannot propagate shapes" in capsys.readouterr().err
    assert main(["show", "plain.pt", "--arg", "x=f32[4,8]", "--arg", "y=f32[8,3]"]) == 0
    out = capsys.readouterr().out
    assert "# x: f32[4, 8], y: f32[8, 3]" in out and "relu = torch.relu(matmul)  # f32[4, 3]" in out
    assert "sum_1 = relu.sum(0)  # f32[3]" in out
