"""The benchmark scripts run (on the CPU, tiny settings): their numbers are measured elsewhere, their code here."""

import json
import subprocess
import sys
from pathlib import Path

from helpers import make_data_bin

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_training_benchmark_runs_on_the_cpu_with_epoch_end_saves(tmp_path):
    data = make_data_bin(tmp_path / "bin", n_train=60)
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_gpu.py"), str(data), "--device", "cpu",
                        "--archs", "transformer_small", "--precisions", "fp32", "--max-tokens", "256", "--updates", "6",
                        "--warmup", "1", "--gemm-size", "128", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    row = json.loads(r.stdout.strip().splitlines()[-1])
    assert row["updates"] == 6 and row["epoch_ends"] >= 1 and row["save"] == "background"
    assert row["s_median"] > 0 and row["tok_s"] > 0 and 0 < row["flop_s"] < 10 * row["peak_flop_s"]
