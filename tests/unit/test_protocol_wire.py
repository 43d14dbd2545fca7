"""Request fields that cross to the engine core as msgpack must fit its integers."""

from __future__ import annotations

import pytest

from slipstream.agent.server.wire_values import check_wire_integers


@pytest.mark.parametrize("value", [
    {"transfer_id": "t", "blocks": [1, 2, 2**63 - 1], "n": -2**63, "ok": True},
    {"u": 2**64 - 1}, [], {}, "text", 1.5e300,
])
def test_values_msgpack_can_carry_pass(value):
    check_wire_integers(value)


@pytest.mark.parametrize("value, where", [
    ({"a": 2**64}, "at a"),
    ({"a": {"b": [0, -2**63 - 1]}}, "at a.b[1]"),
    ([[10**30]], "at [0][0]"),
    (10**30, "is outside"),
])
def test_an_integer_past_64_bits_is_named(value, where):
    with pytest.raises(ValueError, match="outside the 64-bit range") as error:
        check_wire_integers(value)
    assert where in str(error.value)


def test_a_deep_value_is_walked_without_recursion():
    deep: object = 2**70
    for _ in range(50_000):
        deep = {"x": [deep]}
    with pytest.raises(ValueError, match="outside the 64-bit range"):
        check_wire_integers(deep)
