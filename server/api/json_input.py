"""JSON from clients, bounded before anything reads it: the request bodies (create, extend, score) and the live
socket's messages.

`load_object` parses a JSON object and checks, once, the whole of it before any field is read: it nests at most
`MAX_JSON_DEPTH` deep (deeper JSON would reach recursive code -- pydantic, the option mapping, a family's checks
-- and end in a RecursionError), and every string in it, keys included, is text a tokenizer can encode (no lone
UTF-16 surrogate, which JSON's \\u escapes can spell: `engine.request.text_problem`) with no NUL character (a
PostgreSQL text column cannot hold one, and the two stores must take the same inputs). A problem is an `APIError`
400 naming the top-level field it is in; no message echoes the offending text itself. A form's fields are held to
the same (`check_field_text`).
"""

from __future__ import annotations

import json

from longserve.engine.request import text_problem
from longserve.server.api.errors import APIError

#: how deep a client's JSON may nest; the deepest any field takes is 3 (an object in a list in the body)
MAX_JSON_DEPTH = 32


def load_object(text: str, what: str = "request body") -> dict:
    """`text` -> a JSON object within the bounds above (APIError 400 otherwise)."""
    try:
        obj = json.loads(text)
    except RecursionError:
        raise APIError(400, f"the {what} nests JSON more than {MAX_JSON_DEPTH} deep", code="invalid_json") from None
    except ValueError as e:
        raise APIError(400, f"the {what} is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise APIError(400, f"the {what} must be a JSON object, not {type(obj).__name__}", code="invalid_json")
    for key, value in obj.items():
        check_field_text(key, value)
    return obj


def check_field_text(key: str, value) -> None:
    """A top-level field (a JSON body's or a form's): its name and every string in its value are text the server
    takes (`door_text_problem`); APIError 400 naming it otherwise. Other values (a form's file) pass."""
    field = safe_text(key).replace("\x00", "\\x00")
    problem = door_text_problem(key)
    if problem is None:
        problem = _problem(value, 1)
    if problem is not None:
        raise APIError(400, f"{field}: {problem}", param=field, code="invalid_value")


def door_text_problem(text: str) -> str | None:
    """Why the server refuses `text`: not encodable (`text_problem`), or holding a NUL character."""
    problem = text_problem(text)
    if problem is None and "\x00" in text:
        problem = (f"holds a NUL character (U+0000) at {text.index(chr(0))}, which no text field may hold "
                   f"(the job store refuses it)")
    return problem


def safe_text(text: str) -> str:
    """`text` with any lone surrogate written as its escape (`\\udc80`): safe to put in a JSON answer."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _problem(value, depth: int) -> str | None:
    if isinstance(value, str):
        problem = door_text_problem(value)
        return None if problem is None else f"a string in it {problem}" if depth > 1 else problem
    if isinstance(value, (list, dict)):
        if depth >= MAX_JSON_DEPTH:
            return f"nests JSON more than {MAX_JSON_DEPTH} deep"
        for item in (value.items() if isinstance(value, dict) else value):
            for v in (item if isinstance(value, dict) else (item,)):
                problem = _problem(v, depth + 1)
                if problem is not None:
                    return problem
    return None
