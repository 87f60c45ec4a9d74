"""``draw(obj, path=None)``: the forward and backward graphs as an SVG picture.

``obj`` is an ``fxtools.split`` result or a GraphModule from fxtools. Every value is a box
``name = op`` with its shape, coloured by what computes it:

- forward (blue): ops of the forward pass;
- backward (orange): ops of the backward pass;
- recompute (purple): ops of a split's backward that compute again a value the forward
  computed (the ``"recompute"`` part a save/recompute policy chose);
- saved (yellow): for a split, the tensors the forward hands to the backward, drawn between
  the two graphs; inputs are white, constants grey.

The colours come from ``meta.PART`` (``graph/meta.py``), which ``vjp``/``grad`` and ``split`` set;
a GraphModule without it is drawn in one colour. The picture is laid out by Graphviz: it needs
``pydot`` (``pip install 'fxtools[draw]'``) and the ``dot`` program (``apt-get install
graphviz``). The returned string is SVG text that notebooks display as a picture.
"""

from __future__ import annotations

import html
import operator
import os

import torch
import torch.fx as fx

from ..errors import FxtoolsError
from ..graph import meta
from .show import describe

__all__ = ["draw", "to_dot", "Svg", "DrawError", "COLORS"]

# part -> (fill, border)
COLORS = {
    "forward": ("#cfe2f3", "#3d85c6"),
    "backward": ("#fce5cd", "#e69138"),
    "recompute": ("#d9d2e9", "#674ea7"),
    "saved": ("#fff2cc", "#bf9000"),
    "input": ("#ffffff", "#666666"),
    "constant": ("#eeeeee", "#999999"),
    "output": ("#ffffff", "#333333"),
    "other": ("#d9ead3", "#6aa84f"),  # a GraphModule without part metadata
}
_LEGEND = {
    "forward": "forward",
    "backward": "backward",
    "recompute": "recomputed in the backward",
    "saved": "saved for the backward",
}
_FONT = "Helvetica,Arial,sans-serif"

_SYMBOLS = {
    operator.add: "+",
    operator.sub: "-",
    operator.mul: "*",
    operator.truediv: "/",
    operator.floordiv: "//",
    operator.matmul: "@",
    operator.pow: "**",
    operator.neg: "-x",
    operator.mod: "%",
    operator.lt: "<",
    operator.le: "<=",
    operator.gt: ">",
    operator.ge: ">=",
    operator.eq: "==",
    operator.ne: "!=",
    operator.and_: "&",
    operator.or_: "|",
    operator.invert: "~",
    operator.xor: "^",
}


class DrawError(FxtoolsError):
    """pydot or Graphviz's ``dot`` program is missing, or Graphviz failed."""


class Svg(str):
    """SVG text; a notebook displays it as the picture (``_repr_svg_``)."""

    def _repr_svg_(self) -> str:
        return str(self)


def _pydot():
    try:
        import pydot
    except ImportError:
        raise DrawError(
            "fxtools.draw needs pydot and Graphviz: pip install 'fxtools[draw]' (or pip install "
            "pydot), and the dot program (apt-get install graphviz, brew install graphviz or "
            "conda install graphviz)"
        ) from None
    return pydot


# ---------------------------------------------------------------------------------------------
# Labels
# ---------------------------------------------------------------------------------------------


def op_name(node: fx.Node) -> str:
    """A short name for what ``node`` computes: ``linear``, ``*``, ``.view``, ``[2]``."""
    if node.op == "call_method":
        return f".{node.target}"
    if node.op == "call_module":
        return f"self.{node.target}"
    target = node.target
    if target is operator.getitem:
        return f"[{node.args[1]!r}]"
    if target in _SYMBOLS:
        return _SYMBOLS[target]
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    return getattr(target, "__name__", str(target)).split(".")[-1]


def _label(title: str, detail: str | None) -> str:
    text = f"<b>{html.escape(title)}</b>"
    if detail:
        text += f'<br/><font point-size="9">{html.escape(detail)}</font>'
    return f"<{text}>"


def _node_label(node: fx.Node, part: str) -> str:
    shape = describe(node.meta.get("val"))
    if part in ("input", "saved"):
        return _label(node.name, shape)
    if node.op == "get_attr":
        return _label(f"{node.name} = self.{node.target}", shape)
    op = op_name(node)
    return _label(node.name if op == node.name else f"{node.name} = {op}", shape)


# ---------------------------------------------------------------------------------------------
# Building the Graphviz graph
# ---------------------------------------------------------------------------------------------


def _is_unpacking(node: fx.Node) -> bool:
    """A placeholder or an item extracted from one (``fc1_weight = params['fc1.weight']``)."""
    while node.op == "call_function" and node.target in (operator.getitem, getattr):
        node = node.args[0]
        if not isinstance(node, fx.Node):
            return False
    return node.op == "placeholder"


