"""``slipstream router``: the length-aware pool router in front of serving instances.

    argv -> RouterConfig (+ the model's tokenizer) -> build_router_app() -> uvicorn

This is the one place the router reads environment variables: ``POD_IP`` (the address to bind
when ``--host`` is not given) and ``POD_NAMESPACE`` (the namespace to watch when
``--namespace`` is not given), both from the downward API in a cluster.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from slipstream.agent.router.config import (
    CONTROLLER_ROLE, DEFAULT_LONG_PREFILL_THRESHOLD_TOKENS, INSTANCE_QUEUE_ORDERS, POOLS,
    ROLE_LABEL, FairnessConfig, KubernetesDiscovery, RouterConfig, StaticBackend)
from slipstream.agent.server.config import (
    DEFAULT_HOST, DEFAULT_MAX_BODY_BYTES, DEFAULT_REQUEST_READ_TIMEOUT_S, LOG_LEVELS, bind_host)

EPILOG = """\
examples:
  # two local agents, one per pool, no Kubernetes
  slipstream router --model DIR --backend http://127.0.0.1:8001=short \\
                    --backend http://127.0.0.1:8002=long

  # in a cluster: follow the operator's agent pods and their slipstream.dev/pool labels
  slipstream router --model DIR --namespace serving \\
                    --selector slipstream.dev/replica=chat,slipstream.dev/role=controller
