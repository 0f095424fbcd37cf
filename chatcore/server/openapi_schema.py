"""The OpenAPI schemas of the `msgspec.Struct` bodies: Litestar's own, completed.

Litestar's Struct schemas leave out a bound whose value is 0 (`temperature >= 0`, `top_k >= 0`: it takes
a falsy bound for none) and the bounds of the members of a union (`stop`: a string or a list), and say
nothing of a Struct refusing unknown fields. This plugin, ahead of Litestar's, adds each bound msgspec
enforces that the schema lacks, on the schema of the type it bounds, and `additionalProperties: false`
where unknown fields are refused."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar._openapi.schema_generation.plugins import StructSchemaPlugin
from litestar.openapi.spec import Schema
from litestar.typing import FieldDefinition
from msgspec import inspect

# msgspec's bound -> the `Schema` attribute that shows it, by the kind of value bounded
NUMBER_BOUNDS = {"ge": "minimum", "gt": "exclusive_minimum", "le": "maximum", "lt": "exclusive_maximum"}
LENGTH_BOUNDS = {
    "string": {"min_length": "min_length", "max_length": "max_length"},
    "array": {"min_length": "min_items", "max_length": "max_items"},
    "object": {"min_length": "min_properties", "max_length": "max_properties"},
}
OPENAPI_TYPES: dict[type[inspect.Type], str] = {
    inspect.IntType: "integer", inspect.FloatType: "number", inspect.StrType: "string",
    inspect.ListType: "array", inspect.DictType: "object",
}


def _bounds(member: inspect.Type) -> dict[str, Any]:
    kind = OPENAPI_TYPES.get(type(member), "")
    names = NUMBER_BOUNDS if kind in ("integer", "number") else LENGTH_BOUNDS.get(kind, {})
    return {key: value for name, key in names.items() if (value := getattr(member, name, None)) is not None}


def _members(field_type: inspect.Type) -> list[inspect.Type]:
    members = field_type.types if isinstance(field_type, inspect.UnionType) else (field_type,)
    return [m.type if isinstance(m, inspect.Metadata) else m for m in members]


def complete_bounds(prop: Schema, field_type: inspect.Type) -> None:
    """Show on `prop` the bounds it lacks: for a union of bounded types (not just an optional one), each on the
    member schema of its type; for an array, its items' too."""
    members = [m for m in _members(field_type) if not isinstance(m, inspect.NoneType)]
    for member in members:
        target = prop
        if prop.one_of and len(members) > 1:
            kind = OPENAPI_TYPES.get(type(member))
            target = next((s for s in prop.one_of if isinstance(s, Schema) and s.type == kind), prop)
        for key, value in _bounds(member).items():
            if getattr(prop, key) is None and getattr(target, key) is None:
                setattr(target, key, value)
        if isinstance(member, inspect.ListType) and isinstance(target.items, Schema):
            complete_bounds(target.items, member.item_type)


class StructBodySchemaPlugin(StructSchemaPlugin):
    def to_openapi_schema(self, field_definition: FieldDefinition, schema_creator: Any) -> Schema:
        schema = super().to_openapi_schema(field_definition, schema_creator)
        info = msgspec.inspect.type_info(field_definition.type_)
        assert isinstance(info, inspect.StructType)
        if info.forbid_unknown_fields:
            schema.additional_properties = False
        for field in info.fields:
            prop = (schema.properties or {}).get(field.encode_name)
            if isinstance(prop, Schema):
                complete_bounds(prop, field.type)
        return schema
