"""What a fairseq user types, with fairseq's meaning: --remove-bpe, --lenpen-style fairseq, fairseq's architecture
names and training flags."""

from __future__ import annotations

import random

import pytest
from click.testing import CliRunner

from attnmt import registry
from attnmt.data.subword import remove_bpe


def run(args: list[str], stdin: str = "") -> tuple[int, str, str]:
    from attnmt.cli import cli

    registry.load_plugins()
    from attnmt.errors import UserError

    r = CliRunner().invoke(cli, args, input=stdin, catch_exceptions=True)
    if isinstance(r.exception, UserError):  # what attnmt's main prints as a one-line error, exit status 1
        return 1, r.stdout, r.stderr + f"attnmt: error: {r.exception}\n"
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return r.exit_code, r.stdout, r.stderr


@pytest.mark.parametrize("pieces, symbol, text", [
    ("a bi@@ g dog@@ gy runs", "@@ ", "a big doggy runs"),
    ("a bi@@ g dog@@ gy runs", "subword_nmt", "a big doggy runs"),
    ("end@@", "@@ ", "end"),  # a marker on the last piece goes too, as in fairseq
    ("\u2581a \u2581bi g \u2581dog", "sentencepiece", "a big dog"),
    ("a bi## g", "## ", "a big"),  # any other symbol: removed with what follows it
    ("a bi@@ g", "none", "a bi@@ g"),
])
def test_remove_bpe_as_fairseq(pieces, symbol, text):
    assert remove_bpe(pieces, symbol) == text


def _bpe_corpus(root, n: int = 60):
    """Parallel text already segmented by subword-nmt (``@@ `` markers), as a fairseq user brings it."""
    rng = random.Random(0)
    words = ["hou@@ se", "gar@@ den", "dog", "ca@@ t", "red", "blue", "sm@@ all", "big"]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(2, 6))) for _ in range(n)]
    for split, part in (("train", lines[:50]), ("valid", lines[50:55]), ("test", lines[55:])):
        (root / f"{split}.en").write_text("\n".join(part) + "\n", encoding="utf-8")
        (root / f"{split}.de").write_text("\n".join(part) + "\n", encoding="utf-8")
    return lines[55:]


@pytest.fixture(scope="module")
def bpe_model(tmp_path_factory):
    """A data-bin of subword-nmt text (preprocess --bpe none, fairseq-preprocess's behaviour) and a model on it."""
    from helpers import TINY_MODEL

    root = tmp_path_factory.mktemp("bpe")
    refs = _bpe_corpus(root)
    code, _, err = run(["preprocess", "--source-lang", "en", "--target-lang", "de", "--trainpref", str(root / "train"),
                        "--validpref", str(root / "valid"), "--testpref", str(root / "test"),
                        "--destdir", str(root / "bin"), "--joined-dictionary", "--workers", "1", "--quiet"])
    assert code == 0, err
    code, _, err = run(["train", str(root / "bin"), *TINY_MODEL, "--save-dir", str(root / "ck"), "--max-update", "2",
                        "--max-tokens", "256", "--threads", "1", "--progress", "lines"])
    assert code == 0, err
    return root, refs


def test_remove_bpe_on_a_model_of_presegmented_text(bpe_model):
    root, refs = bpe_model
    ck = str(root / "ck" / "checkpoint_last.pt")
    base = ["generate", str(root / "bin"), "--path", ck, "--max-len-a", "0", "--max-len-b", "6", "--format", "fairseq"]
    _, kept, _ = run(base)
    assert "@@ " in "\n".join(ln for ln in kept.splitlines() if ln.startswith("T-"))  # without the option: pieces
    code, out, err = run([*base, "--remove-bpe"])  # bare: subword-nmt's "@@ "
    assert code == 0, err
    rows = [ln.split("\t") for ln in out.splitlines()]
    assert [r[1] for r in rows if r[0].startswith("T-")] == [remove_bpe(t, "@@ ") for t in refs]
    for tag in ("H-", "D-"):
        assert not any("@@" in r[2] for r in rows if r[0].startswith(tag))
    _, plain, _ = run([*base[:-2], "--remove-bpe=subword_nmt", "--quiet"])
    assert plain.splitlines() == [r[2] for r in rows if r[0].startswith("D-")]
    # translate takes it too
    code, out, _ = run(["translate", "--path", ck, "--max-len-a", "0", "--max-len-b", "6", "--remove-bpe",
                        "--quiet"], "hou@@ se dog\n")
    assert code == 0 and "@@" not in out


