"""HyperPyYAML (the official cosyvoice2.yaml's dialect) read as plain data, without importing its classes.

Tags naming Python objects (`!new:`, `!name:`, ...) are read as their plain mapping, sequence or scalar;
`!ref <a.b>` nodes are resolved after the whole document is read, with `3 * 2`-style arithmetic on literals.
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any

import yaml


class _Ref(str):
    """The text of a `!ref` node, resolved after the whole document is read."""


class _TagIgnoringLoader(yaml.SafeLoader):
    pass


def _construct_tagged(loader: yaml.SafeLoader, _suffix: str, node: yaml.Node) -> Any:
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    return loader.construct_scalar(node)


def _construct_ref(loader: yaml.SafeLoader, node: yaml.Node) -> _Ref:
    return _Ref(loader.construct_scalar(node))


_TagIgnoringLoader.add_constructor("!ref", _construct_ref)
for _prefix in ("!new:", "!name:", "!apply:", "!module:", "!copy:", "!include:"):
    _TagIgnoringLoader.add_multi_constructor(_prefix, _construct_tagged)

_REF_RE = re.compile(r"<([^<>]+)>")
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv}


def _eval_arith(expr: str) -> Any:
    """Evaluate `3 * 2`-style arithmetic on literals only (no names, no calls)."""

    def ev(n: ast.AST) -> Any:
        if isinstance(n, ast.Expression):
            return ev(n.body)
        if isinstance(n, ast.Constant):
            return n.value
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
            return -ev(n.operand)
        if isinstance(n, ast.BinOp) and type(n.op) in _BINOPS:
            return _BINOPS[type(n.op)](ev(n.left), ev(n.right))
        raise ValueError(f"unsupported !ref expression {expr!r}")

    return ev(ast.parse(expr.strip(), mode="eval"))


def _resolve(node: Any, root: dict[str, Any]) -> Any:
    if isinstance(node, _Ref):
        text = str(node)
        whole = _REF_RE.fullmatch(text.strip())
        if whole:
            return _resolve(_lookup(root, whole.group(1)), root)
        return _eval_arith(_REF_RE.sub(lambda m: repr(_resolve(_lookup(root, m.group(1)), root)), text))
    if isinstance(node, dict):
        return {k: _resolve(v, root) for k, v in node.items()}
    if isinstance(node, list):
        return [_resolve(v, root) for v in node]
    return node


def _lookup(root: dict[str, Any], dotted: str) -> Any:
    cur: Any = root
    for part in dotted.split("."):
        cur = cur[part]
    return cur


def load(text: str) -> Any:
    """YAML text -> plain data with its tags dropped; `!ref`s are still `_Ref` nodes (see `resolve`)."""
    return yaml.load(text, Loader=_TagIgnoringLoader)


def resolve(root: dict[str, Any]) -> dict[str, Any]:
    """A loaded document with every `!ref` replaced by what it names (or the arithmetic's value)."""
    return _resolve(root, root)
