"""kopf registration: every ``@kopf.on.*`` function is a few lines that delegate.

    ServingReplica create/update/resume, timer --> handle_reconcile.reconcile
    agent pod changed (label slipstream.dev/replica) --> reconcile its owner
    daemon per ServingReplica --> handle_rebalance.run (pool rebalancer)
    daemon per ServingReplica --> handle_autoscale.run (autoscaler, drains)

Failures reach kopf through ``retry``: transient API errors as TemporaryError (every
trigger), a spec that cannot be placed as PermanentError (the spec-change triggers only; the
timer keeps reconciling quietly, in case nodes are added).

Importing this module registers the handlers with kopf's default registry; ``cli.py`` imports
it, builds the settings and the API client (passed to handlers as ``memo.kube``) and runs kopf.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import kopf

from slipstream.crds.servingreplica import GROUP, PLURAL, VERSION
from slipstream.operator.control_credentials import ControlCredentials
from slipstream.operator.kube import Kube
from slipstream.operator import (
    handle_autoscale, handle_rebalance, handle_reconcile, naming, retry)

RESOURCE = (GROUP, VERSION, PLURAL)
# A safety net under the event-driven triggers: placement retries, missed pod events.
RESYNC_INTERVAL_S = 15.0


def post_event(body: dict, event_type: str, reason: str, message: str) -> None:
    kopf.event(body, type=event_type, reason=reason, message=message)


def adopt(child: dict, owner: dict) -> None:
    kopf.adopt(child, owner=kopf.Body(cast(kopf.RawBody, owner)))  # the API server's JSON


@kopf.on.resume(*RESOURCE)
@kopf.on.create(*RESOURCE)
@kopf.on.update(*RESOURCE)
def on_replica_changed(namespace: str | None, name: str, memo: kopf.Memo, **_: Any) -> None:
    result = reconcile(memo.kube, namespaced(namespace), name, _control(memo))
    retry.raise_if_unplaceable(result.placement_failure if result else None)


@kopf.timer(*RESOURCE, interval=RESYNC_INTERVAL_S, idle=RESYNC_INTERVAL_S / 3)
def resync(namespace: str | None, name: str, memo: kopf.Memo, **_: Any) -> None:
    reconcile(memo.kube, namespaced(namespace), name, _control(memo))


@kopf.on.event("", "v1", "pods", labels={naming.REPLICA_LABEL: kopf.PRESENT})
def on_agent_pod_event(type: str | None, body: kopf.Body, memo: kopf.Memo,  # noqa: A002
                       **_: Any) -> None:
    owner = handle_reconcile.owner_of(type, dict(body))
    if owner is not None:
        reconcile(memo.kube, *owner, _control(memo))


def reconcile(kube: Kube, namespace: str, name: str,
              control: ControlCredentials = ControlCredentials()
              ) -> handle_reconcile.Reconciled | None:
    with retry.temporary_api_errors(f"reconcile {namespace}/{name}"):
        return handle_reconcile.reconcile(kube, namespace, name, adopt=adopt, event=post_event,
                                          control=control)


@kopf.daemon(*RESOURCE, id="rebalancer", cancellation_timeout=5.0)
async def rebalancer(namespace: str | None, name: str, stopped: kopf.DaemonStopped,
                     memo: kopf.Memo, logger: logging.Logger | logging.LoggerAdapter,
                     **_: Any) -> None:
    namespace = namespaced(namespace)
    await handle_rebalance.run(memo.kube, namespace, name, stopped, event=post_event,
                               logger=logger, control_token=_control(memo).token(namespace, name))


@kopf.daemon(*RESOURCE, id="autoscaler", cancellation_timeout=5.0)
async def autoscaler(namespace: str | None, name: str, stopped: kopf.DaemonStopped,
                     memo: kopf.Memo, logger: logging.Logger | logging.LoggerAdapter,
                     **_: Any) -> None:
    kube, control = memo.kube, _control(memo)
    namespace = namespaced(namespace)
    await handle_autoscale.run(kube, namespace, name, stopped, event=post_event,
                               reconcile=lambda ns, n: reconcile(kube, ns, n, control),
                               logger=logger, control_token=control.token(namespace, name))


def _control(memo: kopf.Memo) -> ControlCredentials:
    """The agents' control credentials (cli.py puts them in the memo; tests may not)."""
    control = getattr(memo, "control", None)
    return control if isinstance(control, ControlCredentials) else ControlCredentials()


def namespaced(namespace: str | None) -> str:
    """kopf's handler types allow cluster-scoped objects; a ServingReplica never is one."""
    if namespace is None:
        raise kopf.PermanentError("a ServingReplica must have a namespace")
    return namespace
