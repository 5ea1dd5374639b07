"""An evaluator of the Terraform expressions deploy/terraform uses, in Python, over python-hcl2's
parse tree (its Lark grammar of HCL2), so that the modules' variables, validation blocks,
provider-free locals and outputs are evaluated where no Terraform binary is (CI: Debian has no
terraform package, and no provider can be downloaded anywhere here).

What it follows of Terraform (1.9-1.11, checked against ``terraform console`` 1.11.4 where one
was at hand):

- values: strings, numbers (Python int and float), bools, null (None), lists (tuples), maps
  and objects (dicts); variables are converted to their declared ``type`` (string, number,
  bool, list/set/map of a type, object with every attribute required, any) and a null or a
  missing attribute is refused as Terraform refuses it;
- expressions: literals, ``${...}`` inside strings (numbers written without ``.0``), ``var.``,
  ``local.`` (evaluated on demand), ``path.module``, attribute and index access, ``[for ...]``
  and ``{for ... => ...}`` with ``if``, over lists (value, or index and value) and maps (in
  lexical key order, as Terraform), ``a ? b : c``, the arithmetic, comparison and logical
  operators — both sides of ``&&`` and ``||`` are evaluated (Terraform 1.11 does not short-cut:
  ``true || tonumber("x") > 0`` is an error), equality is false between types (``5 == "5"``);
- functions: those the modules call in the files evaluated here (:data:`FUNCTIONS`);
  ``templatefile`` renders with :mod:`tests.deploy.tftemplate`;
- validation blocks that refer to other variables (1.9+), and the cycle Terraform refuses
  when two variables' validations refer to each other, directly or through others.

Anything else (a resource or data reference, a splat, a heredoc, a function not listed, ``...``
expansion) raises :class:`HclError` naming it, so the files stay within what is evaluated
here; where a Terraform binary is present, tests/deploy/test_terraform.py has Terraform evaluate
the same things and compares.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import json
import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hcl2.parser import parser as hcl_parser
from lark import Token, Tree

from tests.deploy import tftemplate


class HclError(ValueError):
    """Outside the evaluated subset, or an error Terraform would raise too."""


_SKIP = {"new_line_or_comment"}
_PUNCT = {"(", ")", "[", "]", "{", "}", ",", ":", "=", "?", "=>", ".", "for", "in", "if"}


def _kids(node: Tree) -> list[Any]:
    """The children that carry meaning: no comments, newlines or punctuation."""
    out = []
    for child in node.children:
        if isinstance(child, Tree):
            if child.data not in _SKIP:
                out.append(child)
        elif isinstance(child, Token) and child.value.strip() not in _PUNCT:
            out.append(child)
    return out


def parse(text: str) -> Tree:
    tree = hcl_parser().parse(text if text.endswith("\n") else text + "\n")
    assert isinstance(tree, Tree)
    return tree


def parse_expression(text: str) -> Tree:
    """One expression (``"var.x > 1"``), as the tree of an attribute's value."""
    body = _kids(parse(f"__expr__ = {text}\n"))[0]
    attribute = _kids(body)[0]
    return _kids(attribute)[-1]


# -- files: attributes and blocks --------------------------------------------------------------


@dataclass
class Block:
    kind: str
    labels: list[str]
    attributes: dict[str, Tree] = field(default_factory=dict)
    blocks: list[Block] = field(default_factory=list)

    def children(self, kind: str) -> list[Block]:
        return [b for b in self.blocks if b.kind == kind]


def _name(node: Any) -> str:
    if isinstance(node, Token):
        return str(node.value)
    if node.data in ("identifier", "keyword", "literal_value"):
        return str(_kids(node)[0].value)
    if node.data == "string":
        value = evaluate(node, Scope())
        assert isinstance(value, str)
        return value
    raise HclError(f"not a name: {node.data}")


