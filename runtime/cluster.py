"""Ray: session-host actors and the controller that keeps the session directory.

- ``Controller``: a named, detached actor (``kvferry-controller`` in namespace
  ``kvferry``): hosts and their health (heartbeats), the directory session id ->
  host address, placement (least loaded healthy host, or a requested one).
- ``SessionHost``: one per machine (or accelerator). Loads the model once,
  hosts many sessions, serves them over gRPC (:class:`kvferry.server.HostServer`)
  and reports to the controller.
- ``DemoHost``: one model and one conversation streamed back with Ray's
  streaming generators (``kvferry demo``).

``serve`` runs one host on this node: with an embedded Ray (the default) or on
an existing cluster (``--address`` / ``$RAY_ADDRESS``).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import ray

from . import blas
from .errors import ConfigError, KvferryError
from .paths import ensure_token  # noqa: F401  (re-exported: `kvferry serve` and jobs use it)

log = logging.getLogger("kvferry.host")

NAMESPACE = "kvferry"
CONTROLLER = "kvferry-controller"
HEARTBEAT_S = 2.0
UNHEALTHY_AFTER_S = 10.0


@ray.remote(num_cpus=0)
class Controller:
    def __init__(self) -> None:
        self._hosts: dict[str, dict] = {}
        self.directory: dict[str, str] = {}

    def register_host(self, address: str, model: str, node: str) -> None:
        self._hosts[address] = {"address": address, "model": model, "node": node, "sessions": 0,
                               "last_seen": time.time()}

    def unregister_host(self, address: str) -> None:
        self._hosts.pop(address, None)

    def heartbeat(self, address: str, sessions: int) -> None:
        if address in self._hosts:
            self._hosts[address].update(sessions=sessions, last_seen=time.time())

    def hosts(self) -> list[dict]:
        now = time.time()
        return [{**h, "healthy": now - h["last_seen"] < UNHEALTHY_AFTER_S} for h in self._hosts.values()]

    def place(self, requested: str | None = None, model: str | None = None) -> str | None:
        healthy = [h for h in self.hosts() if h["healthy"] and (model is None or h["model"] == model)]
        if requested:
            return requested if any(h["address"] == requested for h in healthy) else None
        return min(healthy, key=lambda h: h["sessions"])["address"] if healthy else None

    def register_session(self, sid: str, address: str) -> None:
        self.directory[sid] = address

    def forget_session(self, sid: str) -> None:
        self.directory.pop(sid, None)

    def lookup(self, sid: str) -> str | None:
        return self.directory.get(sid)

    def move(self, sid: str, src: str, dst: str) -> bool:
        """Atomic switch: only if the session is still recorded at ``src``."""
        if self.directory.get(sid, src) != src:
            return False
        self.directory[sid] = dst
        return True

    def directory_snapshot(self) -> dict[str, str]:
        return dict(self.directory)


def controller() -> Any:
    return Controller.options(name=CONTROLLER, namespace=NAMESPACE, lifetime="detached",
                              get_if_exists=True).remote()


@ray.remote(num_cpus=1, max_concurrency=8)
class SessionHost:
    def __init__(self, model: str | None, bind: str, keys_file: str | None, dtype: str = "auto",
                 max_kv_bytes: int | None = None, tls: dict | None = None, client_tls: dict | None = None,
                 policy: dict | None = None, http_port: int | None = None, metrics_public: bool = False,
                 log_format: str = "text", **server: Any) -> None:
        """``keys_file``: see kvferry.keys.hand_over (None: no auth); ``policy``: a
        HostPolicy's fields; ``http_port``: serve the OpenAI API there too
        (kvferry.http_front); ``server``: HostServer's options (allow_no_auth,
        advertise, peers, drain_dir, drain_timeout, lane_port)."""
        from .logs import setup

        setup(log_format)
        from .host import ModelHost, warmup
        from .keys import take_over
        from .policy import HostPolicy
        from .server import HostServer
        from .transport import TLSConfig
        from . import warm_migration

        keys = take_over(keys_file) if keys_file else None
        self.host = ModelHost(model, dtype=dtype, progress=False, max_kv_bytes=max_kv_bytes,
                              policy=HostPolicy(**(policy or {})))
        warmup(self.host.lm)
        self.host.preload()
        if self.host.device.is_gpu:  # a CPU has no kernels to compile on first use
            self.host.warm()
            if warm_migration.enabled():  # nor a first migration to pay for (kvferry.warm_migration)
                warm_migration.warm_logged(self.host)
        self.ctl = ray.get_actor(CONTROLLER, namespace=NAMESPACE)
        node = f"{socket.gethostname()}/{ray.get_runtime_context().get_node_id()[:8]}"
        self.srv = HostServer(self.host, bind, keys=keys, tls=TLSConfig(**tls) if tls else None,
                              client_tls=TLSConfig(**client_tls) if client_tls else None,
                              directory=self.ctl, node=node, **server).start()
        self.http = None
        if http_port is not None:
            from .http_front import HttpFront

            self.http = HttpFront(self.srv, bind.rpartition(":")[0], http_port,
                                  metrics_public=metrics_public).start()
        ray.get(self.ctl.register_host.remote(self.srv.address, self.host.lm.name, node))
        from .collector import freeze

        frozen = freeze()  # what start-up made lives as long as the host: full collections skip it
        self.host.gc_clock.warn = True  # a long collection shows in some reply's token times: log it
        log.info("host up on %s (model %s%s; %d start-up objects frozen out of the collector)", self.srv.address,
                 self.host.lm.name, f", HTTP on {self.http.address}" if self.http else "", frozen)
        self._stop = threading.Event()
        threading.Thread(target=self._beat, daemon=True).start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self.ctl.heartbeat.remote(self.srv.address, len(self.host.sessions))
            except Exception:
                pass

    def address(self) -> str:
        return self.srv.address

    def http_address(self) -> str | None:
        return self.http.address if self.http else None

    def logs(self, after: int = 0) -> tuple[int, list[str]]:
        """Log lines after number ``after`` (``kvferry serve`` prints them)."""
        from .logs import RING

        return RING.after(after) if RING is not None else (after, [])

    def info(self) -> dict:
        return {"address": self.srv.address, "model": self.host.lm.name, "pid": os.getpid(),
                "sessions": list(self.host.sessions), "blas": blas.status()["kind"],
                "device": self.host.device.as_dict(), "dtype": self.host.lm.dtype}

    def restored(self) -> list[dict]:
        return self.srv.restored

    def drain(self, timeout: float | None = None) -> list[dict]:
        return self.srv.drain(timeout or self.srv.drain_timeout)

    def finished(self) -> bool:
        """True once a drain asked this host to stop (``kvferry drain``)."""
        return self.srv.finished.is_set()

    def stop(self) -> None:
        self._stop.set()
        try:
            ray.get(self.ctl.unregister_host.remote(self.srv.address), timeout=5)
        except Exception:
            pass
        if self.http is not None:
            self.http.stop()
        self.srv.stop(0.5)
        log.info("host down on %s", self.srv.address)


@ray.remote(num_cpus=1)
class DemoHost:
    """A model in an actor holding one conversation (``kvferry demo``)."""

    def __init__(self, model: str | None, dtype: str = "auto"):
        from .host import ModelHost, warmup

        self.host = ModelHost(model, dtype=dtype, progress=False)
        self.lm = self.host.lm
        warmup(self.lm)

    def info(self) -> dict:
        return {"model": self.lm.name, "dtype": self.lm.dtype, "weights": self.lm.weights,
                "device": self.host.device.as_dict(), "blas": blas.status()["kind"], "pid": os.getpid()}

    def chat(self, text: str, max_tokens: int = 128, temp: float = 0.0, seed: int = 0) -> Iterator[dict]:
        """One user turn of the actor's conversation, driven by the chat guest."""
        from .params import SamplingParams

        if not hasattr(self, "session"):
            self.session = self.host.create_session(
                sampling=SamplingParams(temperature=temp, seed=seed, max_tokens=max_tokens))
        for ev in self.session.send(text):
            st = self.session.last
            yield {"text": ev.text, "token": ev.token, "finish_reason": ev.finish_reason,
                   "generation_tps": st.generation_tps if ev.finish_reason else 0.0,
                   "generation_tokens": st.generation_tokens if ev.finish_reason else ev.index + 1}


