"""The server's errors, in OpenAI's format, and how a value is shown in them."""

import reprlib
from typing import Any


class APIError(Exception):
    """An error the server answers in OpenAI's format: `{"error": {"message", "type", "param", "code"}}`."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        error_type = self.TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": error_type, "param": self.param, "code": self.code}}


def invalid(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="unsupported_parameter")


SHORT_REPR = reprlib.Repr()  # bounded however deep the value nests
SHORT_REPR.maxlevel, SHORT_REPR.maxstring, SHORT_REPR.maxother = 3, 50, 50


def short(value: Any) -> str:
    """A value as an error message shows it: its repr, nested values and long strings elided, cut at 60 characters."""
    text = SHORT_REPR.repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