def test_remove_bpe_with_a_subword_model_of_attnmt_changes_nothing(tmp_path):
    from pathlib import Path

    from attnmt.data.subword import SentencePieceBPE, TextPipeline
    from attnmt.inference import InferenceBundle

    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(f"the small dog {i} runs in the big garden" for i in range(200)) + "\n")
    pipe = TextPipeline(None, SentencePieceBPE.train([str(corpus)], 40, str(tmp_path / "spm")))
    bundle = InferenceBundle(model=None, src_dict=None, tgt_dict=None, src_pipeline=pipe, tgt_pipeline=pipe,
                             source_lang="en", target_lang="de", path=Path("model.pt"))
    pieces = pipe.encode("the small dog runs")
    note = bundle.with_remove_bpe("@@ ")
    assert "model.pt already merges subwords" in note and "changes nothing" in note
    assert bundle.detokenize(pieces) == "the small dog runs" and bundle.hypothesis_pieces(pieces) == pieces


def test_lenpen_style_fairseq_is_printed_and_used(bpe_model):
    root, _ = bpe_model
    ck = str(root / "ck" / "checkpoint_last.pt")
    base = ["generate", str(root / "bin"), "--path", ck, "--max-len-a", "0", "--max-len-b", "6", "--format", "fairseq",
            "--beam", "2", "--nbest", "2", "--lenpen", "1.0"]
    code, out, err = run([*base, "--lenpen-style", "fairseq"])
    assert code == 0, err
    assert "score = logprob / length^1 (fairseq)" in err
    for line in out.splitlines():
        if line.startswith("H-"):
            score = float(line.split("\t")[1])
        if line.startswith("P-"):
            pos = [float(x) for x in line.split("\t")[1].split()]
            assert score == pytest.approx(sum(pos) / len(pos), abs=1e-3)  # fairseq's |Y| ** lenpen
    code, _, err = run(base)
    assert "score = logprob / ((5 + length) / 6)^1 (GNMT)" in err
    code, _, err = run([*base, "--lenpen-style", "marian"])
    assert code != 0 and "marian" in err


# ---------------------------------------------------------------------------------------------- attnmt train

# fairseq's examples/translation/README.md, IWSLT'14 de-en, with the command name changed (and a short budget)
FAIRSEQ_IWSLT_LINE = (
    "--arch transformer_iwslt_de_en --share-decoder-input-output-embed --optimizer adam --adam-betas '(0.9, 0.98)' "
    "--clip-norm 0.0 --lr 5e-4 --lr-scheduler inverse_sqrt --warmup-updates 4000 --dropout 0.3 --weight-decay 0.0001 "
    "--criterion label_smoothed_cross_entropy --label-smoothing 0.1 --max-tokens 4096 --eval-bleu "
    "--eval-bleu-args '{\"beam\": 5, \"max_len_a\": 1.2, \"max_len_b\": 10}' --eval-bleu-detok moses "
    "--eval-bleu-remove-bpe --eval-bleu-print-samples --best-checkpoint-metric bleu --maximize-best-checkpoint-metric")


