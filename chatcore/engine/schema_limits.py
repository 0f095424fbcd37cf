"""Static limits on the JSON schemas clients send to be compiled into grammars (`response_format`, tool calls).

xgrammar's compile time grows fast with some shapes: arrays nested 256 deep took 0.7 s here, 500 deep
several seconds, and a 532 KB enum 3.4 s and 137 MB of compiled grammar. These limits refuse such
shapes before anything compiles, with a message that names the limit:
- the schema's nesting depth: how many levels of objects and arrays the JSON document nests below its
  top-level object, which is level 0, so that a schema of 32 nested arrays (`{"type": "array", "items":
  ...}` 32 times around `{"type": "integer"}`) is depth 32. Scalars add no level. Counted iteratively,
  so a schema nested deeper than Python's recursion limit is refused like any other;
- its size, as compact JSON;
- the number of `enum` values;
- `$ref`s: only local ones (`#` or `#/...`, JSON pointers into the same document). xgrammar resolves
  nothing else (`http://`, `file://`, relative names, `#anchor`) and would silently allow any JSON there.

Some small schemas still compile slowly (a 53-byte `pattern` with nested repetitions took 5 s): the
compile pool's time limit and threads (chatcore/engine/grammar.py) bound those.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

# Keywords whose values are JSON data, not schemas: an object there may hold a "$ref" or "enum" key as data.
DATA_KEYWORDS = frozenset({"const", "default", "examples", "enum"})
# Keywords whose values map names to schemas: a property may be called "enum" or "$ref".
NAME_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
SCHEMA, NAMES, DATA = range(3)  # what a node of the walk is


class SchemaTooComplex(ValueError):
    """A schema over one of the static limits; its message names the limit."""


@dataclass(frozen=True, slots=True)
class SchemaLimits:
    max_bytes: int
    max_depth: int
    max_enum_values: int

    def check(self, schemas: Sequence[tuple[str, Any]]) -> None:
        """Check the schemas of one request, each under its name (a path a client recognises): depth and
        `$ref`s each, bytes and enum values summed over all of them. Raises `SchemaTooComplex`."""
        total_bytes = total_enums = 0
        for where, schema in schemas:
            total_enums += self._walk(where, schema)
            total_bytes += len(msgspec.json.encode(schema))  # safe now: its depth is bounded
        if total_bytes > self.max_bytes:
            raise SchemaTooComplex(f"the JSON schema is {total_bytes} bytes as compact JSON; the limit is "
                                   f"{self.max_bytes} (max_schema_bytes)")
        if total_enums > self.max_enum_values:
            raise SchemaTooComplex(f"the JSON schema lists {total_enums} enum values; the limit is "
                                   f"{self.max_enum_values} (max_schema_enum_values)")

    def _walk(self, where: str, schema: Any) -> int:
        """Depth and `$ref`s of one schema, without recursion; returns its count of enum values."""
        enums = 0
        stack: list[tuple[Any, int, int]] = [(schema, 0, SCHEMA)]  # (node, its level, what it is)
        while stack:
            node, depth, kind = stack.pop()
            if depth > self.max_depth and isinstance(node, (dict, list)):
                raise SchemaTooComplex(f"{where} is nested more than {self.max_depth} levels deep "
                                       f"(max_schema_depth)")
            if isinstance(node, dict):
                if kind == SCHEMA:
                    enums += _check_keywords(where, node)
                stack.extend((value, depth + 1, _child_kind(kind, key)) for key, value in node.items())
            elif isinstance(node, list):
                stack.extend((item, depth + 1, kind) for item in node)
        return enums


def _child_kind(kind: int, key: str) -> int:
    if kind != SCHEMA:
        return DATA if kind == DATA else SCHEMA
    return DATA if key in DATA_KEYWORDS else NAMES if key in NAME_MAPS else SCHEMA


def _check_keywords(where: str, node: dict[str, Any]) -> int:
    """A schema object's `$ref` must be local; returns the number of values its `enum` lists."""
    ref = node.get("$ref")
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        raise SchemaTooComplex(f"{where}: $ref {ref[:80]!r} cannot be resolved: only references into the schema "
                               "itself ('#' or '#/...') are supported")
    enum = node.get("enum")
    return len(enum) if isinstance(enum, list) else 0
