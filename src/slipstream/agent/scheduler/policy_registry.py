"""Policy names to classes; the one place a configured name becomes a policy object."""

from __future__ import annotations

from slipstream.agent.scheduler.justitia import JustitiaPolicy
from slipstream.agent.scheduler.policies import (
    EdfPolicy,
    FcfsPolicy,
    LarsClassicPolicy,
    LarsPolicy,
    LrsPolicy,
    PolicyContext,
    SchedulingPolicy,
    SrptPolicy,
)

POLICIES: dict[str, type[SchedulingPolicy]] = {
    cls.name: cls
    for cls in (FcfsPolicy, EdfPolicy, LrsPolicy, LarsPolicy, LarsClassicPolicy, SrptPolicy,
                JustitiaPolicy)
}


def make_policy(name: str, context: PolicyContext) -> SchedulingPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose from {sorted(POLICIES)}")
    return POLICIES[name](context)