def test_fairseq_iwslt_training_line_runs(bpe_model, tmp_path):
    import json
    import shlex

    root, _ = bpe_model
    save = tmp_path / "ck"
    code, _, err = run(["train", str(root / "bin"), *shlex.split(FAIRSEQ_IWSLT_LINE), "--save-dir", str(save),
                        "--max-update", "1", "--threads", "1", "--encoder-layers", "1", "--decoder-layers", "1",
                        "--log-format", "json", "--log-file", str(tmp_path / "train.log")])
    assert code == 0, err
    records = [json.loads(ln) for ln in (save / "train.jsonl").read_text().splitlines()]
    valid = [r for r in records if r["type"] == "valid"]
    assert valid and "bleu" in valid[-1]
    hyp = valid[-1]["sample_hypothesis"]
    assert "@@" not in hyp and "@@" not in valid[-1]["sample_reference"]  # --eval-bleu-remove-bpe
    assert "example hypothesis:" in err
    assert any(ln.startswith("{") and json.loads(ln)["type"] == "valid" for ln in err.splitlines())  # json
    logged = (tmp_path / "train.log").read_text().splitlines()
    assert logged and all(ln[:4].isdigit() and " | " in ln for ln in logged)  # timestamped lines
    notice = next(ln for ln in err.splitlines() if "defaults that differ" in ln)
    assert notice.endswith("in effect: --adam-eps 1e-09 (fairseq: 1e-08)")  # the line sets all the others


def test_eval_bleu_args_map_onto_the_eval_bleu_options():
    from attnmt.training.config import TrainConfig

    cfg = TrainConfig(eval_bleu=True, eval_bleu_args='{"beam": 5, "max_len_a": 1.2, "max_len_b": 10, "lenpen": 1}')
    assert (cfg.eval_bleu_beam, cfg.eval_bleu_max_len_a, cfg.eval_bleu_max_len_b, cfg.eval_bleu_lenpen) == \
        (5, 1.2, 10, 1.0)
    with pytest.raises(ValueError, match="unknown key.*nbest; attnmt takes beam, lenpen, max_len_a, max_len_b"):
        TrainConfig(eval_bleu_args='{"nbest": 2}')
    with pytest.raises(ValueError, match="is not JSON"):
        TrainConfig(eval_bleu_args="{beam: 5}")
    assert TrainConfig(log_format="tqdm").progress == "bar" and TrainConfig(no_progress_bar=True).progress == "simple"


def test_checkpoint_options_keep_best_no_last_no_save_and_restore_file(bpe_model, tmp_path):
    from helpers import TINY_MODEL

    root, _ = bpe_model
    base = ["train", str(root / "bin"), *TINY_MODEL, "--max-tokens", "128", "--threads", "1", "--progress", "none"]
    a = tmp_path / "a"
    code, _, err = run([*base, "--save-dir", str(a), "--max-update", "6", "--validate-interval-updates", "2",
                        "--keep-best-checkpoints", "2", "--no-last-checkpoints", "--no-epoch-checkpoints",
                        "--save-interval-updates", "2"])
    assert code == 0, err
    names = sorted(p.name for p in a.glob("*.pt"))
    best_n = [n for n in names if n.startswith("checkpoint.best_loss_")]
    assert "checkpoint_last.pt" not in names and 1 <= len(best_n) <= 2, names
    from attnmt.checkpoint import BEST_N_PATTERN

    parsed = [BEST_N_PATTERN.match(n) for n in best_n]
    assert all(m and m.group(1) == "loss" and m.group(3) for m in parsed), best_n  # value and update count
    # the kept ones are the 2 lowest losses of all validations (train.jsonl), each under its own update's name
    import json

    valid = [json.loads(line) for line in (a / "train.jsonl").read_text().splitlines()]
    valid = sorted((r["loss"], r["num_updates"]) for r in valid if r.get("type") == "valid")
    kept = sorted((float(m.group(2)), int(m.group(3))) for m in parsed)
    assert [u for _, u in kept] == [u for _, u in valid[: len(kept)]]
    assert all(abs(v - loss) < 1e-6 for (v, _), (loss, _) in zip(kept, valid))
    code, _, err = run([*base, "--save-dir", str(tmp_path / "none"), "--max-update", "2", "--no-save"])
    assert code == 0 and not list((tmp_path / "none").glob("*.pt")), err
    # --restore-file: another run's state, continued in a new directory
    b = tmp_path / "b"
    code, _, err = run([*base, "--save-dir", str(b), "--max-update", "8", "--restore-file",
                        str(a / "checkpoint_2_6.pt")])
    assert code == 0, err
    import torch

    assert torch.load(b / "checkpoint_last.pt", weights_only=False)["train"]["num_updates"] == 8
    code, _, err = run([*base, "--save-dir", str(tmp_path / "c"), "--restore-file", str(tmp_path / "nope.pt")])
    assert code == 1 and "nope.pt: --restore-file not found" in err


