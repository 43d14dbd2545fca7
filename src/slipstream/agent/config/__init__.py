"""The agent's one config (``ServeConfig``): pure data, no torch, so the operator renders the
file the agent reads with the same models.

    engine_sections.py   model, engine, parallelism, scheduler
    serving_sections.py  slo, pools, server, disaggregation, kvTiers
    serve_config.py      ServeConfig: the sections, layering, the file form, one-line errors
    setting.py           the field helper: help text and flag next to each setting
    sizes.py             "4GiB" / "0.5" as the settings spell sizes
"""
