"""The transformer command lines of fairseq 0.12.2's documentation, with ``fairseq-X`` changed to ``attnmt X``.

Sources: ``examples/translation/README.md`` (T), ``examples/scaling_nmt/README.md`` (S), ``docs/getting_started.rst``
(G). Paths point at tiny data; lines that train until stopped get ``--max-update 1`` and a small model; the table
in docs/fairseq.md lists each line before and after.
"""

from __future__ import annotations

import shlex

import pytest
from test_fairseq_compat import _bpe_corpus, run

TINY = "--encoder-layers 1 --decoder-layers 1 --encoder-embed-dim 16 --decoder-embed-dim 16 " \
       "--encoder-ffn-embed-dim 32 --decoder-ffn-embed-dim 32 --encoder-attention-heads 2 --decoder-attention-heads 2"


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    """``$TEXT``: subword-nmt segmented train/valid/test (the prepare-*.sh scripts' output), both languages."""
    root = tmp_path_factory.mktemp("fairseq_lines")
    _bpe_corpus(root)
    return root


def line(template: str, **paths) -> list[str]:
    return shlex.split(template.format(**{k: str(v) for k, v in paths.items()}))


@pytest.fixture(scope="module")
def trained(text):
    """T3 then a short T4: the IWSLT'14 lines of examples/translation/README.md."""
    t3 = ("preprocess --source-lang en --target-lang de --trainpref {t}/train --validpref {t}/valid --testpref {t}/test "
          "--destdir {t}/data-bin --workers 20")
    code, _, err = run(line(t3, t=text))
    assert code == 0, err
    t4 = ("train {t}/data-bin --arch transformer_iwslt_de_en --share-decoder-input-output-embed --optimizer adam "
          "--adam-betas '(0.9, 0.98)' --clip-norm 0.0 --lr 5e-4 --lr-scheduler inverse_sqrt --warmup-updates 4000 "
          "--dropout 0.3 --weight-decay 0.0001 --criterion label_smoothed_cross_entropy --label-smoothing 0.1 "
          "--max-tokens 4096 --eval-bleu --eval-bleu-args '{{\"beam\": 5, \"max_len_a\": 1.2, \"max_len_b\": 10}}' "
          "--eval-bleu-detok moses --eval-bleu-remove-bpe --eval-bleu-print-samples --best-checkpoint-metric bleu "
          "--maximize-best-checkpoint-metric")
    code, _, err = run([*line(t4, t=text), "--save-dir", str(text / "checkpoints"), "--max-update", "2",
                        *TINY.split(), "--progress", "none"])
    assert code == 0, err
    return text / "data-bin", text / "checkpoints" / "checkpoint_best.pt"


@pytest.mark.parametrize("tag, template", [
    ("T5", "generate {d} --path {c} --batch-size 128 --beam 5 --remove-bpe"),
    ("T11", "generate {d} --path {c} --beam 5 --remove-bpe"),
    ("T1", "generate {d} --path {c} --beam 5 --batch-size 128 --remove-bpe"),
    ("T8", "generate {d} --path {c} --beam 5 --remove-bpe"),
    ("S4", "generate {d} --path {c} --beam 4 --lenpen 0.6 --remove-bpe"),
    ("G4", "generate {d} --path {c} --batch-size 128 --beam 5"),
])
def test_generate_lines(trained, tag, template):
    data, ckpt = trained
    code, out, err = run([*line(template, d=data, c=ckpt), "--max-len-b", "4", "--format", "fairseq"])
    assert code == 0, err
    assert sum(ln.startswith("H-") for ln in out.splitlines()) == 5
    assert ("@@" in out) == ("--remove-bpe" not in template)


def test_preprocess_lines(text, tmp_path):
    t6 = ("preprocess --source-lang en --target-lang de --trainpref {t}/train --validpref {t}/valid --testpref {t}/test "
          "--destdir {o}/wmt17_en_de --thresholdtgt 0 --thresholdsrc 0 --workers 20")
    s1 = ("preprocess --source-lang en --target-lang de --trainpref {t}/train --validpref {t}/valid --testpref {t}/test "
          "--destdir {o}/wmt16_en_de_bpe32k --nwordssrc 32768 --nwordstgt 32768 --joined-dictionary --workers 20")
    for template in (t6, s1):
        code, _, err = run(line(template, t=text, o=tmp_path))
        assert code == 0, err
    assert (tmp_path / "wmt16_en_de_bpe32k" / "dict.en.txt").read_text() == \
        (tmp_path / "wmt16_en_de_bpe32k" / "dict.de.txt").read_text()


