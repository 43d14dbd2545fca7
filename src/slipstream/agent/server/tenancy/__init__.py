"""Tenants: who is calling, what they may ask for, and how much (issue 30, docs/tenancy.md).

    tenants YAML (--tenants FILE, a Secret in a cluster) --config.py--> TenantsFile
        --registry.py--> Tenants: key digest -> tenant, reloaded when the file changes
    HTTP request --gate.py (ASGI middleware, before the body is read)--> 401/403/429, or a
        Caller (identity.py) in the ASGI scope for the handlers
    handler: Caller.app_id / resolve_slo (slo_policy.py) / charge_tokens (limits.py)
        --> the fair queue sees the tenant and its weight, LARS a permitted SLO

The agent (``slipstream serve``) and the router (``slipstream router``) use the same code, so
a request is checked at both. Nothing here imports the engine or a web framework beyond
Starlette's ASGI types.
"""
