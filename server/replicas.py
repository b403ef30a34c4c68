"""`quantserve serve MODEL --replicas N|auto`: copies of the server, placed by Ray Serve.

Three parts, each in its own module:

- the replicas (server/replica_server.py): a Ray Serve deployment whose every replica is the
  server a bare `quantserve serve` runs, on a port of its own; Ray Serve places them (one GPU each
  where there are GPUs), replaces one whose health check fails and scales them (`auto`) on the
  requests their engines hold;
- the registry (same module): a small Ray actor listing the replicas that are up and where;
- the gateway (server/gateway.py): the one address clients use, in this process, proxying each
  request straight to a replica's port — least loaded, or by session — and retrying once
  elsewhere when a replica dies.

Ray Serve's own HTTP proxy is not started: a request and its answer (a stream's events included)
cross one local HTTP hop and never Ray, so a replica's process does exactly a bare server's work
(each Ray hop per streamed event cost 11-28 % of the throughput on a GPU: bench/RESULTS.md).
Everything Ray-specific stays in these modules; without `--replicas` Ray is never imported.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import uuid
from dataclasses import dataclass

from quantserve.server.config import APIOptions, EngineOptions
from quantserve.server.uvicorn_server import server_class

_API = APIOptions()  # defaults for what app_kwargs leaves out

log = logging.getLogger("quantserve.server")

ROUTINGS = ("least-loaded", "session")


@dataclass
class ReplicaOptions:
    replicas: int | None  # None: autoscaled between 1 and max_replicas
    max_replicas: int = 4
    routing: str = "least-loaded"
    address: str | None = None  # an existing Ray cluster; None starts a local one
    host: str = "127.0.0.1"
    port: int = 8000
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 60.0
    gpus_per_replica: float | None = None  # None: 1 where the node has GPUs, else 0
    cpus_per_replica: float = 1.0

    def __post_init__(self):
        if self.replicas is not None and self.replicas < 1:
            raise ValueError(f"--replicas must be at least 1 (got {self.replicas})")
        if self.max_replicas < 1:
            raise ValueError(f"--max-replicas must be at least 1 (got {self.max_replicas})")
        if self.routing not in ROUTINGS:
            raise ValueError(f"unknown --routing {self.routing!r}: choose {', '.join(ROUTINGS)}")


def parse_replicas(text: str) -> int | None:
    """`--replicas`: a count >= 1, or 'auto' (None)."""
    if text == "auto":
        return None
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"--replicas must be a number of replicas or 'auto', not {text!r}") from None
    if n < 1:
        raise ValueError(f"--replicas must be at least 1 (got {n})")
    return n


def build_application(model: str, engine_options: EngineOptions, name: str, app_kwargs: dict,
                      opts: ReplicaOptions, registry: str):
    """The Ray Serve application: the model replicas, told the registry's name."""
    from ray import serve

    from quantserve.server.replica_server import ModelReplica, scale_on_load

    gpus = opts.gpus_per_replica
    if gpus is None:
        import ray

        gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
    config = {
        "ray_actor_options": {"num_gpus": gpus, "num_cpus": opts.cpus_per_replica},
        "health_check_period_s": 5, "health_check_timeout_s": 30,
        # Ray Serve's stop calls the replica's __del__, which lets uvicorn finish the open requests
        "graceful_shutdown_timeout_s": app_kwargs.get("shutdown_grace_s", _API.shutdown_grace_s) + 15,
    }
    if opts.replicas is None:
        config["autoscaling_config"] = {
            "min_replicas": 1, "max_replicas": opts.max_replicas,
            "target_ongoing_requests": engine_options.max_batch,
            "upscale_delay_s": opts.upscale_delay_s, "downscale_delay_s": opts.downscale_delay_s,
            "metrics_interval_s": 1.0, "look_back_period_s": 5.0,
            "policy": {"policy_function": scale_on_load}}
    else:
        config["num_replicas"] = opts.replicas
    deployment = serve.deployment(ModelReplica, name="model").options(**config)
    # a local cluster's replicas listen on loopback only; a cluster's on their node's address
    return deployment.bind(model, engine_options, name, app_kwargs, registry, None if opts.address else "127.0.0.1")


