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
    ("T1", "generate {d} --path {c} --beam 5 --batch-size 128 --remove-bpe"),
    ("T8", "generate {d} --path {c} --beam 5 --remove-bpe"),
    ("S4", "generate {d} --path {c} --beam 4 --lenpen 0.6 --remove-bpe"),
    ("G3", "generate {d} --path {c} --batch-size 128 --beam 5"),
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


@pytest.mark.parametrize("tag, template, message", [
    ("T7", "train {d} --arch fconv_wmt_en_de --dropout 0.2 --criterion label_smoothed_cross_entropy "
           "--label-smoothing 0.1 --optimizer nag --clip-norm 0.1 --lr 0.5 --lr-scheduler fixed --force-anneal 50 "
           "--max-tokens 4000 --save-dir {o}", "--force-anneal is a fairseq option that attnmt does not take"),
    ("G2", "train {d} --optimizer nag --lr 0.25 --clip-norm 0.1 --dropout 0.2 --max-tokens 4000 --arch "
           "fconv_iwslt_de_en --save-dir {o}", "fconv_iwslt_de_en: a fairseq convolutional model"),
    ("S2", "train {d} --arch transformer_vaswani_wmt_en_de_big --share-all-embeddings --optimizer adam --adam-betas "
           "'(0.9, 0.98)' --clip-norm 0.0 --lr 0.0005 --lr-scheduler inverse_sqrt --warmup-updates 4000 "
           "--warmup-init-lr 1e-07 --dropout 0.3 --weight-decay 0.0 --criterion label_smoothed_cross_entropy "
           "--label-smoothing 0.1 --max-tokens 3584 --fp16 --save-dir {o}", "--fp16 needs a CUDA GPU"),
    ("G7", "train {d}:{d}:{d} --arch transformer --save-dir {o}", "sharded data directories"),
])
def test_lines_refused_with_a_reason(trained, tmp_path, tag, template, message):
    import torch

    if tag == "S2" and torch.cuda.is_available():
        pytest.skip("--fp16 trains on a GPU")
    data, _ = trained
    code, _, err = run(line(template, d=data, o=tmp_path / "ck"))
    assert code != 0 and message in err, err


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
