"""A griffe extension for the API reference: what static analysis cannot see in dpledger.

The reference is built by static analysis (griffe), so neither PyTorch nor TensorFlow is
imported. Two things need help there:

* ``@attrs.frozen`` classes have an ``__init__`` that attrs writes at import time. This extension
  writes the same signature from the class's annotated fields (``attrs.field(init=False)``
  skipped, ``default=`` / ``factory=`` / ``attrs.Factory`` as the default, ``kw_only``, a leading
  underscore dropped as attrs does), so the reference shows the real constructor and the
  ``Args:`` of a config class match its parameters.
* ``check_dp_sgd = STEP_CHECKS.check_dp_sgd`` (a public function that is a bound method of a
  module-level instance) is an attribute to static analysis; it is documented as the function it
  is at run time, with the method's signature and docstring.
* The docstrings use Sphinx roles (``:class:`~dpledger.ledger.PrivacyLedger```) and ``Example:``
  headings. A role becomes code that links to its target where the reference renders that
  target (an optional cross-reference: plain code, without a warning, where it does not), and
  ``Example:`` becomes the Google-style ``Examples:`` section, so that the doctests render as
  code. reST literal blocks (``text::`` and an indented block) become fenced code blocks.

Loaded by ``mkdocs.yml`` (``plugins.mkdocstrings.handlers.python.options.extensions``).
"""

from __future__ import annotations

import ast
import html
import re
import textwrap
from typing import Any

import griffe

_ATTRS_DECORATORS = {
    "attrs.define",
    "attrs.frozen",
    "attrs.mutable",
    "attr.s",
    "attr.attrs",
    "attr.define",
    "attr.frozen",
    "attr.mutable",
}
_FIELD_CALLS = {"attrs.field", "attr.ib", "attr.attrib", "attr.field"}
_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")
_EXAMPLE_HEADING = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)
_LITERAL_MARKER = re.compile(r"^(\s*)(.*?\S)?(\s)?::\s*$")


def _call_path(value: Any) -> str | None:
    if isinstance(value, griffe.ExprCall):
        return value.function.canonical_path  # type: ignore[union-attr]
    if isinstance(value, griffe.Expr):
        return value.canonical_path
    return None


def _call_arguments(value: Any) -> dict[str, Any]:
    if not isinstance(value, griffe.ExprCall):
        return {}
    return {
        argument.name: argument.value
        for argument in value.arguments
        if isinstance(argument, griffe.ExprKeyword)
    }


def _attrs_decorator(cls: griffe.Class) -> Any:
    for decorator in cls.decorators:
        if _call_path(decorator.value) in _ATTRS_DECORATORS:
            return decorator.value
    return None


def _fields(cls: griffe.Class, kw_only: bool) -> list[griffe.Parameter]:
    parameters = []
    for member in cls.members.values():
        if member.is_alias or not member.is_attribute or member.annotation is None:
            continue
        if "class-attribute" in member.labels and "instance-attribute" not in member.labels:
            continue  # a ClassVar
        if str(member.annotation).startswith("ClassVar"):
            continue
        value = member.value
        arguments = _call_arguments(value) if _call_path(value) in _FIELD_CALLS else None
        default: Any = value
        field_kw_only = kw_only
        if arguments is not None:
            if str(arguments.get("init")) == "False":
                continue
            field_kw_only = kw_only or str(arguments.get("kw_only")) == "True"
            if "default" in arguments:
                default = arguments["default"]
            elif "factory" in arguments:
                default = griffe.ExprCall(function=arguments["factory"], arguments=[])
            else:
                default = None
        if _call_path(default) in {"attrs.Factory", "attr.Factory"} and isinstance(
            default, griffe.ExprCall
        ):
            default = griffe.ExprCall(function=default.arguments[0], arguments=[])
        name = str(arguments["alias"]).strip("'\"") if arguments and "alias" in arguments else None
        parameters.append(
            griffe.Parameter(
                name or member.name.lstrip("_"),
                annotation=member.annotation,
                kind=griffe.ParameterKind.keyword_only
                if field_kw_only
                else griffe.ParameterKind.positional_or_keyword,
                default=default,
                docstring=member.docstring,
            )
        )
    return parameters


def _set_attrs_init(cls: griffe.Class) -> None:
    decorator = _attrs_decorator(cls)
    if decorator is None or "__init__" in cls.members:
        return
    if str(_call_arguments(decorator).get("init")) == "False":
        return
    parameters: list[griffe.Parameter] = []
    try:
        mro = cls.mro()
    except ValueError:
        mro = []
    for parent in [*reversed(mro), cls]:
        parent_decorator = _attrs_decorator(parent)
        if parent_decorator is not None:
            kw_only = str(_call_arguments(parent_decorator).get("kw_only")) == "True"
            parameters.extend(_fields(parent, kw_only))
    by_name = {parameter.name: parameter for parameter in parameters}
    ordered = sorted(by_name.values(), key=lambda p: p.kind is griffe.ParameterKind.keyword_only)
    self_parameter = griffe.Parameter(
        "self", annotation=None, kind=griffe.ParameterKind.positional_or_keyword
    )
    init = griffe.Function(
        "__init__",
        lineno=0,
        endlineno=0,
        parent=cls,
        parameters=griffe.Parameters(self_parameter, *ordered),
        returns="None",
    )
    cls.set_member("__init__", init)


