"""Ranks that never wait for a dead one: a watchdog and small messages through the launcher's store.

A multi-process job's ranks meet only through the key-value store the launcher already runs for
torch.distributed (``MASTER_ADDR:MASTER_PORT``: rank 0's TCPStore, or torchrun's agent store), each with a
client connection of its own:

- :class:`Watchdog`: every rank bumps its own beat counter every ``beat_s`` seconds, and checks every other
  rank's. A rank whose counter has stood still for ``dead_after_s`` seconds (killed, even by SIGKILL, or hung), a
  rank that announced its failure (:meth:`Watchdog.fail`: an exception, an out-of-memory marker), or a store that
  no longer answers ends this process at once, exit status 1, whatever its main thread is waiting for. A job whose
  replica dies thus exits within ``dead_after_s + 2 * beat_s`` seconds (under a minute), and every sample the
  others finished is already in their shards (``eval.run``).
- :class:`Channel`: broadcast from rank 0, gather to rank 0, a barrier, and "the last to arrive decides" (the
  last replica to finish a run merges the shards), over store keys. Every rank makes the
  same calls in the same order (as with torch.distributed collectives), so the n-th call's keys are the same
  everywhere. A call may wait as long as a live peer needs (a replica finishing its last batch): only the
  watchdog, never a timeout, ends a wait.

Keys live under ``batchmax/<nonce>/``, the nonce broadcast by rank 0 at start, so a restarted job never reads
an earlier one's keys.

- :class:`Setup`: the first steps every process of a job takes, the main job's and the lm-eval model's alike: the
  bound below, the store and a watchdog from the first moment (``watch_from_start``), then the process groups'
  rendezvous (``parallel.init_distributed``), each step named.
- :class:`SetupBound`: the set-up of a multi-process job (the store, the configuration and data, the process
  group's rendezvous and DeepSpeed's set-up, the model's load, AutoTP, the meeting after it) under one bound,
  ``setup_timeout``. A rank still in set-up when the bound passes prints one line naming the step it waits in (and,
  when it waits on a file lock such as a torch extension build's, the lock's path and age), tells every peer (they
  end too) and exits 1: a live rank that waits forever (its beats go on, so the watchdog cannot tell) still ends.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import pickle
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from .. import parallel

logger = logging.getLogger(__name__)

__all__ = [
    "BEAT_S",
    "DEAD_AFTER_S",
    "START_GRACE_S",
    "Channel",
    "Setup",
    "SetupBound",
    "Watchdog",
    "connect",
    "watch_from_start",
]

BEAT_S = 2.0  #: seconds between two beats of a rank
DEAD_AFTER_S = 30.0  #: a rank whose beat has not moved for this long is dead (env ``BATCHMAX_DEAD_AFTER_S``)
#: a rank that has not beaten once after this long never started (env ``BATCHMAX_START_GRACE_S``); the launchers
#: start every rank within seconds of the others (torchrun's agents meet first)
START_GRACE_S = 120.0
_POLL_S = 0.05  #: a waiting call checks its key this often
_STORE_TIMEOUT_S = 15  #: one store operation; a store that does not answer in time is gone


def _exit(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    logging.shutdown()
    os._exit(1)


def watch_from_start(rank: int, world: int) -> tuple[dist.Store, Watchdog] | None:
    """The job's store and a started watchdog, from the first moment of a multi-process job: before the model loads
    and before any wait on another rank (the process groups' rendezvous, AutoTP, the first collectives), so a rank
    lost at any moment ends every other within the watchdog's limit. None under MPI (no store address before
    DeepSpeed's discovery: ``connect`` then follows the process group, and mpirun itself ends a job whose rank dies).

    The store is the launcher's: torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE``), else the one rank 0
    hosts at ``MASTER_ADDR:MASTER_PORT`` for the default process group, started here first (multi-tenant: the
    process group's rendezvous reuses it). A client waits at most ``START_GRACE_S`` for rank 0 to host it; a live
    rank's later waits (a slow load: the ``setup_timeout`` setting) are bounded by its peers' beats, not by that
    timeout."""
    if world <= 1 or not parallel.rendezvous_env():
        return None
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    grace = float(os.environ.get("BATCHMAX_START_GRACE_S", START_GRACE_S))
    try:
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world_size=world,
            is_master=rank == 0 and not agent,
            timeout=datetime.timedelta(seconds=grace),
            wait_for_workers=False,
            multi_tenant=True,
        )
    except (RuntimeError, dist.DistStoreError) as err:
        raise RuntimeError(
            f"rank {rank}: the job's store at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} did not "
            f"answer within {grace:.0f} s (rank 0 lost or never started: {' '.join(str(err).split())[:200]})"
        ) from None
    store.set_timeout(datetime.timedelta(seconds=_STORE_TIMEOUT_S))
    run = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    prefixed = dist.PrefixStore(f"batchmax/{run}/", store)  # a restarted torchrun job never reads older keys
    return prefixed, Watchdog(prefixed, rank, world, start_grace_s=grace).start()


def connect(rank: int, world: int, timeout_s: float = _STORE_TIMEOUT_S) -> dist.Store:
    """A client of the launcher's store (``MASTER_ADDR``/``MASTER_PORT``), keys prefixed by a nonce of this job.

    Collective over the default process group (the nonce comes from rank 0): call it on every rank once the group
    exists."""
    box = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size=world,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    return dist.PrefixStore(f"batchmax/{box[0]}/", store)


class Watchdog:
    """Ends this process when any other rank dies, fails or the store is gone (see the module docstring).

    ``on_dead(message)``: what to do then (default: the message as one ``error:`` line, then ``os._exit(1)``).
    :meth:`leave` marks a normal end, so that peers still working do not take the silence for a death."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world: int,
        *,
        beat_s: float | None = None,
        dead_after_s: float | None = None,
        start_grace_s: float | None = None,
        on_dead: Callable[[str], None] = _exit,
    ):
        if dead_after_s is None:
            dead_after_s = float(os.environ.get("BATCHMAX_DEAD_AFTER_S", DEAD_AFTER_S))
        beat_s = min(BEAT_S, dead_after_s / 4) if beat_s is None else beat_s
        self.store, self.rank, self.world = store, rank, world
        self.beat_s, self.dead_after_s, self.on_dead = beat_s, dead_after_s, on_dead
        # a peer that has not beaten yet may still be starting: it is dead only after this long
        self.start_grace_s = dead_after_s if start_grace_s is None else max(start_grace_s, dead_after_s)
        self._stop = threading.Event()
        self._failed = False
        self._thread = threading.Thread(target=self._watch, name="batchmax-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self.store.add(f"beat/{self.rank}", 1)
        self._thread.start()
        return self

    def until_exit(self) -> Watchdog:
        """Watch until this process ends (a library's process, such as lm-eval's, whose end is not ours): a normal
        exit leaves (``leave``) and then destroys the process groups, before the interpreter tears down (a group
        left to the interpreter's end may abort the process there: "terminate called without an active exception",
        seen once in CI under load); an uncaught exception fails (``fail``: the peers end at once)."""
        previous = sys.excepthook

        def hook(kind, value, tb):
            self.fail(f"{kind.__name__}: {' '.join(str(value).split())}")
            previous(kind, value, tb)

        def end() -> None:
            if self._failed:
                return
            self.leave()
            if dist.is_initialized():
                dist.destroy_process_group()

        sys.excepthook = hook
        atexit.register(end)
        return self

    def silent_peers(self) -> list[int]:
        """The peers (not yet left) whose beat does not move over the next ``2.5 * beat_s`` seconds: after a
        collective broke on a closed connection, which rank was lost. Empty when every peer beats (or no store)."""
        try:
            peers = [r for r in range(self.world) if r != self.rank and not self.store.add(f"left/{r}", 0)]
            before = {r: self.store.add(f"beat/{r}", 0) for r in peers}
            time.sleep(2.5 * self.beat_s)
            return [r for r in peers if self.store.add(f"beat/{r}", 0) == before[r]]
        except Exception:  # noqa: BLE001 - the store is gone with rank 0: nothing to name
            return []

    def fail(self, why: str) -> None:
        """Tell every peer that this rank is ending with an error (they exit at their next check)."""
        self._failed = True
        try:
            self.store.set("failed", f"rank {self.rank}: {why}"[:500])
        except Exception:  # noqa: BLE001 - the store may be gone too; the peers will see our beat stop
            pass

    def leave(self, wait_s: float = 30.0) -> None:
        """A normal end, once every rank is done: stop beating and watching. Rank 0 leaves last (at most ``wait_s``
        after the others' turn), as its process may host the store."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=wait_s)  # no watch left inside a store call when the process ends
        try:
            self.store.add(f"left/{self.rank}", 1)
            deadline = time.monotonic() + wait_s
            while self.rank == 0 and time.monotonic() < deadline:
                if all(self.store.add(f"left/{r}", 0) for r in range(1, self.world)):
                    break
                time.sleep(_POLL_S)
        except Exception:  # noqa: BLE001 - nobody is left to tell
            pass

    def _watch(self) -> None:
        seen = {r: (0, time.monotonic()) for r in range(self.world) if r != self.rank}
        while not self._stop.wait(self.beat_s):
            try:
                message = self._check(seen)
            except Exception as err:  # noqa: BLE001 - a store that fails is a store that is gone
                message = f"the job's store does not answer ({type(err).__name__}): rank 0's host is gone"
            if message is not None and not self._stop.is_set():
                self._stop.set()
                self.on_dead(
                    f"rank {self.rank}: {message}; ending this rank (finished samples are on disk: run "
                    "the same command again to complete the missing ones)"
                )
                return

    def _check(self, seen: dict[int, tuple[int, float]]) -> str | None:
        self.store.add(f"beat/{self.rank}", 1)
        if not self._failed and self.store.check(["failed"]):  # (this rank's own failure: it is ending already)
            return f"another rank failed ({self.store.get('failed').decode()})"
        now = time.monotonic()
        for r, (count, since) in list(seen.items()):
            if self.store.add(f"left/{r}", 0):
                del seen[r]
                continue
            beat = self.store.add(f"beat/{r}", 0)
            if beat != count:
                seen[r] = (beat, now)
            elif beat == 0 and now - since > self.start_grace_s:
                return f"rank {r} never started ({now - since:.0f} s)"
            elif beat > 0 and now - since > self.dead_after_s:
                return f"rank {r} has not answered for {now - since:.0f} s (killed or hung)"
        return None


class Channel:
    """Rank 0 decides, everyone follows: broadcast, gather and barrier over the store (module docstring)."""

    def __init__(self, store: dist.Store, rank: int, world: int):
        self.store, self.rank, self.world = store, rank, world
        self._calls = 0

    def _key(self, name: str) -> str:
        return f"c{self._calls}/{name}"

    def _wait(self, key: str) -> Any:
        while not self.store.check([key]):
            time.sleep(_POLL_S)
        return pickle.loads(self.store.get(key))

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self._calls += 1
        key = self._key("b")
        if self.rank == src:
            self.store.set(key, pickle.dumps(obj))
            return obj
        return self._wait(key)

    def gather(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` on ``dst`` (in rank order), None elsewhere."""
        self._calls += 1
        if self.rank != dst:
            self.store.set(self._key(f"g{self.rank}"), pickle.dumps(obj))
            return None
        out = []
        for r in range(self.world):
            if r == dst:
                out.append(obj)
                continue
            key = self._key(f"g{r}")
            out.append(self._wait(key))
            self.store.delete_key(key)
        return out

    def barrier(self) -> None:
        self.gather(None)
        self.broadcast(None)

    def last_decides(self, part: Any, decide: Callable[[list[Any]], Any]) -> Any:
        """Every rank hands in ``part``; the last rank to arrive calls ``decide(parts)`` (rank order) and every rank
        gets its result. Nobody waits for a rank that is still working unless it has to: the early ones only for
        the result."""
        self._calls += 1
        self.store.set(self._key(f"p{self.rank}"), pickle.dumps(part))
        if self.store.add(self._key("n"), 1) < self.world:
            return self._wait(self._key("r"))
        parts = [pickle.loads(self.store.get(self._key(f"p{r}"))) for r in range(self.world)]
        for r in range(self.world):
            self.store.delete_key(self._key(f"p{r}"))
        result = decide(parts)
        self.store.set(self._key("r"), pickle.dumps(result))
        return result


# ---------------------------------------------------------------------- set-up under one bound
def waited_lock(thread_id: int) -> tuple[str, float] | None:
    """The lock file (path, age in seconds) that thread ``thread_id`` waits on in ``FileBaton.wait``, if it does."""
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        baton = frame.f_locals.get("self") if frame.f_code.co_name == "wait" else None
        path = getattr(baton, "lock_file_path", None)
        if isinstance(path, str):
            try:
                return path, time.time() - os.stat(path).st_mtime
            except OSError:
                return None  # released meanwhile
        frame = frame.f_back
    return None


class SetupBound:
    """A multi-process job's set-up under one bound (module docstring): ``with bound.step("what"):`` names what this
    rank does now; :meth:`done` once generation may start. Inactive (nothing watched) for a world of one.

    ``tell(line)``: how the peers learn of the end (the watchdog's :meth:`Watchdog.fail`), set once it exists;
    ``on_expire(line)``: what ends this rank (default: the line on stderr, then ``os._exit(1)``)."""

    def __init__(
        self,
        rank: int,
        bound_s: float,
        *,
        active: bool = True,
        check_s: float = 1.0,
        on_expire: Callable[[str], None] = _exit,
    ):
        self.rank, self.bound_s, self.check_s, self.on_expire = rank, bound_s, check_s, on_expire
        self.tell: Callable[[str], None] | None = None
        self.current, self._since = "starting", time.monotonic()
        self._deadline = self._since + bound_s
        self._main = threading.get_ident()
        self._stop = threading.Event()
        if active:
            threading.Thread(target=self._watch, name="batchmax-setup-bound", daemon=True).start()

    @contextlib.contextmanager
    def step(self, what: str):
        self.current, self._since = what, time.monotonic()
        yield

    def done(self) -> None:
        self._stop.set()

    def why(self) -> str:
        """What this rank waits in, as the line it ends with (after ``rank R: ``)."""
        line = (
            f"set-up did not finish within {self.bound_s:g} s (setup_timeout): waiting in {self.current} for "
            f"{time.monotonic() - self._since:.0f} s"
        )
        lock = waited_lock(self._main)
        if lock is not None:
            line += (
                f", on the lock file {lock[0]} ({lock[1]:.0f} s old: a build that was killed leaves it, and nothing "
                "removes it; delete it when no build is running)"
            )
        return line

    def _watch(self) -> None:
        while not self._stop.wait(self.check_s):
            if time.monotonic() > self._deadline and not self._stop.is_set():
                why = self.why()
                if self.tell is not None:
                    self.tell(why)
                self.on_expire(f"rank {self.rank}: {why}")
                return


class Setup:
    """How every process of a job starts, in one place (the main job, ``job.run``, and the lm-eval model,
    ``harness.BatchMaxLM``): the set-up bound (:class:`SetupBound`, ``bound_s``), then the job's store and a watchdog
    from the first moment (``watch_from_start``: None in a world of one and under MPI), which from then on is how
    the peers learn that this rank ends; :meth:`join` is the process groups' rendezvous, a named step.

    ``RuntimeError``/``ValueError``: the store did not answer, or a multi-node SLURM job lacks its address."""

    def __init__(self, rank: int, world: int, bound_s: float):
        self.bound = SetupBound(rank, bound_s, active=world > 1)
        with self.bound.step("connecting to the job's store (the launcher's MASTER_ADDR:MASTER_PORT)"):
            self.early = watch_from_start(rank, world)
        if self.early is not None:
            self.bound.tell = self.early[1].fail

    def step(self, what: str):
        """``with setup.step("what"):`` names what this rank does now (:meth:`SetupBound.step`)."""
        return self.bound.step(what)

    def join(self, tp: int, device: str, timeout_s: int = parallel.SETUP_TIMEOUT_S) -> parallel.Layout:
        """The process groups' rendezvous and DeepSpeed's set-up (``parallel.init_distributed``), a named step."""
        with self.bound.step(parallel.rendezvous_step(device)):
            return parallel.init_distributed(tp, device, timeout_s=timeout_s)

    def tell(self, why: str) -> None:
        """This rank ends with an error during the set-up: every other rank's watchdog ends it too."""
        if self.early is not None:
            self.early[1].fail(why)

    def done(self) -> None:
        """The set-up is over (:meth:`SetupBound.done`)."""
        self.bound.done()
