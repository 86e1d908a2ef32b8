"""The benchmark scripts run (on the CPU, tiny settings): their numbers are measured elsewhere, their code here."""

import json
import subprocess
import sys
from pathlib import Path

from helpers import make_checkpoint, make_data_bin, sentence_lines

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_training_benchmark_runs_on_the_cpu_with_epoch_end_saves(tmp_path):
    data = make_data_bin(tmp_path / "bin", n_train=60)
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_gpu.py"), str(data), "--device", "cpu",
                        "--archs", "transformer_small", "--precisions", "fp32", "--max-tokens", "256", "--updates", "6",
                        "--warmup", "1", "--gemm-size", "128", "--valid", "--as-before", "--profile", "1", "--json"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    row = json.loads(r.stdout.strip().splitlines()[-1])
    assert row["updates"] == 6 and row["epoch_ends"] >= 1 and row["save"] == "background"
    assert 0 < row["valid_loss"] < 20 and row["as_before"] and row["warmup_s"] > 0 and "busy" in row["profile"]
    assert row["s_median"] > 0 and row["tok_s"] > 0 and 0 < row["flop_s"] < 10 * row["peak_flop_s"]


def test_kernel_choices_runs_its_int8_comparison_where_the_cpu_has_it():
    from attnmt.backends import capabilities

    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_choices.py"), "--threads", "1", "--only",
                        "int8"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("int8 (")]
    assert len(lines) == (7 if capabilities.cpu().onednn_int8 else 0), r.stdout
    assert all("bf16 packed" in ln and "int8 with quantization" in ln for ln in lines)


def test_the_continuous_batching_benchmark_finds_translates_translations(tmp_path):
    ckpt = make_checkpoint(tmp_path)
    src = tmp_path / "src.en"
    src.write_text("\n".join(sentence_lines(30, 3)) + "\n", encoding="utf-8")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "continuous_batching.py"), "--path", str(ckpt),
                        "--input", str(src), "--sentences", "40", "--in-flight", "6", "--rounds", "1", "threads=1",
                        "max_len_b=12"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| continuous, 6 in flight |" in r.stdout and "| static calls of 6 |" in r.stdout
    assert "continuous translations equal to translate's: 40/40" in r.stdout, r.stdout


def test_the_sweep_reads_a_trials_valid_losses_from_a_log_cut_short(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("multi30k_sweep", ROOT / "benchmarks" / "multi30k_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    log = tmp_path / "train.jsonl"
    valid = [{"type": "valid", "num_updates": u, "loss": loss} for u, loss in ((130, 7.90412), (260, 6.63718))]
    lines = [{"type": "start"}, valid[0], valid[0], {"type": "train", "num_updates": 200, "loss": 8.0}, valid[1]]
    log.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"type": "valid", "num_upd')  # killed mid-line
    assert sweep.valid_curve(log) == [[130, 7.9041], [260, 6.6372]]
    assert sweep.valid_curve(tmp_path / "never_written.jsonl") == []
