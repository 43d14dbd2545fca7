"""``slipstream operator``: run the ServingReplica operator (kopf) in this process.

    argv --> OperatorSettings + API client (memo.kube) --> kopf.run(registration's handlers)

Outside a cluster it uses $KUBECONFIG (or ~/.kube/config); in a pod, its service account.
"""

from __future__ import annotations

import argparse
import logging
import random
import warnings
from pathlib import Path

from slipstream.operator.naming import PREFIX


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", "-n", action="append", default=[], metavar="NAMESPACE",
                        help="watch only this namespace (repeatable); default: every namespace")
    parser.add_argument("--peering", default=None, metavar="NAME",
                        help="kopf peering object for leader election between operator "
                             "replicas (the chart creates it); without it the operator runs "
                             "standalone")
    parser.add_argument("--priority", type=int, default=None,
                        help="peering priority: the highest live one leads; default: random, "
                             "so that exactly one replica leads")
    parser.add_argument("--metrics-port", type=int, default=8080,
                        help="port of the operator's Prometheus /metrics; 0 turns it off")
    parser.add_argument("--health-port", type=int, default=8081,
                        help="port of kopf's liveness endpoint /healthz; 0 turns it off")
    parser.add_argument("--bind-address", default="0.0.0.0", metavar="ADDRESS",
                        help="address for the metrics and health endpoints (the chart passes "
                             "the pod IP)")
    parser.add_argument("--workers", type=int, default=16,
                        help="threads for the synchronous handlers")
    parser.add_argument("--control-master-key-file", type=Path, default=None, metavar="FILE",
                        help="the key each ServingReplica's control-port token is derived "
                             "from (the chart mounts it from a Secret): the operator writes "
                             "each replica a token Secret, its agents require the token and "
                             "the operator presents it; without it the control ports are open")
    parser.add_argument("--verbose", "-v", action="store_true", help="debug logging")


def build_settings(args: argparse.Namespace):
    import kopf

    settings = kopf.OperatorSettings()
    # Our own names on the objects, and no kopf bookkeeping in .status (the CRD's status
    # schema is ours alone).
    settings.persistence.finalizer = f"{PREFIX}/operator"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=PREFIX, key="last-handled-configuration")
    # Only warnings become Kubernetes Events; our own Events are posted explicitly.
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = "slipstream-operator"
    settings.execution.max_workers = args.workers
    return settings


def run(args: argparse.Namespace) -> int:
    import kopf
    import urllib3

    import slipstream.operator.registration  # noqa: F401 - registers the handlers
    from slipstream.operator import metrics
    from slipstream.operator.control_credentials import ControlCredentials
    from slipstream.operator.kube import Kube, load_client_config

    kopf.configure(verbose=args.verbose, log_prefix=True)  # root logging, object prefixes
    # A cluster reached without TLS verification (a dev kubeconfig) is worth one warning,
    # not one per API call.
    warnings.filterwarnings("once", category=urllib3.exceptions.InsecureRequestWarning)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # one line per probe
    load_client_config()
    if args.metrics_port:
        metrics.serve(args.metrics_port, args.bind_address)
    host = f"[{args.bind_address}]" if ":" in args.bind_address else args.bind_address
    liveness = f"http://{host}:{args.health_port}/healthz" if args.health_port else None
    # Naming a peering makes it mandatory in kopf: without one, run standalone instead.
    peering = {"standalone": True} if args.peering is None else {
        "peering_name": args.peering,
        "priority": args.priority if args.priority is not None else random.randint(1, 2**31)}
    control = ControlCredentials.from_file(args.control_master_key_file)
    kopf.run(settings=build_settings(args), memo=kopf.Memo(kube=Kube(), control=control),
             namespaces=args.namespace, clusterwide=not args.namespace,
             liveness_endpoint=liveness, **peering)
    return 0