def _body(node: Tree, into: Block) -> Block:
    for item in _kids(node):
        if item.data == "attribute":
            parts = _kids(item)
            into.attributes[_name(parts[0])] = parts[-1]
        elif item.data == "block":
            parts = _kids(item)
            body = parts[-1]
            block = Block(kind=_name(parts[0]), labels=[_name(p) for p in parts[1:-1]])
            into.blocks.append(_body(body, block))
    return into


def load_file(path: Path) -> Block:
    """A .tf file as a tree of blocks, each attribute's expression unevaluated (parsed once per
    content: the tests evaluate the same modules many times)."""
    return _load_text(str(path), path.read_text())


@functools.lru_cache(maxsize=64)
def _load_text(name: str, text: str) -> Block:
    return _body(_kids(parse(text))[0], Block(kind="file", labels=[name]))


def load_module(directory: Path, files: list[str] | None = None) -> Block:
    """Every .tf file of ``directory`` (or only ``files``) as one block."""
    merged = Block(kind="module", labels=[str(directory)])
    paths = [directory / f for f in files] if files else sorted(directory.glob("*.tf"))
    for path in paths:
        merged.blocks += load_file(path).blocks
    return merged


# -- values ------------------------------------------------------------------------------------


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "list"
    if isinstance(value, dict):
        return "map"
    raise HclError(f"not a Terraform value: {value!r}")


def to_string(value: Any) -> str:
    """What ``"${value}"`` gives: a string, a number without a needless ``.0``, a bool."""
    kind = _kind(value)
    if kind == "string":
        return str(value)
    if kind == "number":
        if not math.isfinite(value):
            raise HclError(f"{value!r} cannot be written")
        return tftemplate.number(value)
    if kind == "bool":
        return "true" if value else "false"
    raise HclError(f"a {kind} cannot be written into a string (Terraform: Invalid template)")


def _number(value: Any, what: str) -> int | float:
    if _kind(value) == "number":
        return value  # type: ignore[no-any-return]
    if _kind(value) == "string":
        try:
            return json.loads(value)  # type: ignore[no-any-return]
        except ValueError:
            pass
    raise HclError(f"{what}: a number is required, got {value!r}")


def _bool(value: Any, what: str) -> bool:
    if isinstance(value, bool):
        return value
    if value in ("true", "false"):
        return value == "true"
    raise HclError(f"{what}: a bool is required, got {value!r}")


