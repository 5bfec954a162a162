"""`RequestError`: one request refused or failed, as its client reads it. Torch-free.

One type from the engine's admission to the HTTP answer: the engine core raises it (a refusal at admission, a
likelihood job it cannot run), the engine process sends its fields back in a `Rejected` / `ScoreResult` message
(protocol/messages.py), the engine client raises it again in the HTTP process, and the routes raise it for their
own checks; the app answers it with OpenAI's error body `{"error": {message, type, param, code}}`.

`param` names the offending field: inside the engine as SamplingParams names it (`input_ids` for the prompt);
a route renames it to its own request's field on the way out (server/param_names.py).
"""

from __future__ import annotations

INVALID_REQUEST = "invalid_request_error"  # OpenAI's error type of a client's mistake (a 4xx)
SERVER_ERROR = "server_error"  # and of the server's (a 5xx)


class RequestError(ValueError):
    """A request refused or failed: HTTP `status`, OpenAI's error `type` (from the status unless given) and
    `code`, the offending `param`, the `message`, and HTTP `headers` to send with the answer (Retry-After).
    A ValueError: the offline Engine's callers catch a bad input as one."""

    def __init__(self, message: str, *, status: int = 400, code: str | None = None, param: str | None = None,
                 type_: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.code, self.param = message, status, code, param
        self.type = type_ or (SERVER_ERROR if status >= 500 else INVALID_REQUEST)
        self.headers = headers

    def renamed(self, param: str | None) -> "RequestError":
        """The same error naming `param` instead (a route's name for the engine's field)."""
        return RequestError(self.message, status=self.status, code=self.code, param=param, type_=self.type,
                            headers=self.headers)

    def body(self) -> dict[str, dict[str, str | int | None]]:
        """OpenAI's error body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def duplicate_request_id(rid: str, param: str | None = None) -> RequestError:
    """The refusal of a request whose id is already in flight (the engine's check, and the HTTP process's before
    it sends one: both name the id their caller knows)."""
    return RequestError(f"request id {rid!r} is already in flight", code="duplicate_request_id", param=param)
