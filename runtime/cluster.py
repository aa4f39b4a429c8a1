"""JAX's distributed runtime for a job of several processes (``torchrun``, a TPU pod).

NOTE [distributed start]: ``jax.distributed.initialize`` must run before any JAX backend starts,
and ``import deferfuse`` starts one (it counts the devices to register ``tpu:N``). So deferfuse
starts the distributed runtime at import, in its first device lookup (``platform.choose``), when
the launcher's variables say the job has several processes: ``WORLD_SIZE`` > 1 with ``RANK``
(``torchrun`` sets both, and ``MASTER_ADDR``/``MASTER_PORT``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``).
JAX process ids are torch ranks. The coordinator (JAX's coordination service, in rank 0's process)
listens on ``MASTER_ADDR:MASTER_PORT+1`` unless ``DEFERFUSE_COORDINATOR`` (or JAX's own
``JAX_COORDINATOR_ADDRESS``) names another ``host:port``. With ``DEFERFUSE_DISTRIBUTED=1`` and no
launcher variables, JAX's own cluster discovery runs (a TPU pod slice, SLURM). A program that
called ``jax.distributed.initialize`` itself before importing deferfuse keeps its runtime.

After it, ``jax.devices()`` lists every process's devices: ``tpu:N`` are ``jax.local_devices()``.

NOTE [signals]: SIGTERM and SIGINT end a rank as they end a CPU process: the default action (or
the program's own handler; SIGINT raises KeyboardInterrupt). JAX's preemption service would
install a SIGTERM handler that only logs "SIGTERM caught" and lets the process run on, so SLURM,
Kubernetes and torchrun could stop a rank only with SIGKILL: deferfuse turns it off unless
``JAX_ENABLE_PREEMPTION_SERVICE`` is set. A rank that ends by raising (after a signal or not)
disconnects at exit within the distributed timeout, never waiting longer: JAX's shutdown runs on
a thread of its own, and if it has not returned by then, JAX's own exit hook (which calls it
again, on the main thread) is left nothing to shut down.

NOTE [orderly exit]: rank 0's process hosts JAX's coordination service, and a process whose service
is gone terminates itself (JAX's fatal "the leader task died"), even at exit. So at exit every other
rank says so in the key-value store and disconnects, and rank 0 waits (up to the timeout) until
every other rank has exited, or stopped sending heartbeats, before it ends. Heartbeats (one key per
rank, rewritten every second) are ours: JAX's own are not visible to the processes.
"""
from __future__ import annotations

import atexit
import os
import threading
import time

HEARTBEAT_S = 1.0


