"""The identity table of the Hugging Face interop on Multi30k: for each family, a model built with transformers
from a config, trained for a few hundred updates on Multi30k en-de (so that its translations end where a
translation would), saved with ``save_pretrained`` and imported with ``attnmt import-hf``, then

* the tokenizers: attnmt's source ids (and target ids) against transformers' tokenizer on ``--tokenizer-lines``
  lines of val + test_2016_flickr;
* the searches: ``generate()`` against attnmt's search, greedy and beam 4, on ``-n`` test_2016_flickr sentences,
  identical token ids n/N and the largest difference of a token's log-probability (attnmt's search against
  transformers' teacher-forced scores of the same tokens, fp32), under the rules both define alike (no length
  penalty, no minimum length, the stop of ``early_stopping=True``: ``tests/hf_models.py``);
* the export round trip: an attnmt model exported with ``export --to huggingface``, translated by
  ``MarianMTModel`` and attnmt alike, imported back and exported again with identical tensors.

    python benchmarks/hf_identity.py --data ../shared/data/multi30k --out /tmp/hf-identity
"""

from __future__ import annotations

import argparse
import gzip
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))


def lines(path: Path, n: int) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line.strip() for _, line in zip(range(n), f)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="the Multi30k directory (train/val/test_2016_flickr .en/.de.gz)")
    ap.add_argument("--out", required=True)
    ap.add_argument("-n", type=int, default=200, help="test sentences translated")
    ap.add_argument("--tokenizer-lines", type=int, default=1000)
    ap.add_argument("--train-pairs", type=int, default=8000)
    ap.add_argument("--updates", type=int, default=300)
    args = ap.parse_args()

    import torch
    import transformers
    from hf_models import compare, fsmt_dir, m2m100_dir, marian_dir, nllb_dir

    from attnmt import checkpoint
    from attnmt.inference import load_for_inference
    from attnmt.interop.huggingface import import_model

    torch.set_num_threads(2)
    data, out = Path(args.data), Path(args.out)
    pairs = (lines(data / "train.en.gz", args.train_pairs), lines(data / "train.de.gz", args.train_pairs))
    test = lines(data / "test_2016_flickr.en.gz", args.n)
    tok_src = (lines(data / "val.en.gz", 1014) + lines(data / "test_2016_flickr.en.gz", 1000))[:args.tokenizer_lines]
    tok_tgt = (lines(data / "val.de.gz", 1014) + lines(data / "test_2016_flickr.de.gz", 1000))[:args.tokenizer_lines]
    rows = []
    families = {
        "MarianMT, shared vocabulary (swish)": lambda d: marian_dir(d, train_steps=args.updates, pairs=pairs,
                                                                     pieces=2000, d_model=64),
        "MarianMT, separate vocabularies (gelu)": lambda d: marian_dir(d, separate=True, activation="gelu",
                                                                        train_steps=args.updates, pairs=pairs,
                                                                        pieces=2000, d_model=64),
        "M2M-100 (en->de)": lambda d: m2m100_dir(d, train_steps=args.updates, pairs=pairs, pieces=2000, d_model=64),
        "FSMT (Moses + BPE codes)": lambda d: fsmt_dir(d, train_steps=args.updates, pairs=pairs, merges=2000,
                                                       d_model=64),
        "NLLB-200 (tokenizer.json, eng_Latn->deu_Latn)": lambda d: nllb_dir(d, train_steps=args.updates, pairs=pairs,
                                                                             pieces=2000, d_model=64),
    }
    languages = {"M2M-100 (en->de)": ("en", "de"), "NLLB-200 (tokenizer.json, eng_Latn->deu_Latn)": ("eng_Latn", "deu_Latn")}
    import json

    for i, (name, build) in enumerate(families.items()):
        d = out / f"family{i}"
        done = d / "results.json"  # a family measured before (the runs take minutes each)
        if done.is_file():
            r = json.loads(done.read_text())
            rows.append((name, r["src"], r["tgt"], r["n"], {int(k): tuple(v) for k, v in r["results"].items()}))
            continue
        hf = d / "hf" if (d / "hf" / "config.json").is_file() else build(d)
        langs = languages.get(name)
        ckpt = d / "model.pt"
        checkpoint.save(import_model(hf, *(langs or (None, None))), ckpt)
        tok = transformers.AutoTokenizer.from_pretrained(str(hf))
        bundle = load_for_inference(ckpt)
        if langs:
            tok.src_lang, tok.tgt_lang = langs
            bundle.set_languages(*langs)
        src_same = sum(bundle.encode_source(s) == tok(s)["input_ids"] for s in tok_src)
        tgt_ids = tok(text_target=tok_tgt)["input_ids"]
        prefix = [bundle.forced_first] if bundle.forced_first is not None else []
        tgt_same = sum(prefix + bundle.tgt_dict.encode_line(bundle.tgt_pipeline.encode(t)) == ids
                       for t, ids in zip(tok_tgt, tgt_ids))
        _, results = compare(hf, ckpt, test, langs, max_new=60)
        rows.append((name, src_same, tgt_same, len(tok_src), results))
        done.write_text(json.dumps({"src": src_same, "tgt": tgt_same, "n": len(tok_src), "results": results}))

    # an attnmt model out and back: trained briefly on the same pairs by attnmt itself
    rt = out / "roundtrip"
    rt.mkdir(parents=True, exist_ok=True)
    for lang, text in (("en", pairs[0]), ("de", pairs[1])):
        (rt / f"train.{lang}").write_text("\n".join(text) + "\n", encoding="utf-8")
    (rt / "valid.en").write_text("\n".join(lines(data / "val.en.gz", 200)) + "\n", encoding="utf-8")
    (rt / "valid.de").write_text("\n".join(lines(data / "val.de.gz", 200)) + "\n", encoding="utf-8")
    cli = [sys.executable, "-m", "attnmt.cli"]
    if not (rt / "ck" / "checkpoint_last.pt").is_file():
        subprocess.run([*cli, "preprocess", "-s", "en", "-t", "de", "--trainpref", str(rt / "train"), "--validpref",
                        str(rt / "valid"), "--destdir", str(rt / "bin"), "--bpe", "sentencepiece", "--vocab-size",
                        "2000", "--joined-dictionary"], check=True, capture_output=True)
        subprocess.run([*cli, "train", str(rt / "bin"), "--arch", "transformer_small", "--encoder-layers", "2",
                        "--decoder-layers", "2", "--max-update", str(args.updates), "--save-dir", str(rt / "ck"),
                        "--progress", "none", "--no-epoch-checkpoints", "--lr", "2e-3", "--warmup-updates", "100"],
                       check=True, capture_output=True)
    subprocess.run([*cli, "export", "--path", str(rt / "ck" / "checkpoint_last.pt"), "--to", "huggingface",
                    "--output-dir", str(rt / "hf"), "--force"], check=True, capture_output=True)
    _, results = compare(rt / "hf", rt / "ck" / "checkpoint_last.pt", test, None, max_new=60)
    from safetensors.torch import load_file

    from attnmt.interop.marian_export import export_marian

    export_marian(import_model(rt / "hf"), rt / "hf2", force=True)
    a, b = load_file(str(rt / "hf" / "model.safetensors")), load_file(str(rt / "hf2" / "model.safetensors"))
    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows.append(("attnmt transformer_small (2+2) exported as MarianMT", None, None, None, results))

    print(f"{len(test)} test_2016_flickr sentences, at most 60 tokens + </s>; 'limit': of the differing ones, those "
          f"that ran to the length limit")
    print(f"{'model':<52} {'tokenizer src / tgt':>20} {'greedy ids':>11} {'limit':>5} {'max |dlp|':>9} "
          f"{'beam 4 ids':>11} {'limit':>5} {'max |dlp|':>9}")
    for name, s, t, n, res in rows:
        tok = f"{s}/{n} / {t}/{n}" if s is not None else "-"
        g, b4 = res[1], res[4]
        print(f"{name:<52} {tok:>20} {g[0]:>7}/{len(test):<3} {g[2]:>5} {g[1]:>9.2e} {b4[0]:>7}/{len(test):<3} "
              f"{b4[2]:>5} {b4[1]:>9.2e}")
    print(f"export -> import -> export: identical tensors: {same}")


if __name__ == "__main__":
    main()
