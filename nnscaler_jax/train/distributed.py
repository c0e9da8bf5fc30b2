"""Multi-process start: join a JAX distributed job, or launch one on this machine.

:func:`initialize` is the first thing a training process calls: it reads the process layout from
its arguments or the usual environment variables, does nothing for a single process, and
otherwise joins the job with ``jax.distributed.initialize`` (CPU collectives over gloo) with
bounded timeouts, so that a dead peer ends the others with an error instead of a hang.

:func:`launch_local` simulates a cluster on one machine: it starts ``processes`` copies of a
command, each with its own CPU devices and the environment :func:`initialize` reads, streams
their output and stops them all as soon as one fails.

Environment (the first one set wins):

==========================  ============================================================
coordinator address         ``JAX_COORDINATOR_ADDRESS``, ``COORDINATOR_ADDRESS``,
                            ``NNSCALER_COORDINATOR_ADDRESS`` (``host:port`` of process 0)
number of processes         ``JAX_NUM_PROCESSES``, ``NUM_PROCESSES``, ``NNSCALER_NUM_PROCESSES``
this process's id           ``JAX_PROCESS_ID``, ``PROCESS_ID``, ``NNSCALER_PROCESS_ID``
==========================  ============================================================
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO

import jax

__all__ = ["ProcessEnv", "free_port", "initialize", "launch_local", "process_env"]

log = logging.getLogger(__name__)

ADDRESS_VARS = ("JAX_COORDINATOR_ADDRESS", "COORDINATOR_ADDRESS", "NNSCALER_COORDINATOR_ADDRESS")
NUM_PROCESSES_VARS = ("JAX_NUM_PROCESSES", "NUM_PROCESSES", "NNSCALER_NUM_PROCESSES")
PROCESS_ID_VARS = ("JAX_PROCESS_ID", "PROCESS_ID", "NNSCALER_PROCESS_ID")
_DEVICE_FLAG = "--xla_force_host_platform_device_count"
_LOOPBACK = ("127.", "localhost", "[::1]")


@dataclasses.dataclass(frozen=True, slots=True)
class ProcessEnv:
    """Where this process sits in a job: ``num_processes`` 1 means a single process."""

    coordinator_address: str | None
    num_processes: int
    process_id: int
    local_device_count: int | None = None


def _env(names: Sequence[str], environ: Mapping[str, str]) -> tuple[str, str] | None:
    return next(((n, environ[n]) for n in names if environ.get(n, "").strip()), None)


def _env_int(names: Sequence[str], environ: Mapping[str, str]) -> int | None:
    found = _env(names, environ)
    if found is None:
        return None
    name, value = found
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def process_env(coordinator_address: str | None = None, num_processes: int | None = None,
                process_id: int | None = None, *, local_device_count: int | None = None,
                environ: Mapping[str, str] | None = None) -> ProcessEnv:
    """The process layout from the arguments, or from the environment where they are None.

    ``local_device_count`` is only passed through (the environment's ``XLA_FLAGS`` already
    set the CPU device count of a process that :func:`launch_local` started).

    Raises ``ValueError`` for a layout that cannot be right (an id outside ``0..n-1``, several
    processes without a coordinator address).

    >>> process_env(environ={})
    ProcessEnv(coordinator_address=None, num_processes=1, process_id=0, local_device_count=None)
    >>> process_env(environ={"JAX_NUM_PROCESSES": "2", "PROCESS_ID": "1",
    ...                      "JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}).process_id
    1
    """
    environ = os.environ if environ is None else environ
    if coordinator_address is None:
        found = _env(ADDRESS_VARS, environ)
        coordinator_address = found[1].strip() if found else None
    n = num_processes if num_processes is not None else _env_int(NUM_PROCESSES_VARS, environ)
    pid = process_id if process_id is not None else _env_int(PROCESS_ID_VARS, environ)
    n, pid = (1 if n is None else int(n)), (0 if pid is None else int(pid))
    if n < 1 or not 0 <= pid < n:
        raise ValueError(f"process id {pid} is not in 0..{n - 1} (num_processes={n}); set "
                         f"{PROCESS_ID_VARS[0]} to 0..{n - 1} on each of the {n} processes")
    if n > 1 and not coordinator_address:
        raise ValueError(f"{n} processes need a coordinator address (host:port of process 0): "
                         f"pass coordinator_address= or set {ADDRESS_VARS[0]}")
    return ProcessEnv(coordinator_address, n, pid, local_device_count)


def _use_gloo() -> None:
    """CPU collectives over gloo (unless the user chose another implementation, e.g. mpi)."""
    if jax.config.jax_cpu_collectives_implementation in (None, "", "none", "gloo"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, local_device_count: int | None = None,
               timeout_s: int = 120, heartbeat_timeout_s: int = 20,
               shutdown_timeout_s: int = 60) -> ProcessEnv:
    """Joins the multi-process job this process belongs to; a no-op for a single process.

    Call it before any other jax call (``jax.devices()`` included). Arguments left None are
    read from the environment (see the module docstring). With several processes it selects
    gloo CPU collectives and calls ``jax.distributed.initialize``; afterwards ``jax.devices()``
    lists the devices of every process.

    Args:
        coordinator_address: ``host:port`` of process 0, which serves the coordination.
        num_processes: how many processes the job has.
        process_id: this process's id, ``0..num_processes - 1``.
        local_device_count: CPU devices this process simulates (``jax_num_cpu_devices``).
        timeout_s: how long to wait for every process to join before raising.
        heartbeat_timeout_s: a peer silent this long counts as dead, and every process of
            the job then ends with an error (instead of waiting in a collective forever).
        shutdown_timeout_s: how long a finished process waits for the others at exit.

    Returns:
        The :class:`ProcessEnv` in use.

    >>> initialize(num_processes=1)   # a single process: nothing to join
    ProcessEnv(coordinator_address=None, num_processes=1, process_id=0, local_device_count=None)
    """
    env = process_env(coordinator_address, num_processes, process_id,
                      local_device_count=local_device_count)
    if env.local_device_count is not None:
        jax.config.update("jax_num_cpu_devices", int(env.local_device_count))
    if env.num_processes == 1:
        return env
    if jax.distributed.is_initialized():
        log.info("jax.distributed is already initialized: process %d of %d",
                 jax.process_index(), jax.process_count())
        return env
    _use_gloo()
    address = env.coordinator_address
    bind = address if address.startswith(_LOOPBACK) else None
    log.info("joining %s as process %d of %d", address, env.process_id, env.num_processes)
    try:
        jax.distributed.initialize(
            address, env.num_processes, env.process_id,
            initialization_timeout=int(timeout_s),
            heartbeat_timeout_seconds=int(heartbeat_timeout_s),
            shutdown_timeout_seconds=int(shutdown_timeout_s),
            coordinator_bind_address=bind)
    except RuntimeError as e:
        raise RuntimeError(f"process {env.process_id} of {env.num_processes} could not join "
                           f"the job at {address}: {e}. Call initialize() before any other "
                           "jax call, and start every process within "
                           f"{timeout_s} s.") from e
    return env


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _child_env(base: Mapping[str, str], *, address: str, processes: int, process_id: int,
               devices: int) -> dict[str, str]:
    env = dict(base)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_FLAG)]
    env.update({
        ADDRESS_VARS[0]: address, NUM_PROCESSES_VARS[0]: str(processes),
        PROCESS_ID_VARS[0]: str(process_id),
        "XLA_FLAGS": " ".join([*flags, f"{_DEVICE_FLAG}={devices}"]),
        "PYTHONUNBUFFERED": "1",
    })
    env.setdefault("JAX_PLATFORMS", "cpu")
    if any(k.lower() in ("http_proxy", "https_proxy", "all_proxy", "grpc_proxy") for k in env):
        # gRPC (the coordination service) would send 127.0.0.1 through the proxy
        hosts = [h for h in env.get("NO_PROXY", env.get("no_proxy", "")).split(",") if h]
        env["NO_PROXY"] = env["no_proxy"] = ",".join(
            dict.fromkeys([*hosts, "127.0.0.1", "localhost"]))
    return env


class _Output:
    """Copies the children's output: process 0's stdout as is, the rest prefixed to stderr."""

    def __init__(self, stdout: IO[str], stderr: IO[str]) -> None:
        self.stdout, self.stderr = stdout, stderr
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def follow(self, pipe: IO[bytes], rank: int, is_stdout: bool) -> None:
        plain = is_stdout and rank == 0
        thread = threading.Thread(target=self._copy, args=(pipe, rank, plain), daemon=True)
        thread.start()
        self.threads.append(thread)

    def _copy(self, pipe: IO[bytes], rank: int, plain: bool) -> None:
        with pipe:
            for raw in iter(pipe.readline, b""):
                line = raw.decode(errors="replace")
                if not line.endswith("\n"):
                    line += "\n"
                self.write(line if plain else f"[process {rank}] {line}", to_stdout=plain)

    def write(self, text: str, *, to_stdout: bool = False) -> None:
        stream = self.stdout if to_stdout else self.stderr
        with self.lock:
            stream.write(text)
            stream.flush()

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is None:  # not reaped: its pid (= its process group) is still ours
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass


def _stop(procs: Sequence[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM to each running child's process group, SIGKILL after ``grace_s``."""
    for proc in procs:
        _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code  # killed by signal N -> 128 + N, as shells say


def _watch(procs: Sequence[subprocess.Popen], out: _Output, timeout_s: float | None,
           grace_s: float) -> int:
    """Waits for the children; the first failure (or the timeout) stops the rest."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        failed = next(((i, c) for i, c in enumerate(codes) if c not in (None, 0)), None)
        if failed is not None:
            rank, code = failed
            running = [i for i, c in enumerate(codes) if c is None]
            if running:
                out.write(f"[launcher] process {rank} exited with code {code}; stopping "
                          f"process(es) {', '.join(map(str, running))}\n")
            _stop(procs, grace_s)
            return _exit_code(code)
        if all(c == 0 for c in codes):
            return 0
        if deadline is not None and time.monotonic() > deadline:
            out.write(f"[launcher] timed out after {timeout_s:g} s; stopping all processes\n")
            _stop(procs, grace_s)
            return 124
        time.sleep(0.05)


def launch_local(argv: Sequence[str], processes: int, *, devices_per_process: int,
                 port: int | None = None, timeout_s: float | None = None,
                 env: Mapping[str, str] | None = None, grace_s: float = 5.0,
                 stdout: IO[str] | None = None, stderr: IO[str] | None = None) -> int:
    """Runs ``argv`` as ``processes`` local processes of one job; returns 0 when all succeed.

    Each child gets the environment :func:`initialize` reads (coordinator ``127.0.0.1:port``,
    its process id), ``devices_per_process`` CPU devices (``XLA_FLAGS``) and
    ``JAX_PLATFORMS=cpu`` unless set. Process 0's stdout is copied unchanged to ``stdout``, so
    its last line stays the last line (a ``--json`` result); every other output line goes to
    ``stderr`` prefixed ``[process K]``. When a process exits non-zero the others get SIGTERM
    (SIGKILL ``grace_s`` later) and its exit code is returned (128 + N for signal N).

    Args:
        argv: the command, e.g. ``[sys.executable, "-m", "nnscaler_jax", "train", ...]``.
        processes: how many processes to start.
        devices_per_process: CPU devices each simulates.
        port: the coordinator's port (default: a free one).
        timeout_s: stop everything and return 124 after this many seconds (default: none).
        env: extra environment variables for the children.
        grace_s: seconds between SIGTERM and SIGKILL when stopping.
        stdout, stderr: text streams for the output (default: ``sys.stdout``/``sys.stderr``).

    Example (two processes of four CPU devices each, 8 devices in all)::

        code = launch_local([sys.executable, "-m", "nnscaler_jax", "train", "--mesh", "2x4",
                             "--json"], 2, devices_per_process=4, timeout_s=600)
    """
    if int(processes) < 1 or int(devices_per_process) < 1:
        raise ValueError(f"need processes >= 1 and devices_per_process >= 1, got {processes} "
                         f"and {devices_per_process}")
    address = f"127.0.0.1:{port or free_port()}"
    out = _Output(stdout or sys.stdout, stderr or sys.stderr)
    base = {**os.environ, **(env or {})}
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(int(processes)):
            child = _child_env(base, address=address, processes=int(processes),
                               process_id=rank, devices=int(devices_per_process))
            proc = subprocess.Popen(list(argv), env=child, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True)
            procs.append(proc)
            out.follow(proc.stdout, rank, is_stdout=True)
            out.follow(proc.stderr, rank, is_stdout=False)
        code = _watch(procs, out, timeout_s, grace_s)
    finally:  # an exception or Ctrl-C here must not leave children behind
        _stop(procs, grace_s)
    out.join(timeout_s=10.0)
    return code
