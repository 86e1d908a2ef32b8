"""Dynamic batching: sentences of concurrent requests searched together, on one decoding thread.

Requests put their sentences on one queue, and the decoding loop searches them in one of two ways.

**Continuous batching** (jobs with a ``stream``: ``attnmt serve --batching continuous``): a job's sentences join a
running search (:class:`~attnmt.generation.continuous.ContinuousSearch`) at its next step, as long as at most
``max_batch`` sentences are in flight, and each sentence leaves it as soon as its translation is final; a job is
answered once all of its sentences are. Every step thus decodes all the sentences in flight, whatever their
arrival, and a short sentence is not held back by a long one. Jobs of other search options wait at the head of
the queue until the running search has drained (first come, first served).

**Static batches** (jobs without one): the loop takes the oldest job, waits at most ``batch_wait``
seconds for more of the same kind (the same search options), then translates up to ``max_batch`` sentences (and at
most ``max_call_cost`` of work) in one call of the translator, starting with the oldest job of the client served
least recently (clients take turns) and leaving out jobs of much longer sentences than that one's (so a short
request does not wait in a call for long ones). The translator sorts them by length and cuts them into
``--max-tokens`` batches as ``attnmt translate`` does. A request's sentences are never split across two calls unless it alone has more than
``max_batch``. Clients that just got their answers usually send their next sentences at once: after each call the
loop waits up to ``return_wait`` seconds until as many sentences as it answered (plus those already waiting) are
there, so that concurrent clients keep sharing full batches instead of settling into two alternating halves; the
wait ends early once they are there, so a lone client waits for nothing.

The queue is bounded in sentences and in cost (the work a request asks for: ``Job.cost``; :class:`Overloaded` when
full: the service answers 503). A request whose caller has gone (it disconnected, timed out, or the service is
stopping: :meth:`Batcher.cancel`) leaves the queue at once; in a running continuous search its sentences end at
the next step; a static search call stops after its current search batch once all of its requests are gone.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# While idle, the decoding loop wakes this often (seconds). Python runs a signal's handler on the main thread only,
# between two bytecodes; when the kernel hands SIGTERM to another thread of the process (the HTTP server's, a
# torch worker's), a main thread asleep in a wait without a timeout would never run it and the service would not
# stop. Waking up lets the handler run within this long.
IDLE_WAKE_SECONDS = 0.2


class Overloaded(Exception):
    """The queue holds too many sentences; try again later."""


class Stopped(Exception):
    """The service is shutting down and takes no new work."""


@dataclass
class Job:
    """One request's sentences, already encoded, and where its answer goes."""

    sources: list[list[int]]
    key: tuple  # jobs with equal keys may share a batch (the same search options)
    run: Callable[..., list[Any]]  # (sentences of this key, cancelled: () -> bool) -> their results
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    arrived: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    stream: Callable[[], Any] | None = None  # the running search of this key (continuous batching), made on demand
    finish: Callable[[list[int], Any], Any] | None = None  # (source ids, hypotheses) -> a sentence's result
    results: list[Any] = field(default_factory=list)
    left: int = 0  # sentences still in flight
    cost: int = 0  # the work it asks for (what max_queue_tokens bounds)
    client: str = ""  # who asked (an API key or an address): the static batches take turns between clients

    def settle(self, result: Any = None, error: BaseException | None = None) -> None:
        def set_it():
            if not self.future.done():
                if error is not None:
                    self.future.set_exception(error)
                else:
                    self.future.set_result(result)

        try:
            self.loop.call_soon_threadsafe(set_it)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass


@dataclass
class BatchStats:
    batches: int = 0
    sentences: int = 0
    target_tokens: int = 0
    busy_seconds: float = 0.0
    steps: int = 0  # continuous batching: search steps, and the sentences they decoded in all
    step_sentences: int = 0


