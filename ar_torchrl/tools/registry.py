"""The registries of tools (:data:`TOOLS`) and of call formats (:data:`PARSERS`).

A tool's entry carries its torch-free config schema, whose ``build()`` returns the tool
(``calculator`` in :mod:`ar_torchrl.tools.calculator`); a parser's schema builds the parser
(``tag`` and ``hermes`` in :mod:`ar_torchrl.tools.parsers`). Both register with the one shape of
:mod:`ar_torchrl.registry` (``@register_tool(name, help=...)`` on the options dataclass). Both are
:class:`~ar_torchrl.registry.Registry` instances, so a recipe lists and checks them before it
imports anything heavy.

Example:
    >>> TOOLS.names(), PARSERS.names()
    (('calculator',), ('tag', 'hermes'))
    >>> TOOLS.build("calculator", {"max_digits": 30})("2**10")
    '1024'
"""

from __future__ import annotations

from ar_torchrl.registry import Registry

__all__ = ["PARSERS", "TOOLS", "register_parser", "register_tool"]

TOOLS = Registry(
    "tool",
    builtins=("ar_torchrl.tools.calculator",),
    decorator="register_tool",
    build="build(self) -> Tool",
)
PARSERS = Registry(
    "tool call parser",
    builtins=("ar_torchrl.tools.parsers",),
    decorator="register_parser",
    build="build(self) -> ToolCallParser",
)

#: ``@register_tool(name, help=...)`` on the tool's options dataclass
#: (:meth:`ar_torchrl.registry.Registry.register` of :data:`TOOLS`).
register_tool = TOOLS.register
#: ``@register_parser(name, help=...)`` on a call format's options dataclass (:data:`PARSERS`).
register_parser = PARSERS.register
