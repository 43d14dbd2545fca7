"""Length-aware pool router with application-level fairness (``slipstream router``).

No torch here: the router needs only the model's tokenizer and an HTTP stack.

    config.py          RouterConfig, label keys shared with the operator
    classify.py        prompt tokens (model tokenizer, chat template) -> short/long class
    instances.py       InstanceTable: pool membership, per-instance predicted backlog
    pod_discovery.py   pods (list + watch, label selector) -> InstanceTable
    stats_poller.py    agents' /metrics -> load reports
    fair_queue.py      Justitia virtual finish time per app_id (scheduler/justitia.py's clock)
    dispatcher.py      least predicted backlog; the fair queue when every candidate is full
    proxy.py           forwarding, retry before the first token, SSE passthrough
    metrics.py         slipstream_router_* (names in server/metric_names.py)
    app.py, cli.py     the FastAPI app and the `slipstream router` command
"""
