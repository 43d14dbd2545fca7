"""Moving a request's KV blocks from a prefill instance to a decode instance.

    prefill instance                              decode instance
    ----------------                              ---------------
    KV tensors registered with the transport      KV tensors registered with the transport
    request prefilled, first token sampled
    blocks held under a transfer id  --handle-->  (the router carries the handle)
                                                  allocate blocks, pull them block by block
    side channel: "release <id>"     <----------  ack once every block has arrived
    blocks freed

The decode side pulls (reads) the blocks, as vLLM's NIXL connector does: the prefill
instance never needs to know where the request goes next, and a decode instance that dies
before acknowledging only costs the prefill side its blocks until the hold times out.

``transport.KVTransport`` is the interface; ``mooncake.MooncakeTransport`` (Mooncake
Transfer Engine, TCP or RDMA) is the real engine and ``zmq_transport.ZmqTransport`` the
fallback that needs nothing beyond pyzmq. ``side_channel`` is the small control channel
both use for acknowledgements.
"""
