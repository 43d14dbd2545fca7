"""Freeing a prefill instance's KV hold from the router when no decode leg will read it.

    DisaggChain: a chain attempt failed after the prefill instance opened a hold (the decode
        leg found no decode instance, or failed) --release_hold()--> POST
        <prefill instance>/v1/kv_transfer/release {"transfer_id"} --> the hold is freed now

Without this a hand-off whose decode leg never started kept its blocks on the prefill
instance until ``--kv-hold-timeout-seconds`` (120 s by default). The call is best effort and
idempotent: an unknown or already released transfer id is a no-op on the agent, and a
failure only logs (the hold timeout still frees the blocks).
"""

from __future__ import annotations

import logging

import httpx

log = logging.getLogger(__name__)
RELEASE_PATH = "/v1/kv_transfer/release"
RELEASE_TIMEOUT_S = 5.0


async def release_hold(client: httpx.AsyncClient, instance_url: str, transfer_id: str,
                       headers: dict[str, str]) -> bool:
    """Ask the prefill instance at ``instance_url`` to free ``transfer_id``; True when it
    said so. ``headers`` carry the client's credentials (an agent with tenants on wants
    them on every API call)."""
    try:
        answer = await client.post(f"{instance_url}{RELEASE_PATH}", timeout=RELEASE_TIMEOUT_S,
                                   json={"transfer_id": transfer_id},
                                   headers={key: value for key, value in headers.items()
                                            if key.lower() == "authorization"})
    except httpx.HTTPError as error:
        log.warning("could not release KV hold %s on %s (%s); its hold timeout frees it",
                    transfer_id, instance_url, type(error).__name__)
        return False
    if answer.status_code != 200:
        log.warning("releasing KV hold %s on %s answered %d; its hold timeout frees it",
                    transfer_id, instance_url, answer.status_code)
        return False
    return True