def test_fairseq_architecture_names_and_refusals(bpe_model, tmp_path):
    from attnmt.cli import load_components
    from attnmt.registry import arch_config

    load_components()
    t2t = arch_config("transformer_wmt_en_de_big_t2t")
    assert t2t.encoder_embed_dim == 1024 and t2t.encoder_normalize_before and t2t.attention_dropout == 0.1
    assert arch_config("transformer_vaswani_wmt_en_de_big") == arch_config("transformer_big")
    assert arch_config("transformer_wmt_en_de") == arch_config("transformer")
    root, _ = bpe_model
    code, _, err = run(["train", str(root / "bin"), "--arch", "fconv_wmt_en_de", "--save-dir", str(tmp_path)])
    assert code != 0 and "fconv_wmt_en_de: a fairseq convolutional model" in err and "transformer_big" in err
    code, _, err = run(["train", str(root / "bin"), "--arch", "transformer", "--force-anneal", "50"])
    assert code == 2 and "--force-anneal is a fairseq option that attnmt does not take" in err


def test_defaults_that_differ_from_fairseq_are_printed(bpe_model, tmp_path):
    from helpers import TINY_MODEL

    root, _ = bpe_model
    code, _, err = run(["train", str(root / "bin"), *TINY_MODEL, "--save-dir", str(tmp_path), "--max-update", "1",
                        "--optimizer", "adam", "--lr", "1e-3", "--progress", "lines"])
    assert code == 0, err
    line = next(ln for ln in err.splitlines() if "defaults that differ from fairseq-train's" in ln)
    assert "--criterion label_smoothed_cross_entropy (fairseq: cross_entropy)" in line
    assert "--lr-scheduler inverse_sqrt (fairseq: fixed)" in line
    assert "--optimizer" not in line and "--lr " not in line  # given on the command line


def test_slurm_tasks_find_their_rendezvous():
    from attnmt.training.distributed import slurm_environ

    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu[01-02]"}
    assert slurm_environ(12345, env, hostnames=["gpu01", "gpu02"]) == {
        "RANK": "3", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "MASTER_ADDR": "gpu01", "MASTER_PORT": "12345"}
    assert slurm_environ(12345, {**env, "WORLD_SIZE": "2"}) == {}  # torchrun inside the allocation wins
    assert slurm_environ(12345, {}) == {}


def test_interactive_prints_fairseq_interactive_lines(bpe_model):
    root, _ = bpe_model
    ck = str(root / "ck" / "checkpoint_last.pt")
    args = ["interactive", str(root / "bin"), "--path", ck, "--beam", "5", "--source-lang", "en", "--target-lang",
            "de", "--max-len-a", "0", "--max-len-b", "5", "--remove-bpe"]
    code, out, err = run(args, "hou@@ se dog\nred ca@@ t\n")
    assert code == 0, err
    rows = [ln.split("\t") for ln in out.splitlines()]
    assert [r[0] for r in rows] == ["S-0", "W-0", "H-0", "D-0", "P-0", "S-1", "W-1", "H-1", "D-1", "P-1"]
    assert rows[0][1] == "hou@@ se dog" and rows[1][2] == "seconds" and float(rows[1][1]) >= 0
    assert "@@" not in rows[3][2]
    code, _, err = run([*args[:-1], "--bpe", "subword_nmt"], "dog\n")
    assert code == 1 and "--bpe subword_nmt needs --bpe-codes FILE" in err
    code, _, err = run([*args[:9], "fr"], "dog\n")
    assert code == 1 and "--target-lang fr" in err and "translates en->de" in err


