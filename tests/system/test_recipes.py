"""Smoke runs of every recipe on a slice of the real data, so that no step of a recipe can silently rot.

Each recipe runs end to end (checksums, preprocess, train, average, generate, score, plots) with a tiny budget:
a few hundred training pairs, a one-layer model, a few updates and short outputs. The real corpora live in
../shared/data (next to the repository); without them these tests are skipped.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("ATTNMT_SHARED_DATA", ROOT.parent / "shared" / "data"))
TINY = "--encoder-layers 1 --decoder-layers 1 --encoder-embed-dim 64 --decoder-embed-dim 64 " \
       "--encoder-ffn-embed-dim 128 --decoder-ffn-embed-dim 128 --max-tokens 1024 --validate-interval-updates 0"
SHORT = "--max-len-a 0 --max-len-b 4 --max-tokens 8192"

pytestmark = pytest.mark.slow


def run_recipe(name: str, tmp_path: Path, data: str, **env) -> subprocess.CompletedProcess:
    if not (SHARED / data).is_dir():
        pytest.skip(f"{SHARED / data} not found")
    full_env = {**os.environ, "WORK": str(tmp_path / "work"), "DATA_DIR": str(SHARED / data), "THREADS": "2",
                **env}
    r = subprocess.run(["bash", str(ROOT / "recipes" / name / "run.sh")], cwd=ROOT, env=full_env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path


@pytest.mark.precision
def test_multi30k_recipe_smoke(tmp_path):
    """The README's main job on a slice; CI runs it again as on a CPU without native bf16 (fp32 throughout)."""
    r = run_recipe("multi30k", tmp_path, "multi30k", TRAIN_LINES="300", MAX_UPDATE="0", MAX_TIME_MINUTES="5",
               EXTRA_TRAIN_ARGS=TINY + " --max-epoch 2", GEN_ARGS=SHORT, AVG="1 2", MBR_SAMPLES="4")
    start = json.loads((tmp_path / "work" / "checkpoints" / "train.jsonl").read_text().splitlines()[0])
    from conftest import NATIVE_BF16

    assert start["type"] == "start" and start["precision"] == ("bf16" if NATIVE_BF16 else "fp32"), start
    assert "Traceback" not in r.stderr
    out = tmp_path / "work" / "results"
    lines = {"val": 1014, "test_2016_flickr": 1000, "test_2017_flickr": 1000, "test_2017_mscoco": 461,
             "test_2018_flickr": 1071}
    for split, n in lines.items():
        result = json.loads((out / f"{split}.bleu.json").read_text())
        assert result["n_lines"] == n
        assert "13a" in result["signature"]
    assert_png(out / "training_curves.png")
    assert_png(out / "attention_1.png")
    # the measured speed decides: the probe's rate, the updates the budget buys, how many models share them, the
    # dropout and the schedule for each model's share
    probe = re.search(r"probe: ([\d.]+) updates/s \((\w+)\) -> about (\d+) updates in 5 minutes"
                      r"(?:; transformer_mini: ([\d.]+) updates/s, ([\d.]+)x -> about (\d+) updates \(not trained: "
                      r"from 2.2x and 8000 updates on it is trained\))?; chosen: "
                      r"transformer_small, precision \w+, dropout ([\d.]+), (.*?)(, 2 models of 2.5 minutes each "
                      r"\(seeds 1-2; settings and updates per model\), translated as their ensemble)? \(below 3500",
                      r.stderr)
    assert probe, r.stderr
    ups, precision, expected, dropout = float(probe[1]), probe[2], int(probe[3]), float(probe[7])
    assert precision == start["precision"] and abs(expected - ups * 5 * 60) <= 1
    members = 2 if expected >= 8000 else 1
    # below the ensemble's count a second probe times transformer_mini (here as small as the other: no speed-up)
    assert bool(probe[4]) == (members == 1), r.stderr
    if probe[4]:
        assert float(probe[5]) == round(float(probe[4]) / ups, 2)
        assert float(probe[5]) < 2.2 or int(probe[6]) < 8000
    assert bool(probe[9]) == (members == 2), r.stderr
    per_model = expected // members
    long_run = per_model >= 3500
    assert dropout == (0.3 if long_run else 0.2) and f"--dropout {dropout}" in r.stderr
    if long_run:
        minutes = 5 / members  # the decay follows the clock as well: it ends when the model's time is up
        assert probe[8] == f"a linear decay to 0 at update {per_model} or minute {minutes:g}, whichever comes first"
        assert re.search(rf"lr scheduler: polynomial_decay {{[^}}]*'total_num_update': {per_model}, "
                         rf"'total_train_minutes': {minutes}}}", r.stderr)
    else:
        assert probe[8] == "the inverse square root schedule" and "lr scheduler: inverse_sqrt" in r.stderr
    # the averaging window and the length penalty are chosen on val: every pair tried (for each model, and for the
    # ensemble of their choices), the best one used
    rows = [line.split("\t") for line in (out / "val_choice.tsv").read_text().splitlines()[1:]]
    tags = [""] if members == 1 else ["m1:", "m2:"]
    expected_rows = [(t + k, lp) for t in tags for k in ("1", "2", "best2") for lp in ("0.6", "1.0")]
    if members == 2:
        expected_rows += [("ensemble", lp) for lp in ("0.6", "1.0")]
    # then the choice decoded with minimum Bayes risk, kept where val prefers it
    beam_best = max(rows[:-1], key=lambda row: float(row[2]))
    assert [(k, lp) for k, lp, _ in rows] == expected_rows + [(beam_best[0] + " mbr-samples 4", beam_best[1])]
    best = max(rows, key=lambda row: float(row[2]))
    label, mbr = (beam_best[0], ", --mbr-samples 4") if best is rows[-1] else (best[0], "")
    what = "the ensemble of the 2 models" if label == "ensemble" else f"average {label}"
    assert f"chosen on val: {what}, lenpen {best[1]}{mbr} (val BLEU {best[2]})" in r.stderr
    assert f"5/6 generate (beam 4, lenpen {best[1]}{mbr}) and score" in r.stderr
    val = json.loads((out / "val.bleu.json").read_text())
    assert round(val["score"], 2) == float(best[2])


