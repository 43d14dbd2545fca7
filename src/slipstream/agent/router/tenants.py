"""The router's side of tenancy: what a request becomes once its key's tenant is known.

    gate (server/tenancy/gate.py): key -> Caller, or 401/403/429 before the body is read
    Router.route --scoped_body(caller, body)--> the body the agents get:
        app_id = "<tenant>/<sub-application>" (403 for another tenant's name)
        slo    = the objective the tenant permits, explicit (clamped to its tightest class)
    --scoped_request(caller, routed, body)--> the fair queue keys on the tenant, by its weight;
        tokens per minute are charged (429)

Rewriting the body means an agent behind the router schedules by the permitted SLO and the
tenant even when it runs without a tenants file; with one, it checks the same key again and
reaches the same answer (an explicit SLO already within the floor is kept as it is).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from slipstream.agent.router.classify import RoutedRequest
from slipstream.agent.server.tenancy.identity import Caller
from slipstream.agent.server.tenancy.slo_policy import RequestedSlo


def scoped_body(caller: Caller, body: dict[str, Any]) -> bytes | None:
    """The body to forward (JSON), or None to forward the client's bytes unchanged (an
    ``app_id`` or ``slo`` of the wrong shape: the agent answers it with its precise 400)."""
    app_id = body.get("app_id")
    if app_id is not None and not isinstance(app_id, str):
        return None
    application = caller.application(app_id)
    requested = _requested_slo(body.get("slo"))
    if requested is None:
        return None
    resolved = caller.resolve_slo(requested)
    scoped = {**body, "app_id": f"{caller.fair_queue_id}/{application}",
              "slo": resolved.as_body()}
    return json.dumps(scoped).encode()


def scoped_request(caller: Caller, routed: RoutedRequest) -> RoutedRequest:
    """Charge the request's tokens (prompt, plus max_tokens when it gives one: the agent,
    which knows the context length, charges its own bound again) and key it on the tenant."""
    caller.charge_tokens(routed.prompt_tokens + (routed.max_tokens or 0))
    return dataclasses.replace(routed, app_id=caller.fair_queue_id, share_weight=caller.weight)


def _requested_slo(slo: Any) -> RequestedSlo | None:
    """The client's ``slo`` as a RequestedSlo; an empty one when absent; None when it is not
    a well-formed object."""
    if slo is None:
        return RequestedSlo()
    if not isinstance(slo, dict) or set(slo) - {"class", "ttft_s", "tpot_ms"}:
        return None
    class_name = slo.get("class")
    numbers = [slo.get("ttft_s"), slo.get("tpot_ms")]
    if class_name is not None and not isinstance(class_name, str):
        return None
    if any(value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not value > 0) for value in numbers):
        return None
    ttft_s, tpot_ms = (None if value is None else float(value) for value in numbers)
    return RequestedSlo(class_name, ttft_s, tpot_ms)
