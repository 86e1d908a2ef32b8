"""Training on 2 CPU processes with gloo through the stock launcher (torch.distributed.run).

Equivalence with gradient accumulation in one process, SIGTERM -> checkpoint -> exact resume, a dead or hung peer
ending the job with an error within --ddp-timeout, an out-of-memory batch on one rank stopping both, and the
pieces (environment, backend choice, signal flag, rank grouping of batches) on their own.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from helpers import TINY_MODEL, make_data_bin

from attnmt import checkpoint as ckpts
from attnmt.backends import backend_for, training_device
from attnmt.cli import main
from attnmt.data.batching import EpochBatchIterator
from attnmt.errors import UserError
from attnmt.training import distributed
from attnmt.training.data import chunks as _chunks

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="needs torch.distributed with gloo")

# the tiny model, fp32 on one thread per process; no validation unless a test wants it
BASE = [*TINY_MODEL, "--lr", "3e-3", "--warmup-updates", "2", "--progress", "none", "--threads", "1", "--cpu"]


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1")


def _torchrun(*args, monitor_interval: float | None = None) -> list[str]:
    """The stock launcher, as a user runs it: torchrun --standalone --nproc-per-node 2 -m attnmt.cli train ..."""
    monitor = [] if monitor_interval is None else ["--monitor-interval", str(monitor_interval)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *monitor,
            "-m", "attnmt.cli", "train", *map(str, args)]


def _two_nodes(*args, timeout=120) -> subprocess.CompletedProcess:
    """Two torchrun "nodes" (one process each) meeting at a c10d rendezvous, as on a cluster (here on localhost)."""
    endpoint = f"127.0.0.1:{_free_port()}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "two-nodes",
           "-m", "attnmt.cli", "train", *map(str, args)]
    nodes = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env())
             for _ in range(2)]
    try:
        errs = [p.communicate(timeout=timeout)[1] for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    return subprocess.CompletedProcess(cmd, max(p.returncode for p in nodes), "", "\n".join(errs))


def _attnmt(*args) -> list[str]:
    return [sys.executable, "-m", "attnmt.cli", "train", *map(str, args)]


def _run(cmd, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=timeout)


def _weights(save_dir: Path) -> dict:
    return ckpts.load(save_dir / ckpts.LAST)["model"]


def _records(save_dir: Path, kind: str) -> list[dict]:
    path = save_dir / "train.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:  # a line being written
            continue
        if rec["type"] == kind:
            out.append(rec)
    return out


def _wait_for_update(save_dir: Path, n: int, proc: subprocess.Popen, timeout: float = 90) -> None:
    """Until train.jsonl (--log-interval 1) shows update ``n``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        train = _records(save_dir, "train")
        if train and train[-1]["num_updates"] >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(f"training ended (status {proc.returncode}) before update {n}: "
                                 f"{proc.stderr.read()[-2000:]}")
        time.sleep(0.02)
    proc.kill()
    raise AssertionError(f"no update {n} within {timeout} s")


