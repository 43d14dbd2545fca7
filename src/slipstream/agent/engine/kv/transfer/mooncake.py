"""Mooncake Transfer Engine behind ``KVTransport`` (kvcache-ai/Mooncake, Apache-2.0).

The engine is imported lazily, only for ``--kv-transport mooncake``. Wheels on PyPI:

- ``mooncake-transfer-engine-non-cuda`` for CPU hosts (the TCP transport; what CI runs),
- ``mooncake-transfer-engine`` for CUDA hosts (TCP, or RDMA with ``protocol="rdma"``).

Both provide the ``mooncake`` module; install one of them. Each links ``libibverbs.so.1``
even when only TCP is used, so the host also needs the rdma-core user-space library
(Debian/Ubuntu: ``apt-get install libibverbs1``; ``make transfer-engine-libs`` does it).

Metadata is exchanged peer to peer (``P2PHANDSHAKE``): no etcd or metadata server. Every KV
region (one layer's K or V tensor) is registered once at start; a transfer reads, per
block, one segment of ``layout.block_bytes`` from each region of the holder into the same
region here, as one batch, with runs of consecutive blocks merged into one segment.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import torch

from slipstream.agent.engine.kv.transfer.layout import KVLayout
from slipstream.agent.engine.kv.transfer.transport import KVHandle, KVTransferError, KVTransport

log = logging.getLogger(__name__)

INSTALL_HINT = ("install the Mooncake Transfer Engine (pip install "
                "mooncake-transfer-engine-non-cuda on CPU hosts, mooncake-transfer-engine on "
                "CUDA hosts) and libibverbs1 (apt-get install libibverbs1), or use "
                "--kv-transport zmq")


def load_transfer_engine() -> Any:
    """The ``mooncake.engine.TransferEngine`` class, or a RuntimeError that says what to
    install (the import fails both without the wheel and without libibverbs)."""
    # glog writes every INFO line to stderr unless told otherwise; keep warnings and errors.
    os.environ.setdefault("GLOG_minloglevel", "1")
    try:
        from mooncake.engine import TransferEngine
    except ImportError as error:
        raise RuntimeError(f"the Mooncake Transfer Engine cannot be loaded ({error}); "
                           f"{INSTALL_HINT}") from error
    return TransferEngine


def _location(tensor: torch.Tensor) -> str:
    if tensor.device.type == "cuda":
        return f"cuda:{tensor.device.index or 0}"
    return "cpu:0"


def merge_runs(remote: list[int], local: list[int]) -> list[tuple[int, int, int]]:
    """``(remote_start, local_start, count)`` runs where both block lists advance by one."""
    runs: list[tuple[int, int, int]] = []
    for r, l in zip(remote, local):
        if runs and runs[-1][0] + runs[-1][2] == r and runs[-1][1] + runs[-1][2] == l:
            start_r, start_l, count = runs[-1]
            runs[-1] = (start_r, start_l, count + 1)
        else:
            runs.append((r, l, 1))
    return runs


class MooncakeTransport(KVTransport):
    name = "mooncake"

    def __init__(self, layout: KVLayout, regions: list[torch.Tensor], host: str,
                 protocol: str = "tcp", device_name: str = "") -> None:
        super().__init__(layout, regions)
        engine_class = load_transfer_engine()
        self._engine = engine_class()
        result = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        if result != 0:
            raise RuntimeError(f"the Mooncake Transfer Engine did not start on {host} over "
                               f"{protocol} (error {result})")
        self._endpoint = f"{host}:{self._engine.get_rpc_port()}"
        self._registered: list[int] = []
        for region in regions:
            address, size = region.data_ptr(), region.numel() * region.element_size()
            if self._engine.register_memory(address, size, _location(region)) != 0:
                self.close()
                raise RuntimeError(f"the Mooncake Transfer Engine could not register "
                                   f"{size} bytes of KV cache")
            self._registered.append(address)
        # The Python binding is not documented as thread-safe; one transfer at a time.
        self._lock = threading.Lock()
        log.info("Mooncake transfer engine (%s) at %s, %d KV regions registered", protocol,
                 self._endpoint, len(regions))

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def read_blocks(self, handle: KVHandle, remote_block_ids: list[int],
                    local_block_ids: list[int]) -> None:
        self.check_compatible(handle)
        if len(handle.region_addrs) != len(self.regions):
            raise KVTransferError(f"the handle names {len(handle.region_addrs)} KV regions; "
                                  f"this instance has {len(self.regions)}")
        block_bytes = self.layout.block_bytes
        local: list[int] = []
        remote: list[int] = []
        lengths: list[int] = []
        for remote_start, local_start, count in merge_runs(remote_block_ids, local_block_ids):
            for region, remote_base in zip(self.regions, handle.region_addrs):
                local.append(region.data_ptr() + local_start * block_bytes)
                remote.append(remote_base + remote_start * block_bytes)
                lengths.append(count * block_bytes)
        with self._lock:
            result = self._engine.batch_transfer_sync_read(handle.endpoint, local, remote,
                                                           lengths)
        if result != 0:
            raise KVTransferError(f"Mooncake read of {len(remote_block_ids)} blocks from "
                                  f"{handle.endpoint} failed (error {result})")

    def close(self) -> None:
        for address in self._registered:
            self._engine.unregister_memory(address)
        self._registered.clear()