def test_multi30k_recipe_long_budget_trains_two_models_and_translates_with_their_ensemble(tmp_path):
    """A budget that buys 8,000 updates or more: two models (seeds 1 and 2) of half the time and updates each, each
    with dropout 0.3 and the linear decay to 0 at its share; val chooses each model's average and then between
    them and their ensemble, which translates the test sets."""
    r = run_recipe("multi30k", tmp_path, "multi30k", TRAIN_LINES="300", MAX_UPDATE="0", MAX_TIME_MINUTES="240",
                   EXTRA_TRAIN_ARGS=TINY + " --max-epoch 1", GEN_ARGS=SHORT, AVG="1")
    probe = re.search(r"-> about (\d+) updates in 240 minutes; chosen: transformer_small, precision \w+, dropout 0.3, "
                      r"a linear decay to 0 at update (\d+) or minute 120, whichever comes first, 2 models of 120 minutes each \(seeds 1-2",
                      r.stderr)
    assert probe and int(probe[1]) >= 8000 and int(probe[2]) == int(probe[1]) // 2, r.stderr
    assert r.stderr.count(f"lr scheduler: polynomial_decay {{'lr': 0.002, 'warmup_updates': 500, "
                          f"'end_learning_rate': 0.0, 'power': 1.0, 'total_num_update': {probe[2]}, "
                          f"'total_train_minutes': 120.0}}") == 2
    import torch

    work = tmp_path / "work"
    first, second = (torch.load(work / d / "checkpoint_last.pt", map_location="cpu", weights_only=False)
                     for d in ("checkpoints", "checkpoints2"))
    assert [c["train"]["train_config"]["seed"] for c in (first, second)] == [1, 2]
    assert [c["train"]["train_config"]["max_time_minutes"] for c in (first, second)] == [120, 120]
    name = "encoder.layers.0.ffn.fc1.weight"
    assert not torch.equal(first["model"][name], second["model"][name])  # two different models
    rows = [line.split("\t") for line in (work / "results" / "val_choice.tsv").read_text().splitlines()[1:]]
    assert [(k, lp) for k, lp, _ in rows] == [(k, lp) for k in ("m1:1", "m2:1", "ensemble") for lp in ("0.6", "1.0")]
    best = max(rows, key=lambda row: float(row[2]))
    val = json.loads((work / "results" / "val.bleu.json").read_text())
    assert round(val["score"], 2) == float(best[2])
    if best[0] == "ensemble":
        assert f"chosen on val: the ensemble of the 2 models, lenpen {best[1]} (val BLEU {best[2]}) -> " \
               f"{work}/checkpoints/averaged.pt:{work}/checkpoints2/averaged.pt" in r.stderr
    else:
        assert f"chosen on val: average {best[0]}, lenpen {best[1]}" in r.stderr
    assert len((work / "results" / "test_2016_flickr.hyp.de").read_text().splitlines()) == 1000
    assert_png(work / "results" / "training_curves2.png")