def _node_ip(address: str) -> dict:
    """Join as the node whose address routes to the cluster's GCS: Ray's own guess
    fails on a machine without a default route (and on several "machines" sharing
    one box), and then the host's actor would land on another node."""
    from .addresses import route_source

    host = address.rpartition(":")[0].strip("[]") if ":" in address else ""
    try:
        ip = route_source(socket.getaddrinfo(host, None)[0][4][0]) if host else None
    except OSError:
        ip = None
    return {"_node_ip_address": ip} if ip else {}


def init_ray(address: str | None = None) -> bool:
    """Connect to a cluster, or start an embedded one bound to loopback. Returns
    True when the Ray instance is ours (embedded)."""
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env = {"env_vars": blas.worker_env()}
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        try:
            ray.init(address=address, namespace=NAMESPACE, runtime_env=env, log_to_driver=False,
                     **_node_ip(address))
        except (ConnectionError, RuntimeError) as e:  # a user's setting, not a bug: one line
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            hint = " (a cluster with token auth needs RAY_AUTH_MODE=token and its token)" \
                if "auth" in str(e).lower() else ""
            raise ConfigError(f"cannot join the Ray cluster at {address}: {first}{hint}") from None
        return False
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, namespace=NAMESPACE,
             runtime_env=env, log_to_driver=False, configure_logging=False)
    return True


