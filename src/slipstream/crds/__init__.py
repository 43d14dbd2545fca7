"""The ServingReplica API: pydantic models (the source of truth) and the generated CRD YAML."""
