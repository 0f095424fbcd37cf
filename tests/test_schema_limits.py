"""`max_schema_depth` (chatcore/engine/schema_limits.py): a schema nested exactly `max_schema_depth` levels
below its top-level object is accepted, one level more is refused, for arrays and objects, whether the levels
are subschemas or data; a scalar adds no level (issue 47: 32 nested arrays were refused at a limit of 32)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from chatcore.config import Settings
from chatcore.engine.schema_limits import SchemaLimits, SchemaTooComplex

DEPTH = Settings.model_fields["max_schema_depth"].default  # 32: the default the review met
LIMITS = SchemaLimits(max_bytes=1 << 20, max_depth=DEPTH, max_enum_values=1000)


def nested_arrays(levels: int) -> dict[str, Any]:
    """`levels` array schemas around an integer: `[[...[1]...]]`, `levels` arrays deep."""
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


def nested_maps(levels: int) -> dict[str, Any]:
    """`levels` object schemas (maps of maps) around an integer, each one level below the last."""
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "additionalProperties": schema}
    return schema


def const_lists(levels: int) -> dict[str, Any]:
    """Data, not subschemas: a `const` of lists `levels` deep under the top-level object, a scalar inside."""
    value: Any = "leaf"
    for _ in range(levels):
        value = [value]
    return {"const": value}


def const_objects(levels: int) -> dict[str, Any]:
    value: Any = 1
    for _ in range(levels):
        value = {"a": value}
    return {"const": value}


SHAPES: list[Callable[[int], dict[str, Any]]] = [nested_arrays, nested_maps, const_lists, const_objects]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda f: f.__name__)
def test_a_schema_nested_exactly_max_schema_depth_levels_is_accepted(shape: Callable[[int], dict[str, Any]]) -> None:
    LIMITS.check([("response_format", shape(DEPTH))])


@pytest.mark.parametrize("shape", SHAPES, ids=lambda f: f.__name__)
def test_one_level_more_is_refused_naming_the_limit(shape: Callable[[int], dict[str, Any]]) -> None:
    with pytest.raises(SchemaTooComplex) as refused:
        LIMITS.check([("response_format", shape(DEPTH + 1))])
    assert str(refused.value) == f"response_format is nested more than {DEPTH} levels deep (max_schema_depth)"


def test_the_limit_follows_the_setting_and_counts_only_objects_and_arrays() -> None:
    small = SchemaLimits(max_bytes=1 << 20, max_depth=2, max_enum_values=1000)
    small.check([("s", {"type": "array", "items": {"type": "array", "items": {"type": "string", "minLength": 1}}})])
    small.check([("s", {"enum": [[1, "two", None]]})])  # level 1 list, level 2 list: the scalars inside add none
    with pytest.raises(SchemaTooComplex, match="nested more than 2 levels"):
        small.check([("s", {"enum": [[[1]]]})])
    with pytest.raises(SchemaTooComplex, match="nested more than 2 levels"):
        small.check([("s", {"type": "object", "properties": {"a": {"type": "object", "properties": {}}}})])
