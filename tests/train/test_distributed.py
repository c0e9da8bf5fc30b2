"""Multi-process runs on one machine: 2 processes x 4 CPU devices over gloo compute what one
process of 8 devices computes, a checkpoint written by 2 processes restores in one, and a dead
process ends the job (through the launcher, and through the heartbeat alone) in < 60 s.

Every child runs under a hard timeout (``launch_local(timeout_s=...)`` or ``Popen.wait``), so
these tests cannot hang the suite.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from dist_worker import compute, global_inputs
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnscaler_jax.train.checkpoint import Checkpointer
from nnscaler_jax.train.distributed import (
    ProcessEnv,
    free_port,
    initialize,
    launch_local,
    process_env,
)

WORKER = str(Path(__file__).with_name("dist_worker.py"))
HARD_TIMEOUT_S = 240  # a child still running after this is killed and the test fails
ROOT = str(Path(__file__).resolve().parents[2])


def _launch(*args: str, processes: int = 2, devices: int = 4, timeout_s: float = HARD_TIMEOUT_S):
    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    code = launch_local([sys.executable, WORKER, *args], processes, devices_per_process=devices,
                        timeout_s=timeout_s, env={"PYTHONPATH": ROOT}, stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue(), time.monotonic() - start


def _last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


# ---- the environment, without processes ------------------------------------------------------

def test_process_env_reads_the_usual_variables_and_checks_them():
    assert process_env(environ={}) == ProcessEnv(None, 1, 0)
    env = {"COORDINATOR_ADDRESS": "h:1", "NUM_PROCESSES": "4", "NNSCALER_PROCESS_ID": "3"}
    assert process_env(environ=env) == ProcessEnv("h:1", 4, 3)
    env["JAX_PROCESS_ID"] = "2"  # JAX_* first
    assert process_env(environ=env).process_id == 2
    assert process_env("a:2", 2, 1, environ=env) == ProcessEnv("a:2", 2, 1)  # arguments first
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES='two' is not an integer"):
        process_env(environ={"JAX_NUM_PROCESSES": "two"})
    with pytest.raises(ValueError, match="process id 4 is not in 0..3"):
        process_env("h:1", 4, 4, environ={})
    with pytest.raises(ValueError, match="coordinator address"):
        process_env(None, 2, 0, environ={})


def test_initialize_is_a_no_op_for_one_process():
    assert initialize(num_processes=1) == ProcessEnv(None, 1, 0)
    assert not jax.distributed.is_initialized()


# ---- real processes --------------------------------------------------------------------------

@pytest.mark.slow
def test_two_processes_compute_what_one_process_of_eight_devices_computes():
    code, out, err, _ = _launch("compute")
    assert code == 0, err[-3000:]
    got = _last_json(out)  # process 0's last line is the launcher's last stdout line
    assert got["processes"] == 2 and got["devices"] == 8
    want = compute()  # this pytest process: 1 process x 8 CPU devices
    assert want["processes"] == 1 and want["devices"] == 8
    assert {k: got[k] for k in ("sum", "psum", "matmul")} == {
        k: want[k] for k in ("sum", "psum", "matmul")}
    x, w = global_inputs()
    assert got["sum"] == float(x.sum()) and got["matmul"] == (x @ w).tolist()
    assert all(line.startswith(("[process 0] ", "[process 1] "))
               for line in err.splitlines() if line), err[-2000:]
    assert "[process 1] {" in err  # process 1's stdout went to stderr, prefixed


@pytest.mark.slow
def test_a_checkpoint_written_by_two_processes_restores_in_one(tmp_path):
    code, out, err, _ = _launch("checkpoint", str(tmp_path / "ck"))
    assert code == 0, err[-3000:]
    got = _last_json(out)
    x, w = global_inputs()
    assert got["step"] == 3 and got["meta"] == {"processes": 2}
    assert got["x"] == x.tolist() and got["w"] == w.tolist() and got["step"] == 3
    mesh = jax.make_mesh((4, 2), ("data", "model"))  # another mesh shape, in this process
    target = {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P("data"))),
              "w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=NamedSharding(mesh, P())),
              "step": jax.ShapeDtypeStruct((), np.int32, sharding=NamedSharding(mesh, P()))}
    with Checkpointer(tmp_path / "ck") as ckpt:
        state, info = ckpt.restore(target=target)
    np.testing.assert_array_equal(state["x"], x)
    np.testing.assert_array_equal(state["w"], w)
    assert int(state["step"]) == 3 and info.meta == {"processes": 2}


@pytest.mark.slow
def test_the_launcher_stops_the_job_when_a_process_dies():
    code, out, err, seconds = _launch("die", "1")
    assert code != 0 and seconds < 60, (code, seconds, err[-3000:])
    assert "[launcher] process 1 exited with code 1; stopping process(es) 0" in err, err[-3000:]
    assert "never failed" not in out


def _spawn(rank: int, port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
           "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(rank), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    return subprocess.Popen([sys.executable, WORKER, "die", "1"], env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@pytest.mark.slow
def test_a_dead_peer_ends_the_survivor_without_a_launcher():
    """No launcher to stop it: the survivor, waiting in a collective, ends with an error once
    the heartbeat timeout of ``initialize`` notices the dead process."""
    port = free_port()
    procs = [_spawn(rank, port) for rank in (0, 1)]
    try:
        assert procs[1].wait(HARD_TIMEOUT_S) == 1
        died = time.monotonic()
        code = procs[0].wait(HARD_TIMEOUT_S)
        seconds = time.monotonic() - died
        output = procs[0].stdout.read().decode(errors="replace")
        assert code != 0 and seconds < 60, (code, seconds, output[-3000:])
        assert "never failed" not in output
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            proc.stdout.close()
