"""Tensor, stream-pipeline and KV-cache parallelism: process groups and the controller/worker transport."""