def _equal(a: Any, b: Any) -> bool:
    if _kind(a) != _kind(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return bool(a == b)


# -- types: a variable's value converted as Terraform converts it ------------------------------


def convert(value: Any, type_node: Tree | None, what: str) -> Any:
    """``value`` as the declared type (``type = list(object({...}))``): Terraform's conversion,
    for the types deploy/terraform declares."""
    if type_node is None or value is None:
        return value
    node = type_node
    while node.data == "expr_term" and len(_kids(node)) == 1:
        node = _kids(node)[0]
    if node.data == "identifier":
        name = _name(node)
        if name == "any":
            return value
        if name == "string":
            if _kind(value) in ("string", "number", "bool"):
                return to_string(value)
            raise HclError(f"{what}: string required")
        if name == "number":
            return _number(value, what)
        if name == "bool":
            return _bool(value, what)
        raise HclError(f"{what}: unknown type {name}")
    if node.data == "function_call":
        parts = _kids(node)
        name = _name(parts[0])
        args = _kids(parts[1]) if len(parts) > 1 else []
        if name in ("list", "set", "tuple") and len(args) == 1:
            if not isinstance(value, list):
                raise HclError(f"{what}: list of {_text(args[0])} required")
            items = [convert(v, args[0], f"{what}[{i}]") for i, v in enumerate(value)]
            if name == "set":
                unique: list[Any] = []
                for item in items:
                    if not any(_equal(item, u) for u in unique):
                        unique.append(item)
                return unique
            return items
        if name == "map" and len(args) == 1:
            if not isinstance(value, dict):
                raise HclError(f"{what}: map of {_text(args[0])} required")
            return {k: convert(v, args[0], f"{what}[{k!r}]") for k, v in value.items()}
        if name == "object" and len(args) == 1:
            attrs = _object_type(args[0])
            if not isinstance(value, dict):
                raise HclError(f"{what}: object required")
            out = {}
            for attr, attr_type in attrs.items():
                if attr not in value:
                    raise HclError(f'{what}: attribute "{attr}" is required')
                out[attr] = convert(value[attr], attr_type, f"{what}.{attr}")
            return out
    raise HclError(f"{what}: type {_text(type_node)} is outside the evaluated subset")


def _object_type(node: Tree) -> dict[str, Tree]:
    while node.data == "expr_term":
        node = _kids(node)[0]
    if node.data != "object":
        raise HclError("object() takes an object of attribute types")
    out = {}
    for elem in _kids(node):
        key, value = _kids(elem)[0], _kids(elem)[-1]
        out[_object_key(key, Scope())] = value
    return out


def _text(node: Any) -> str:
    if isinstance(node, Token):
        return str(node.value)
    return "".join(_text(c) for c in node.children)


# -- scope -------------------------------------------------------------------------------------


@dataclass
class Scope:
    """What names mean: ``var``, ``local`` (lazily evaluated), ``path``, ``module``, and the
    variables of the ``for`` expressions around."""

    names: dict[str, Any] = field(default_factory=dict)

    def child(self, **names: Any) -> Scope:
        return Scope({**self.names, **names})


class Locals(Mapping[str, Any]):
    """A module's ``locals``, each evaluated the first time it is read (and once)."""

    def __init__(self, exprs: Mapping[str, Tree], scope: Callable[[], Scope]) -> None:
        self._exprs = dict(exprs)
        self._scope = scope
        self._values: dict[str, Any] = {}
        self._busy: set[str] = set()

    def __getitem__(self, name: str) -> Any:
        if name not in self._values:
            if name not in self._exprs:
                raise KeyError(name)
            if name in self._busy:
                raise HclError(f"local.{name} refers to itself")
            self._busy.add(name)
            try:
                self._values[name] = evaluate(self._exprs[name], self._scope())
            finally:
                self._busy.discard(name)
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._exprs)

    def __len__(self) -> int:
        return len(self._exprs)


# -- expressions -------------------------------------------------------------------------------

_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\"}


def _unescape(text: str) -> str:
    out, i = [], 0
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt in _ESCAPES:
                out.append(_ESCAPES[nxt])
                i += 2
                continue
            if nxt == "u":
                out.append(chr(int(text[i + 2 : i + 6], 16)))
                i += 6
                continue
            raise HclError(f"escape \\{nxt} is outside the evaluated subset")
        out.append(ch)
        i += 1
    return "".join(out)