"""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default == []:
            return action.help
        return super()._get_help_string(action)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = _HelpFormatter
    parser.epilog = EPILOG
    parser.add_argument("--model", type=Path, default=None, metavar="DIR",
                        help="model directory with tokenizer.json (and tokenizer_config.json "
                             "for chat); prompts are counted with it. Without it, length is "
                             "estimated at 4 characters per token")

    backends = parser.add_argument_group("backends (one of)")
    backends.add_argument("--backend", action="append", default=[], metavar="URL=POOL",
                          help=f"a serving instance and its pool ({', '.join(POOLS)}); repeat "
                               "for each. Static: no Kubernetes needed")
    backends.add_argument("--namespace", default=None,
                          help="watch agent pods in this namespace (default with no --backend: "
                               "$POD_NAMESPACE). Relabelling a pod's slipstream.dev/pool moves "
                               "it between pools at once")
    backends.add_argument("--selector", default=f"{ROLE_LABEL}={CONTROLLER_ROLE}",
                          help="label selector of the agent pods to route to")
    backends.add_argument("--kubeconfig", default=None,
                          help="kubeconfig file; default: in-cluster, else $KUBECONFIG")

    routing = parser.add_argument_group("routing")
    routing.add_argument("--long-prefill-threshold-tokens", type=int,
                         default=DEFAULT_LONG_PREFILL_THRESHOLD_TOKENS, metavar="TOKENS",
                         help="prompts this long or longer go to the long pool "
                              "(ServingReplica spec.pools.longPrefillThresholdTokens)")
    routing.add_argument("--max-in-flight-per-instance", type=int, default=64, metavar="N",
                         help="an instance with this many requests in flight is saturated; "
                              "when all are, requests wait in a fair queue per application")
    routing.add_argument("--max-backlog-tokens-per-instance", type=int, default=None,
                         metavar="TOKENS", help="also saturated at this predicted backlog")
    routing.add_argument("--prefix-block-tokens", type=int, default=64, metavar="TOKENS",
                         help="prefix-aware routing: the router remembers which instance it "
                              "sent each prompt block of this many tokens to, and counts the "
                              "prefill an instance's cache saves against its backlog; 0 routes "
                              "by backlog only")
    routing.add_argument("--prefix-affinity-weight", type=float, default=2.0, metavar="W",
                         help="backlog tokens that one prompt token cached on an instance is "
                              "worth when choosing it (higher keeps conversations home longer)")
    routing.add_argument("--instance-queue-order", choices=INSTANCE_QUEUE_ORDERS,
                         default="shorter-first",
                         help="how the agents order queued prefills, which decides how much of "
                              "an instance's backlog a new request waits behind: shorter-first "
                              "(the agents' LARS, SRPT: a queued prefill counts only up to the "
                              "new request's own uncached prompt) or fifo (agents running FCFS: "
                              "all of it)")
    routing.add_argument("--decode-weight-tokens", type=int, default=32, metavar="TOKENS",
                         help="prefill tokens a running decode counts as in the backlog")
    routing.add_argument("--stats-interval-seconds", type=float, default=1.0, metavar="S",
                         help="how often each agent's /metrics is read for its load")
    routing.add_argument("--max-attempts", type=int, default=3,
                         help="instances tried per request when one fails before the first token")
    routing.add_argument("--queue-timeout-seconds", type=float, default=120.0, metavar="S",
                         help="longest wait in the fair queue before answering 503")
    routing.add_argument("--unhealthy-cooldown-seconds", type=float, default=5.0, metavar="S",
                         help="a failed instance gets no new requests for this long")
    routing.add_argument("--prior-output-tokens", type=int, default=256, metavar="TOKENS",
                         help="fair queue: predicted output length of an application's first "
                              "request (later ones use its finished requests' mean)")

    http = parser.add_argument_group("HTTP server")
    http.add_argument("--host", default=None,
                      help=f"address to bind; default: $POD_IP if set, else {DEFAULT_HOST}")
    http.add_argument("--port", type=int, default=8080, help="TCP port")
    # The same limits and tenants file as `slipstream serve` (server.* in its config).
    http.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                      metavar="BYTES", help="larger request bodies get 413, unread")
    http.add_argument("--request-read-timeout-s", type=float,
                      default=DEFAULT_REQUEST_READ_TIMEOUT_S, metavar="S",
                      help="a client must send the request line and headers within this "
                           "long, and then the body within this long, else 408")
    http.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    http.add_argument("--tenants", type=Path, default=None, metavar="FILE",
                      help="tenants YAML (docs/tenancy.md): API keys (as SHA-256 digests), "
                           "fair-share weights, SLO classes and rate limits; every /v1 request "
                           "then needs 'Authorization: Bearer KEY'. Without it the API is "
                           "open to any caller, as the start-up line says")


def parse_backend(text: str) -> StaticBackend:
    url, separator, pool = text.rpartition("=")
    if not separator or not url:
        raise ValueError(f"--backend wants URL=POOL, got {text!r}")
    return StaticBackend(url=url.rstrip("/"), pool=pool)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    static = tuple(parse_backend(text) for text in args.backend)
    namespace = args.namespace or (None if static else os.environ.get("POD_NAMESPACE"))
    if static and args.namespace:
        raise ValueError("give --backend or --namespace, not both")
    if not static and not namespace:
        raise ValueError("no backends: give --backend URL=POOL, or --namespace (or "
                         "$POD_NAMESPACE) to watch agent pods")
    kubernetes = None if static or namespace is None else KubernetesDiscovery(
        namespace=namespace, label_selector=args.selector, kubeconfig=args.kubeconfig)
    return RouterConfig(
        host=bind_host(args.host), port=args.port,
        long_prefill_threshold_tokens=args.long_prefill_threshold_tokens,
        max_in_flight_per_instance=args.max_in_flight_per_instance,
        max_backlog_tokens_per_instance=args.max_backlog_tokens_per_instance,
        decode_weight_tokens=args.decode_weight_tokens,
        prefix_block_tokens=args.prefix_block_tokens,
        prefix_affinity_weight=args.prefix_affinity_weight,
        instance_queue_order=args.instance_queue_order,
        stats_interval_s=args.stats_interval_seconds, max_attempts=args.max_attempts,
        queue_timeout_s=args.queue_timeout_seconds,
        unhealthy_cooldown_s=args.unhealthy_cooldown_seconds,
        static_backends=static, kubernetes=kubernetes,
        fairness=FairnessConfig(prior_output_tokens=args.prior_output_tokens),
        log_level=args.log_level, max_body_bytes=args.max_body_bytes,
        request_read_timeout_s=args.request_read_timeout_s, tenants_path=args.tenants)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from slipstream.agent.engine.tokenizer import Tokenizer
    from slipstream.agent.router.app import build_router_app
    from slipstream.agent.server.tenancy.config import tenancy_line
    from slipstream.agent.server.limits import timed_protocol

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger = logging.getLogger(__name__)
    try:
        config = config_from_args(args)
        tenancy_line(config.tenants_path)  # a file that does not validate stops here
        tokenizer = Tokenizer.from_dir(args.model) if args.model is not None else None
    except (ValueError, OSError) as error:
        logger.error("cannot start: %s", error)
        return 2
    if tokenizer is None:
        logger.warning("no --model: prompt lengths are estimated from characters, not tokens")
    app = build_router_app(config, tokenizer)
    host = f"[{config.host}]" if ":" in config.host else config.host
    watched = config.kubernetes
    source = (f"pods in {watched.namespace} ({watched.label_selector})" if watched is not None
              else f"{len(config.static_backends)} static backends")
    print(f"Slipstream router at http://{host}:{config.port}/v1 -> {source}; long prompts: "
          f">= {config.long_prefill_threshold_tokens} tokens\n  "
          f"{tenancy_line(config.tenants_path)}", file=sys.stderr, flush=True)
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level,
                access_log=config.log_level == "debug", timeout_graceful_shutdown=5,
                http=timed_protocol(config.request_read_timeout_s))
    return 0
