"""The tenants file: one YAML document, validated once when it is (re)loaded.

    --tenants FILE (a mounted Secret in a cluster) --load_tenants()--> TenantsFile
        --> registry.Tenants (lookups, limits) on the agent and on the router

Example (docs/tenancy.md has the whole story)::

    tenants:
      - name: search                 # the fair queue's tenant and the metrics label
        weight: 2                    # fair share: twice a weight-1 tenant's
        api_keys:
          - {id: search-prod, sha256: 9f86d0...}        # `slipstream tenants new-key`
          - {id: laptop, sha256: 60303a..., revoked: true}
        slo_classes:
          interactive: {ttft_s: 0.5, tpot_ms: 50}
          batch: {ttft_s: 30}
        default_slo_class: interactive
        limits: {requests_per_minute: 600, tokens_per_minute: 200000, max_in_flight: 32}
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from slipstream.agent.server.tenancy.keys import DIGEST_HEX_CHARS

# DNS-label-like: fits a Prometheus label, a Kubernetes name and a log line unescaped.
TENANT_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
SLO_CLASS_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
# Tenants past this many in the file share the metrics label "other": a file written by a
# program cannot grow a metric's series without bound.
MAX_LABELLED_TENANTS = 100


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SloClass(_Strict):
    """A named objective: time to first token, and optionally time per output token."""

    ttft_s: float = Field(gt=0, le=86_400)
    tpot_ms: float | None = Field(default=None, gt=0, le=600_000)


class Limits(_Strict):
    """Per tenant, summed over its keys; ``None`` means no limit of that kind."""

    requests_per_minute: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)
    max_in_flight: int | None = Field(default=None, ge=1)


class ApiKey(_Strict):
    id: str = Field(min_length=1, max_length=64)  # for logs; never the key itself
    sha256: str = Field(min_length=DIGEST_HEX_CHARS, max_length=DIGEST_HEX_CHARS,
                        pattern=r"^[0-9a-f]+$")
    revoked: bool = False


class Tenant(_Strict):
    name: str
    weight: float = Field(default=1.0, gt=0, le=1000)
    api_keys: tuple[ApiKey, ...] = Field(min_length=1)
    slo_classes: dict[str, SloClass] = Field(min_length=1)
    default_slo_class: str
    limits: Limits = Field(default_factory=Limits)
    suspended: bool = False  # keys still authenticate; every request gets a 403

    @model_validator(mode="after")
    def _consistent(self) -> Tenant:
        if not TENANT_NAME.match(self.name):
            raise ValueError(f"tenant name {self.name!r} must be a DNS label: lower-case "
                             "letters, digits and '-', at most 63 characters")
        for class_name in self.slo_classes:
            if not SLO_CLASS_NAME.match(class_name):
                raise ValueError(f"tenant {self.name}: SLO class name {class_name!r} must be "
                                 "lower-case letters, digits, '_' or '-'")
        if self.default_slo_class not in self.slo_classes:
            raise ValueError(f"tenant {self.name}: default_slo_class "
                             f"{self.default_slo_class!r} is not one of its slo_classes")
        return self

    @property
    def tightest_ttft_s(self) -> float:
        return min(slo.ttft_s for slo in self.slo_classes.values())

    @property
    def tightest_tpot_ms(self) -> float | None:
        declared = [slo.tpot_ms for slo in self.slo_classes.values() if slo.tpot_ms is not None]
        return min(declared) if declared else None


class TenantsFile(_Strict):
    tenants: tuple[Tenant, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> TenantsFile:
        names = [tenant.name for tenant in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError("tenant names must be unique")
        digests = [key.sha256 for tenant in self.tenants for key in tenant.api_keys]
        if len(set(digests)) != len(digests):
            raise ValueError("an API key digest appears twice; one key belongs to one tenant")
        return self


def parse_tenants(text: str, source: str = "tenants file") -> TenantsFile:
    """Validate a tenants document; ValueError names what is wrong (never a key digest)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ValueError(f"{source}: not YAML ({error})") from None
    try:
        return TenantsFile.model_validate(data)
    except ValidationError as error:
        first = error.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(part) for part in first["loc"]) or "(top level)"
        message = first["msg"].removeprefix("Value error, ")
        raise ValueError(f"{source}: {where}: {message}") from None


def load_tenants(path: Path) -> TenantsFile:
    return parse_tenants(path.read_text(), str(path))


def tenancy_line(path: Path | None) -> str:
    """The start-up line's word on who may call (serve and router print it); loading the
    file here also stops a start with one that does not validate (ValueError, OSError)."""
    if path is None:
        return ("tenants: none: the API is open to any caller, no API keys "
                "(--tenants FILE requires them; docs/tenancy.md)")
    tenants = load_tenants(path).tenants
    keys = sum(len(tenant.api_keys) for tenant in tenants)
    return (f"tenants: {len(tenants)} tenants, {keys} API keys from {path}: every /v1 request "
            "needs 'Authorization: Bearer KEY'")