def evaluate(node: Any, scope: Scope) -> Any:
    if isinstance(node, Token):
        raise HclError(f"unexpected token {node.value!r}")
    kind = node.data
    kids = _kids(node)
    if kind == "expr_term":
        if len(kids) != 1:
            raise HclError(f"cannot evaluate {_text(node)!r}")
        return evaluate(kids[0], scope)
    if kind == "int_lit":
        return int(kids[0].value)
    if kind == "float_lit":
        return float(kids[0].value)
    if kind == "literal_value":
        return {"true": True, "false": False, "null": None}[kids[0].value]
    if kind == "string":
        parts = [k for k in kids if isinstance(k, Tree) and k.data == "string_part"]
        return "".join(_string_part(part, scope) for part in parts)
    if kind == "identifier":
        name = _name(node)
        if name not in scope.names:
            raise HclError(f"{name!r} is not defined here (only var, local, path and for-names)")
        return scope.names[name]
    if kind == "tuple":
        return [evaluate(k, scope) for k in kids]
    if kind == "object":
        out: dict[str, Any] = {}
        for elem in kids:
            key_node, value_node = _kids(elem)[0], _kids(elem)[-1]
            out[_object_key(key_node, scope)] = evaluate(value_node, scope)
        return out
    if kind == "get_attr_expr_term":
        base = evaluate(kids[0], scope)
        attr = _name(_kids(kids[1])[0])
        if not isinstance(base, Mapping) or attr not in base:
            raise HclError(f"{_text(node).strip()}: no attribute {attr!r}")
        return base[attr]
    if kind == "index_expr_term":
        return _index(evaluate(kids[0], scope), kids[1], scope, _text(node).strip())
    if kind == "function_call":
        return _call(node, scope)
    if kind == "conditional":
        condition = _bool(evaluate(kids[0], scope), "the condition of ? :")
        return evaluate(kids[1] if condition else kids[2], scope)
    if kind == "binary_op":
        left = evaluate(kids[0], scope)
        term = _kids(kids[1])
        op = str(_kids(term[0])[0].value) if isinstance(term[0], Tree) else str(term[0].value)
        right = evaluate(term[1], scope)
        return _binary(op, left, right)
    if kind == "unary_op":
        op = str(node.children[0].value)
        value = evaluate(kids[-1], scope)
        if op == "-":
            return -_number(value, "unary -")
        return not _bool(value, "!")
    if kind == "for_tuple_expr":
        return _for(node, scope, as_object=False)
    if kind == "for_object_expr":
        return _for(node, scope, as_object=True)
    raise HclError(f"{kind} ({_text(node).strip()[:60]!r}) is outside the evaluated subset")


def _string_part(part: Tree, scope: Scope) -> str:
    child = part.children[0]
    if isinstance(child, Token):
        if child.type == "STRING_CHARS":
            return _unescape(str(child.value))
        raise HclError(f"{child.value!r} is outside the evaluated subset")
    if child.data == "interpolation":
        return to_string(evaluate(_kids(child)[-1], scope))
    raise HclError(f"template directive {_text(child)!r} is outside the evaluated subset")


def _object_key(node: Tree, scope: Scope) -> str:
    inner = _kids(node)[0]
    if isinstance(inner, Tree) and inner.data == "expr_term":
        ident = _kids(inner)
        if len(ident) == 1 and isinstance(ident[0], Tree) and ident[0].data == "identifier":
            return _name(ident[0])  # a bare name is the key itself, never a variable
    if isinstance(inner, Tree) and inner.data == "keyword":
        return _name(inner)
    return to_string(evaluate(inner, scope))


def _index(base: Any, index: Tree, scope: Scope, where: str) -> Any:
    if index.data == "short_index":
        key: Any = int(_kids(index)[0].value)
    else:
        key = evaluate(_kids(index)[0], scope)
    if isinstance(base, list):
        n = _number(key, where)
        if not float(n).is_integer() or not 0 <= n < len(base):
            raise HclError(f"{where}: index {key!r} out of range (length {len(base)})")
        return base[int(n)]
    if isinstance(base, Mapping):
        if to_string(key) not in base:
            raise HclError(f"{where}: no element {key!r}")
        return base[to_string(key)]
    raise HclError(f"{where}: cannot index a {_kind(base)}")


def _items(collection: Any, where: str) -> list[tuple[Any, Any]]:
    if isinstance(collection, list):
        return list(enumerate(collection))
    if isinstance(collection, Mapping):
        return [(k, collection[k]) for k in sorted(collection)]
    raise HclError(f"{where}: cannot iterate over a {_kind(collection)}")