def test_average_and_score_lines(trained, text, tmp_path):
    data, ckpt = trained
    s3 = "average-checkpoints --inputs {d} --num-epoch-checkpoints 10 --output {o}/checkpoint.avg10.pt"
    code, _, err = run(line(s3, d=ckpt.parent, o=tmp_path))  # two epochs trained: fewer than 10, as fairseq says
    assert code == 1 and "need 10" in err and "lower --num-epoch-checkpoints" in err
    code, _, err = run(line(s3.replace("10", "2"), d=ckpt.parent, o=tmp_path))
    assert code == 0, err
    (tmp_path / "gen.out.sys").write_text("a big dog\n")
    (tmp_path / "gen.out.ref").write_text("a big dog\n")
    code, out, err = run(line("score --sys {o}/gen.out.sys --ref {o}/gen.out.ref", o=tmp_path))
    assert code == 0 and "BLEU" in out + err


def test_more_preprocess_lines(text, tmp_path):
    """G2: getting_started's IWSLT line (no --workers); T9: WMT'14 en-fr; M1/M2: the multilingual README's two
    binarizations into one directory, the second refused with what to do (attnmt trains one pair per data-bin)."""
    for split in ("train", "valid", "test"):  # a French side, and the multilingual README's file names
        (text / f"{split}.fr").write_text((text / f"{split}.de").read_text())
        for pair, langs in (("de-en", ("de", "en")), ("fr-en", ("fr", "en"))):
            for lang in langs:
                (text / f"{split}.bpe.{pair}.{lang}").write_text((text / f"{split}.{'de' if lang == 'fr' else lang}")
                                                                 .read_text())
    g = ("preprocess --source-lang de --target-lang en --trainpref {t}/train --validpref {t}/valid --testpref {t}/test "
         "--destdir {o}/iwslt14.tokenized.de-en")
    t9 = ("preprocess --source-lang en --target-lang fr --trainpref {t}/train --validpref {t}/valid --testpref {t}/test "
          "--destdir {o}/wmt14_en_fr --thresholdtgt 0 --thresholdsrc 0 --workers 60")
    m1 = ("preprocess --source-lang de --target-lang en --trainpref {t}/train.bpe.de-en --validpref {t}/valid.bpe.de-en "
          "--joined-dictionary --destdir {o}/iwslt17.de_fr.en.bpe16k --workers 10")
    for template in (g, t9, m1):
        code, _, err = run(line(template, t=text, o=tmp_path))
        assert code == 0, err
    assert (tmp_path / "wmt14_en_fr" / "test.en-fr.fr.bin").exists()
    m2 = ("preprocess --source-lang fr --target-lang en --trainpref {t}/train.bpe.fr-en --validpref {t}/valid.bpe.fr-en "
          "--joined-dictionary --tgtdict {o}/iwslt17.de_fr.en.bpe16k/dict.en.txt --destdir {o}/iwslt17.de_fr.en.bpe16k "
          "--workers 10")
    code, _, err = run(line(m2, t=text, o=tmp_path))
    assert code == 1 and "holds a different preprocessing (--source-lang 'de' vs 'fr'" in err
    assert "choose another --destdir" in err and len(err.splitlines()) == 1


def test_update_freq_line(trained, tmp_path):
    """G5: ``fairseq-train --update-freq 8 (...)``: gradients of 8 batches per update, as fairseq accumulates them."""
    data, _ = trained
    code, _, err = run([*line("train {d} --update-freq 8 --arch transformer_iwslt_de_en --save-dir {o}", d=data,
                              o=tmp_path / "ck"), *TINY.split(), "--max-update", "1", "--max-tokens", "24",
                        "--progress", "none"])
    assert code == 0, err
    import torch

    state = torch.load(tmp_path / "ck" / "checkpoint_last.pt", weights_only=False)["train"]
    assert state["num_updates"] == 1 and state["train_config"]["update_freq"] == 8
    assert state["iterator"]["offset"] == 8 < state["iterator"]["num_batches"]  # one update took 8 batches


