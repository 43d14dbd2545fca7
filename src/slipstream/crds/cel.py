"""CEL validation rules attached to the pydantic API models.

    crds/servingreplica.py (Field(json_schema_extra=rules(...))) -> crds/schema.py -> CRD YAML
    -> kube-apiserver evaluates them on every create/update

The rules live next to the fields they guard, as data, so the CRD YAML carries them and the
unit tests can evaluate the very same expressions. Every message names the field it is about:
a user who gets a rejection should know what to edit without reading the schema.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Degrees are powers of two (CEL in Kubernetes has no bitwise operators, so list them).
POWERS_OF_TWO = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
POWER_OF_TWO_LIST = "[" + ", ".join(str(p) for p in POWERS_OF_TWO) + "]"


@dataclass(frozen=True)
class Rule:
    """One ``x-kubernetes-validations`` entry. Messages are static: the API server prices a
    ``messageExpression`` that builds strings (``string(self)``) as if the result could be
    megabytes long, and rejects the CRD for its cost."""

    rule: str
    message: str
    field_path: str = ""  # relative to the object the rule sits on, e.g. ".parallelism.tp"
    reason: str = "FieldValueInvalid"

    def to_schema(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"rule": self.rule, "message": self.message}
        if self.field_path:
            entry["fieldPath"] = self.field_path
        entry["reason"] = self.reason
        return entry


def rules(*entries: Rule) -> dict[str, Any]:
    """``json_schema_extra`` for a pydantic Field or model carrying these rules."""
    return {"x-kubernetes-validations": [entry.to_schema() for entry in entries]}


def power_of_two(path: str) -> Rule:
    return Rule(f"self in {POWER_OF_TWO_LIST}",
                f"{path} must be a power of two (1, 2, 4, ... {POWERS_OF_TWO[-1]})")


def positive(path: str, unit: str = "", *, number: bool = False) -> Rule:
    """``self > 0``; ``number`` for ``type: number`` fields, compared with a double literal."""
    zero = "0.0" if number else "0"
    suffix = f" ({unit})" if unit else ""
    return Rule(f"self > {zero}", f"{path} must be positive{suffix}")


def non_negative(path: str, *, number: bool = False) -> Rule:
    """``self >= 0``; ``number`` as for ``positive``."""
    return Rule(f"self >= {'0.0' if number else '0'}", f"{path} must not be negative")


def share(path: str) -> Rule:
    """A share of a whole, above 0 and at most 1."""
    return Rule("self > 0.0 && self <= 1.0", f"{path} must be within (0, 1]")


def one_of(path: str, allowed: tuple[str, ...]) -> Rule:
    listed = ", ".join(f"'{value}'" for value in allowed)
    return Rule(f"self in [{listed}]", f"{path} must be one of: {', '.join(allowed)}")
