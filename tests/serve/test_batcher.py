"""The service's dynamic batching: concurrent jobs share a call, the queue bound refuses work (503), a job whose
caller gave up is not searched, a failing batch fails its jobs only, and stopping finishes what is queued."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from attnmt.serve.batcher import Batcher, Job, Overloaded, Stopped


class Recorder:
    """A ``run`` that records each call's sentences; ``gate`` holds the first call until it is set."""

    def __init__(self, gate: threading.Event | None = None, fail_on: int | None = None):
        self.calls: list[list[list[int]]] = []
        self.gate = gate
        self.fail_on = fail_on
        self.started = threading.Event()

    def __call__(self, sources, cancelled=lambda: False):
        self.started.set()
        if self.gate is not None:
            self.gate.wait(10)
        self.calls.append(sources)
        if self.fail_on is not None and [self.fail_on] in sources:
            raise RuntimeError("boom")
        return [[x * 10 for x in s] for s in sources]


def run_jobs(batcher: Batcher, groups, run, key=("k",), before_wait=None):
    async def main():
        loop = asyncio.get_running_loop()
        jobs = [Job(sources=g, key=key, run=run, future=loop.create_future(), loop=loop) for g in groups]
        for j in jobs:
            batcher.submit(j)
        if before_wait:
            before_wait(jobs)
        return await asyncio.gather(*(j.future for j in jobs), return_exceptions=True)

    return asyncio.run(main())


def test_jobs_waiting_together_share_one_call_and_get_their_own_results():
    b = Batcher(max_batch=64, batch_wait=0.2, max_queue=100)
    rec = Recorder()
    out = run_jobs(b, [[[1], [2]], [[3]], [[4], [5], [6]]], rec)
    b.stop()
    assert out == [[[10], [20]], [[30]], [[40], [50], [60]]]
    assert rec.calls == [[[1], [2], [3], [4], [5], [6]]]
    assert (b.stats.batches, b.stats.sentences) == (1, 6)


def test_a_batch_holds_at_most_max_batch_sentences_and_never_splits_a_job():
    b = Batcher(max_batch=3, batch_wait=0.2, max_queue=100)
    rec = Recorder()
    out = run_jobs(b, [[[1], [2]], [[3], [4]], [[5]], [[6], [7], [8], [9]]], rec)
    b.stop()
    assert out[3] == [[60], [70], [80], [90]]
    assert rec.calls == [[[1], [2]], [[3], [4], [5]], [[6], [7], [8], [9]]]


def test_jobs_of_other_search_options_go_to_other_calls():
    b = Batcher(max_batch=64, batch_wait=0.2, max_queue=100)
    rec = Recorder()

    async def main():
        loop = asyncio.get_running_loop()
        jobs = [Job(sources=[[k]], key=(k % 2,), run=rec, future=loop.create_future(), loop=loop) for k in range(4)]
        for j in jobs:
            b.submit(j)
        return await asyncio.gather(*(j.future for j in jobs))

    assert asyncio.run(main()) == [[[0]], [[10]], [[20]], [[30]]]
    b.stop()
    assert sorted(rec.calls) == [[[0], [2]], [[1], [3]]]


def test_a_full_queue_refuses_work_and_a_given_up_job_is_not_searched():
    gate = threading.Event()
    rec = Recorder(gate)
    b = Batcher(max_batch=2, batch_wait=0.0, max_queue=3)

    async def main():
        loop = asyncio.get_running_loop()

        def job(s):
            return Job(sources=s, key=("k",), run=rec, future=loop.create_future(), loop=loop)

        first = job([[1], [2]])
        b.submit(first)  # taken by the decoding thread, which waits on the gate
        await loop.run_in_executor(None, rec.started.wait, 10)
        waiting = job([[3], [4]])
        b.submit(waiting)
        with pytest.raises(Overloaded):
            b.submit(job([[5], [6]]))  # 2 queued + 2 > 3
        waiting.cancelled = True  # its caller timed out
        gate.set()
        return await first.future

    assert asyncio.run(main()) == [[10], [20]]
    b.stop()
    assert rec.calls == [[[1], [2]]]
    assert b.queued == 0