def _last_error(e: Exception) -> str:
    """The exception line that ends a failed actor's traceback (``error_msg``), kvferry's
    own errors by their message alone."""
    lines = [ln.strip() for ln in str(getattr(e, "error_msg", e)).splitlines() if ln.strip()]
    name, _, msg = (lines[-1] if lines else str(e)).partition(": ")
    if not msg:
        return name
    if name.startswith("kvferry."):
        return msg
    return f"{name.rsplit('.', 1)[-1]}: {msg}"


def start_host(model: str | None, bind: str, token: str | None, *, node_id: str | None = None,
               max_kv_bytes: int | None = None, tokens_file: str | None = None, **server: Any):
    """A SessionHost actor on ``node_id`` (default: this node). ``token`` (the admin
    key) and ``tokens_file`` (kvferry.keys) reach it in a private file, never as an
    actor argument."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from .keys import Keyring, hand_over

    controller()
    node_id = node_id or ray.get_runtime_context().get_node_id()
    secret = hand_over(Keyring.build(token, tokens_file)) if (token or tokens_file) else None
    try:
        actor = SessionHost.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            runtime_env={"env_vars": blas.worker_env()},
        ).remote(model, bind, secret, max_kv_bytes=max_kv_bytes, **server)
        try:
            return actor, ray.get(actor.address.remote())
        except ray.exceptions.RayActorError as e:  # its __init__ raised: Ray keeps only the text
            raise KvferryError(f"the session host did not start: {_last_error(e)}") from None
    finally:
        if secret:  # read by the actor already; gone either way
            Path(secret).unlink(missing_ok=True)


def serve(model: str | None, bind: str, token: str | None, *, address: str | None = None,
          ready: Any = None, report: Any = None, max_kv_bytes: int | None = None, **server: Any) -> None:
    """Run one session host on this node until SIGINT/SIGTERM (which drain it
    first: every session moves to a peer or is saved) or a ``kvferry drain``.
    ``report(outcome)`` hears of each session restored at start or drained."""
    own = init_ray(address)
    actor, addr = start_host(model, bind, token, max_kv_bytes=max_kv_bytes, **server)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    for o in ray.get(actor.restored.remote()):
        report and report(o)
    if ready:
        ready(addr, ray.get(actor.http_address.remote()))
    seen = 0

    def relay_logs() -> None:  # the host actor's log lines, on this process's stderr
        nonlocal seen
        try:
            seen, lines = ray.get(actor.logs.remote(seen), timeout=10)
        except Exception:
            return
        for line in lines:
            print(line, file=sys.stderr, flush=True)
    try:
        while not stop.wait(1.0):
            relay_logs()
            if ray.get(actor.finished.remote()):  # drained by `kvferry drain`
                break
        else:
            timeout = float(server.get("drain_timeout") or 0) or None
            try:
                for o in ray.get(actor.drain.remote(timeout), timeout=(timeout or 60) + 30):
                    report and report(o)
            except Exception as e:  # the host goes down regardless; say why the drain did not finish
                report and report({"session": "*", "outcome": "failed", "where": "", "error": str(e)})
            relay_logs()
    finally:
        try:
            ray.get(actor.stop.remote(), timeout=10)
        except Exception:
            pass
        ray.kill(actor)
        if own:
            try:
                ray.kill(ray.get_actor(CONTROLLER, namespace=NAMESPACE))
            except Exception:
                pass
            ray.shutdown()
