"""The control socket's wire format: one JSON object per line, each way.

Every message is a single UTF-8 line of JSON terminated by ``"\\n"`` (the
encoders escape everything outside ASCII, so an encoded line never holds a raw
newline).  Nothing is ever unpickled or evaluated: a line is parsed by
:func:`json.loads` and its shape checked by hand.

Request (client → server)::

    {"cmd": "status", "args": {"verbose": true}}      # "args" optional, an object

Response (server → client), exactly one per request, in request order::

    {"ok": true, "result": <any JSON value>}
    {"ok": false, "error": {"code": "<one of ERROR_CODES>", "message": "<text>"}}

Limits: a request line holds at most :data:`MAX_REQUEST_BYTES` bytes (without
its ``"\\n"``); a response line at most :data:`MAX_RESPONSE_BYTES`.
"""

from __future__ import annotations

import json
from typing import Any

from buildidd.errors import ProtocolError

MAX_REQUEST_BYTES = 64 * 1024
"""Longest request line in bytes, not counting the terminating ``"\\n"``."""

MAX_RESPONSE_BYTES = 1024 * 1024
"""Longest response line in bytes, ``"\\n"`` included; a larger result is
answered with a ``too_large`` error instead."""

# Error codes, the stable part of an error response (messages are for people).
BAD_JSON = "bad_json"                    # not UTF-8, not JSON, or nested too deep
BAD_REQUEST = "bad_request"              # not an object, cmd not a string, args not an object, unknown key
UNKNOWN_COMMAND = "unknown_command"      # no handler for cmd
TOO_LARGE = "too_large"                  # request line > MAX_REQUEST_BYTES or response > MAX_RESPONSE_BYTES
TIMEOUT = "timeout"                      # no complete request within the server's client timeout
INTERNAL = "internal"                    # the handler raised (details in the server's log)
PERMISSION_DENIED = "permission_denied"  # SO_PEERCRED identity not allowed
BUSY = "busy"                            # the server already serves its maximum number of clients
BAD_RESPONSE = "bad_response"            # client side only: the server's line is not a valid response
NOT_PERMITTED = "not_permitted"          # admitted, but this caller may not do this to that target
                                         # (lookup of a process of another user: /proc/PID/maps rules)

ERROR_CODES = frozenset({BAD_JSON, BAD_REQUEST, UNKNOWN_COMMAND, TOO_LARGE, TIMEOUT,
                         INTERNAL, PERMISSION_DENIED, BUSY, BAD_RESPONSE, NOT_PERMITTED})


class ControlError(ProtocolError):
    """A protocol-level failure with a stable code.

    Raised by the decoders on a malformed line, by :class:`~.client.ControlClient`
    when the server answers ``ok: false``, and by command handlers that want a
    specific code sent back (e.g. ``ControlError(BAD_REQUEST, "missing 'pid'")``).

    Attributes:
        code: one of :data:`ERROR_CODES` (or a handler-defined token).
        message: human-readable detail.
    """

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def _dumps(obj: Any) -> bytes:
    """Compact ASCII JSON plus ``"\\n"``. Raises TypeError/ValueError on a value JSON cannot hold."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii") + b"\n"


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _loads(line: bytes) -> Any:
    """Parse one line (trailing ``"\\n"`` allowed). Raises ControlError(BAD_JSON)."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ControlError(BAD_JSON, f"not UTF-8 at byte {e.start}") from e
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError as e:  # "[[[[..." 64 KiB deep
        raise ControlError(BAD_JSON, "nested too deep") from e
    except ValueError as e:  # json.JSONDecodeError is a ValueError
        raise ControlError(BAD_JSON, str(e)) from e


def encode_request(cmd: str, args: dict[str, Any] | None = None) -> bytes:
    """One request line (bytes, ``"\\n"``-terminated).

    Raises:
        ControlError: BAD_REQUEST when cmd is not a str, args not a dict or not
            JSON-serialisable; TOO_LARGE when the line exceeds MAX_REQUEST_BYTES.
    """
    if not isinstance(cmd, str):
        raise ControlError(BAD_REQUEST, f"cmd must be a string, not {type(cmd).__name__}")
    msg: dict[str, Any] = {"cmd": cmd}
    if args is not None:
        if not isinstance(args, dict):
            raise ControlError(BAD_REQUEST, f"args must be a dict, not {type(args).__name__}")
        msg["args"] = args
    try:
        line = _dumps(msg)
    except (TypeError, ValueError) as e:
        raise ControlError(BAD_REQUEST, f"args not JSON-serialisable: {e}") from e
    if len(line) - 1 > MAX_REQUEST_BYTES:
        raise ControlError(TOO_LARGE, f"request of {len(line) - 1} bytes exceeds {MAX_REQUEST_BYTES}")
    return line


def decode_request(line: bytes) -> tuple[str, dict[str, Any]]:
    """Parse one request line into ``(cmd, args)``; args is ``{}`` when absent.

    Args:
        line: the bytes of one line, with or without its ``"\\n"``.

    Raises:
        ControlError: TOO_LARGE (over MAX_REQUEST_BYTES), BAD_JSON, BAD_REQUEST.
    """
    if line.endswith(b"\n"):
        line = line[:-1]
    if len(line) > MAX_REQUEST_BYTES:
        raise ControlError(TOO_LARGE, f"request line of {len(line)} bytes exceeds {MAX_REQUEST_BYTES}")
    msg = _loads(line)
    if not isinstance(msg, dict):
        raise ControlError(BAD_REQUEST, f"request must be a JSON object, not {type(msg).__name__}")
    extra = set(msg) - {"cmd", "args"}
    if extra:
        raise ControlError(BAD_REQUEST, f"unknown request keys: {sorted(extra)}")
    cmd = msg.get("cmd")
    if not isinstance(cmd, str):
        raise ControlError(BAD_REQUEST, "missing cmd" if cmd is None else "cmd must be a string")
    args = msg.get("args", {})
    if not isinstance(args, dict):
        raise ControlError(BAD_REQUEST, "args must be a JSON object")
    return cmd, args


def encode_response(result: Any) -> bytes:
    """A success line ``{"ok": true, "result": result}``.

    Raises:
        TypeError, ValueError: result is not JSON-serialisable (NaN included).
    """
    return _dumps({"ok": True, "result": result})


def encode_error(code: str, message: str) -> bytes:
    """An error line ``{"ok": false, "error": {"code": code, "message": message}}``."""
    return _dumps({"ok": False, "error": {"code": str(code), "message": str(message)}})


def decode_response(line: bytes) -> Any:
    """The result carried by one response line.

    Raises:
        ControlError: with the server's code and message when ``ok`` is false;
            BAD_RESPONSE (or BAD_JSON) when the line is not a valid response.
    """
    msg = _loads(line)
    if not isinstance(msg, dict) or not isinstance(msg.get("ok"), bool):
        raise ControlError(BAD_RESPONSE, "response must be an object with a boolean 'ok'")
    if msg["ok"]:
        if "result" not in msg:
            raise ControlError(BAD_RESPONSE, "ok response without 'result'")
        return msg["result"]
    err = msg.get("error")
    if not isinstance(err, dict) or not isinstance(err.get("code"), str):
        raise ControlError(BAD_RESPONSE, "error response without an error code")
    raise ControlError(err["code"], str(err.get("message", "")))
