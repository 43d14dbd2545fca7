"""OpenAI-compatible HTTP API, control API and Prometheus metrics."""