def test_a_failing_batch_fails_its_jobs_and_the_thread_goes_on():
    b = Batcher(max_batch=64, batch_wait=0.0, max_queue=100)
    rec = Recorder(fail_on=7)
    out = run_jobs(b, [[[7]]], rec)
    assert isinstance(out[0], RuntimeError)
    assert run_jobs(b, [[[8]]], rec) == [[[80]]]
    b.stop()


def test_stop_finishes_the_queued_work_then_refuses_more():
    gate = threading.Event()
    rec = Recorder(gate)
    b = Batcher(max_batch=1, batch_wait=0.0, max_queue=100)

    async def main():
        loop = asyncio.get_running_loop()
        jobs = [Job(sources=[[k]], key=("k",), run=rec, future=loop.create_future(), loop=loop) for k in range(3)]
        for j in jobs:
            b.submit(j)
        stopper = threading.Thread(target=b.stop)
        stopper.start()
        await asyncio.sleep(0.05)
        with pytest.raises(Stopped):
            b.submit(Job(sources=[[9]], key=("k",), run=rec, future=loop.create_future(), loop=loop))
        gate.set()
        got = await asyncio.gather(*(j.future for j in jobs))
        stopper.join()
        return got

    assert asyncio.run(main()) == [[[0]], [[10]], [[20]]]


def test_after_a_call_the_loop_waits_for_its_clients_next_sentences():
    """Three clients answered together come back one by one; with a return wait they share the next call again
    (without one, the first to come back would be searched alone)."""

    def round_trips(return_wait: float) -> list[int]:
        rec = Recorder()
        b = Batcher(max_batch=8, batch_wait=0.0, max_queue=100, return_wait=return_wait)

        async def main():
            loop = asyncio.get_running_loop()

            def job(k):
                return Job(sources=[[k]], key=("k",), run=rec, future=loop.create_future(), loop=loop)

            first = [job(k) for k in range(3)]
            for j in first:
                b.submit(j)
            await asyncio.gather(*(j.future for j in first))
            again = []
            for k in range(3):  # the clients return 20 ms apart
                again.append(job(10 + k))
                b.submit(again[-1])
                await asyncio.sleep(0.02)
            await asyncio.gather(*(j.future for j in again))

        asyncio.run(main())
        b.stop()
        return [len(c) for c in rec.calls]

    assert round_trips(0.5)[-1] == 3
    assert round_trips(0.0)[-3:] == [1, 1, 1]


# ------------------------------------------------------------------------------------------ continuous batching


class FakeSearch:
    """A running search whose sentence ``[n, ...]`` takes ``n`` steps and translates to ``[x * 10 ...]``; records
    the sentences in flight at each step. ``fail_on``: a step with this sentence in flight raises."""

    def __init__(self, fail_on: int | None = None, step_seconds: float = 0.0):
        self.flight: dict = {}  # key -> (sentence, steps left)
        self.sizes: list[int] = []
        self.fail_on = fail_on
        self.step_seconds = step_seconds

    @property
    def size(self) -> int:
        return len(self.flight)

    def add(self, sources, keys):
        for s, k in zip(sources, keys):
            self.flight[k] = (s, s[0])

    def drop(self, keys):
        for k in keys:  # as ContinuousSearch does: the sentence ends at the next step
            if k in self.flight:
                self.flight[k] = (self.flight[k][0], 1)

    def step(self):
        time.sleep(self.step_seconds)
        self.sizes.append(self.size)
        if any(s[0] == self.fail_on for s, _ in self.flight.values()):
            raise RuntimeError("boom")
        done = []
        for k, (s, left) in list(self.flight.items()):
            if left <= 1:
                done.append((k, [x * 10 for x in s]))
                del self.flight[k]
            else:
                self.flight[k] = (s, left - 1)
        return done


