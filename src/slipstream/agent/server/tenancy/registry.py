"""The tenants of one process: who a key belongs to, and each tenant's live limits.

    --tenants FILE --Tenants(path)--> digest -> (tenant, key) index, one TenantLimiter per
        tenant (kept across reloads, so a reload never resets anyone's usage)
    gate.py --identify(key)--> Caller, or the 401/403 to answer

The file is looked at again at most once per ``check_interval_s`` and reloaded when it
changed (a Kubernetes Secret update swaps the mounted file): revoking or adding a key takes
effect within seconds, without a restart. A file that no longer validates is logged and the
last good one stays in force.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from slipstream.contracts.errors import APIError
from slipstream.agent.server.tenancy.config import (
    MAX_LABELLED_TENANTS, ApiKey, Tenant, TenantsFile, load_tenants)
from slipstream.agent.server.tenancy.identity import FORBIDDEN_TYPE, Caller
from slipstream.agent.server.tenancy.keys import key_digest
from slipstream.agent.server.tenancy.limits import TenantLimiter

log = logging.getLogger(__name__)
INVALID_KEY = "invalid_api_key"
OTHER_LABEL = "other"  # tenants past MAX_LABELLED_TENANTS in the file
NONE_LABEL = "none"  # requests refused before a tenant was known
OPEN_LABEL = "open"  # every request, when there is no tenants file


def unauthorized(message: str, *, missing: bool = False) -> APIError:
    """OpenAI's 401: ``invalid_request_error``, code ``invalid_api_key`` (none if missing)."""
    return APIError(401, message, code=None if missing else INVALID_KEY,
                    error_type="invalid_request_error",
                    headers={"WWW-Authenticate": 'Bearer realm="slipstream"'})


class Tenants:
    def __init__(self, path: Path, clock: Callable[[], float] = time.monotonic,
                 check_interval_s: float = 1.0) -> None:
        self.path = path
        self._clock = clock
        self._check_interval_s = check_interval_s
        self._lock = threading.Lock()
        self._limiters: dict[str, TenantLimiter] = {}
        self._stamp = self._file_stamp()
        self._checked_s = clock()
        self._install(load_tenants(path))  # a bad file at start-up is the caller's ValueError

    def _install(self, tenants_file: TenantsFile) -> None:
        by_digest: dict[str, tuple[Tenant, ApiKey]] = {}
        for tenant in tenants_file.tenants:
            for key in tenant.api_keys:
                by_digest[key.sha256] = (tenant, key)
            limiter = self._limiters.get(tenant.name)
            if limiter is None:
                self._limiters[tenant.name] = TenantLimiter(tenant.limits, self._clock)
            else:
                limiter.update(tenant.limits)
        self.file = tenants_file
        self._by_digest = by_digest
        self._names = frozenset(tenant.name for tenant in tenants_file.tenants)
        self.labels = {tenant.name: tenant.name if index < MAX_LABELLED_TENANTS else OTHER_LABEL
                       for index, tenant in enumerate(tenants_file.tenants)}

    def metric_labels(self) -> list[str]:
        """Every tenant label this file can produce, for series that exist from the start."""
        return sorted({*self.labels.values(), NONE_LABEL})

    def describe(self) -> str:
        keys = sum(len(tenant.api_keys) for tenant in self.file.tenants)
        return f"{len(self.file.tenants)} tenants, {keys} API keys from {self.path}"

    def identify(self, key: str) -> Caller:
        """The caller a presented key belongs to; raises the 401 or 403 to answer."""
        self._maybe_reload()
        entry = self._by_digest.get(key_digest(key))
        if entry is None:
            raise unauthorized("Incorrect API key provided.")
        tenant, api_key = entry
        if api_key.revoked:
            raise unauthorized("This API key was revoked.")
        if tenant.suspended:
            raise APIError(403, f"Tenant {tenant.name!r} is suspended.", code="tenant_suspended",
                           error_type=FORBIDDEN_TYPE)
        return Caller(tenant=tenant, key_id=api_key.id, limiter=self._limiters[tenant.name],
                      label=self.labels[tenant.name],
                      other_tenants=self._names - {tenant.name})

    def _maybe_reload(self) -> None:
        now_s = self._clock()
        if now_s - self._checked_s < self._check_interval_s:
            return
        with self._lock:
            self._checked_s = now_s
            stamp = self._file_stamp()
            if stamp == self._stamp:
                return
            self._stamp = stamp
            try:
                self._install(load_tenants(self.path))
            except (OSError, ValueError) as error:
                log.error("tenants file changed but cannot be used, keeping the last good "
                          "one: %s", error)
                return
        log.info("tenants file reloaded: %s", self.describe())

    def _file_stamp(self) -> tuple[int, int, int] | None:
        try:
            info = os.stat(self.path)
        except OSError:
            return None
        return info.st_ino, info.st_mtime_ns, info.st_size
