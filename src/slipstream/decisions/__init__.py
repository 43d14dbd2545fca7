"""Pure decisions that both the operator and the simulator make, so that a simulated study
measures the code that runs in the cluster.

    pools.decide(): PLA-Serve's short/long pool rebalancer (Algorithm 2)
    autoscale.decide_scale(): the SLO autoscaler's instance count (and which to drain)

No I/O, no Kubernetes client, no torch: inputs are plain signals and the ServingReplica's own
settings (``slipstream.crds``); outputs are frozen decision records.
"""