def test_generate_pipelines(trained, text, tmp_path):
    """T2 (``grep ^H gen.out | cut -f3-``, ``grep ^T ... | cut -f2-``, fairseq-score), S5 (compound-split BLEU of
    gen.out) and S6 (sacreBLEU of gen.out): on fairseq's lines, which --fairseq prints; attnmt's plain output has
    none (docs/fairseq.md says so)."""
    data, ckpt = trained
    code, plain, err = run(line("generate {d} --path {c} --beam 4 --lenpen 0.6 --remove-bpe", d=data, c=ckpt)
                           + ["--max-len-b", "4"])
    assert code == 0 and not any(ln.startswith(("H-", "T-")) for ln in plain.splitlines()), err
    code, out, err = run(line("generate {d} --path {c} --beam 4 --lenpen 0.6 --remove-bpe --fairseq", d=data, c=ckpt)
                         + ["--max-len-b", "4"])
    assert code == 0, err
    gen = tmp_path / "gen.out"
    gen.write_text(out)
    assert "BLEU" in out.splitlines()[-1]  # the tail compound_split_bleu.sh checks for
    sys_lines = [ln.split("\t", 2)[2] for ln in out.splitlines() if ln.startswith("H")]
    ref_lines = [ln.split("\t", 1)[1] for ln in out.splitlines() if ln.startswith("T")]
    assert len(sys_lines) == len(ref_lines) == 5
    (tmp_path / "gen.out.sys").write_text("\n".join(sys_lines) + "\n")
    (tmp_path / "gen.out.ref").write_text("\n".join(ref_lines) + "\n")
    code, out, err = run(line("score --sys {o}/gen.out.sys --ref {o}/gen.out.ref --tokenized-bleu", o=tmp_path))
    assert code == 0 and "BLEU" in out, err
    # fairseq-score's line: the same scorer as generate's closing line, on the grepped fields
    code, out, err = run(line("score --sys {o}/gen.out.sys --ref {o}/gen.out.ref --fairseq", o=tmp_path))
    assert code == 0 and out.strip() == gen.read_text().splitlines()[-1].split(": ", 1)[1], (out, err)
    for extra in (["--tokenized-bleu", "--compound-split", "--lang", "de"], []):  # S5, S6
        code, out, err = run(line("score --sys {o}/gen.out --ref {o}/gen.out.ref", o=tmp_path) + extra)
        assert code == 0 and "BLEU" in out, err