def stream_job(loop, sources, search: FakeSearch, key=("k",), order: list | None = None):
    def finish(ids, hyps):
        if order is not None:
            order.append(ids[0])
        return hyps

    return Job(sources=sources, key=key, run=None, future=loop.create_future(), loop=loop,
               stream=lambda: search, finish=finish)


def test_sentences_join_the_running_search_and_leave_it_when_done():
    """A short sentence sent after a long one is answered first; at most max_batch sentences are in flight."""
    search, order = FakeSearch(), []
    b = Batcher(max_batch=3, batch_wait=0.0, max_queue=100)

    async def main():
        loop = asyncio.get_running_loop()
        jobs = [stream_job(loop, s, search, order=order) for s in ([[9]], [[5], [2]], [[1]], [[3]])]
        for j in jobs:
            b.submit(j)
        return await asyncio.gather(*(j.future for j in jobs))

    assert asyncio.run(main()) == [[[90]], [[50], [20]], [[10]], [[30]]]
    b.stop()
    assert order.index(1) < order.index(9) and order.index(2) < order.index(5)
    assert max(search.sizes) == 3  # the job of one sentence joined once a place was free
    assert (b.stats.sentences, b.stats.steps) == (5, len(search.sizes))
    assert b.stats.step_sentences == sum(search.sizes)


def test_jobs_of_other_options_wait_until_the_running_search_drains():
    searches = {("a",): FakeSearch(), ("b",): FakeSearch()}
    order: list[int] = []
    b = Batcher(max_batch=8, batch_wait=0.0, max_queue=100)

    async def main():
        loop = asyncio.get_running_loop()
        jobs = [stream_job(loop, s, searches[k], key=k, order=order) for s, k in
                (([[4]], ("a",)), ([[1]], ("b",)), ([[2]], ("a",)))]
        for j in jobs:
            b.submit(j)
        got = await asyncio.gather(*(j.future for j in jobs[:2]))
        b.submit(late := stream_job(loop, [[3]], searches[("a",)], key=("a",), order=order))
        return got + [await jobs[2].future, await late.future]

    assert asyncio.run(main()) == [[[40]], [[10]], [[20]], [[30]]]
    b.stop()
    assert order[:3] == [2, 4, 1]  # the "b" job waited until the "a" jobs taken with the first one were done
    assert searches[("a",)].sizes[:4] == [2, 2, 1, 1] and searches[("b",)].sizes == [1]


def test_a_failing_search_fails_its_jobs_and_the_loop_goes_on():
    failing = FakeSearch(fail_on=7)
    b = Batcher(max_batch=8, batch_wait=0.0, max_queue=100)

    async def main(search, groups):
        loop = asyncio.get_running_loop()
        jobs = [stream_job(loop, g, search) for g in groups]
        for j in jobs:
            b.submit(j)
        return await asyncio.gather(*(j.future for j in jobs), return_exceptions=True)

    out = asyncio.run(main(failing, [[[3]], [[7]]]))
    assert all(isinstance(o, RuntimeError) for o in out)
    assert asyncio.run(main(FakeSearch(), [[[2]]])) == [[[20]]]  # a fresh search for the next jobs
    b.stop()


def test_stop_finishes_the_sentences_in_flight_and_the_queued_ones():
    search = FakeSearch()
    b = Batcher(max_batch=1, batch_wait=0.0, max_queue=100)

    async def main():
        loop = asyncio.get_running_loop()
        jobs = [stream_job(loop, [[k]], search) for k in (3, 2, 1)]
        for j in jobs:
            b.submit(j)
        await asyncio.sleep(0)
        stopper = threading.Thread(target=b.stop)
        stopper.start()
        got = await asyncio.gather(*(j.future for j in jobs))
        stopper.join()
        return got

    assert asyncio.run(main()) == [[[30]], [[20]], [[10]]]