def _resolve(obj: griffe.Object, name: str) -> str | None:
    """The full path a role's target names in the scope of ``obj`` (None if unknown)."""
    if name.startswith("dpledger."):
        return name
    first, _, rest = name.partition(".")
    scope: griffe.Object | None = obj
    while scope is not None:
        members = scope.all_members if isinstance(scope, griffe.Class) else scope.members
        if first in members:
            member = members[first]
            path = member.target_path if isinstance(member, griffe.Alias) else member.path
            if isinstance(scope, griffe.Class) and not isinstance(member, griffe.Alias):
                path = f"{scope.path}.{first}"
            return f"{path}.{rest}" if rest else path
        scope = scope.parent
    return None


def _role(obj: griffe.Object, match: re.Match[str]) -> str:
    """A Sphinx role as code that links to its target where the reference renders it."""
    name = match.group(2)
    title = name.rsplit(".", 1)[-1] if match.group(1) else name
    target = _resolve(obj, name)
    if target is None:
        return f"`{title}`"
    return f'<code><autoref identifier="{target}" optional>{html.escape(title)}</autoref></code>'


def _fence(block: list[str], indent: str) -> list[str]:
    """An indented reST literal block as a fenced Markdown block (Python if it parses)."""
    code = textwrap.dedent("\n".join(block)).strip("\n")
    try:
        ast.parse(code)
        language = "python"
    except SyntaxError:
        language = "text"
    lines = [f"{indent}```{language}"]
    lines += [f"{indent}{line}" if line else "" for line in code.split("\n")]
    return [*lines, f"{indent}```"]


def _literal_blocks(text: str) -> str:
    """reST literal blocks (``text::`` then an indented block) as fenced code blocks; the marker
    becomes ``text:`` (``text ::`` becomes ``text``), as reST renders it."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        match = _LITERAL_MARKER.match(lines[i])
        if match and i + 1 < len(lines) and not lines[i + 1].strip():
            indent = match.group(1)
            block, j = [], i + 1
            while j < len(lines) and (
                not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > len(indent)
            ):
                block.append(lines[j])
                j += 1
            while block and not block[-1].strip():
                block.pop()
                j -= 1
            if any(line.strip() for line in block):
                lead = match.group(2)
                if lead in ("Example", "Examples"):  # a Google-style section: body indented
                    out += [f"{indent}Examples:", *_fence(block, indent + "    ")]
                else:
                    if lead:
                        out.append(f"{indent}{lead}{'' if match.group(3) else ':'}")
                    out += ["", *_fence(block, indent)]
                i = j
                continue
        out.append(lines[i])
        i += 1
    return "\n".join(out)


def _normalise(obj: griffe.Object) -> None:
    docstring = obj.docstring
    if docstring is None:
        return
    value = _literal_blocks(docstring.value)
    value = _ROLE.sub(lambda match: _role(obj, match), value)
    docstring.value = _EXAMPLE_HEADING.sub(r"\1Examples:", value)


def _bound_method(module: griffe.Module, attribute: griffe.Attribute) -> griffe.Function | None:
    """``name = INSTANCE.method`` at module level, where ``INSTANCE = Class(...)`` in the same
    module: the method as the function it is at run time (its signature without ``self``, its
    docstring), under the attribute's name."""
    value = attribute.value
    if not isinstance(value, griffe.ExprAttribute) or len(value.values) != 2:
        return None
    instance_name, method_name = (str(part) for part in value.values)
    instance = module.members.get(instance_name)
    if not isinstance(instance, griffe.Attribute) or not isinstance(
        instance.value, griffe.ExprCall
    ):
        return None
    try:
        cls = module.modules_collection[instance.value.function.canonical_path]  # type: ignore[union-attr]
    except (KeyError, AttributeError):
        return None
    if isinstance(cls, griffe.Alias):
        cls = cls.final_target
    method = cls.all_members.get(method_name) if isinstance(cls, griffe.Class) else None
    if isinstance(method, griffe.Alias):
        method = method.final_target
    if not isinstance(method, griffe.Function):
        return None
    parameters = [p for i, p in enumerate(method.parameters) if i > 0 or p.name != "self"]
    function = griffe.Function(
        attribute.name,
        lineno=attribute.lineno,
        endlineno=attribute.endlineno,
        parent=module,
        parameters=griffe.Parameters(*parameters),
        returns=method.returns,
        docstring=griffe.Docstring(
            method.docstring.value if method.docstring else "",
            parser=method.docstring.parser if method.docstring else None,
        ),
    )
    return function


def _bind_methods(module: griffe.Module) -> None:
    for name in list(module.exports or []):
        member = module.members.get(str(name))
        if isinstance(member, griffe.Attribute):
            function = _bound_method(module, member)
            if function is not None:
                function.docstring.parent = function  # type: ignore[union-attr]
                module.set_member(str(name), function)


def _visit(obj: griffe.Object, seen: set[str]) -> None:
    if obj.path in seen:
        return
    seen.add(obj.path)
    _normalise(obj)
    if isinstance(obj, griffe.Class):
        _set_attrs_init(obj)
    if isinstance(obj, griffe.Module):
        _bind_methods(obj)
    for member in list(obj.members.values()):
        if not member.is_alias:
            _visit(member, seen)  # type: ignore[arg-type]


class DpledgerDocs(griffe.Extension):
    """attrs constructors and Google-style sections for the dpledger API reference."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        """Rewrite every object of the loaded package once it is complete."""
        _visit(pkg, set())