class _Picture:
    """Graphviz nodes and edges, grouped in clusters, for one or two GraphModules."""

    def __init__(self, title: str | None):
        self.pydot = _pydot()
        self.dot = self.pydot.Dot(
            graph_type="digraph",
            rankdir="TB",
            nodesep="0.25",
            ranksep="0.35",
            fontname=_FONT,
            label=html.escape(title or "").replace("\\", "\\\\"),
            labelloc="t",
        )
        self.dot.set_node_defaults(
            shape="box", style="rounded,filled", fontname=_FONT, fontsize="11", margin="0.12,0.04", height="0.3"
        )
        self.dot.set_edge_defaults(color="#555555", arrowsize="0.6")
        self.clusters = {}
        self.parts = set()

    def cluster(self, name: str, label: str):
        if name not in self.clusters:
            fill = {"forward": "#f3f8fd", "backward": "#fef8f1", "saved": "#fffbea"}.get(name, "#ffffff")
            sub = self.pydot.Cluster(
                name, label=label, style="rounded,filled", fillcolor=fill, color="#cccccc", fontname=_FONT, fontsize="12"
            )
            self.dot.add_subgraph(sub)
            self.clusters[name] = sub
        return self.clusters[name]

    def node(self, ident: str, label: str, part: str, where=None, **extra):
        fill, border = COLORS[part]
        self.parts.add(part)
        attrs = dict(label=label, fillcolor=fill, color=border, id=ident, tooltip=ident)
        if part == "saved":
            attrs.update(shape="note", style="filled")
        elif part == "input":
            attrs.update(shape="ellipse", style="filled")
        elif part == "output":
            attrs.update(shape="box", style="filled,bold")
        elif part == "recompute":
            attrs.update(style="rounded,filled,dashed", penwidth="1.5")
        attrs.update(extra)
        (where if where is not None else self.dot).add_node(self.pydot.Node(ident, **attrs))

    def edge(self, a: str, b: str, **attrs):
        self.dot.add_edge(self.pydot.Edge(a, b, **attrs))

    def legend(self):
        cells = "".join(
            f'<td bgcolor="{COLORS[p][0]}" border="1" color="{COLORS[p][1]}">{html.escape(text)}</td>'
            for p, text in _LEGEND.items()
            if p in self.parts
        )
        if cells:
            table = f'<<table border="0" cellspacing="4" cellpadding="4"><tr>{cells}</tr></table>>'
            self.dot.add_node(self.pydot.Node("legend", shape="plaintext", style="", label=table, fontsize="10", id="legend"))


def _container(node: fx.Node) -> bool:
    """A pytree argument or a Python value: not drawn (the tensors taken out of it are)."""
    val = node.meta.get("val")
    if val is not None:
        return not isinstance(val, torch.Tensor)
    return all(
        u.op == "call_function" and u.target in (operator.getitem, getattr) and u.args[0] is node for u in node.users
    )  # (an unused argument without a shape is a specialised Python value)


def _part_of(node: fx.Node, known: dict, marked: bool) -> str:
    """The node's part; ops that passes made after marking (``simplify``) get their inputs' part."""
    if node.op == "get_attr":
        return "constant"
    part = meta.PART.get(node)
    if part or not marked:
        return part or "other"
    near = [known.get(a) for a in node.all_input_nodes]
    return "backward" if {"backward", "recompute"} & set(near) else "forward"


def _add_graph(pic: _Picture, gm: fx.GraphModule, prefix: str, where, alias=None) -> dict:
    """Draw every value of ``gm`` (placeholders in ``alias`` are drawn elsewhere); returns node -> id.

    ``where(node, part)`` picks the cluster of a node. Containers of pytree arguments are not
    drawn, only the tensors taken out of them.
    """
    alias = alias or {}
    ids, known = {}, {}
    marked = any(meta.PART.on(n) for n in gm.graph.nodes)
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        if node in alias:
            ids[node] = alias[node]
            continue
        if _is_unpacking(node):
            if _container(node):
                ids[node] = None
                continue
            part = "input"
        else:
            part = known[node] = _part_of(node, known, marked)
        ident = f"{prefix}.{node.name}"
        ids[node] = ident
        pic.node(ident, _node_label(node, part), part, where(node, part))
        for a in dict.fromkeys(node.all_input_nodes):
            if ids.get(a):
                pic.edge(ids[a], ident)
    return ids


def _output_leaves(value) -> list:
    if isinstance(value, fx.Node):
        return [value]
    if isinstance(value, (tuple, list)):
        return [n for v in value for n in _output_leaves(v)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in _output_leaves(v)]
    return []


