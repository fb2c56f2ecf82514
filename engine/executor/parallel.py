"""Tensor parallelism: one model split over `tensor_parallel_size` processes (ranks). Each rank holds
its share of the attention heads (K/V heads included, with its own KV pool for them) and of the MLP's
intermediate columns; the scheduler, block manager and sampler run on rank 0 only.

    rank 0: the engine's own process                  ranks 1..N-1: spawned by it (`rank_main`)
    schedule, prepare the batch
    send (block copies, rows) to every worker  ---->  receive, copy blocks, prepare the same batch
    forward; an all-reduce after o_proj and    <--->  forward; the same all-reduces
      after down_proj in every layer
    LM head on the sampled rows, sample               wait for the next step

In a layer (engine/executor/models/llama.py) q/k/v and gate/up are column-parallel (each rank computes its own
heads and columns), o_proj and down_proj row-parallel (each rank a partial sum, one all-reduce each);
the embedding, the norms and the LM head are replicated. A step moves its rows over a pipe to each
worker (a few KB) and two [tokens, hidden] all-reduces per layer between the ranks.

The all-reduces run on a process group of their own (gloo on CPU, NCCL on CUDA) built from a TCPStore
on 127.0.0.1, not on torch.distributed's global default group: an engine can be rebuilt, and several
can live in one process.

A rank that dies, or a forward that raises while the ranks run it together (they are then out of
step), is fatal: `RankDiedError`, an `EngineDeadError`, ends the engine loop, the request in flight fail
over, and the server rebuilds the engine as after any dead loop."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from engine.core.block_manager import BlockCopies
from engine.errors import RankDiedError

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.core.scheduler import ScheduledSeq

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 120.0  # a collective that waits this long for a rank: that rank is gone
START_TIMEOUT_S = 600.0  # a worker has this long to load its shard and allocate its KV pool
STOP_TIMEOUT_S = 5.0

Row = tuple[list[int], int, list[int]]  # (block table, first position, token ids computed this step)


class TPGroup:
    """This rank's place in the group, and the all-reduce the model's row-parallel layers call."""

    def __init__(self, rank: int, size: int, store: dist.Store, device: torch.device) -> None:
        self.rank, self.size, self.device = rank, size, device
        if device.type == "cuda":
            self.pg = dist.ProcessGroupNCCL(store, rank, size)
        else:
            self.pg = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=COLLECTIVE_TIMEOUT_S))

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        """In place (every rank ends with the reduction), and returned."""
        options = dist.AllreduceOptions()
        options.reduceOp = op
        self.pg.allreduce([tensor], options).wait()
        return tensor

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's value (e.g. how many KV blocks each rank's pool can hold)."""
        return int(
            self.all_reduce(
                torch.tensor([value], dtype=torch.long, device=self.device), dist.ReduceOp.MIN
            ).item()
        )


def make_store(port: int, size: int, is_master: bool) -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1",
        port,
        size,
        is_master=is_master,
        wait_for_workers=False,
        timeout=timedelta(seconds=START_TIMEOUT_S),
    )


def worker_threads(size: int) -> int:
    """Torch threads of a worker rank on CPU: its share of the cores."""
    return max(1, (os.cpu_count() or 1) // size)


class Ranks:
    """Rank 0's handle on ranks 1..N-1: starts them, sends each step, notices when one is gone.
    `start` spawns them (they load their shards while rank 0 loads its own); `group` is rank 0's
    TPGroup; `wait_ready` waits until every rank has its KV pool."""

    def __init__(self, config: EngineConfig, device: torch.device, rank_main: Callable) -> None:
        """`rank_main(rank, port, config, conn)`: what each spawned rank runs (the model runner's rank loop)."""
        self.size = config.tensor_parallel_size
        self._store = make_store(0, self.size, is_master=True)
        context = mp.get_context("spawn")  # a forked child would inherit rank 0's threads and torch state
        self.processes: list[mp.Process] = []
        self.conns = []
        for rank in range(1, self.size):
            parent, child = context.Pipe()
            process = context.Process(
                target=rank_main,
                args=(rank, self._store.port, config, child),
                name=f"pagedserve-tp-rank{rank}",
                daemon=True,
            )
            process.start()
            child.close()
            self.processes.append(process)
            self.conns.append(parent)
        try:
            self._wait_for("started")  # alive after its imports: now every rank joins the group
            self.group = TPGroup(0, self.size, self._store, device)
        except Exception as exc:
            self.close()
            raise RankDiedError(f"tensor-parallel ranks did not join: {exc}") from exc

    @property
    def pids(self) -> list[int | None]:
        return [p.pid for p in self.processes]

    def wait_ready(self) -> None:
        """Every worker has loaded its shard and allocated its KV pool."""
        self._wait_for("ready")

    def _wait_for(self, expected: str) -> None:
        """Each worker's next message, which must be `expected`; a worker that dies or says anything
        else (its error) fails the start at once, one that stays silent after START_TIMEOUT_S."""
        deadline = time.monotonic() + START_TIMEOUT_S
        for rank, (process, conn) in enumerate(zip(self.processes, self.conns, strict=True), start=1):
            while not conn.poll(0.1):
                if not process.is_alive() and not conn.poll():
                    raise RankDiedError(f"tensor-parallel rank {rank} exited with code {process.exitcode}")
                if time.monotonic() > deadline:
                    raise RankDiedError(
                        f"tensor-parallel rank {rank} not {expected} in {START_TIMEOUT_S:.0f} s"
                    )
            try:
                kind, detail = conn.recv()
            except (EOFError, OSError):
                kind, detail = "error", f"exited with code {process.exitcode}"
            if kind != expected:
                raise RankDiedError(f"tensor-parallel rank {rank} failed to start: {detail}")

    def run(self, scheduled: list[ScheduledSeq], forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Send the step's rows to the other ranks, run rank 0's part of the forward; any failure is fatal."""
        self.send(
            BlockCopies([], [], []),
            [
                (
                    s.seq.block_table,
                    s.start,
                    [s.token_id_at(p) for p in range(s.start, s.start + s.num_new_tokens)],
                )
                for s in scheduled
            ],
        )
        try:
            return forward()
        except Exception as exc:
            self.check_alive()
            raise RankDiedError(
                f"a tensor-parallel forward raised ({exc!r}); the ranks are out of step"
            ) from exc

    def send(self, copies: BlockCopies, rows: list[Row]) -> None:
        self.check_alive()
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send((copies, rows))
            except OSError as exc:
                raise RankDiedError(f"tensor-parallel rank {rank} is gone: {exc!r}") from exc

    def check_alive(self) -> None:
        dead = [
            f"rank {rank} (exit code {p.exitcode})"
            for rank, p in enumerate(self.processes, start=1)
            if not p.is_alive()
        ]
        if dead:
            raise RankDiedError(f"tensor-parallel {', '.join(dead)} died")

    def close(self) -> None:
        """Stop every worker: asked first, then terminated, then killed."""
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for process in self.processes:
            process.join(STOP_TIMEOUT_S)
            if process.is_alive():
                process.terminate()
                process.join(STOP_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join()
        for conn in self.conns:
            conn.close()
        self.conns = []


__all__ = ["RankDiedError", "TPGroup", "Ranks", "make_store", "worker_threads"]
