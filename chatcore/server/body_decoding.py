"""Request bodies decoded straight into their handler's `data` type, strictly.

Litestar's own decoding converts a body to its type with msgspec's lax rules (the string "5" would pass for
an integer); this `Request` class decodes the JSON body into the handler's annotated `data` Struct with the
strict rules instead, so a field of the wrong type is refused as it always was. Litestar then takes the
decoded Struct as it is, and the OpenAPI document shows that Struct.

No text a client sends may hold NUL (U+0000): PostgreSQL cannot store it in a text column, so a title, prompt,
message or id holding one failed in the database with a 500. Bodies, WebSocket frames (`ws.py`) and request
paths (`app.py`) holding one are refused with `bad_request` naming where, on every database alike."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request

from chatcore.outcomes import ErrorCode
from chatcore.server.errors import ApiError, from_validation_error


class StrictRequest(Request[Any, Any, Any]):
    async def json(self) -> Any:
        field = self.route_handler.parsed_data_field
        if field is None:
            return await super().json()
        body = await self.body()
        try:
            data = msgspec.json.decode(body, type=field.annotation, strict=True)
        except msgspec.ValidationError as exc:
            raise from_validation_error(exc) from exc
        except msgspec.DecodeError as exc:
            raise ApiError(ErrorCode.BAD_REQUEST, f"JSON is malformed: {exc}") from exc
        refused = nul_error(msgspec.json.decode(body)) if b"\\u0000" in body else None
        if refused is not None:
            raise refused
        return data


NUL = "\x00"


def nul_error(value: Any) -> ApiError | None:
    """`bad_request` naming where (`messages[0].content`, a key included) a decoded JSON value first holds a
    NUL; None when it holds none. Walked with a stack: a body may nest as deep as its decoder allows."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, str) and NUL in item:
            return ApiError(ErrorCode.BAD_REQUEST, f"{where or 'the body'} must not contain NUL (U+0000) characters")
        if isinstance(item, dict):
            for key, child in reversed(item.items()):
                name = str(key).replace(NUL, "\\u0000")
                path = f"{where}.{name}" if where else name
                stack.append((path, child))
                stack.append((path, key))  # a key with a NUL is named by its own path
        elif isinstance(item, list):
            stack.extend((f"{where}[{i}]", child) for i, child in reversed(list(enumerate(item))))
    return None