def _draw_graph_module(pic: _Picture, gm: fx.GraphModule) -> None:
    parts = {meta.PART.get(n) for n in gm.graph.nodes} - {None}

    def backward_only(node):
        """An input that only backward ops read (``grad_out``)."""
        users, stack, seen = [], list(node.users), set()
        while stack:
            u = stack.pop()
            if u in seen:
                continue
            seen.add(u)
            if _is_unpacking(u):
                stack.extend(u.users)
            elif u.op != "output":
                users.append(u)
        return bool(users) and all(meta.PART.get(u) == "backward" for u in users)

    def where(node, part):
        if not parts:
            return None
        if part == "input":
            part = "backward" if backward_only(node) else "forward"
        if part in ("forward", "backward"):
            return pic.cluster(part, part)
        return None

    ids = _add_graph(pic, gm, "gm", where)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    pic.node("gm.output", _label("return", None), "output")
    for leaf in dict.fromkeys(_output_leaves(out.args[0])):
        if ids.get(leaf):
            pic.edge(ids[leaf], "gm.output")


def _draw_split(pic: _Picture, s) -> None:
    fw, bw = s.forward, s.backward
    fw_out = next(n for n in fw.graph.nodes if n.op == "output")
    out_value, saved_nodes = fw_out.args[0]
    bw_ph = [n for n in bw.graph.nodes if n.op == "placeholder"]
    saved_ph = bw_ph[: len(s.saved)]
    total = f"{s.saved_bytes:,} B" if hasattr(s, "saved_bytes") else ""
    saved_cluster = pic.cluster("saved", f"saved: {len(s.saved)} tensors, {total} beyond the inputs")

    fw_cluster = pic.cluster("forward", "forward")
    fw_ids = _add_graph(pic, fw, "forward", lambda n, p: fw_cluster)
    pic.node("forward.output", _label("out", None), "output", fw_cluster)
    for leaf in dict.fromkeys(_output_leaves(out_value)):
        if fw_ids.get(leaf):
            pic.edge(fw_ids[leaf], "forward.output")

    alias = {}
    for ph, info in zip(saved_ph, s.saved):
        ident = f"saved.{ph.name}"
        detail = f"{describe(ph.meta.get('val')) or ''}  {info.bytes:,} B"
        if info.kind == "input":
            detail += " (input)"
        pic.node(ident, _label(ph.name, detail), "saved", saved_cluster)
        alias[ph] = ident
    for src, ph in zip(saved_nodes, saved_ph):
        if fw_ids.get(src):
            pic.edge(fw_ids[src], alias[ph], color=COLORS["saved"][1], penwidth="1.5")

    bw_cluster = pic.cluster("backward", "backward")
    bw_ids = _add_graph(pic, bw, "backward", lambda n, p: bw_cluster, alias)
    bw_out = next(n for n in bw.graph.nodes if n.op == "output")
    pic.node("backward.output", _label("grads", None), "output", bw_cluster)
    for leaf in dict.fromkeys(_output_leaves(bw_out.args[0])):
        if bw_ids.get(leaf):
            pic.edge(bw_ids[leaf], "backward.output")


def to_dot(obj, title: str | None = None):
    """The ``pydot.Dot`` graph ``draw`` renders (for other output formats: ``.create_png()``)."""
    is_split = all(hasattr(obj, a) for a in ("forward", "backward", "saved"))  # fxtools.Split
    if not isinstance(obj, fx.GraphModule) and not is_split:
        raise TypeError(f"draw takes an fxtools.split result or a GraphModule, not {type(obj).__name__}")
    pic = _Picture(title)
    (_draw_split if is_split else _draw_graph_module)(pic, obj)
    pic.legend()
    return pic.dot


def render_svg(dot) -> str:
    """Run Graphviz's ``dot`` on a ``pydot.Dot``: SVG text."""
    try:
        data = dot.create_svg()
    except FileNotFoundError:
        raise DrawError(
            "fxtools.draw needs Graphviz's dot program, which is not on PATH: apt-get install "
            "graphviz (Debian, Ubuntu), brew install graphviz (macOS) or conda install graphviz"
        ) from None
    except AssertionError as exc:  # pydot reports dot's own failures this way
        raise DrawError(f"Graphviz failed: {exc}") from None
    return data.decode("utf-8")


def draw(obj, path=None, *, title: str | None = None) -> Svg:
    """The forward and backward graphs of ``obj`` (a Split or a GraphModule) as SVG text.

    Writes it to ``path`` when given. In a notebook the result displays as the picture.
    """
    svg = Svg(render_svg(to_dot(obj, title)))
    if path is not None:
        with open(os.fspath(path), "w", encoding="utf-8") as fh:
            fh.write(svg)
    return svg