def _for(node: Tree, scope: Scope, *, as_object: bool) -> Any:
    kids = _kids(node)
    intro = _kids(kids[0])
    names = [_name(n) for n in intro[:-1]]
    collection = evaluate(intro[-1], scope)
    rest = kids[1:]
    cond = None
    if rest and isinstance(rest[-1], Tree) and rest[-1].data == "for_cond":
        cond = _kids(rest[-1])[-1]
        rest = rest[:-1]
    if any(isinstance(r, Token) and r.value == "..." for r in rest):
        raise HclError("grouping (...) in a for expression is outside the evaluated subset")
    out_list: list[Any] = []
    out_map: dict[str, Any] = {}
    for key, value in _items(collection, _text(intro[-1]).strip()):
        bound = {names[-1]: value} if len(names) == 1 else {names[0]: key, names[1]: value}
        inner = scope.child(**bound)
        if cond is not None and not _bool(evaluate(cond, inner), "a for expression's if"):
            continue
        if as_object:
            k = to_string(evaluate(rest[0], inner))
            if k in out_map:
                raise HclError(f"duplicate key {k!r} in a for expression")
            out_map[k] = evaluate(rest[1], inner)
        else:
            out_list.append(evaluate(rest[0], inner))
    return out_map if as_object else out_list


def _binary(op: str, a: Any, b: Any) -> Any:
    if op == "&&":
        return _bool(a, "&&") and _bool(b, "&&")
    if op == "||":
        return _bool(a, "||") or _bool(b, "||")
    if op == "==":
        return _equal(a, b)
    if op == "!=":
        return not _equal(a, b)
    x, y = _number(a, op), _number(b, op)
    if op == "<":
        return x < y
    if op == ">":
        return x > y
    if op == "<=":
        return x <= y
    if op == ">=":
        return x >= y
    if op == "+":
        return x + y
    if op == "-":
        return x - y
    if op == "*":
        return x * y
    if op == "/":
        return x / y if y else math.copysign(math.inf, x)
    if op == "%":
        return math.fmod(x, y)
    raise HclError(f"operator {op} is outside the evaluated subset")


# -- functions ---------------------------------------------------------------------------------


def _regex(pattern: str, text: str) -> Any:
    match = re.search(pattern, text)
    if match is None:
        raise HclError(f"regex: {text!r} does not match {pattern!r}")
    if match.groupdict():
        return match.groupdict()
    return list(match.groups()) if match.groups() else match.group(0)


def _ipv4_loose(text: str) -> str:
    """Terraform's CIDR parser takes IPv4 octets with leading zeros (01.2.3.4) as decimal."""
    parts = text.split(".")
    if len(parts) == 4 and all(p.isdigit() for p in parts):
        return ".".join(str(int(p)) for p in parts)
    return text


def _cidrhost(prefix: str, hostnum: Any) -> str:
    address, sep, bits = prefix.partition("/")
    if not sep or not bits.isdigit():
        raise HclError(f"cidrhost: invalid CIDR {prefix!r}")
    try:
        network = ipaddress.ip_network(f"{_ipv4_loose(address)}/{bits}", strict=False)
    except ValueError as exc:
        raise HclError(f"cidrhost: invalid CIDR {prefix!r}: {exc}") from None
    n = int(_number(hostnum, "cidrhost"))
    if not 0 <= n < network.num_addresses:
        raise HclError(f"cidrhost: prefix {prefix!r} has no host {n}")
    return str(network.network_address + n)


def _coalesce(*args: Any) -> Any:
    for arg in args:
        if arg is not None and arg != "":
            return arg
    raise HclError("coalesce: no non-null, non-empty-string arguments")


def _flatten(value: Any) -> list[Any]:
    out: list[Any] = []
    for item in value:
        out.extend(_flatten(item) if isinstance(item, list) else [item])
    return out


def _distinct(value: list[Any]) -> list[Any]:
    out: list[Any] = []
    for item in value:
        if not any(_equal(item, o) for o in out):
            out.append(item)
    return out


def _range(*args: Any) -> list[Any]:
    nums = [_number(a, "range") for a in args]
    if len(nums) == 1:
        start, limit, step = 0, nums[0], 1
    else:
        start, limit, step = nums[0], nums[1], nums[2] if len(nums) > 2 else 1
    out, value = [], start
    while (step > 0 and value < limit) or (step < 0 and value > limit):
        out.append(value)
        value += step
    return out