@pytest.mark.parametrize("tag, template, message", [
    ("T10", "train {d} --lr 0.5 --clip-norm 0.1 --dropout 0.1 --max-tokens 3000 --criterion "
            "label_smoothed_cross_entropy --label-smoothing 0.1 --lr-scheduler fixed --force-anneal 50 --arch "
            "fconv_wmt_en_fr --save-dir {o}", "--force-anneal is a fairseq option that attnmt does not take"),
    ("M3", "train {d} --max-epoch 50 --ddp-backend=no_c10d --task multilingual_translation --lang-pairs de-en,fr-en "
           "--arch multilingual_transformer_iwslt_de_en --share-decoders --share-decoder-input-output-embed "
           "--optimizer adam --adam-betas '(0.9, 0.98)' --lr 0.0005 --lr-scheduler inverse_sqrt --min-lr '1e-09' "
           "--warmup-updates 4000 --warmup-init-lr '1e-07' --label-smoothing 0.1 --criterion "
           "label_smoothed_cross_entropy --dropout 0.3 --weight-decay 0.0001 --save-dir {o} --max-tokens 4000 "
           "--update-freq 8", "--lang-pairs is a fairseq option that attnmt does not take: fairseq's multilingual"),
    ("M4", "interactive {d} --task multilingual_translation --source-lang de --target-lang en --path {o}/x.pt "
           "--buffer-size 2000 --batch-size 128 --beam 5 --remove-bpe=sentencepiece", "--task is a fairseq option"),
    ("G6", "train {d} --fp16 --arch transformer --save-dir {o}", "--fp16 needs a CUDA GPU"),
    ("S2b", "train {d} --arch transformer_vaswani_wmt_en_de_big --share-all-embeddings --optimizer adam --adam-betas "
            "'(0.9, 0.98)' --clip-norm 0.0 --lr 0.001 --lr-scheduler inverse_sqrt --warmup-updates 4000 "
            "--warmup-init-lr 1e-07 --dropout 0.3 --weight-decay 0.0 --criterion label_smoothed_cross_entropy "
            "--label-smoothing 0.1 --max-tokens 3584 --fp16 --update-freq 16 --save-dir {o}", "--fp16 needs a CUDA GPU"),
    ("T7", "train {d} --arch fconv_wmt_en_de --dropout 0.2 --criterion label_smoothed_cross_entropy "
           "--label-smoothing 0.1 --optimizer nag --clip-norm 0.1 --lr 0.5 --lr-scheduler fixed --force-anneal 50 "
           "--max-tokens 4000 --save-dir {o}", "--force-anneal is a fairseq option that attnmt does not take"),
    ("G3", "train {d} --optimizer nag --lr 0.25 --clip-norm 0.1 --dropout 0.2 --max-tokens 4000 --arch "
           "fconv_iwslt_de_en --save-dir {o}", "fconv_iwslt_de_en: a fairseq convolutional model"),
    ("S2", "train {d} --arch transformer_vaswani_wmt_en_de_big --share-all-embeddings --optimizer adam --adam-betas "
           "'(0.9, 0.98)' --clip-norm 0.0 --lr 0.0005 --lr-scheduler inverse_sqrt --warmup-updates 4000 "
           "--warmup-init-lr 1e-07 --dropout 0.3 --weight-decay 0.0 --criterion label_smoothed_cross_entropy "
           "--label-smoothing 0.1 --max-tokens 3584 --fp16 --save-dir {o}", "--fp16 needs a CUDA GPU"),
    ("G9", "train {d}:{d}:{d} --arch transformer --save-dir {o}", "sharded data directories"),
])
def test_lines_refused_with_a_reason(trained, tmp_path, tag, template, message):
    import torch

    if tag in ("S2", "S2b", "G6") and torch.cuda.is_available():
        pytest.skip("--fp16 trains on a GPU")
    data, _ = trained
    code, _, err = run(line(template, d=data, o=tmp_path / "ck"))
    assert code != 0 and message in err, err


def test_interactive_fairseq_mode_translates_as_generate_fairseq(trained, text):
    """fairseq-interactive's search defaults with --fairseq: the H- lines of generate --fairseq on the same text."""
    data, ckpt = trained
    source = (text / "test.en").read_text()
    code, gen_out, err = run(line("generate {d} --path {c} --fairseq --remove-bpe", d=data, c=ckpt))
    assert code == 0, err
    code, inter_out, err = run(line("interactive --path {c} {d} --fairseq --remove-bpe", d=data, c=ckpt), source)
    assert code == 0, err
    assert "beam 5" in err and "fairseq" in err.split("search: ", 1)[1]

    def hyps(out):
        return [ln.split("\t", 1)[1] for ln in out.splitlines() if ln.startswith("H-")]
    assert hyps(inter_out) == hyps(gen_out) and len(hyps(gen_out)) == 5


def test_interactive_line(trained, tmp_path):
    data, ckpt = trained
    g1 = ("interactive --path {c} {d} --beam 5 --source-lang en --target-lang de --tokenizer moses --bpe subword_nmt "
          "--bpe-codes {o}/bpecodes")
    from attnmt.data.subword import SubwordNmtBPE

    corpus = tmp_path / "raw.txt"  # the codes the model's training text was segmented with, in effect
    corpus.write_text("the house is red\nwhy is the garden small\nthe cat and the dog\n" * 20)
    SubwordNmtBPE.train([str(corpus)], 30, str(tmp_path / "bpe"))
    (tmp_path / "bpe.codes").rename(tmp_path / "bpecodes")
    code, out, err = run(line(g1, c=ckpt, d=data, o=tmp_path) + ["--max-len-b", "4"], "Why is the house red?\n")
    assert code == 0, err
    assert [ln.split("\t")[0] for ln in out.splitlines()] == ["S-0", "W-0", "H-0", "D-0", "P-0"]
    code, out, err = run(line("interactive --path {c} {d} --beam 5 --source-lang en --target-lang de --remove-bpe",
                              c=ckpt, d=data) + ["--max-len-b", "4"], "hou@@ se dog\n")
    assert code == 0, err
    assert [ln.split("\t")[0] for ln in out.splitlines()] == ["S-0", "W-0", "H-0", "D-0", "P-0"]
