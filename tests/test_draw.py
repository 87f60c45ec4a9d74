"""fxtools.draw: SVG pictures of the forward and backward graphs, rendered by Graphviz."""

import sys
import xml.etree.ElementTree as ET

import pytest
import torch
from conftest import needs_graphviz

import fxtools
from fxtools.cli import examples
from fxtools.cli.main import main
from fxtools.codegen.draw import COLORS, DrawError, Svg, _is_unpacking, draw
from fxtools.graph import meta

SVG = "{http://www.w3.org/2000/svg}"


def nodes_of(svg: str) -> dict:
    """``{node id: fill colour}`` for every drawn node of the picture (parses it as XML)."""
    root = ET.fromstring(svg)
    out = {}
    for g in root.iter(f"{SVG}g"):
        if g.get("class") != "node":
            continue
        shape = next(
            e
            for e in g.iter()
            if e.tag in (f"{SVG}path", f"{SVG}polygon", f"{SVG}ellipse") and e.get("fill") not in (None, "none")
        )
        out[g.get("id")] = shape.get("fill")
    return out


def compute_nodes(gm):
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_method") and n.target is not getattr]


def gpt_block():
    block = examples.Block(examples.gpt_config("tiny"))
    return block, torch.randn(2, 8, 16)


@needs_graphviz
def test_split_of_a_gpt_block_colours_forward_backward_recomputed_and_saved(tmp_path):
    block, x = gpt_block()
    s = fxtools.split(block, x, policy="recompute_cheap")
    svg = draw(s, tmp_path / "block.svg")
    assert (tmp_path / "block.svg").read_text() == svg
    fills = nodes_of(svg)
    fw, bw, rc, saved = (COLORS[p][0] for p in ("forward", "backward", "recompute", "saved"))
    for n in compute_nodes(s.forward):
        assert fills[f"forward.{n.name}"] == fw, n
    recomputed = {n.name for n in compute_nodes(s.backward) if meta.PART.get(n) == "recompute"}
    ops = {getattr(n.target, "__name__", str(n.target)) for n in compute_nodes(s.backward) if n.name in recomputed}
    assert "gelu" in ops and "native_layer_norm" in ops, ops
    for n in compute_nodes(s.backward):
        assert fills[f"backward.{n.name}"] == (rc if n.name in recomputed else bw), n
        if n.name in recomputed and not isinstance(n.meta.get("val"), (tuple, list)):
            assert f"forward.{n.name}" in fills  # a recomputation is a copy of a forward value
    # the saved tensors are boxes between the graphs, one per saved value, none drawn twice
    saved_ids = {k for k, v in fills.items() if v == saved}
    assert saved_ids == {f"saved.{info.name}" for info in s.saved}
    assert not any(f"backward.{info.name}" in fills for info in s.saved)
    assert fills["backward.grad_out"] == COLORS["input"][0]


@needs_graphviz
def test_saving_everything_recomputes_less_and_the_picture_says_so():
    model, inputs = examples.mlp(activation="gelu")
    pictures = {}
    for policy in ("save_all", "recompute_cheap"):
        s = fxtools.split(model, *inputs, policy=policy)
        fills = nodes_of(draw(s))
        purple = {k.split(".", 1)[1] for k, v in fills.items() if v == COLORS["recompute"][0] and k.startswith("backward.")}
        assert purple == {n.name for n in compute_nodes(s.backward) if meta.PART.get(n) == "recompute"}
        pictures[policy] = (purple, len([v for v in fills.values() if v == COLORS["saved"][0]]))
    assert pictures["save_all"][0] < pictures["recompute_cheap"][0]
    assert pictures["save_all"][1] > pictures["recompute_cheap"][1]


@needs_graphviz
def test_grad_graph_module_is_coloured_forward_and_backward():
    model, inputs = examples.mlp()
    loss, args = examples.as_loss(model, inputs)
    gm = fxtools.grad(loss, *args)
    svg = draw(gm, title="grad of an MLP")
    assert isinstance(svg, Svg) and svg._repr_svg_() == svg  # notebooks display it
    fills = nodes_of(svg)
    fw, bw = COLORS["forward"][0], COLORS["backward"][0]
    names = {n.name: fills[f"gm.{n.name}"] for n in compute_nodes(gm) if not _is_unpacking(n)}
    assert {"fc1", "act", "logits"} <= {k for k, v in names.items() if v == fw}  # the user's variable, else the module
    assert "cross_entropy_loss" not in names  # grad does not return the loss: its seed is x.new_ones([])
    assert all(v == bw for k, v in names.items() if k.startswith("grad_"))
    assert set(names.values()) == {fw, bw}
    # parameters taken out of the dict argument are inputs; the dict itself is not drawn
    assert fills["gm.fc1_weight"] == COLORS["input"][0] and "gm.params" not in fills
    assert "grad of an MLP" in svg


@needs_graphviz
def test_vjp_labels_are_name_op_and_shape():
    gm = fxtools.vjp(lambda x: torch.sin(x) + x, torch.randn(3, 2))
    svg = draw(gm)
    assert "out_sin = sin" in svg and "out = +" in svg and "grad_x = +" in svg and "f32[3, 2]" in svg
    fills = nodes_of(svg)
    assert fills["gm.x_cos"] == COLORS["backward"][0]  # autograd computes it in the backward too
    assert fills["gm.grad_out"] == COLORS["input"][0]


@needs_graphviz
def test_other_graph_modules_are_drawn_in_one_colour():
    gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU()))
    fills = nodes_of(draw(gm))
    assert set(fills.values()) >= {COLORS["other"][0]} and COLORS["forward"][0] not in fills.values()


def test_missing_dependencies_say_what_to_install(monkeypatch, tmp_path):
    gm = fxtools.vjp(torch.sin, torch.randn(2))
    monkeypatch.setenv("PATH", str(tmp_path))  # no dot program
    with pytest.raises(DrawError, match="apt-get install graphviz"):
        draw(gm)
    monkeypatch.setitem(sys.modules, "pydot", None)  # pydot not installed
    with pytest.raises(DrawError, match=r"pip install 'fxtools\[draw\]'"):
        draw(gm)
    with pytest.raises(TypeError, match="GraphModule"):
        draw(3)


@needs_graphviz
def test_cli_svg(model_dir, capsys, monkeypatch):
    monkeypatch.chdir(model_dir)
    assert main(["split", "model.py:Net", "--arg", "x=f32[4,8]", "--quiet", "--svg", "s.svg"]) == 0
    fills = nodes_of((model_dir / "s.svg").read_text())
    assert fills["backward.h_gelu"] == COLORS["recompute"][0] and fills["forward.h_gelu"] == COLORS["forward"][0]
    assert "wrote s.svg" in capsys.readouterr().err
    assert main(["grad", "model.py:Net", "--arg", "x=f32[4,8]", "--quiet", "--svg", "g.svg"]) == 0
    fills = nodes_of((model_dir / "g.svg").read_text())
    assert fills["gm.fc1"] == COLORS["forward"][0] and fills["gm.grad_fc1_weight"] == COLORS["backward"][0]
