"""Run a function on W gloo processes on this machine, with a deadline instead of a hang.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes, initializes a gloo
process group in each (through a file store), calls ``fn(rank, world_size, *args)`` and
returns every rank's return value, in rank order. A worker's exception fails the test with
its traceback; a worker still running at the deadline fails it as a hang.

``collective_timeout`` (seconds, default ``COLLECTIVE_TIMEOUT_S``) is the process group's own
timeout: a collective that one rank waits in while another never joins gives up after that
long. Tests of "no rank blocks" pass a short one, so that a defect fails them in seconds.
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.multiprocessing as mp

# Collectives give up after this long, so a mismatch becomes an error, not a hang.
COLLECTIVE_TIMEOUT_S = 60


def _entry(fn, rank, world_size, init_file, result_dir, args, collective_timeout, join_timeout):
    import torch._dynamo  # noqa: F401  before the group exists: docs/teardown.md
    import torch.distributed as dist

    torch.set_num_threads(1)
    # Meet in the store first, with the long timeout: ranks finish importing at different
    # times on a busy machine, and the process group's (possibly short) timeout must bound
    # the collectives, not that wait.
    store = dist.FileStore(init_file, world_size)
    store.set_timeout(timedelta(seconds=join_timeout))
    if store.add("arrived", 1) == world_size:
        store.set("everyone", "here")
    store.wait(["everyone"])
    dist.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=collective_timeout),
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(result_dir, f"{rank}.pt"))
        dist.barrier()  # tear down together: gloo can abort a rank whose peer already left
    except BaseException:
        with open(os.path.join(result_dir, f"{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(
    fn,
    world_size: int,
    *args,
    timeout: float = 120.0,
    collective_timeout: float = COLLECTIVE_TIMEOUT_S,
) -> list:
    """``[fn(0, W, *args), ..., fn(W-1, W, *args)]``, each on its own gloo process.

    ``timeout`` bounds the whole run (spawn included); ``collective_timeout`` each collective.
    """
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_entry,
                args=(fn, rank, world_size, init_file, tmp, args, collective_timeout, timeout),
            )
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        errors = []
        for rank in range(world_size):
            path = os.path.join(tmp, f"{rank}.err")
            if os.path.exists(path):
                with open(path) as f:
                    errors.append(f"--- rank {rank} ---\n{f.read()}")
        if hung:
            raise AssertionError(
                f"ranks {hung} still running after {timeout} s (a hang)\n" + "\n".join(errors)
            )
        if errors:
            raise AssertionError("worker failed:\n" + "\n".join(errors))
        bad_exit = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
        if bad_exit:
            raise AssertionError(f"workers exited abnormally: {bad_exit}")
        return [
            torch.load(os.path.join(tmp, f"{rank}.pt"), weights_only=False)
            for rank in range(world_size)
        ]
