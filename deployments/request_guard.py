"""The ingress's gate: optional bearer-token auth and a request body size limit, checked
before anything parses the request. The key is compared in constant time and never
logged or echoed."""
from __future__ import annotations

import hmac

from fastapi import Request
from fastapi.responses import JSONResponse

from .openai_protocol import ApiError


class RequestGuard:
    def __init__(self, api_key: str | None, max_body_bytes: int) -> None:
        self.api_key, self.max_body_bytes = api_key or None, max_body_bytes

    def refusal(self, request: Request) -> JSONResponse | None:
        """The error response for a request that may not pass, else None."""
        if request.method == "POST":
            length = request.headers.get("content-length")
            if length is None:
                return _error(ApiError(411, "a Content-Length header is required"))
            if not length.isdigit() or int(length) > self.max_body_bytes:
                return _error(ApiError(413, f"request body larger than {self.max_body_bytes} bytes"))
        key = self.api_key
        if key and request.url.path != "/health":
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
                return _error(ApiError(401, "missing or invalid API key (Authorization: Bearer <key>)",
                                       type_="authentication_error", code="invalid_api_key"))
        return None


def _error(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)