def _workers(launcher_pid: int) -> dict[int, int]:
    """rank -> pid of the launcher's worker processes (children whose environment has RANK)."""
    found = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) != launcher_pid:
                continue
            env = Path(f"/proc/{d}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in env:
            if item.startswith(b"RANK="):
                found[int(item[5:])] = int(d)
    return found


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (None: no such process)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _gone(pid: int) -> bool:
    fields = _stat_fields(pid)
    return fields is None or fields[0] in "ZX"


def _exit_status(pid: int) -> int | None:
    """The wait status of a zombie process not yet reaped by its parent (the last field of /proc/PID/stat)."""
    fields = _stat_fields(pid)
    return int(fields[-1]) if fields else None


# ---------------------------------------------------------------------------------------------------- batches


@pytest.mark.parametrize("world, update_freq", [(2, 1), (2, 2), (3, 2)])
def test_ranks_together_take_the_groups_one_process_takes_with_a_larger_update_freq(world, update_freq):
    """Update k of W ranks x update-freq U holds exactly the batches of update k of 1 rank x update-freq W*U."""
    rng = np.random.RandomState(0)
    batches = [rng.randint(0, 1000, size=rng.randint(1, 5)) for _ in range(23)]  # 23: padding at the epoch's end
    single = EpochBatchIterator(batches, lambda b: b, seed=4)
    ranks = [EpochBatchIterator(batches, lambda b: b, seed=4, world_size=world, rank=r) for r in range(world)]
    for epoch in (1, 2):
        expected = list(_chunks(single.epoch_order(epoch)[: len(batches)], world * update_freq))
        per_rank = [list(_chunks(it.shard(epoch), update_freq)) for it in ranks]
        assert {len(p) for p in per_rank} == {len(expected)}
        for k, group in enumerate(expected):
            got = [b.tolist() for p in per_rank for b in p[k] if len(b)]
            assert sorted(got) == sorted(b.tolist() for b in group), (epoch, k)


# ---------------------------------------------------------------------------------------------------- units


def test_environment_device_and_backend():
    assert distributed.Env.from_environ({}) == distributed.Env.from_environ({"RANK": "2"}) == distributed.Env(0, 1, 0)
    assert distributed.Env.from_environ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}) == distributed.Env(3, 4, 1)
    with pytest.raises(UserError, match="RANK=4, WORLD_SIZE=4"):
        distributed.Env.from_environ({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(UserError, match="WORLD_SIZE='two' is not an integer"):
        distributed.Env.from_environ({"WORLD_SIZE": "two"})
    cpu = torch.device("cpu")
    assert training_device(1, cpu=True) == cpu
    assert distributed.choose_backend(backend_for(cpu)) == "gloo"
    assert distributed.choose_backend(backend_for(torch.device("cuda", 1))) == "nccl"
    assert distributed.choose_backend(backend_for(torch.device("cuda", 0)), "gloo") == "gloo"
    with pytest.raises(UserError, match="nccl needs CUDA"):
        distributed.choose_backend(backend_for(cpu), "nccl")


def test_preemption_signals_set_a_flag_and_the_old_handlers_come_back():
    before = signal.getsignal(signal.SIGUSR1)
    with distributed.Preemption() as p:
        assert not p.requested
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.01)
        assert p.requested and p.signal_name == "SIGUSR1"
    assert signal.getsignal(signal.SIGUSR1) is before


def test_nproc_per_node_under_a_launcher_is_a_user_error(tmp_path, monkeypatch, capsys):
    data = make_data_bin(tmp_path / "bin", n_train=16)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as e:
        main(["train", str(data), *BASE, "--save-dir", str(tmp_path / "ck"), "--nproc-per-node", "2"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1 and len(err.splitlines()) == 1
    assert "--nproc-per-node starts the training processes itself" in err and "remove --nproc-per-node" in err


def test_sigusr1_in_one_process_saves_exits_75_and_resumes_exactly(tmp_path, monkeypatch, capsys):
    """Preemption in a single process: stop after the current update, checkpoint, status 75, exact resume."""
    from attnmt.training.trainer import Trainer

    data = make_data_bin(tmp_path / "bin", n_train=64)
    args = ["train", str(data), *BASE, "--max-tokens", "64", "--max-update", "8", "--disable-validation"]
    main([*args, "--save-dir", str(tmp_path / "straight")])
    step = Trainer.train_step

    def signalled_step(self, samples):
        out = step(self, samples)
        if self.num_updates == 3:
            os.kill(os.getpid(), signal.SIGUSR1)  # arrives while update 3 finishes
        return out

    monkeypatch.setattr(Trainer, "train_step", signalled_step)
    resumed = tmp_path / "resumed"
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([*args, "--save-dir", str(resumed), "--progress", "lines"])
    assert e.value.code == distributed.PREEMPTED_EXIT == 75
    assert "preempted by SIGUSR1: stopped after update 3" in capsys.readouterr().err
    ck = ckpts.load(resumed / ckpts.LAST)["train"]
    assert ck["num_updates"] == 3 and 0 < ck["iterator"]["offset"]
    assert _records(resumed, "summary")[-1]["stop_reason"] == "preempted"
    monkeypatch.setattr(Trainer, "train_step", step)
    main([*args, "--save-dir", str(resumed)])
    a, b = _weights(tmp_path / "straight"), _weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------------------------------- out of memory


def _tiny_trainer(world_size=1, ddp=False):
    from attnmt.cli import load_components
    from attnmt.criterions import LabelSmoothedCrossEntropy, LabelSmoothedCrossEntropyConfig
    from attnmt.optim import AdamConfig, FixedConfig, FixedSchedule, build_adam
    from attnmt.registry import arch_config, get
    from attnmt.training.trainer import Trainer

    load_components()
    cfg = arch_config("transformer_small", dict(encoder_layers=1, decoder_layers=1, encoder_embed_dim=16,
                                                 decoder_embed_dim=16, encoder_ffn_embed_dim=32,
                                                 decoder_ffn_embed_dim=32, encoder_attention_heads=2,
                                                 decoder_attention_heads=2, dropout=0.0))
    torch.manual_seed(0)
    model = get("model", "transformer").obj.build(cfg, 24, 24, 1, joint_vocab=True)
    cpu = torch.device("cpu")
    return Trainer(model, LabelSmoothedCrossEntropy(LabelSmoothedCrossEntropyConfig(0.1), 1),
                   build_adam(AdamConfig(), model.parameters(), lr=1e-3), FixedSchedule(FixedConfig(lr=1e-3)),
                   backend=backend_for(cpu), world_size=world_size,
                   ddp_model=distributed.wrap(model, backend_for(cpu)) if ddp else None)


def _pair_batch(n, src_len, tgt_len, seed):
    from attnmt.data.pairs import collate_pairs

    rng = np.random.RandomState(seed)
    srcs = [np.append(rng.randint(4, 24, size=src_len - 1), 2) for _ in range(n)]
    tgts = [np.append(rng.randint(4, 24, size=tgt_len - 1), 2) for _ in range(n)]
    return collate_pairs(srcs, tgts, np.arange(n), 1, 2)


def _raise_oom_on_call(trainer, call: int):
    """The model's ``call``-th forward runs out of memory (inside DDP's forward, where a real one would)."""
    calls = [0]

    def hook(module, args):
        calls[0] += 1
        if calls[0] == call:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    trainer.model.register_forward_pre_hook(hook)


def test_out_of_memory_names_the_batch_shape_and_the_flag():
    t = _tiny_trainer()
    _raise_oom_on_call(t, 2)
    t.train_step([_pair_batch(4, 6, 7, 0)])
    with pytest.raises(UserError) as e:
        t.train_step([_pair_batch(5, 9, 11, 1)])
    msg = str(e.value)
    assert "out of memory on cpu in update 2 with a batch of 5 sentences x 9 source / 11 target tokens" in msg
    assert "lower --max-tokens" in msg and len(msg.splitlines()) == 1
    assert t.num_updates == 1
    other = _tiny_trainer()
    other.criterion = lambda model, sample: (_ for _ in ()).throw(RuntimeError("shape mismatch"))
    with pytest.raises(RuntimeError, match="shape mismatch"):  # other errors are not dressed up as OOM
        other.train_step([_pair_batch(2, 3, 3, 2)])


def _oom_worker(rank: int, port: int, out_dir: str) -> None:
    """One of two gloo ranks: update 1 is fine; in update 2, rank 1 runs out of memory in its first micro-batch."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        t = _tiny_trainer(world_size=2, ddp=True)
        t.train_step([_pair_batch(3, 5, 6, 10 + rank), _pair_batch(2, 4, 4, 20 + rank)])
        if rank == 1:
            _raise_oom_on_call(t, 1)
        try:
            t.train_step([_pair_batch(7, 8, 9, 30 + rank), _pair_batch(2, 4, 4, 40 + rank)])
            result = "no error"
        except UserError as e:
            result = str(e)
        Path(out_dir, f"rank{rank}.txt").write_text(result, encoding="utf-8")
    finally:
        distributed.shutdown()  # as attnmt train leaves the group: the process then exits cleanly


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_out_of_memory_on_one_rank_stops_both_ranks_without_a_hang(tmp_path):
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_oom_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + 60
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise AssertionError("the ranks hang after an out-of-memory error on one of them")
    r0 = (tmp_path / "rank0.txt").read_text(encoding="utf-8")
    r1 = (tmp_path / "rank1.txt").read_text(encoding="utf-8")
    assert r1.startswith("rank 1: out of memory on cpu in update 2 with a batch of 7 sentences x 8 source / 9 target")
    assert r0.startswith("rank 0: stopping with the other processes: 1 rank(s) failed in this update")


def _clock_worker(rank: int, port: int, out_dir: str) -> None:
    """One of two gloo ranks whose clocks read differently: they agree on the flags, the clock and so the lr."""
    from attnmt.optim import PolynomialDecayConfig, PolynomialDecaySchedule

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        agreed = distributed.max_over_ranks([rank == 1, False, 60.0 + 30.0 * rank], torch.device("cpu"))
        schedule = PolynomialDecaySchedule(PolynomialDecayConfig(lr=1e-3, total_num_update=100,
                                                                 total_train_minutes=2))
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
        lr = schedule.step_update(opt, 10, train_time=agreed[-1])
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps([agreed, lr]), encoding="utf-8")
    finally:
        dist.destroy_process_group()


def test_ranks_agree_on_the_clock_a_schedule_follows(tmp_path):
    """A learning rate that follows the training clock is the same on every rank: the largest clock reading."""
    import torch.multiprocessing as mp

    mp.start_processes(_clock_worker, args=(_free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    for rank in (0, 1):
        agreed, lr = json.loads((tmp_path / f"rank{rank}.json").read_text(encoding="utf-8"))
        assert agreed == [1.0, 0.0, 90.0]  # a flag raised on one rank, and rank 1's clock, on both ranks
        assert lr == pytest.approx(1e-3 * (1 - 75 / 100))  # 90 s of 120 stand for update 75 of 100


# ---------------------------------------------------------------------------------------------------- 2 processes


def _legacy_launch(*args) -> list[str]:
    """fairseq's getting-started line: python -m torch.distributed.launch --nproc_per_node 2 $(which attnmt) train
    (the launcher passes --local-rank=K before the subcommand)."""
    return [sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node", "2", "--master_port",
            str(_free_port()), str(Path(sys.executable).parent / "attnmt"), "train", *map(str, args)]


@pytest.mark.parametrize("update_freq, launch", [(1, "two nodes"), (2, "one node"), (1, "torch.distributed.launch")])
def test_two_processes_equal_one_process_with_twice_the_update_freq(tmp_path, update_freq, launch, capsys):
    """2 processes x update-freq U == 1 process x update-freq 2U after K updates (dropout off, fp32).

    The 2 processes run on one node (torchrun --standalone --nproc-per-node 2) or as two nodes of one process each
    meeting at a c10d rendezvous (--nnodes 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT).

    --adam-eps 1e-4: a few gradients are zero in exact arithmetic (the key bias: softmax ignores a shift shared by
    all keys) and hold only rounding noise, which Adam with eps 1e-9 turns into steps of the full learning rate in
    a noise-dependent direction; a larger eps keeps those at noise level so the comparison can be tight.
    """
    data = make_data_bin(tmp_path / "bin", n_train=120)
    args = [data, *BASE, "--dropout", "0", "--max-tokens", "96", "--max-update", "6", "--adam-eps", "1e-4",
            "--log-interval", "3"]
    two, one = tmp_path / "two", tmp_path / "one"
    extra = ["--update-freq", update_freq, "--save-dir", two, "--progress", "lines"]
    if launch == "two nodes":
        r = _two_nodes(*args, *extra)
    else:
        r = _run((_legacy_launch if launch == "torch.distributed.launch" else _torchrun)(*args, *extra))
    assert r.returncode == 0, r.stderr[-3000:]
    assert (f"effective batch = max-tokens x world size x update-freq = 96 x 2 x {update_freq} = "
            f"{192 * update_freq} padded tokens per update") in r.stderr
    assert "processes: 2 (gloo" in r.stderr
    main(["train", *map(str, args), "--update-freq", str(2 * update_freq), "--save-dir", str(one)])
    capsys.readouterr()
    a, b = _weights(two), _weights(one)
    assert a.keys() == b.keys()
    for k in a:
        if update_freq == 1:  # the same sums in the same order: gloo adds the two ranks' halves like .grad does
            assert torch.equal(a[k], b[k]), k
        else:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)
    ta, tb = ckpts.load(two / ckpts.LAST)["train"], ckpts.load(one / ckpts.LAST)["train"]
    assert ta["num_updates"] == tb["num_updates"] == 6
    assert ta["iterator"]["epoch"] == tb["iterator"]["epoch"]
    assert ta["iterator"]["offset"] * 2 == tb["iterator"]["offset"]  # each rank consumed half of the batches
    # logged figures are over all ranks: the same tokens, the same loss; validation is sharded and summed
    for kind, keys in (("train", ("ntokens", "nsentences", "loss")), ("valid", ("ntokens", "loss", "nll_loss"))):
        ra, rb = _records(two, kind), _records(one, kind)
        assert len(ra) == len(rb) > 0
        for x, y in zip(ra, rb):
            for key in keys:
                assert x[key] == pytest.approx(y[key], rel=1e-5), (kind, key)


def test_sigterm_saves_a_checkpoint_and_the_relaunch_ends_where_an_uninterrupted_run_does(tmp_path):
    """--nproc-per-node 2 (torchrun in-process): SIGTERM to the launcher mid-epoch -> status 75 and a loadable
    checkpoint holding each rank's RNG state; the same command again resumes and ends with bitwise the same
    weights as a run that was never interrupted (dropout on, so each rank's RNG stream matters)."""
    data = make_data_bin(tmp_path / "bin", n_train=120)
    args = [data, *BASE, "--max-tokens", "32", "--max-update", "60", "--log-interval", "1", "--disable-validation",
            "--nproc-per-node", "2"]
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    reference = subprocess.Popen(_attnmt(*args, "--save-dir", straight), stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True, env=_env())
    interrupted = subprocess.Popen(_attnmt(*args, "--save-dir", cut), stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True, env=_env())
    try:
        _wait_for_update(cut, 3, interrupted)
        interrupted.send_signal(signal.SIGTERM)
        err = interrupted.communicate(timeout=60)[1]
        assert interrupted.returncode == 75, err[-3000:]
        assert "attnmt: SIGTERM: the workers saved" in err and "run the same command again to resume" in err
        ck = ckpts.load(cut / ckpts.LAST)
        n, itr = ck["train"]["num_updates"], ck["train"]["iterator"]
        assert 3 <= n < 60 and itr["world_size"] == 2
        assert 0 < itr["offset"] < 19  # 37 batches: 19 per rank and epoch; stopped inside an epoch
        assert ck["model_config"]["dropout"] > 0
        others = ck["train"]["rng_other_ranks"]
        assert len(others) == 1 and not torch.equal(others[0]["torch"], ck["train"]["rng"]["torch"])
        assert _records(cut, "summary")[-1]["stop_reason"] == "preempted"
        assert reference.wait(timeout=120) == 0, reference.stderr.read()[-3000:]
    finally:
        for p in (reference, interrupted):
            if p.poll() is None:
                p.kill()
    r = _run(_attnmt(*args, "--save-dir", cut))
    assert r.returncode == 0, r.stderr[-3000:]
    assert _records(cut, "summary")[-1]["updates_this_run"] == 60 - n  # resumed, not restarted
    a, b = _weights(straight), _weights(cut)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert ckpts.load(cut / ckpts.LAST)["train"]["num_updates"] == 60


def _start_long_run(tmp_path: Path, timeout_s: float,
                    monitor_interval: float) -> tuple[subprocess.Popen, Path, dict[int, int]]:
    """A long two-rank torchrun job whose launcher looks at its workers every ``monitor_interval`` seconds."""
    data = make_data_bin(tmp_path / "bin", n_train=120)
    save = tmp_path / "ck"
    proc = subprocess.Popen(_torchrun(data, *BASE, "--max-tokens", "32", "--max-update", "100000",
                                      "--log-interval", "1", "--disable-validation", "--ddp-timeout", timeout_s,
                                      "--save-dir", save, monitor_interval=monitor_interval),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env())
    _wait_for_update(save, 2, proc)
    workers = _workers(proc.pid)
    assert sorted(workers) == [0, 1], workers
    return proc, save, workers


def test_a_dead_peer_ends_the_job_with_an_error_naming_it(tmp_path):
    """Rank 0 itself sees the closed connection and names the dead rank, well before --ddp-timeout. The launcher
    does not look at its workers during the test (as the launcher of a peer on another host could not see it), so
    it cannot SIGTERM rank 0 first: the test measures rank 0, then stops the launcher."""
    proc, save, workers = _start_long_run(tmp_path, timeout_s=30, monitor_interval=600)
    try:
        t0 = time.monotonic()
        os.kill(workers[1], signal.SIGKILL)
        while not _gone(workers[0]):
            assert time.monotonic() - t0 < 30, "rank 0 still waits for the dead peer"
            time.sleep(0.05)
        elapsed = time.monotonic() - t0
        status = _exit_status(workers[0])
    finally:
        proc.kill()  # the launcher; its workers are gone by now, or are killed below when the wait above failed
        for pid in workers.values():
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
    err = proc.communicate(timeout=60)[1]
    assert elapsed < 25 and status not in (None, 0), (elapsed, status)
    lines = [ln for ln in err.splitlines() if ln.startswith("attnmt: error: rank 0:")]
    assert len(lines) == 1, err[-3000:]
    assert f"rank 1 (pid {workers[1]}) has exited" in lines[0] and "run the same command again" in lines[0]
    assert "Traceback" not in err, err[-3000:]


@pytest.mark.slow
def test_a_hung_peer_times_out_after_ddp_timeout(tmp_path):
    """A stopped (SIGSTOP) peer holds its connections open: only the collective timeout ends the wait."""
    proc, save, workers = _start_long_run(tmp_path, timeout_s=3, monitor_interval=5)
    try:
        t0 = time.monotonic()
        os.kill(workers[1], signal.SIGSTOP)
        while not _gone(workers[0]):
            assert time.monotonic() - t0 < 30, "rank 0 still waits for the stopped peer"
            time.sleep(0.05)
        waited = time.monotonic() - t0
        os.kill(workers[1], signal.SIGCONT)  # let the launcher's SIGTERM reach it instead of a 30 s kill delay
        err = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            os.kill(workers[1], signal.SIGCONT)
            proc.kill()
    assert proc.returncode != 0 and 2.5 < waited < 20, (proc.returncode, waited)
    lines = [ln for ln in err.splitlines() if ln.startswith("attnmt: error: rank 0:")]
    assert len(lines) == 1, err[-3000:]
    assert "timed out after --ddp-timeout 3 s" in lines[0] and f"rank 1 (pid {workers[1]}) is stopped" in lines[0]
