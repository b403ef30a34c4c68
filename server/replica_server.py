"""One replica of `quantserve serve --replicas`, and the registry that lists the replicas up.

Ray Serve places each replica (one GPU each where there are GPUs), replaces it when its health
check fails and adds or removes replicas as the load asks; the requests themselves never pass
through Ray.  A replica runs the server a bare `quantserve serve` runs — `create_app` over its own
engine, served by uvicorn on an event loop of its own — on a port of its own, bound to its node's
address (127.0.0.1 on a local cluster).  Once its model is loaded it tells the registry where that
port is, and again every second while its engine lives; the gateway (server/gateway.py) watches
the registry and sends requests straight to those ports.

Autoscaling is Ray Serve's, fed by the replicas' own numbers: each reports the requests its
engine holds (running + waiting), and `scale_on_load` asks for enough replicas that none would
hold more than `--max-batch`: requests that would wait add replicas.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger("quantserve.server")

NAMESPACE = "quantserve"  # the Ray namespace of the registry actors
BEAT_S = 1.0  # a replica's heartbeat period
EXPIRY_S = 10.0  # a replica unheard of this long is taken off the list (a killed one is passed over sooner: gateway.py)
START_FAILED = "the replica did not start: "  # (the command quotes what follows)
LOAD_METRIC = "engine_requests"  # running + waiting, as each replica reports it to Ray Serve's autoscaler


def scale_on_load(ctx):
    """Ray Serve autoscaling policy: replicas enough for the requests the engines hold, at the
    target (`--max-batch`) each.  Ray Serve applies the bounds and the up/down delays."""
    import math

    per_replica = (ctx.aggregated_metrics or {}).get(LOAD_METRIC, {})
    load = sum(per_replica.values())
    return math.ceil(load / ctx.config.get_target_ongoing_requests()), {}


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class ModelReplica:
    """A Ray Serve deployment class: the server on its own port, listed in the registry."""

    async def __init__(self, model: str, engine_options, name: str, app_kwargs: dict, registry: str,
                       host: str | None):
        """`host`: the address to serve on; None: the node's address as Ray knows it (a cluster's
        other machines reach the replica there)."""
        import ray
        import uvicorn
        from ray import serve

        from quantserve.server.api_server import create_app
        from quantserve.server.config import APIOptions
        from quantserve.server.engines import ScheduledEngine

        # as for a bare server (server/cli.py): the scheduler thread and the event loop share the
        # GIL, and at the default 5 ms switch interval the loop would wait on it longer than a step
        sys.setswitchinterval(0.001)
        self.engine = ScheduledEngine(Path(model), engine_options)
        self.app = create_app(self.engine, name, wait_for_load=True, **app_kwargs)
        self.grace_s = app_kwargs.get("shutdown_grace_s", APIOptions.shutdown_grace_s)
        host = host or ray.util.get_node_ip_address()
        sock = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.url = _url(host, sock.getsockname()[1])
        # keep-alive longer than the gateway's (30 s), so it is always the gateway that closes an
        # idle connection and it never sends a request down one this side has just closed
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="on",
                                timeout_keep_alive=75, timeout_graceful_shutdown=self.grace_s)
        self.server = uvicorn.Server(config)
        # uvicorn on a thread and loop of its own (uvloop where installed, as a bare server), apart
        # from the loop Ray Serve runs this class's methods on: the requests never wait on Ray's work
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       name="quantserve-replica-http", daemon=True)
        self.thread.start()
        while not self.server.started:  # the app's start-up loads the model (wait_for_load)
            if not self.thread.is_alive():
                problem = self.app.state.server.load_error or "its HTTP server stopped while starting"
                raise RuntimeError(START_FAILED + problem)
            await asyncio.sleep(0.1)
        self.id = serve.get_replica_context().replica_id.unique_id
        self.registry = ray.get_actor(registry, namespace=NAMESPACE)
        await self.registry.beat.remote(self.id, self.url)  # listed before Ray Serve calls it ready
        self._beats = asyncio.ensure_future(self._beat())
        log.info("replica %s serving on %s", self.id, self.url)

    async def _beat(self) -> None:
        import ray
        from ray import serve

        while True:
            await asyncio.sleep(BEAT_S)
            if not (self.engine.alive() and self.thread.is_alive()):
                self.registry.leave.remote(self.id)  # off the list now; Ray Serve's health check replaces it
                return
            try:
                await self.registry.beat.remote(self.id, self.url)
            except ray.exceptions.ActorDiedError:
                # The registry dies with the command that made it: that command was killed outright
                # (SIGKILL, out of memory) on a shared cluster (--address), where Ray Serve apps
                # outlive their driver.  Nothing routes here any more: remove this command's app,
                # or its replicas would hold their GPUs for good.
                app = serve.get_replica_context().app_name
                log.warning("the command that started replica %s is gone: removing its app %s", self.id, app)
                await asyncio.to_thread(serve.delete, app, _blocking=False)
                return
            except ray.exceptions.RayError as e:  # restarting (max_restarts): the next beat lists us again
                log.debug("replica %s: a heartbeat was not taken (%s)", self.id, type(e).__name__)

    def check_health(self) -> None:
        """Ray Serve's health check: failing, the replica is replaced."""
        if not self.engine.alive():
            raise RuntimeError("the engine's scheduler thread has stopped")
        if not self.thread.is_alive():
            raise RuntimeError("the replica's HTTP server has stopped")

    def record_autoscaling_stats(self) -> dict:
        stats = self.engine.stats()
        return {LOAD_METRIC: stats.running + stats.waiting}

    async def __del__(self):
        """Ray Serve's graceful stop (scaling down, shutdown): off the list first, so no new
        request comes, then uvicorn's own shutdown lets the open ones finish."""
        if getattr(self, "_beats", None) is None:
            return  # the constructor did not finish: nothing was listed or started
        self._beats.cancel()
        try:
            await self.registry.leave.remote(self.id)
            await asyncio.sleep(0.5)  # requests the gateway sent before it heard still arrive
        finally:
            self.server.should_exit = True
            await asyncio.to_thread(self.thread.join, self.grace_s + 10)