def start_ray(opts: ReplicaOptions) -> None:
    import ray

    if opts.address:
        ray.init(address=opts.address, logging_level=logging.WARNING, log_to_driver=False)
        return
    # A new local cluster, even where `ray start` left one to find (address=None would join that),
    # its node address 127.0.0.1; RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps Ray from rewriting it to
    # the machine's address.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, logging_level=logging.WARNING,
             log_to_driver=False, configure_logging=True)


def _why_not_deployed(app_name: str) -> str | None:
    """A failed replica's own words (its model's load error, say), from Ray Serve's status: what
    `serve.run` raises says only that the deployment failed."""
    from ray import serve

    from quantserve.server.replica_server import START_FAILED

    try:
        app = serve.status().applications[app_name]
        messages = [d.message.strip() for d in app.deployments.values() if d.message and d.message.strip()]
    except Exception:  # noqa: BLE001 - then serve.run's own message will do
        return None
    if not messages:
        return None
    last = messages[0].splitlines()[-1]  # the message ends with the replica's traceback
    return last.split(START_FAILED, 1)[1] if START_FAILED in last else last


def serve_replicas(model: str, engine_options: EngineOptions, name: str, app_kwargs: dict,
                   opts: ReplicaOptions) -> None:
    """Serve until SIGINT or SIGTERM.  The gateway listens at once (503 `model_loading` until a
    replica is up); the ready line is printed once Ray Serve has the replicas running."""
    import ray
    import uvicorn
    from ray import serve

    from quantserve.server.gateway import Gateway
    from quantserve.server.replica_server import NAMESPACE, Registry
    from quantserve.settings import UserError

    start_ray(opts)
    app_name = None
    try:
        serve.start(proxy_location="Disabled", logging_config={"log_level": "WARNING"})
        # names of their own: several commands may share a cluster (--address)
        tag = uuid.uuid4().hex[:8]
        app_name, registry_name = f"quantserve-{tag}", f"registry-{tag}"
        registry = ray.remote(Registry).options(name=registry_name, namespace=NAMESPACE, num_cpus=0,
                                                max_restarts=-1).remote()
        gateway = Gateway(opts.routing, lambda version: ray.get(registry.watch.remote(version, 5.0)),
                          app_kwargs.get("max_body_bytes", _API.max_body_bytes))
        app = gateway
        if app_kwargs.get("api_key"):  # checked at the door too: no body is read or relayed without it
            from quantserve.server.middleware import APIKeyMiddleware

            app = APIKeyMiddleware(gateway, app_kwargs["api_key"], open_methods=("OPTIONS",))
        grace = app_kwargs.get("shutdown_grace_s", _API.shutdown_grace_s)
        server = server_class()(uvicorn.Config(
            app, host=opts.host, port=opts.port, log_level="warning", access_log=False, lifespan="on",
            timeout_graceful_shutdown=grace, proxy_headers=False,
            server_header=False, date_header=False))  # the replica's own Server and Date headers pass through
        if opts.address:  # a shared cluster outlives this process: its replicas must not (they hold GPUs)
            server.before_abrupt_exit = lambda: serve.delete(app_name, _blocking=False)
        failure: list[str] = []

        def deploy() -> None:
            try:
                app = build_application(model, engine_options, name, app_kwargs, opts, registry_name)
                serve.run(app, name=app_name, route_prefix=None, blocking=False)  # returns once replicas are up
            except Exception as e:  # noqa: BLE001 - reported by the command, which then stops
                failure.append(_why_not_deployed(app_name) or f"{type(e).__name__}: {e}")
                server.should_exit = True
                return
            count = opts.replicas or f"1 (autoscaled up to {opts.max_replicas})"
            host = f"[{opts.host}]" if ":" in opts.host else opts.host
            bound = [s.getsockname()[1] for srv in getattr(server, "servers", []) for s in srv.sockets]
            print(f"serving {name} with {count} replica(s) on http://{host}:{bound[0] if bound else opts.port}/v1 "
                  f"(Ray Serve places them; routing {opts.routing})", file=sys.stderr, flush=True)

        threading.Thread(target=deploy, name="quantserve-deploy", daemon=True).start()
        server.run()
        if failure:
            raise UserError(f"the replicas did not start: {failure[0]}")
        if not server.started:
            raise UserError(f"could not start the gateway on {opts.host}:{opts.port} (port in use?)")
    finally:
        try:
            if not opts.address:
                serve.shutdown()
            elif app_name:
                serve.delete(app_name)  # a shared cluster: only this command's replicas go
        finally:
            ray.shutdown()
