"""OpenAI-style errors of the gateway: one exception type carrying status, code and headers.

Body: ``{"error": {"message", "type", "param", "code"}}`` as the OpenAI API answers, so SDK clients
surface the code. 429s carry ``Retry-After`` (whole seconds, rounded up), ``retry-after-ms`` and the
reason in ``x-tokenpools-reject-reason``; ``x-should-retry: false`` tells SDKs that waiting cannot help.
"""

from __future__ import annotations

import json
import math

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
RATE_LIMIT = "rate_limit_error"
SERVER = "server_error"
UNAVAILABLE = "service_unavailable"


class GatewayError(Exception):
    """An answer the gateway gives instead of proxying: raised anywhere, rendered by the ASGI app."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        error_type: str = INVALID_REQUEST,
        param: str | None = None,
        retry_after_s: float | None = None,
        retryable: bool | None = None,
        reason: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.error_type = error_type
        self.param = param
        self.retry_after_s = retry_after_s
        self.retryable = retryable
        # The reject reason header is sent for admission outcomes (429/503), not for malformed input.
        self.reason = reason

    def body(self) -> bytes:
        return error_body(self.message, self.error_type, self.code, self.param)

    def headers(self) -> list[tuple[bytes, bytes]]:
        headers: list[tuple[bytes, bytes]] = []
        if self.retry_after_s is not None:
            seconds = max(0.0, self.retry_after_s)
            headers.append((b"retry-after", str(max(1, math.ceil(seconds))).encode()))
            headers.append((b"retry-after-ms", str(max(1, math.ceil(seconds * 1000))).encode()))
        if self.reason:
            headers.append((b"x-tokenpools-reject-reason", self.reason.encode()))
        if self.retryable is False:
            headers.append((b"x-should-retry", b"false"))
        if self.status == 401:
            # RFC 9110: a 401 names the scheme that would be accepted (a bearer key or METRICS_TOKEN).
            headers.append((b"www-authenticate", b'Bearer realm="tokenpools"'))
        return headers


def error_body(message: str, error_type: str, code: str, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": error_type, "param": param, "code": code}}).encode()


def invalid_request(message: str, *, param: str | None = None, code: str = "invalid_request") -> GatewayError:
    return GatewayError(400, code, message, param=param)


def invalid_api_key(message: str = "Incorrect or revoked API key provided.") -> GatewayError:
    return GatewayError(401, "invalid_api_key", message, error_type=AUTHENTICATION)


def model_not_found(model: str) -> GatewayError:
    return GatewayError(
        404, "model_not_found", f"The model {model!r} does not exist or this key may not use it.", param="model"
    )


def body_too_large(limit: int) -> GatewayError:
    return GatewayError(413, "request_too_large", f"Request body exceeds the limit of {limit} bytes.")


def rejected(reason: str, message: str, *, retry_after_s: float, retryable: bool) -> GatewayError:
    """A 429 for an admission rejection; `reason` doubles as the error code (ARCHITECTURE.md)."""
    return GatewayError(
        429,
        reason,
        message,
        error_type=RATE_LIMIT,
        retry_after_s=retry_after_s,
        retryable=retryable,
        reason=reason,
    )


def unavailable(code: str, message: str, *, retry_after_s: float = 1.0) -> GatewayError:
    return GatewayError(
        503, code, message, error_type=UNAVAILABLE, retry_after_s=retry_after_s, retryable=True, reason=code
    )


UPSTREAM_SHED = "upstream_shed"


def upstream_shed(reason: str, *, retry_after_s: float) -> GatewayError:
    """A 429 for a request the inference gateway in front of an llm-d pool shed (its flow control's
    `x-llm-d-request-dropped-reason`): nothing was served and the gateway released the whole hold."""
    return rejected(UPSTREAM_SHED, f"The inference gateway shed the request: {reason}.",
                    retry_after_s=retry_after_s, retryable=True)