def test_subword_nmt_bpe_learned_at_preprocess_and_applied_at_translation(tmp_path):
    """preprocess --bpe subword_nmt learns joint codes (stored in the data-bin and the checkpoint); raw text is then
    segmented with them and the output merged, as with SentencePiece."""
    from helpers import TINY_MODEL

    from attnmt.data.subword import SubwordNmtBPE

    rng = random.Random(1)
    words = ["houses", "gardens", "dogs", "cats", "reddish", "blueish", "smallest", "biggest", "the", "a"]
    for split, n in (("train", 300), ("valid", 10)):
        lines = [" ".join(rng.choice(words) for _ in range(rng.randint(2, 7))) for _ in range(n)]
        (tmp_path / f"{split}.en").write_text("\n".join(lines) + "\n")
        (tmp_path / f"{split}.de").write_text("\n".join(lines) + "\n")
    code, _, err = run(["preprocess", "-s", "en", "-t", "de", "--trainpref", str(tmp_path / "train"), "--validpref",
                        str(tmp_path / "valid"), "--destdir", str(tmp_path / "bin"), "--bpe", "subword_nmt",
                        "--vocab-size", "20", "--joined-dictionary", "--quiet"])
    assert code == 0, err
    codes = tmp_path / "bin" / "bpecodes"
    bpe = SubwordNmtBPE.load(codes)
    pieces = bpe.encode("the smallest gardens")
    assert "@@ " in pieces and bpe.decode(pieces) == "the smallest gardens"
    dictionary = (tmp_path / "bin" / "dict.en.txt").read_text()
    assert any(line.split()[0].endswith("@@") for line in dictionary.splitlines())
    code, _, err = run(["train", str(tmp_path / "bin"), *TINY_MODEL, "--save-dir", str(tmp_path / "ck"),
                        "--max-update", "2", "--max-tokens", "256", "--threads", "1", "--progress", "none"])
    assert code == 0, err
    code, out, err = run(["translate", "--path", str(tmp_path / "ck" / "checkpoint_last.pt"), "--max-len-a", "0",
                          "--max-len-b", "6", "--format", "fairseq", "--quiet"], "the smallest gardens\n")
    assert code == 0, err
    h = next(ln for ln in out.splitlines() if ln.startswith("H-")).split("\t")[2]
    d = next(ln for ln in out.splitlines() if ln.startswith("D-")).split("\t")[2]
    assert d == SubwordNmtBPE.load(codes).decode(h) and "@@" not in d
    code, _, err = run(["preprocess", "-s", "en", "-t", "de", "--trainpref", str(tmp_path / "train"), "--destdir",
                        str(tmp_path / "x"), "--bpe-codes", str(codes)])
    assert code == 1 and "--bpe-codes needs --bpe subword_nmt" in err


def test_tensorboard_logdir_gets_the_train_and_valid_scalars(bpe_model, tmp_path):
    pytest.importorskip("tensorboard")
    from helpers import TINY_MODEL
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, _ = bpe_model
    code, _, err = run(["train", str(root / "bin"), *TINY_MODEL, "--save-dir", str(tmp_path / "ck"),
                        "--max-update", "2", "--max-tokens", "256", "--log-interval", "1", "--threads", "1",
                        "--progress", "none", "--tensorboard-logdir", str(tmp_path / "tb")])
    assert code == 0, err
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "train/loss" in tags and "valid/valid/loss" in tags
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2]


def test_every_option_a_command_does_not_take_is_refused_at_once():
    code, _, err = run(["generate", "DATA", "--path", "x.pt", "--task", "translation", "--sacrebleu",
                        "--no-such-thing", "3"])
    assert code == 2
    line = err.strip().splitlines()[-1]
    assert line.startswith("Error: 3 options that attnmt generate does not take: --task is a fairseq option that "
                           "attnmt does not take: attnmt's commands take the task from the data-bin or the checkpoint")
    assert "--sacrebleu is a fairseq option that attnmt does not take: attnmt score computes sacreBLEU by default; " \
           "fairseq's tokenized BLEU is attnmt score --tokenized-bleu" in line
    assert line.endswith("; --no-such-thing: no such option")
    # one unknown option that fairseq does not know either: click's own message, with its suggestion
    code, _, err = run(["generate", "DATA", "--path", "x.pt", "--formt", "plain"])
    assert code == 2 and "No such option '--formt'" in err

