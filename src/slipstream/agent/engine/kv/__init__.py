"""The KV cache's memory: how much the device holds, the host and disk tiers below it,
and the transfer of blocks between instances (P/D)."""
