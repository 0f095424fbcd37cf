"""Request bodies decoded straight into their handler's `data` type, strictly.

Litestar's own decoding converts a body to its type with msgspec's lax rules (the string "5" would pass for
an integer); this `Request` class decodes the JSON body into the handler's annotated `data` Struct with the
strict rules instead, so a field of the wrong type is refused as it always was. Litestar then takes the
decoded Struct as it is, and the OpenAPI document shows that Struct."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request

from chatcore.server.errors import ApiError, from_validation_error


class StrictRequest(Request[Any, Any, Any]):
    async def json(self) -> Any:
        field = self.route_handler.parsed_data_field
        if field is None:
            return await super().json()
        try:
            return msgspec.json.decode(await self.body(), type=field.annotation, strict=True)
        except msgspec.ValidationError as exc:
            raise from_validation_error(exc) from exc
        except msgspec.DecodeError as exc:
            raise ApiError("bad_request", f"JSON is malformed: {exc}") from exc