def _length(value: Any) -> int:
    if isinstance(value, str | list | dict):
        return len(value)
    raise HclError(f"length: a {_kind(value)} has no length")


def _strings(fn: Callable[..., Any]) -> Callable[..., Any]:
    def checked(*args: Any) -> Any:
        for arg in args:
            if not isinstance(arg, str):
                raise HclError(f"a string is required, got {arg!r}")
        return fn(*args)

    return checked


def _setsubtract(a: list[Any], b: list[Any]) -> list[Any]:
    return [x for x in _distinct(a) if not any(_equal(x, y) for y in b)]


def _alltrue(value: list[Any]) -> bool:
    return all(_bool(v, "alltrue") for v in value)


def _floor(value: Any) -> int:
    return math.floor(_number(value, "floor"))


def _contains(collection: list[Any], value: Any) -> bool:
    return any(_equal(value, item) for item in collection)


def _concat(*lists: list[Any]) -> list[Any]:
    return [item for lst in lists for item in lst]


def _merge(*maps: Any) -> dict[str, Any]:
    """Later keys win, as Terraform's merge(); null arguments are skipped."""
    out: dict[str, Any] = {}
    for m in maps:
        if m is None:
            continue
        if not isinstance(m, Mapping):
            raise HclError(f"merge: a map or object is required, got {m!r}")
        out.update(m)
    return out


def _join(separator: Any, items: Any) -> str:
    if not isinstance(separator, str) or not isinstance(items, list):
        raise HclError("join: a separator string and a list of strings are required")
    return separator.join(to_string(i) for i in items)


def _substr(text: Any, offset: Any, length: Any) -> str:
    """Terraform's substr() on characters; a length of -1 takes the rest."""
    if not isinstance(text, str):
        raise HclError(f"substr: a string is required, got {text!r}")
    start, n = int(_number(offset, "substr")), int(_number(length, "substr"))
    if start < 0 or start > len(text):
        raise HclError(f"substr: offset {start} is out of range")
    return text[start:] if n == -1 else text[start : start + n]


FUNCTIONS: dict[str, Callable[..., Any]] = {
    "alltrue": _alltrue,
    "cidrhost": _cidrhost,
    "coalesce": _coalesce,
    "concat": _concat,
    "contains": _contains,
    "distinct": _distinct,
    "endswith": _strings(lambda s, suffix: s.endswith(suffix)),
    "flatten": _flatten,
    "floor": _floor,
    "join": _join,
    "keys": lambda m: sorted(m),
    "length": _length,
    "merge": _merge,
    "range": _range,
    "regex": _strings(_regex),
    "setsubtract": _setsubtract,
    "sha256": _strings(lambda s: hashlib.sha256(s.encode()).hexdigest()),
    "startswith": _strings(lambda s, prefix: s.startswith(prefix)),
    "strcontains": _strings(lambda s, sub: sub in s),
    "substr": _substr,
    "trimspace": _strings(lambda s: s.strip()),
}


def _call(node: Tree, scope: Scope) -> Any:
    parts = _kids(node)
    name = _name(parts[0])
    arg_nodes = _kids(parts[1]) if len(parts) > 1 else []
    if any(isinstance(a, Token) for a in arg_nodes):
        raise HclError(f"{name}(...): argument expansion is outside the evaluated subset")
    if name == "can":
        try:
            evaluate(arg_nodes[0], scope)
        except HclError:
            return False
        return True
    args = [evaluate(a, scope) for a in arg_nodes]
    if name == "templatefile":
        path, variables = args
        if not isinstance(variables, dict):
            raise HclError("templatefile: the variables must be an object")
        try:
            return tftemplate.render(Path(path).read_text(), variables)
        except tftemplate.TemplateError as exc:
            raise HclError(f"templatefile({path}): {exc}") from None
    if name not in FUNCTIONS:
        raise HclError(f"function {name}() is outside the evaluated subset")
    return FUNCTIONS[name](*args)


