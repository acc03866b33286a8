"""The meetings of a multi-process run's ranks (:class:`Collectives`), over the launcher's store
(``eval.replicas``), never in a collective that waits for a dead rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from ..parallel import Layout
from .replicas import Channel, Watchdog

__all__ = ["Collectives"]

T = TypeVar("T")


class Collectives:
    """The meetings of a multi-process run, over the launcher's store (``eval.replicas``), never in a collective
    that waits for a dead rank: ``broadcast``/``barrier``/``last_decides`` among every rank, ``replica_share`` and
    ``replica_gather`` among this replica's tensor-parallel ranks. No-ops in one process (no ``layout``)."""

    def __init__(self, layout: Layout | None = None, store: dist.Store | None = None, watchdog: Watchdog | None = None):
        self.layout, self.watchdog = layout, watchdog
        self.world = 1 if layout is None else layout.world
        if self.world > 1:
            self.all = Channel(store, layout.rank, layout.world)
            self.peers = Channel(dist.PrefixStore(f"replica{layout.replica}/", store), layout.tp_rank, layout.tp)

    def broadcast(self, obj: T) -> T:
        return obj if self.world == 1 else self.all.broadcast(obj)

    def barrier(self) -> None:
        if self.world > 1:
            self.all.barrier()

    def last_decides(self, part: T, decide: Callable[[list[T]], Any]) -> Any:
        return decide([part]) if self.world == 1 else self.all.last_decides(part, decide)

    def replica_share(self, obj: T) -> T:
        """The replica's tensor-parallel rank 0's ``obj`` on each of its ranks."""
        return obj if self.world == 1 or self.layout.tp == 1 else self.peers.broadcast(obj)

    def replica_gather(self, obj: T) -> list[T] | None:
        """Each tensor-parallel rank's ``obj`` on the replica's rank 0 (tp rank order), None on the others."""
        return [obj] if self.world == 1 or self.layout.tp == 1 else self.peers.gather(obj)

    def fail(self, why: str) -> None:
        """This rank is ending with an error: every other rank's watchdog ends it too."""
        if self.watchdog is not None:
            self.watchdog.fail(why)