class Cluster:
    """This process's place in the job: its rank, the number of processes, and the coordination
    client (a key-value store and barriers every process shares; None in a one-process job)."""

    def __init__(self):
        self.started = False
        self.rank = 0
        self.size = 1
        self.client = None
        self.error = None          # why starting failed (raised when a process group needs it)
        self.timeout = 60.0        # seconds rank 0 waits for the others at exit
        self.dead_after = 10.0     # seconds without a heartbeat after which a rank is dead
        self.beats = 0
        self._stop = threading.Event()
        self._seen: dict = {}      # rank -> (its last heartbeat, when we first saw it)

    def start(self, mode: str = "auto", coordinator: str | None = None,
              init_timeout: int = 300, timeout: float = 60.0, rank: int | None = None,
              world: int | None = None, store_coordinator: str | None = None) -> None:
        """Start JAX's distributed runtime if this process is part of a job (once; see NOTE
        [distributed start]). ``mode``: ``auto`` (when the launcher's variables say so), ``1``
        (also JAX's own discovery without them) or ``0`` (never). ``rank`` and ``world``: those
        the process group being made was given, used when ``RANK``/``WORLD_SIZE`` are not set,
        with ``store_coordinator`` (torch's store's host and port + 1) when ``MASTER_ADDR`` is
        not set either."""
        if self.started:
            return
        self.started = True
        self.timeout = timeout
        self.dead_after = min(10.0, timeout / 2)
        from jax._src import distributed
        if distributed.global_state.client is not None:     # the program started it itself
            self._adopt(distributed.global_state)
            return
        mode = str(mode).strip().lower()
        if mode in ("0", "false", "off", "no"):
            return
        env = os.environ
        given = rank is not None and world is not None and world > 1
        if "RANK" in env and int(env.get("WORLD_SIZE", "1") or 1) > 1:
            world, rank = int(env["WORLD_SIZE"]), int(env["RANK"])
        elif not given:
            if mode in ("1", "true", "on", "yes"):
                self._initialize(None, None, None, None, init_timeout)
            return
        coordinator = coordinator or env.get("JAX_COORDINATOR_ADDRESS")
        if not coordinator and ("MASTER_ADDR" not in env or "MASTER_PORT" not in env):
            coordinator = store_coordinator
        if not coordinator:
            if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
                raise RuntimeError(
                    f"RANK={rank} and WORLD_SIZE={world} are set but MASTER_ADDR/MASTER_PORT are "
                    "not: deferfuse starts JAX's distributed runtime from them (its coordinator "
                    "listens on MASTER_PORT+1); launch with torchrun, set both, or set "
                    "DEFERFUSE_COORDINATOR=host:port")
            coordinator = f"{env['MASTER_ADDR']}:{int(env['MASTER_PORT']) + 1}"
        local = None
        if int(env.get("LOCAL_WORLD_SIZE", "1") or 1) > 1 and "LOCAL_RANK" in env:
            # Several processes on this host: one device each (GPUs; see docs/distributed.md for
            # TPU hosts, whose chips are split between processes by libtpu's own variables).
            local = [int(env["LOCAL_RANK"])]
        self._initialize(coordinator, world, rank, local, init_timeout)

    def _initialize(self, coordinator, world, rank, local, init_timeout) -> None:
        import jax
        from jax._src import distributed, xla_bridge
        if xla_bridge.backends_are_initialized():
            self.error = ("JAX's backends were started before deferfuse could start JAX's "
                          "distributed runtime; import deferfuse before any JAX call (or call "
                          "jax.distributed.initialize yourself first)")
            return
        # A process that dies must not take the others down with it (JAX's coordination service
        # would terminate every process): the process group reports it as an error instead.
        jax.config.update("jax_enable_recoverability", True)
        # JAX's preemption service swallows SIGTERM: off unless asked for (NOTE [signals]).
        if "JAX_ENABLE_PREEMPTION_SERVICE" not in os.environ:
            jax.config.update("jax_enable_preemption_service", False)
        try:
            distributed.initialize(coordinator_address=coordinator, num_processes=world,
                                   process_id=rank, local_device_ids=local,
                                   initialization_timeout=init_timeout,
                                   heartbeat_timeout_seconds=max(20, int(self.dead_after) * 2),
                                   shutdown_timeout_seconds=max(1, int(self.timeout)))
        except Exception as e:
            raise RuntimeError(
                f"deferfuse could not start JAX's distributed runtime (process {rank} of {world}, "
                f"coordinator {coordinator or 'found by JAX'}): {e}. The coordinator runs in rank "
                "0's process on MASTER_PORT+1; choose another host:port with "
                "DEFERFUSE_COORDINATOR, or set DEFERFUSE_DISTRIBUTED=0 to run without it") from e
        self._adopt(distributed.global_state)

    def _adopt(self, gs) -> None:
        self.client = gs.client
        self.rank = gs.process_id
        self.size = gs.num_processes
        if self.size > 1:
            self._beat()
            threading.Thread(target=self._heartbeats, name="deferfuse-heartbeat",
                             daemon=True).start()
            atexit.register(self._at_exit)

    # --- heartbeats and exits (NOTE [orderly exit]) --------------------------------------------
    def _beat(self) -> None:
        self.beats += 1
        self.client.key_value_set(f"df/hb/{self.rank}", str(self.beats), allow_overwrite=True)

    def _heartbeats(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._beat()
            except Exception:       # the coordination service is gone: nothing left to tell
                return

    def ranks_with(self, what: str) -> dict:
        """{rank: value} of the ranks that published ``what`` ('failed' or 'exited')."""
        return {int(k.rsplit("/", 1)[1]): v for k, v in self.client.key_value_dir_get(f"df/{what}/")}

    def dead(self, ranks, now: float | None = None) -> list:
        """The ranks among ``ranks`` whose heartbeat has not changed for ``dead_after`` seconds
        (counted from the first time this process looked)."""
        now = time.monotonic() if now is None else now
        out = []
        for r in ranks:
            try:
                v = self.client.key_value_try_get(f"df/hb/{r}")
            except Exception:
                v = None
            last = self._seen.get(r)
            if last is None or last[0] != v:
                self._seen[r] = (v, now)
            elif now - last[1] >= self.dead_after:
                out.append(r)
        return out

    def _at_exit(self) -> None:
        from jax._src import distributed
        self._stop.set()
        try:
            self.client.key_value_set(f"df/exited/{self.rank}", "1", allow_overwrite=True)
        except Exception:
            return
        if self.rank != 0:
            # Disconnect now, while rank 0 waits for it; never for longer than the timeout (NOTE
            # [signals]: a rank ending on an error or a signal must end).
            t = threading.Thread(target=_quietly(distributed.shutdown), daemon=True,
                                 name="deferfuse-shutdown")
            t.start()
            t.join(self.timeout)
            if t.is_alive():
                import sys
                print(f"deferfuse: JAX's distributed runtime did not shut down within "
                      f"{self.timeout:.0f} s; exiting without it", file=sys.stderr)
                # JAX's own exit hook (jax._src.api.clean_up, run after this one) would call
                # shutdown again, on this thread and unbounded: it finds nothing to shut down.
                # The stuck call keeps its own reference to the client.
                state = distributed.global_state
                state.preemption_sync_manager = state.client = state.service = None
            return
        deadline = time.monotonic() + self.timeout
        others = set(range(1, self.size))
        dead: set = set()
        try:
            while others and time.monotonic() < deadline:
                others -= set(self.ranks_with("exited"))
                dead |= set(self.dead(others))
                others -= dead
                if others:
                    time.sleep(0.05)
            if not others and not dead:
                # Returns once every other process has disconnected.
                self.client.get_live_nodes(list(range(self.size)))
        except Exception:
            pass


def _quietly(fn):
    def call():
        try:
            fn()
        except Exception:       # the coordination service is gone: nothing left to tell it
            pass
    return call


CLUSTER = Cluster()