# -- a module ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Invalid:
    """A value a validation block refused: the variable and the block's error_message."""

    variable: str
    message: str


def _validation_refs(block: Block) -> set[str]:
    """The other variables a variable's validation blocks refer to (``var.<name>``)."""
    refs: set[str] = set()
    for validation in block.children("validation"):
        for attr in validation.attributes.values():
            refs |= set(re.findall(r"\bvar\.([A-Za-z_][A-Za-z0-9_-]*)", _text(attr)))
    refs.discard(block.labels[0])
    return refs


def _no_validation_cycle(variables: Mapping[str, Block]) -> None:
    """Terraform (1.9-1.11) orders a validation after the variables it refers to, and each of
    those after its own validation: variables whose validations refer to each other, directly
    or through others, are a cycle it refuses before evaluating anything
    (``Error: Cycle: var.a (validation), var.b (validation)``). The same here."""
    edges = {name: _validation_refs(block) & set(variables) for name, block in variables.items()}
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            cycle = path[path.index(name) :]
            raise HclError("Cycle: " + ", ".join(f"var.{n} (validation)" for n in cycle))
        if name in done:
            return
        for ref in sorted(edges[name]):
            visit(ref, [*path, name])
        done.add(name)

    for name in variables:
        visit(name, [])


class Module:
    """One module's variables (converted to their types, validated), its locals and outputs,
    evaluated from its .tf files with ``inputs`` as a caller (or terraform.tfvars) gives them.

    Only what needs no provider: a local or an output that reads a resource raises
    :class:`HclError` when it is read."""

    def __init__(self, directory: Path, inputs: Mapping[str, Any], files: list[str] | None = None):
        self.directory = directory
        self.root = load_module(directory, files)
        self.variables = {b.labels[0]: b for b in self.root.children("variable")}
        unknown = set(inputs) - set(self.variables)
        if unknown:
            raise HclError(
                f"{directory.name}: no variable {sorted(unknown)} (Terraform: unsupported argument)"
            )
        _no_validation_cycle(self.variables)
        self.var: dict[str, Any] = {}
        for name, block in self.variables.items():
            if name in inputs:
                value = inputs[name]
            elif "default" in block.attributes:
                value = evaluate(block.attributes["default"], Scope())
            else:
                raise HclError(f'{directory.name}: the variable "{name}" is required')
            nullable = (
                evaluate(block.attributes["nullable"], Scope())
                if "nullable" in block.attributes
                else True
            )
            if value is None and not nullable:
                raise HclError(f'{directory.name}: the variable "{name}" must not be null')
            self.var[name] = convert(value, block.attributes.get("type"), f"var.{name}")
        exprs: dict[str, Tree] = {}
        for block in self.root.children("locals"):
            exprs.update(block.attributes)
        self.local = Locals(exprs, lambda: self.scope)
        self.scope = Scope(
            {"var": self.var, "local": self.local, "path": {"module": str(directory)}}
        )

    def invalid(self) -> list[Invalid]:
        """Every validation block whose condition is false, in file order: what Terraform
        reports as "Invalid value for variable"."""
        out = []
        for name, block in self.variables.items():
            for validation in block.children("validation"):
                ok = _bool(evaluate(validation.attributes["condition"], self.scope), "condition")
                if not ok:
                    message = evaluate(validation.attributes["error_message"], self.scope)
                    out.append(Invalid(variable=name, message=message))
        return out

    def output(self, name: str) -> Any:
        blocks = [b for b in self.root.children("output") if b.labels[0] == name]
        if not blocks:
            raise HclError(f"{self.directory.name}: no output {name!r}")
        return evaluate(blocks[0].attributes["value"], self.scope)

    def evaluate(self, text: str) -> Any:
        return evaluate(parse_expression(text), self.scope)
