"""Which reconcile failures kopf retries soon (TemporaryError), which it stops on
(PermanentError), and which it sees as they are."""

from __future__ import annotations

import kopf
import pytest
import urllib3
from kubernetes import client
from kubernetes.client.rest import ApiException

from slipstream.agent.parallel.launch import free_port
from slipstream.operator import registration, retry
from slipstream.operator.kube import Kube
from slipstream.operator.placement import PlacementFailure


def api_error(status: int, headers: dict[str, str] | None = None) -> ApiException:
    error = ApiException(status=status, reason="x")
    error.headers = headers
    return error


@pytest.mark.parametrize("error, delay", [
    (api_error(409), retry.CONFLICT_RETRY_S),
    (api_error(429, {"Retry-After": "7"}), 7.0),
    (api_error(503), retry.BUSY_RETRY_S),
    (urllib3.exceptions.MaxRetryError(None, "/", "refused"), retry.BUSY_RETRY_S),
    (api_error(403), None),
    (api_error(404), None),
    (api_error(422), None),
    (KeyError("spec"), None),
])
def test_only_transient_failures_are_retried(error, delay):
    assert retry.transient_delay_s(error) == delay


def test_an_unreachable_api_server_is_a_temporary_error():
    configuration = client.Configuration()
    configuration.host = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    configuration.retries = 0
    kube = Kube(client.ApiClient(configuration))
    with pytest.raises(kopf.TemporaryError) as raised:
        registration.on_replica_changed(namespace="ns", name="chat", memo=kopf.Memo(kube=kube))
    assert raised.value.delay == retry.BUSY_RETRY_S
    assert "reconcile ns/chat" in str(raised.value)


def test_a_forbidden_request_is_not_retried_as_temporary():
    with pytest.raises(ApiException):
        with retry.temporary_api_errors("reconcile"):
            raise api_error(403)


def test_an_unplaceable_spec_stops_kopf_but_a_shortage_does_not():
    retry.raise_if_unplaceable(None)
    retry.raise_if_unplaceable(PlacementFailure("InsufficientGPUs", "busy", permanent=False))
    with pytest.raises(kopf.PermanentError, match="NoEligibleNodes: no node"):
        retry.raise_if_unplaceable(PlacementFailure("NoEligibleNodes", "no node",
                                                    permanent=True))