def test_multi30k_recipe_one_model_on_request(tmp_path):
    """MEMBERS=1 keeps a long budget in one model: the linear decay to 0 at the whole expected count."""
    r = run_recipe("multi30k", tmp_path, "multi30k", TRAIN_LINES="300", MAX_UPDATE="0", MAX_TIME_MINUTES="240",
                   MEMBERS="1", EXTRA_TRAIN_ARGS=TINY + " --max-epoch 1", GEN_ARGS=SHORT, AVG="1")
    probe = re.search(r"-> about (\d+) updates in 240 minutes; chosen: transformer_small, precision \w+, dropout 0.3, "
                      r"a linear decay to 0 at update (\d+) or minute 240, whichever comes first \(forced: MEMBERS\)", r.stderr)
    assert probe and probe[1] == probe[2] and int(probe[1]) >= 8000, r.stderr
    assert not (tmp_path / "work" / "checkpoints2").exists()


def test_multi30k_recipe_trains_transformer_mini_where_it_is_fast_enough(tmp_path):
    """Where the second probe finds transformer_mini MINI_SPEEDUP times as fast and the budget buys it
    MINI_MIN_UPDATES updates (here any speed-up and count qualify), the recipe trains it, with the settings for its
    own count: the time MAX_UPDATE stands for buys it SPEEDUP times as many updates."""
    r = run_recipe("multi30k", tmp_path, "multi30k", TRAIN_LINES="300", MAX_UPDATE="40", MAX_TIME_MINUTES="5",
                   MINI_SPEEDUP="0.01", MINI_MIN_UPDATES="0", EXTRA_TRAIN_ARGS=TINY, GEN_ARGS=SHORT, AVG="1")
    probe = re.search(r"probe: ([\d.]+) updates/s \(\w+\) -> about 40 updates in 5 minutes \(at most MAX_UPDATE=40\); "
                      r"transformer_mini: ([\d.]+) updates/s, ([\d.]+)x -> about (\d+) updates \(from 0.01x and 0 "
                      r"updates on it is trained\); chosen: transformer_mini, precision \w+, dropout 0.2, the inverse "
                      r"square root schedule \(below", r.stderr)
    assert probe, r.stderr
    ups, mini_ups, speedup, expected = float(probe[1]), float(probe[2]), float(probe[3]), int(probe[4])
    assert speedup == round(mini_ups / ups, 2)
    assert expected == min(int(mini_ups * 5 * 60), round(40 * speedup))
    assert "3/6 train transformer_mini for at most 5 minutes" in r.stderr
    import torch

    last = torch.load(tmp_path / "work" / "checkpoints" / "checkpoint_last.pt", map_location="cpu", weights_only=False)
    assert last["arch"] == "transformer_mini" and last["train"]["train_config"]["max_update"] == expected
    assert len((tmp_path / "work" / "results" / "test_2016_flickr.hyp.de").read_text().splitlines()) == 1000


def test_multi30k_recipe_reverse_direction(tmp_path):
    """The same recipe for another pair: German -> English, only the SRC/TGT knobs change. A given ARCH is kept
    (no second probe)."""
    r = run_recipe("multi30k", tmp_path, "multi30k", SRC="de", TGT="en", TRAIN_LINES="300", MAX_UPDATE="2",
                   MAX_TIME_MINUTES="5", ARCH="transformer_small", MINI_SPEEDUP="0.01", EXTRA_TRAIN_ARGS=TINY,
                   GEN_ARGS=SHORT, AVG="2")
    assert "transformer_mini" not in r.stderr and "(forced: ARCH)" in r.stderr, r.stderr
    out = tmp_path / "work" / "results"
    assert (tmp_path / "work" / "data-bin" / "train.de-en.de.bin").exists()
    refs = (out / "test_2016_flickr.ref.en").read_text().splitlines()
    assert refs[0] == "A man in an orange hat starring at something."  # English references
    assert len((out / "test_2016_flickr.hyp.en").read_text().splitlines()) == 1000