def test_the_queue_is_bounded_by_cost_and_a_cancelled_job_leaves_it_at_once():
    gate = threading.Event()
    rec = Recorder(gate)
    b = Batcher(max_batch=1, batch_wait=0.0, max_queue=100, max_queue_cost=10)

    async def main():
        loop = asyncio.get_running_loop()

        def job(k, cost):
            return Job(sources=[[k]], key=("k",), run=rec, future=loop.create_future(), loop=loop, cost=cost)

        running = job(1, 6)
        b.submit(running)
        await loop.run_in_executor(None, rec.started.wait, 10)
        waiting = job(2, 6)
        b.submit(waiting)
        with pytest.raises(Overloaded):
            b.submit(job(3, 5))  # 6 + 5 > 10
        b.cancel(waiting)
        assert (b.queued, b._queued_cost) == (0, 0)
        after = job(4, 9)
        b.submit(after)  # room again
        gate.set()
        return await running.future, await after.future, waiting.future.done()

    assert asyncio.run(main()) == ([[10]], [[40]], False)
    b.stop()
    assert rec.calls == [[[1]], [[4]]]  # the cancelled job was never searched


def test_a_static_call_stops_between_search_batches_once_all_its_jobs_are_gone():
    first_done, go_on, asked = threading.Event(), threading.Event(), []

    def run(sources, cancelled):
        out = []
        for s in sources:  # one search batch per sentence
            out.append([x * 10 for x in s])
            first_done.set()
            go_on.wait(10)
            asked.append(cancelled())
            if asked[-1]:
                break
        return out + [None] * (len(sources) - len(out))

    b = Batcher(max_batch=8, batch_wait=0.0, max_queue=100)

    async def main():
        loop = asyncio.get_running_loop()
        job = Job(sources=[[1], [2], [3]], key=("k",), run=run, future=loop.create_future(), loop=loop)
        b.submit(job)
        await loop.run_in_executor(None, first_done.wait, 10)
        b.cancel(job)  # its client went while its search ran
        go_on.set()
        await asyncio.sleep(0.1)
        return job.future.done() and job.future.result()

    assert asyncio.run(main()) == [[10], None, None]  # nobody reads it: what was left was not searched
    b.stop()
    assert asked == [True]


def test_a_cancelled_job_leaves_the_running_search_at_its_next_step():
    search = FakeSearch(step_seconds=0.01)
    b = Batcher(max_batch=8, batch_wait=0.0, max_queue=100)

    async def main():
        loop = asyncio.get_running_loop()
        long, short = stream_job(loop, [[50]], search), stream_job(loop, [[3]], search)
        b.submit(long)
        b.submit(short)
        while not search.sizes:
            await asyncio.sleep(0.001)
        b.cancel(long)
        got = await short.future
        while search.size:
            await asyncio.sleep(0.001)
        return got, long.future.done()

    assert asyncio.run(main()) == ([[30]], False)
    b.stop()
    assert len(search.sizes) < 10  # not the 50 steps the long sentence would take
    assert b.stats.sentences == 1 and not b._flight


def test_clients_take_turns_and_a_short_job_is_not_searched_with_much_longer_ones():
    gate = threading.Event()
    rec = Recorder(gate)
    b = Batcher(max_batch=64, batch_wait=0.0, max_queue=100, max_call_cost=250)

    async def main():
        loop = asyncio.get_running_loop()

        def job(k, cost, client):
            return Job(sources=[[k]], key=("k",), run=rec, future=loop.create_future(), loop=loop, cost=cost,
                       client=client)

        running = job(0, 100, "flood")
        b.submit(running)
        await loop.run_in_executor(None, rec.started.wait, 10)
        floods = [job(k, 100, "flood") for k in (1, 2, 3, 4)]
        for j in floods:
            b.submit(j)
        short = job(9, 10, "other")  # arrives last, from another client, a tenth of their work
        b.submit(short)
        gate.set()
        await asyncio.gather(running.future, short.future, *(j.future for j in floods))

    asyncio.run(main())
    b.stop()
    # the other client's short job went next, alone; then the flood's, at most 250 of work a call
    assert rec.calls == [[[0]], [[9]], [[1], [2]], [[3], [4]]]
