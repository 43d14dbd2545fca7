"""The authenticated caller of one request, as the handlers see it.

    gate.py puts a Caller in the ASGI scope --caller_of(request)--> handlers:
        application(app_id)  -> the sub-application (403 for another tenant's name)
        resolve_slo(slo)     -> the objective LARS may see (slo_policy.py)
        charge_tokens(n)     -> tokens-per-minute (429)
        fair_queue_id/weight -> what Justitia's fair queue and the router's queue key on

With tenants on, the fair queue's tenant is always the key's tenant: a body ``app_id`` only
names a sub-application inside it, counted within the tenant's share. An ``app_id`` that
names another tenant (``other`` or ``other/x``) is refused with a 403, so a client learns at
once that it cannot take another tenant's share by claiming its name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slipstream.contracts.errors import APIError
from slipstream.agent.server.tenancy.config import Tenant
from slipstream.agent.server.tenancy.limits import TenantLimiter
from slipstream.agent.server.tenancy.slo_policy import RequestedSlo, ResolvedSlo, resolve_slo

CALLER_SCOPE_KEY = "slipstream.caller"
DEFAULT_APPLICATION = "default"
FORBIDDEN_TYPE = "request_forbidden"


@dataclass
class Caller:
    tenant: Tenant
    key_id: str
    limiter: TenantLimiter
    label: str  # the bounded metrics label (config.MAX_LABELLED_TENANTS)
    other_tenants: frozenset[str]
    slo: ResolvedSlo | None = field(default=None)  # set once resolved; its headers go out

    @property
    def fair_queue_id(self) -> str:
        return self.tenant.name

    @property
    def weight(self) -> float:
        return self.tenant.weight

    def application(self, app_id: str | None) -> str:
        """The sub-application a body ``app_id`` names inside this tenant."""
        if not app_id:
            return DEFAULT_APPLICATION
        owner, slash, rest = app_id.partition("/")
        if slash and owner != self.tenant.name:
            raise _forbidden(f"app_id {app_id!r} names tenant {owner!r}; this API key belongs "
                             f"to tenant {self.tenant.name!r}")
        if not slash and app_id in self.other_tenants:
            raise _forbidden(f"app_id {app_id!r} is another tenant's name; an app_id only "
                             "names an application inside the key's own tenant")
        return rest if slash else app_id

    def resolve_slo(self, requested: RequestedSlo | None) -> ResolvedSlo:
        self.slo = resolve_slo(self.tenant, requested)
        return self.slo

    def charge_tokens(self, amount: int) -> None:
        self.limiter.charge_tokens(amount)


def caller_of(scope: Any) -> Caller | None:
    """The request's Caller (``request.scope`` or an ASGI scope); None with tenants off."""
    caller = scope.get(CALLER_SCOPE_KEY)
    return caller if isinstance(caller, Caller) else None


def _forbidden(message: str) -> APIError:
    return APIError(403, message, code="tenant_mismatch", error_type=FORBIDDEN_TYPE,
                    param="app_id")