@pytest.mark.parametrize("env, message", [
    ({"SRC": "en", "TGT": "xx"}, "no Multi30k data for language 'xx'; SRC and TGT take: cs de en fr"),
    ({"SRC": "de", "TGT": "de"}, "SRC and TGT are both 'de'"),
    ({"PROFILE": "fast"}, "PROFILE=fast: use auto, long, bf16 or fp32"),
    ({"SCHEDULE": "cosine"}, "SCHEDULE=cosine: use auto, inverse_sqrt or linear"),
    ({"AVG": "5 ten"}, "AVG=5 ten: give one or more positive whole numbers"),
    ({"LENPEN": "0.6,high"}, "LENPEN=0.6 high: give one or more numbers"),
    ({"MEMBERS": "0"}, "MEMBERS=0: use auto or the number of models (1: one)"),
    ({"MAX_TIME_MINUTES": "1h"}, "MAX_TIME_MINUTES=1h: give the training budget in minutes, such as 60"),
    ({"MAX_TIME_MINUTES": "0"}, "MAX_TIME_MINUTES=0: give the training budget in minutes, such as 60"),
    ({"MAX_UPDATE": "4.5k"}, "MAX_UPDATE=4.5k: give a whole number of updates (0: no limit)"),
    ({"MINI_SPEEDUP": "fast"}, "MINI_SPEEDUP=fast: give a speed ratio, such as 2.2"),
    ({"MINI_MIN_UPDATES": "8k"}, "MINI_MIN_UPDATES=8k: give a whole number of updates"),
    ({"MBR_SAMPLES": "some"}, "MBR_SAMPLES=some: give a whole number of samples (0: off)"),
])
def test_multi30k_recipe_refuses_unknown_pairs(tmp_path, env, message):
    r = subprocess.run(["bash", str(ROOT / "recipes" / "multi30k" / "run.sh")], cwd=ROOT,
                       env={**os.environ, "WORK": str(tmp_path / "work"), **env}, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith(f"multi30k: error: {message}"), r.stderr
    assert not (tmp_path / "work").exists()  # nothing fetched or written


def test_fetch_data_keeps_the_pair_languages(tmp_path):
    if not (SHARED / "multi30k").is_dir():
        pytest.skip("no Multi30k data")
    r = subprocess.run(["python", str(ROOT / "recipes" / "fetch_data.py"),
                        str(ROOT / "recipes" / "multi30k" / "manifest.tsv"), "--out", str(tmp_path / "raw"),
                        "--data-dir", str(SHARED / "multi30k"), "--langs", "de,en"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "raw").iterdir()) == sorted(
        p.name for p in (SHARED / "multi30k").glob("*.gz"))
    r = subprocess.run(["python", str(ROOT / "recipes" / "fetch_data.py"),
                        str(ROOT / "recipes" / "multi30k" / "manifest.tsv"), "--out", str(tmp_path / "raw"),
                        "--data-dir", str(SHARED / "multi30k"), "--langs", "en,fr"], capture_output=True, text=True)
    assert r.returncode == 1 and "train.fr.gz: missing" in r.stderr  # fr is listed, only not on this machine


@pytest.mark.precision
def test_iwslt14_recipe_smoke(tmp_path):
    run_recipe("iwslt14_de_en", tmp_path, "iwslt14_de_en", TRAIN_LINES="300", MAX_UPDATE="4", MAX_TIME_MINUTES="5",
               EXTRA_TRAIN_ARGS=TINY + " --eval-bleu-max-len-a 0 --eval-bleu-max-len-b 4", GEN_ARGS=SHORT, AVG="2",
               EVAL_BLEU="20")
    out = tmp_path / "work" / "results"
    log = [json.loads(line) for line in (tmp_path / "work" / "checkpoints" / "train.jsonl").read_text().splitlines()]
    assert any(rec.get("bleu") is not None for rec in log)  # the valid BLEU curve has points
    assert len((out / "test.hyp.tok.en").read_text().splitlines()) == 6750
    assert "tokenized" in (out / "test.tok-bleu").read_text().lower()
    assert "13a" in (out / "test.sacrebleu").read_text()
    assert_png(out / "training_curves.png")


def test_wmt14_recipe_smoke(tmp_path):
    run_recipe("wmt14_en_de", tmp_path, "wmt14_en_de", SMOKE="1", SMOKE_LINES="300", SMOKE_VOCAB="1000",
               SMOKE_UPDATES="2", EXTRA_TRAIN_ARGS=TINY, GEN_ARGS=SHORT)
    out = tmp_path / "work" / "results"
    assert len((out / "newstest2014.hyp.de").read_text().splitlines()) == 3003
    assert "13a" in (out / "newstest2014.sacrebleu").read_text()
    assert "compound" in (out / "newstest2014.tok-compound-bleu").read_text().lower()


def test_paper_table3_recipe_smoke(tmp_path):
    """Every row of Table 3 trained a few updates (two trials at a time), scored on dev and tabulated beside the
    paper's figures."""
    r = run_recipe("paper_table3", tmp_path, "multi30k", SMOKE="1", ROWS="A,B,C,D,E,big", PARALLEL="2")
    out = tmp_path / "work" / "table3"
    result = json.loads((out / "table3.json").read_text())
    rows = {e["row"]: e for e in result["rows"]}
    assert list(rows) == ["base", "A1", "A2", "A3", "A4", "B1", "B2", "C1", "C2", "C3", "C4", "C5", "C6", "C7",
                          "D1", "D2", "D3", "D4", "E", "big"]
    assert result["updates"] == 3 and all(e["seeds"] == 1 and "errors" not in e for e in rows.values())
    assert all(e["dev_ppl"] > 1 and 0 <= e["dev_bleu"] <= 100 for e in rows.values())
    # parameters: smaller keys (B) and fewer layers (C1) count less, a wider model (C5) and big more
    assert rows["B1"]["params_M"] < rows["B2"]["params_M"] < rows["base"]["params_M"] == rows["A1"]["params_M"]
    assert rows["C1"]["params_M"] < rows["base"]["params_M"] < rows["C5"]["params_M"] < rows["big"]["params_M"]
    table = (out / "table3.md").read_text().splitlines()
    assert len(table) == 22 and table[1 + 6].startswith("| (B) B1 |") and "| 5.16 | 25.1 | 58 |" in table[1 + 6]
    assert "Traceback" not in r.stderr
    assert_png(out / "table3_bleu.png")


@pytest.mark.parametrize("env, message", [
    ({"ROWS": "A,F"}, "unknown row 'F'"),
    ({"UPDATES": "10", "BUDGET_HOURS": "1"}, "give UPDATES or BUDGET_HOURS, not both"),
    ({"DEVICE": "tpu"}, "DEVICE=tpu: use cpu or cuda"),
    ({"DATA_BIN": "/nonexistent"}, "DATA_BIN=/nonexistent: not a directory"),
])
def test_paper_table3_recipe_refuses_bad_knobs_in_one_line(tmp_path, env, message):
    r = subprocess.run(["bash", str(ROOT / "recipes" / "paper_table3" / "run.sh")], cwd=ROOT,
                       env={**os.environ, "WORK": str(tmp_path / "work"), "DATA_DIR": str(SHARED / "multi30k"),
                            **env}, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_corrupted_data_file_is_reported_with_both_checksums(tmp_path):
    if not (SHARED / "multi30k").is_dir():
        pytest.skip("no Multi30k data")
    bad = tmp_path / "data"
    bad.mkdir()
    for f in (SHARED / "multi30k").glob("*.gz"):
        (bad / f.name).symlink_to(f)
    (bad / "val.de.gz").unlink()
    (bad / "val.de.gz").write_bytes(b"not gzip at all")
    r = subprocess.run(["python", str(ROOT / "recipes" / "fetch_data.py"),
                        str(ROOT / "recipes" / "multi30k" / "manifest.tsv"), "--out", str(tmp_path / "raw"),
                        "--data-dir", str(bad), "--langs", "en,de"], capture_output=True, text=True)
    assert r.returncode == 1
    line = next(ln for ln in r.stderr.splitlines() if "error" in ln)
    assert "val.de.gz" in line and "expected 660e09eb7e1da2f8" in line and "found" in line
