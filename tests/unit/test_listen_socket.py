"""The agent's listening sockets say they are TCP, so asyncio turns Nagle off on every
connection it accepts from them: with proto 0 it did not, and each streamed event after the
response headers on a reused keep-alive connection waited ~40 ms for the client's delayed
ACK (found while measuring docs/tenancy.md's flood benchmark)."""

from __future__ import annotations

import asyncio
import socket

from slipstream.agent.server.api_processes import listening_socket
from slipstream.agent.server.drain import reserve_port


def accepted_nodelay(listener: socket.socket) -> int:
    async def run() -> int:
        seen: list[int] = []

        def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.append(writer.get_extra_info("socket").getsockopt(
                socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(connected, sock=listener)
        port = listener.getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        while not seen:
            await asyncio.sleep(0.01)
        writer.close()
        server.close()
        await server.wait_closed()
        return seen[0]
    return asyncio.run(run())


def test_accepted_connections_have_nagle_off():
    for listener in (reserve_port("127.0.0.1", 0), listening_socket("127.0.0.1", 0)):
        assert listener.proto == socket.IPPROTO_TCP
        assert accepted_nodelay(listener) == 1
