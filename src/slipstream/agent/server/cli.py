"""``slipstream serve``: load a model into the engine and serve it over the OpenAI API.

    argv --cli_flags--> ServeConfig (defaults < environment < --config FILE < flags)
         --serve_configs--> EngineConfig + SchedulerConfig + ServerConfig
         -> serving engine -> build_app() -> uvicorn
    serving engine: EngineCoreClient, the engine in a process of its own (the default; this
    process never imports torch), or AsyncEngine on a thread here (``--single-process``)

The flags are generated from the config's fields in ``cli_flags``; the config's sections
become the engine's, scheduler's and server's objects in ``serve_configs`` (which also reads
the environment). This module starts the engine, the HTTP and control servers, and exits
with the right code. ``--print-config`` prints the resolved config as YAML instead.

In a cluster the operator renders the ServingReplica into the same config file, mounts it,
and starts ``slipstream serve --config /etc/slipstream/engine.yaml`` plus the ports; a flag
given on the command line still wins over the file.

With ``--tp/--spp/--kvp`` above 1 the engine starts worker processes. If one dies, in-flight
requests get a 503 and the process exits with ``EXIT_ENGINE_DEAD`` so it is restarted.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from slipstream.agent.config.serve_config import ConfigError, ServeConfig
from slipstream.agent.engine.config import EngineConfig

# add_arguments and run make this module a `slipstream` subcommand (src/slipstream/cli.py):
# the flags live in cli_flags, what the config turns into in serve_configs.
from slipstream.agent.server.cli_flags import add_arguments, serve_config_from_args
from slipstream.agent.server import serve_configs
from slipstream.agent.server.tenancy.config import tenancy_line
from slipstream.agent.server.config import ServerConfig

if TYPE_CHECKING:
    from slipstream.agent.server.api_processes import ApiProcesses
    from slipstream.contracts.control import PoolHolder
    from slipstream.agent.engine.engine_client import ServingEngine

__all__ = ["AGENT_KEEPALIVE_S", "EXIT_ENGINE_DEAD", "add_arguments", "run"]

EXIT_ENGINE_DEAD = 3  # the engine lost a worker; the supervisor should restart the instance
# Idle client connections stay open this long. Longer than the router's own idle limit
# (router/app.py UPSTREAM_KEEPALIVE_S): the client side must give up on an idle connection
# first, or a request can meet a connection the server is closing at that instant.
AGENT_KEEPALIVE_S = 30


def run(args: argparse.Namespace) -> int:
    try:
        config = serve_config_from_args(args)
    except ConfigError as error:
        print(f"slipstream serve: error: {error}", file=sys.stderr)
        return 2
    if args.print_config:
        print(config.to_yaml(), end="")
        return 0
    return serve(config)


def serve(config: ServeConfig) -> int:
    """Serve as ``config`` says until SIGTERM; the process's exit code."""
    logging.basicConfig(level=config.server.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger(__name__)

    try:
        settings = serve_configs.server_config(config)
        tenancy_line(settings.tenants_path)  # a file that does not validate stops here
    except (ValueError, OSError) as error:
        log.error("cannot start: %s", error)
        return 2
    shared_dir = None
    if config.server.api_processes > 1:
        from slipstream.agent.server.api_processes import make_shared_dir
        from slipstream.agent.server.metrics import merge_across_processes

        shared_dir = make_shared_dir()
        merge_across_processes(str(shared_dir))  # before any metric exists
    try:
        return _serve(config, settings, shared_dir)
    finally:
        if shared_dir is not None:
            shutil.rmtree(shared_dir, ignore_errors=True)


def _serve(config: ServeConfig, server_config: ServerConfig, shared_dir: Path | None
           ) -> int:
    # Heavy imports only once we are really serving; torch and the model code only in the
    # process that runs the engine (the engine core's, unless --single-process).
    from slipstream.agent.engine.errors import EngineDeadError
    from slipstream.agent.server.drain import reserve_port

    log = logging.getLogger(__name__)
    # The ports first: one in use fails now, not after the model has loaded.
    try:
        listener = reserve_port(server_config.host, server_config.port,
                                shared=shared_dir is not None)
    except OSError as error:
        return _port_in_use("--port", server_config.host, server_config.port, error)
    if server_config.control_port:
        try:
            reserve_port(server_config.host, server_config.control_port).close()
        except OSError as error:
            listener.close()
            return _port_in_use("--control-port", server_config.host,
                                server_config.control_port, error)
    try:
        engine_settings = serve_configs.engine_config(config)
        engine = _start_engine(config, engine_settings)
    except (ValueError, FileNotFoundError, EngineDeadError, RuntimeError) as error:
        # RuntimeError: a KV transfer engine that cannot load (its message says what to do).
        log.error("cannot start: %s", error)
        listener.close()
        return 2
    # While the engine core starts (it imports torch and loads the model), this process
    # imports the HTTP side.
    from slipstream.agent.server.api import build_app
    from slipstream.agent.server.drain import DrainingServer
    from slipstream.agent.server.drain import server_config as server_config_for_uvicorn

    try:
        engine.wait_ready()
    except EngineDeadError as error:
        log.error("cannot start: %s", error)
        listener.close()
        return 2
    app = build_app(engine, server_config)
    metrics = app.state.serving.metrics
    others: ApiProcesses | None = None  # --api-processes: the API processes after this one
    pool_holder: PoolHolder = metrics
    if shared_dir is not None:
        from slipstream.agent.server.api_processes import (
            EXIT_GRACE_S, ApiProcesses, PoolEverywhere)
        from slipstream.agent.server.engine_core import EngineCoreClient

        assert isinstance(engine, EngineCoreClient)  # the config checked apiProcesses
        extra = ApiProcesses(config.server.api_processes - 1, engine, engine_settings,
                             shared_dir)
        engine.before_shutdown = lambda: extra.wait(server_config.drain_timeout_s +
                                                    EXIT_GRACE_S)
        others, pool_holder = extra, PoolEverywhere(metrics, engine)
    control_server = None
    if server_config.control_port:
        from slipstream.contracts.control import ControlService, start_control_server
        from slipstream.contracts.control_auth import ControlToken

        try:
            token = None if server_config.control_token_file is None else \
                ControlToken(server_config.control_token_file)
            control_server, _ = start_control_server(
                ControlService(engine, pool_holder), server_config.host,
                server_config.control_port, token)
        except (OSError, ValueError) as error:
            logging.getLogger(__name__).error("cannot start the control API: %s (pick another "
                                              "--control-port, or 0 to turn it off)", error)
            engine.close()
            listener.close()
            return 2
    server = DrainingServer(server_config_for_uvicorn(
        app, host=server_config.host, port=server_config.port,
        log_level=server_config.log_level, keepalive_s=AGENT_KEEPALIVE_S,
        drain_timeout_s=server_config.drain_timeout_s,
        request_read_timeout_s=server_config.request_read_timeout_s),
        engine, server_config.drain_timeout_s)
    # A dead worker ends the process (non-zero), after the in-flight requests got their errors.
    engine.on_fatal = lambda _reason: setattr(server, "should_exit", True)
    port = listener.getsockname()[1]  # the real one, also for --port 0

    def on_started() -> None:
        if others is not None:
            # Now that the core is warm and this process serves: the others, on its port.
            others.start(port, dataclasses.replace(server_config, pool=metrics.pool))
        _print_banner(server_config, port, engine.model_name, engine.max_model_len)

    server.on_started = on_started
    if others is not None:
        server.on_drain = others.drain
    try:
        server.run(sockets=[listener])
    except SystemExit:  # uvicorn's way to report a failed start-up; it logged why
        pass
    finally:
        if control_server is not None:
            control_server.stop(grace=1)
        engine.close()  # the core and workers go even if uvicorn never started the app
    if engine.fatal_error is not None:
        logging.getLogger(__name__).error("exiting: %s", engine.fatal_error)
        return EXIT_ENGINE_DEAD
    if not server.started:  # start-up failed (the port, the warm-up); uvicorn said why
        return 2
    return 0


def _start_engine(config: ServeConfig, engine_settings: EngineConfig) -> ServingEngine:
    """The serving engine the config asks for. In two processes this returns once the engine
    core is spawned (``wait_ready`` waits for it to load); in one, once the model is loaded."""
    if not config.server.single_process:
        from slipstream.agent.server.engine_core import EngineCoreClient

        return EngineCoreClient(engine_settings, serve_configs.scheduler_config(config),
                                threads=config.engine.threads, wait=False)
    from slipstream.agent.engine.async_engine import AsyncEngine
    from slipstream.agent.engine.profile.auto_profile import with_runtime_profile
    from slipstream.agent.parallel.compose import build_engine

    logging.getLogger(__name__).info("the engine runs on a thread of this process "
                                     "(--single-process)")
    engine_settings = with_runtime_profile(engine_settings)
    return AsyncEngine(engine_settings, engine=build_engine(
        engine_settings, serve_configs.scheduler_config(config)))


def _control_access(config: ServerConfig) -> str:
    if not config.control_port:
        return ""
    if config.control_token_file is None:
        return " (open: no --control-token-file)"
    return " (bearer token required)"


def _port_in_use(flag: str, host: str, port: int, error: OSError) -> int:
    hint = f"pick another {flag}" + (", or 0 to turn it off" if flag == "--control-port" else "")
    logging.getLogger(__name__).error("cannot start: %s %d on %s: %s (%s)", flag, port, host,
                                      error.strerror or error, hint)
    return 2


def _print_banner(config: ServerConfig, port: int, model_name: str, max_model_len: int
                  ) -> None:
    host = f"[{config.host}]" if ":" in config.host else config.host
    url = f"http://{host}:{port}"
    print(f"Slipstream serving {model_name!r} (context {max_model_len} tokens) at {url}/v1\n"
          f"  metrics: {url}/metrics   health: {url}/health   "
          f"control (gRPC): {host}:{config.control_port or 'off'}"
          f"{_control_access(config)}\n"
          f"  {tenancy_line(config.tenants_path)}\n"
          f"  try: curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
          f"-d '{{\"model\": \"{model_name}\", \"messages\": [{{\"role\": \"user\", "
          f"\"content\": \"Hello\"}}], \"max_tokens\": 16}}'", flush=True)
