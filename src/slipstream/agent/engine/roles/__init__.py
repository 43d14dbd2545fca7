"""An instance's role in prefill/decode disaggregation, as the engine sees it: one hook
object (``Role``, base.py) that ``LLMEngine`` calls at fixed points of a request's life.

    base.py       the ``Role`` hooks, the mixed role (no-ops), ``make_role``
    disagg.py     the prefill and decode roles (``DisaggRole``)
    transfers.py  what they own: the KV transport, the side channel (``Disaggregation``)
    exports.py    prefill side: KV held for decode instances
    imports.py    decode side: KV fetched from prefill instances, on a transfer thread

The mixed role imports nothing heavy; the others load zmq and the transfer engines.
"""
