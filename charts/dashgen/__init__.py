"""Grafana dashboards as code for the Slipstream chart.

    python -m dashgen            (run from charts/, with slipstream importable)
        -> charts/slipstream/dashboards/<uid>.json, shipped as ConfigMaps labelled
           grafana_dashboard: "1" by templates/dashboards.yaml

Queries are built from ``slipstream.contracts.metric_names``; tests check that every query
parses, names only exported metrics, and returns data from a live agent.
"""
