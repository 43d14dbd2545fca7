"""What a request value must be to cross from the API process to the engine core, which
carries commands as msgpack (core_messages.py): checked in the request models, so a value
the wire cannot carry is a 400, not a failure deep in the send."""

from __future__ import annotations

from typing import Any

INT64_MIN, UINT64_MAX = -2**63, 2**64 - 1


def check_wire_integers(value: Any) -> None:
    """ValueError if a JSON value holds an integer msgpack cannot carry (outside -2**63 to
    2**64 - 1), naming where. Walks with a stack, not recursion: a deeply nested body must
    not become a RecursionError."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, bool):
            continue
        if isinstance(item, int) and not INT64_MIN <= item <= UINT64_MAX:
            where = f" at {path}" if path else ""
            raise ValueError(f"the integer {item}{where} is outside the 64-bit range")
        if isinstance(item, dict):
            stack.extend((f"{path}.{key}" if path else str(key), child)
                         for key, child in item.items())
        elif isinstance(item, list):
            stack.extend((f"{path}[{index}]", child) for index, child in enumerate(item))