class Batcher:
    """The decoding thread and its bounded queue (see the module docstring)."""

    def __init__(self, max_batch: int, batch_wait: float, max_queue: int,
                 count_tokens: Callable[[Any], int] = lambda r: 0, thread: bool = True, return_wait: float = 0.0,
                 max_queue_cost: int = 0, max_call_cost: int = 0):
        """``thread``: decode on a thread of its own; False: the caller runs :meth:`run` (the service decodes on
        the main thread: a thread's own OpenMP team makes torch's small products several times slower)."""
        self.max_batch = max_batch
        self.batch_wait = batch_wait
        self.max_queue = max_queue
        self.max_queue_cost = max_queue_cost  # 0: unbounded
        self.max_call_cost = max_call_cost  # the most work one static call takes (0: unbounded)
        self._queued_cost = 0
        self._served: OrderedDict[str, int] = OrderedDict()  # client -> the call that last served it
        self._calls = 0
        self.count_tokens = count_tokens
        self.return_wait = return_wait
        self._expect, self._expect_until = 0, 0.0  # sentences expected back after the last call, and until when
        self.stats = BatchStats()
        self._queue: deque[Job] = deque()
        self._queued = 0  # sentences waiting
        self._cond = threading.Condition()
        self._stopping = False
        self._drop_all = False
        self._streams: dict[tuple, Any] = {}  # search options -> their running search (kept for reuse)
        self._stream: Any = None  # the search with sentences in flight
        self._stream_key: tuple | None = None
        self._flight: dict[int, tuple[Job, int]] = {}  # sentence id in the search -> (job, index)
        self._next_sentence = 0
        self._thread = threading.Thread(target=self.run, name="attnmt-decoding", daemon=True) if thread else None
        if self._thread is not None:
            self._thread.start()

    @property
    def queued(self) -> int:
        """Sentences waiting to be searched."""
        return self._queued

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._stopping:
                raise Stopped()
            if self._queued and (self._queued + len(job.sources) > self.max_queue or self.max_queue_cost
                                 and self._queued_cost + job.cost > self.max_queue_cost):
                raise Overloaded()
            self._queue.append(job)
            self._queued += len(job.sources)
            self._queued_cost += job.cost
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """``job``'s caller has gone: drop it from the queue, or from the search it is in (see the module
        docstring)."""
        with self._cond:
            job.cancelled = True
            try:
                self._queue.remove(job)
            except ValueError:  # taken already
                return
            self._queued -= len(job.sources)
            self._queued_cost -= job.cost

    def stop(self, timeout: float | None = None, drop: bool = False) -> None:
        """Finish what is queued (``drop``: cancel it, and what is in flight), then end the decoding loop (and wait
        for its thread, if it has one)."""
        with self._cond:
            self._stopping = True
            if drop:  # the sentences in flight end at the next step (_drop_cancelled, on the decoding thread)
                self._drop_all = True
                for j in self._queue:
                    j.cancelled = True
                self._queue.clear()
                self._queued = self._queued_cost = 0
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _take(self) -> list[Job] | None:
        """The next batch's jobs (None: stopped and nothing left)."""
        with self._cond:
            while not self._queue:
                if self._stopping:
                    return None
                self._cond.wait(IDLE_WAKE_SECONDS)
            first = self._queue[0]
            deadline = first.arrived + self.batch_wait
            while not self._stopping:
                same = sum(len(j.sources) for j in self._queue if j.key == first.key)
                now = time.monotonic()
                until = max(deadline, self._expect_until) if same < self._expect else deadline
                if same >= self.max_batch or until <= now:
                    break
                self._cond.wait(until - now)
            if not self._queue:  # all cancelled while waiting
                return []
            first = min(self._queue, key=lambda j: (self._served.get(j.client, -1), j.arrived))
            unit = first.cost / max(1, len(first.sources))  # its work per sentence
            jobs, size, cost, full, keep = [], 0, 0, False, deque()
            for j in [first, *(j for j in self._queue if j is not first)]:
                # first come, first served after the first: the first job that does not fit ends the batch; jobs
                # of much longer sentences than the first's wait for a call of their own
                fits = j.key == first.key and not full and (not jobs or size + len(j.sources) <= self.max_batch
                                                            and (not self.max_call_cost
                                                                 or cost + j.cost <= self.max_call_cost))
                if fits and j.cost <= 2 * unit * len(j.sources):
                    jobs.append(j)
                    size += len(j.sources)
                    cost += j.cost
                    self._queued -= len(j.sources)
                    self._queued_cost -= j.cost
                else:
                    full = full or (j.key == first.key and not fits)
                    keep.append(j)
            self._queue = keep
            self._calls += 1
            for j in jobs:  # the clients served now go after the others next time
                self._served[j.client] = self._calls
                self._served.move_to_end(j.client)
            while len(self._served) > 10_000:
                self._served.popitem(last=False)
            return jobs

    def run(self) -> None:
        """The decoding loop: batches until :meth:`stop` and the queue is empty."""
        while True:
            if self._stream is not None and self._stream.size:
                self._join(self._admissible())
                self._drop_cancelled()
                self._step()
                continue
            jobs = self._take()
            if jobs is None:
                return
            jobs = [j for j in jobs if not j.cancelled]
            if not jobs:
                continue
            if jobs[0].stream is not None:
                self._join(jobs)
                continue
            sources = [s for j in jobs for s in j.sources]
            t0 = time.perf_counter()
            try:
                results = jobs[0].run(sources, lambda jobs=jobs: all(j.cancelled for j in jobs))
            except Exception as e:  # noqa: BLE001 - a request must never end the decoding loop
                for j in jobs:
                    j.settle(error=e)
                continue
            finally:
                self.stats.busy_seconds += time.perf_counter() - t0
            self.stats.batches += 1
            self.stats.sentences += len(sources)
            self.stats.target_tokens += sum(self.count_tokens(r) for r in results if r is not None)
            with self._cond:  # the clients answered now are expected back with their next sentences
                self._expect = min(self.max_batch, self._queued + len(sources))
                self._expect_until = time.monotonic() + self.return_wait
            at = 0
            for j in jobs:
                j.settle(results[at: at + len(j.sources)])
                at += len(j.sources)

    # ------------------------------------------------------------------------------------------ continuous

    def _admissible(self) -> list[Job]:
        """The jobs at the head of the queue that may join the running search now (its options, within
        ``max_batch`` sentences in flight); a job of other options at the head stops admission until it drains."""
        jobs: list[Job] = []
        with self._cond:
            room = self.max_batch - self._stream.size
            while self._queue:
                j = self._queue[0]
                if j.cancelled:
                    self._queue.popleft()
                    self._queued -= len(j.sources)
                    self._queued_cost -= j.cost
                    continue
                if j.stream is None or j.key != self._stream_key or len(j.sources) > room:
                    break
                self._queue.popleft()
                self._queued -= len(j.sources)
                self._queued_cost -= j.cost
                room -= len(j.sources)
                jobs.append(j)
        return jobs

    def _join(self, jobs: list[Job]) -> None:
        """Let the jobs' sentences join the running search of their options (started if needed)."""
        if not jobs:
            return
        key = jobs[0].key
        t0 = time.perf_counter()
        try:
            if self._stream is None or self._stream_key != key:
                if key not in self._streams:
                    self._streams[key] = jobs[0].stream()
                self._stream, self._stream_key = self._streams[key], key
            ids = []
            for j in jobs:
                j.results, j.left = [None] * len(j.sources), len(j.sources)
                for i in range(len(j.sources)):
                    self._flight[self._next_sentence] = (j, i)
                    ids.append(self._next_sentence)
                    self._next_sentence += 1
            self._stream.add([s for j in jobs for s in j.sources], ids)
            self.stats.batches += 1
        except Exception as e:  # noqa: BLE001 - a request must never end the decoding loop
            self._fail(e, jobs)
        finally:
            self.stats.busy_seconds += time.perf_counter() - t0

    def _step(self) -> None:
        """One step of the running search; answer the jobs whose last sentence it finished."""
        t0 = time.perf_counter()
        size = self._stream.size
        try:
            done = self._stream.step()
        except Exception as e:  # noqa: BLE001 - a request must never end the decoding loop
            self._fail(e)
            return
        finally:
            self.stats.busy_seconds += time.perf_counter() - t0
        self.stats.steps += 1
        self.stats.step_sentences += size
        for sid, hyps in done:
            if sid not in self._flight:  # dropped: its caller has gone
                continue
            job, i = self._flight.pop(sid)
            try:
                job.results[i] = job.finish(job.sources[i], hyps)
            except Exception as e:  # noqa: BLE001
                job.settle(error=e)
                job.left = -1
                continue
            self.stats.sentences += 1
            self.stats.target_tokens += self.count_tokens(job.results[i])
            job.left -= 1
            if job.left == 0:
                job.settle(job.results)

    def _drop_cancelled(self) -> None:
        """End the sentences of cancelled jobs in the running search."""
        gone = [sid for sid, (j, _) in self._flight.items() if j.cancelled or self._drop_all]
        if gone:
            for sid in gone:
                del self._flight[sid]
            self._stream.drop(gone)

    def _fail(self, error: BaseException, jobs: list[Job] = ()) -> None:
        """A search failed: answer its jobs (and ``jobs``) with ``error`` and start afresh."""
        for j in {id(j): j for j in [*(j for j, _ in self._flight.values()), *jobs]}.values():
            j.settle(error=error)
        self._flight.clear()
        self._streams.pop(self._stream_key, None)
        self._stream, self._stream_key = None, None
