"""The documentation's code runs as written: every fenced ```python block of docs/*.md and of
README.md, each page's blocks in order in one namespace (as a reader pastes them into one
session), from a fresh working directory. Printed output and code not meant to run are fenced
```text (or ```sh), and are not run. New pages are picked up by the glob."""

import pathlib
import re
import textwrap

import pytest
import torch

import fxtools.registry as registry

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
FENCE = re.compile(r"^(?P<indent>[ \t]*)```python[ \t]*\n(?P<code>.*?)^(?P=indent)```[ \t]*$", re.S | re.M)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(line, code)`` of each ```python block (indented ones, inside lists, dedented)."""
    return [(text.count("\n", 0, m.start()) + 2, textwrap.dedent(m["code"])) for m in FENCE.finditer(text)]


def test_blocks_are_found_as_a_reader_sees_them():
    text = "a\n```python\nx = 1\n```\n```text\nnot run\n```\n1. step\n\n   ```python\n   y = x + 1\n   ```\n"
    assert python_blocks(text) == [(3, "x = 1\n"), (11, "y = x + 1\n")]


@pytest.fixture
def rules_restored():
    """Pages may register rules (fxtools.register_vjp): the tables are restored afterwards. The
    built-in rules load on first use: loaded before the snapshot, or restoring it would drop them."""
    registry._builtin()
    tables = {name: dict(table) for name, table in registry._RULE_SETS.items()}
    rules, nondiff = dict(registry._RULES), set(registry._NONDIFFERENTIABLE)
    yield
    registry._RULES.clear()
    registry._RULES.update(rules)
    for name, table in registry._RULE_SETS.items():  # the same dicts: the active rule set refers to them
        table.clear()
        table.update(tables.get(name, {}))
    registry._NONDIFFERENTIABLE.clear()
    registry._NONDIFFERENTIABLE.update(nondiff)


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p.read_text())], ids=lambda p: p.name)
def test_python_blocks_run(page, tmp_path, monkeypatch, rules_restored):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    namespace: dict = {"__name__": "__docs__"}
    for line, code in python_blocks(page.read_text()):
        # padded with blank lines so that a traceback's line numbers are the page's own
        exec(compile("\n" * (line - 1) + code, str(page), "exec"), namespace)
