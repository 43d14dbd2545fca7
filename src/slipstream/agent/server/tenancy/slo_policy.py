"""What SLO a tenant's request is scheduled by: a class it names, or its default, loosened
at will but never tightened past the tenant's tightest class.

    body "slo": {"class": "batch"} | {"ttft_s": 5} | {"class": "batch", "ttft_s": 60} | absent
        --resolve_slo(tenant, requested)--> ResolvedSlo (what LARS sees) + what was clamped

Why clamp rather than refuse: a client that sets one SLO for every request (an SDK default)
keeps working when it lands on a tenant with looser classes; it is scheduled at the tightest
objective its tenant holds, and the response header ``x-slipstream-slo-clamped`` says which
field was raised to what. A forged ``ttft_s: 0.001`` thus buys exactly what the tenant's own
tightest class buys, nothing more. An unknown class name is a 400: that is a client bug, not
an attempt to go faster.
"""

from __future__ import annotations

from dataclasses import dataclass

from slipstream.contracts.errors import bad_request
from slipstream.agent.server.tenancy.config import Tenant

CLAMPED_HEADER = "x-slipstream-slo-clamped"
CLASS_HEADER = "x-slipstream-slo-class"


@dataclass(frozen=True)
class RequestedSlo:
    """A request's ``slo`` object as sent (agent: the validated SloSpec; router: the JSON)."""

    class_name: str | None = None
    ttft_s: float | None = None
    tpot_ms: float | None = None


@dataclass(frozen=True)
class ResolvedSlo:
    class_name: str
    ttft_s: float
    tpot_ms: float | None  # None: the instance's default TPOT applies
    clamped: tuple[str, ...] = ()  # "ttft_s=0.5": fields raised to the tenant's floor

    def as_body(self) -> dict[str, float]:
        """The ``slo`` object the router forwards: explicit, already within the floor."""
        body = {"ttft_s": self.ttft_s}
        if self.tpot_ms is not None:
            body["tpot_ms"] = self.tpot_ms
        return body


def resolve_slo(tenant: Tenant, requested: RequestedSlo | None) -> ResolvedSlo:
    requested = requested or RequestedSlo()
    class_name = requested.class_name or tenant.default_slo_class
    base = tenant.slo_classes.get(class_name)
    if base is None:
        raise bad_request(f"slo.class: {class_name!r} is not an SLO class of this tenant; it "
                          f"has {', '.join(sorted(tenant.slo_classes))}", param="slo.class")
    clamped: list[str] = []
    ttft_s, tpot_ms = base.ttft_s, base.tpot_ms
    if requested.ttft_s is not None:
        floor = tenant.tightest_ttft_s
        ttft_s = max(requested.ttft_s, floor)
        if requested.ttft_s < floor:
            clamped.append(f"ttft_s={floor:g}")
    if requested.tpot_ms is not None:
        tpot_floor = tenant.tightest_tpot_ms
        if tpot_floor is None:
            clamped.append("tpot_ms=default")  # no class of this tenant sets one
        else:
            tpot_ms = max(requested.tpot_ms, tpot_floor)
            if requested.tpot_ms < tpot_floor:
                clamped.append(f"tpot_ms={tpot_floor:g}")
    return ResolvedSlo(class_name, ttft_s, tpot_ms, tuple(clamped))
