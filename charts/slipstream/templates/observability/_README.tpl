{{- /*
Observability objects of the chart go in this folder: Grafana dashboards as ConfigMaps
(labelled for the Grafana sidecar), the PrometheusRule with SLO burn-rate alerts, and the
ServiceMonitor for the agents and the operator. Files starting with "_" are not rendered.
*/ -}}
