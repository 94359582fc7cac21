"""The Ray actors DeepInfer runs and the front's handle on each: `LoopThread` (one worker or
rank loop in a thread of a threaded actor), `WorkerActor` (a prefill/decode worker), and
`RayActorProcess` / `RayWorkerProcess` (the `WorkerProcess` the front supervises, with liveness
read from Ray). `import ray` happens inside the methods, so importing this module needs no ray."""
from __future__ import annotations

import dataclasses
import logging
import os
import threading

from deepinfer.cluster.worker_spec import WorkerSpec

logger = logging.getLogger(__name__)


class LoopThread:
    """The part every DeepInfer actor shares: it runs one worker or rank loop in a thread (a
    threaded actor keeps answering `wait` / `ping` meanwhile); `wait` returns the loop's exit
    code when it ends (1 on an error, which the loop reported to the front where it could)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._exit_code: int | None = None
        self._thread: threading.Thread | None = None

    def _start_loop(self, target, name: str, what: str) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, args=(target, what), name=name,
                                            daemon=True)
            self._thread.start()

    def _run(self, target, what: str) -> None:
        code = 0
        try:
            target()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            logger.exception("%s failed", what)
            code = 1
        self._exit_code = code
        self._done.set()

    def wait(self) -> int:
        self._done.wait()
        return self._exit_code


class WorkerActor(LoopThread):
    """The Ray actor of one worker: `start` runs `run_worker_proc` in a thread and returns at
    once with where it runs; `wait` returns the loop's exit code when it ends."""

    def __init__(self, spec: WorkerSpec) -> None:
        super().__init__()
        self.spec = spec

    def start(self) -> dict:
        import ray

        from deepinfer.cluster.worker_proc import run_worker_proc
        ip = ray.util.get_node_ip_address()
        # This node's IP, not 127.0.0.1: the KV endpoint must be reachable from other nodes.
        # No parent pid: the front is not our parent; Ray ends the actor with its owner.
        spec = dataclasses.replace(self.spec, host=ip, parent_pid=None)
        self._start_loop(lambda: run_worker_proc(spec), f"deepinfer-{spec.worker_id}",
                         f"{spec.worker_id}: worker loop")
        context = ray.get_runtime_context()
        return {"pid": os.getpid(), "node_id": context.get_node_id(), "node_ip": ip,
                "actor_id": context.get_actor_id()}

    def ping(self) -> bool:
        return True


class RayActorProcess:
    """`WorkerProcess` over one actor whose `wait()` returns its loop's exit code. Liveness
    comes from Ray: the pending `wait()` resolves when the loop ends and fails when the actor
    (or its node) dies. Subclasses create the actor and call `_attach`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.actor = None
        self._info_ref = self._wait_ref = None
        self._info: dict | None = None
        self._exitcode: int | None = None
        self.death_cause: str | None = None

    def _attach(self, actor, info_ref) -> None:
        self.actor, self._info_ref = actor, info_ref
        self._wait_ref = actor.wait.remote()

    @property
    def info(self) -> dict | None:
        """pid / node_id / node_ip / actor_id once the actor runs (never blocks)."""
        import ray
        if self._info is None and self._info_ref is not None:
            ready, _ = ray.wait([self._info_ref], timeout=0)
            if ready:
                try:
                    self._info = ray.get(self._info_ref)
                except Exception:  # died before it answered
                    self._info = {}
        return self._info or None

    @property
    def pid(self) -> int | None:
        info = self.info
        return None if info is None else info.get("pid")

    @property
    def exitcode(self) -> int | None:
        self.is_alive()
        return self._exitcode

    def is_alive(self) -> bool:
        import ray
        if self._wait_ref is None:
            return False
        if self._exitcode is not None:
            return False
        ready, _ = ray.wait([self._wait_ref], timeout=0)
        if ready:
            self._on_end()
        return self._exitcode is None

    def _on_end(self) -> None:
        import ray
        try:
            self._exitcode = int(ray.get(self._wait_ref))
        except Exception as exc:  # RayActorError: killed, crashed, or its node is gone
            self._exitcode = -9
            self.death_cause = str(exc).strip().splitlines()[0] if str(exc).strip() else \
                type(exc).__name__
            logger.warning("Ray actor %s died: %s", self.name, self.death_cause)
        ray.kill(self.actor, no_restart=True)  # a loop that ended leaves an idle actor

    def kill(self) -> None:
        import ray
        if self.actor is not None:
            ray.kill(self.actor, no_restart=True)

    def join(self, timeout: float | None = None) -> None:
        import ray
        if self._wait_ref is not None:
            ray.wait([self._wait_ref], timeout=timeout)
            self.is_alive()


class RayWorkerProcess(RayActorProcess):
    """One prefill/decode worker's actor."""

    def __init__(self, actor_class, spec: WorkerSpec, options: dict) -> None:
        super().__init__(f"deepinfer-{spec.worker_id}")
        self.spec = spec
        self._actor_class, self._options = actor_class, options

    def start(self) -> None:
        try:
            actor = self._actor_class.options(**self._options).remote(self.spec)
            self._attach(actor, actor.start.remote())
        except Exception as exc:  # the front treats OSError as "could not spawn, back off"
            raise OSError(f"Ray could not create the actor of {self.spec.worker_id}: {exc}") \
                from exc
