"""Run a function on N gloo ranks on this machine (CPU), for torch.distributed tests.

Ranks are forked from the test process (torch and nkilib already imported: no per-rank start-up cost),
rendezvous over TCP on 127.0.0.1 at a free port, and gloo is pinned to the loopback interface. Each rank
returns a value through a queue (serialised with torch.save: tensors sent as shared memory would
not outlive their rank); a rank that fails sends its traceback; ranks still alive at the
deadline are killed (by their own pid) and the test fails with a timeout.
"""
import io
import multiprocessing
import os
import queue
import socket
import traceback

import torch


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world, port, results, fn, args):
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        try:
            buf = io.BytesIO()
            torch.save(fn(rank, world, *args), buf)
            results.put((rank, "ok", buf.getvalue()))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(world: int, fn, *args, timeout: float = 60.0) -> list:
    """[fn(rank, world, *args) for each rank], run on `world` forked gloo ranks; raises on error or timeout."""
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, results, fn, args), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out, errors = {}, []
    try:
        for _ in range(world):
            rank, status, value = results.get(timeout=timeout)
            if status == "ok":
                out[rank] = torch.load(io.BytesIO(value))
            else:
                errors.append(f"rank {rank}:\n{value}")
                break
    except queue.Empty:
        errors.append(f"timeout after {timeout} s; ranks that answered: {sorted(out)}")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [out[r] for r in range(world)]


def call_outcomes(calls: dict) -> dict:
    """{name: "accepted" or "<ErrorType>: <message>"} for each call of {name: call}, run in order on this rank.

    For the ranks of a bad-input test: each rank returns what every call did (a ValueError or TypeError
    caught, anything else raised), and the test process asserts on the messages.
    """
    messages = {}
    for name, call in calls.items():
        try:
            call()
            messages[name] = "accepted"
        except (ValueError, TypeError) as exc:
            messages[name] = f"{type(exc).__name__}: {exc}"
    return messages
