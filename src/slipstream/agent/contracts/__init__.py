"""The types that cross between the agent's parts: a request as the API hands it to the
engine (``EngineRequest``), its sampling settings, SLO and KV transfer.

Pure data with no imports beyond the standard library, so the scheduler (pure Python), the
engine, the server and both transports between them share one definition. msgspec carries
these dataclasses over ZeroMQ as they are.
"""