class Registry:
    """A Ray actor (one per `quantserve serve --replicas`): the replicas up, by id, with their
    URLs.  `watch` is a long poll: it answers at once when the caller's version is not the
    current one, else when the list changes or `timeout_s` passes."""

    def __init__(self):
        self.members: dict[str, tuple[str, float]] = {}  # replica id -> (url, last heartbeat)
        self.epoch = f"{time.time_ns():x}"  # a restarted registry's versions never match the old ones
        self.count = 0
        self.started = time.monotonic()
        self.changed = asyncio.Event()

    def _bump(self) -> None:
        self.count += 1
        self.changed.set()
        self.changed = asyncio.Event()

    def beat(self, replica_id: str, url: str) -> None:
        known = self.members.get(replica_id)
        self.members[replica_id] = (url, time.monotonic())
        if known is None or known[0] != url:
            self._bump()

    def leave(self, replica_id: str) -> None:
        if self.members.pop(replica_id, None) is not None:
            self._bump()

    def _expire(self) -> None:
        cutoff = time.monotonic() - EXPIRY_S
        gone = [r for r, (_, seen) in self.members.items() if seen < cutoff]
        for r in gone:
            del self.members[r]
        if gone:
            self._bump()

    async def watch(self, version: str | None, timeout_s: float) -> tuple[str, dict[str, str]]:
        # restarted (Ray restarts a dead registry): the replicas' next beats list them again, so
        # wait for them rather than tell the gateway there are none
        settle = self.started + 2 * BEAT_S - time.monotonic()
        if settle > 0:
            await asyncio.sleep(settle)
        deadline = time.monotonic() + timeout_s
        while True:
            self._expire()
            current = f"{self.epoch}:{self.count}"
            left = deadline - time.monotonic()
            if current != version or left <= 0:
                return current, {r: url for r, (url, _) in self.members.items()}
            try:
                await asyncio.wait_for(self.changed.wait(), min(left, BEAT_S))
            except asyncio.TimeoutError:
                pass  # look at the heartbeats again
