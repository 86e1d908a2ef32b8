"""Translation speed of an OPUS-MT-shaped MarianMT model: attnmt (fp32, int8) against transformers' ``generate``
and CTranslate2 (float32, int8), on the same model, sentences, beam and batches.

    python benchmarks/hf_speed.py --sentences ../shared/data/multi30k/test_2016_flickr.en.gz \
        --text ../shared/data/multi30k/train.en.gz --out /tmp/hf-speed

The model is built locally with transformers from a config shaped like Helsinki-NLP/opus-mt-en-de (d 512, 6+6
layers, ffn 2048, 8 heads, a 58,101-symbol shared vocabulary, swish, embeddings scaled by sqrt(d)) with random
weights: a SentencePiece model learned on the sentences' file gives the real pieces, and the rest of the
vocabulary is filler symbols (what a 58k vocabulary costs is the output projection, whatever its symbols). It is
saved with ``save_pretrained``, imported with ``attnmt import-hf`` and converted with CTranslate2's transformers
converter. A random model seldom ends a sentence, so every engine is given the same fixed length limit (``--max-len``
target tokens before the end of sentence) and mostly decodes up to it; the figure is target tokens (end of sentence
included) per second of translation, loading and text processing not timed, best of ``--repeats`` after a
warm-up. Every engine runs with ``--threads`` threads and ``--batch-size`` sentences per batch (sorted by length);
the machine must be otherwise idle.
"""

from __future__ import annotations

import argparse
import gzip
import subprocess
import sys
import time
from pathlib import Path


def read_lines(path: str, n: int) -> list[str]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.strip() for _, line in zip(range(n), f)]


def build_model(out: Path, corpus: str) -> Path:
    """The OPUS-MT-shaped MarianMT directory (built once, by recipes/pretrained/build_marian.py)."""
    hf = out / "opus-mt-shaped"
    if not (hf / "model.safetensors").is_file():
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes" / "pretrained"))
        from build_marian import build

        build(corpus, hf, "opus-mt")
    return hf


def timed(fn, repeats: int) -> tuple[float, object]:
    fn()  # warm-up (first-call costs: allocations, kernel selection)
    best, result = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sentences", required=True, help="source sentences (text or .gz), one per line")
    ap.add_argument("--text", help="text to learn the SentencePiece model on [default: --sentences]")
    ap.add_argument("--out", required=True, help="working directory (the models are built there once)")
    ap.add_argument("-n", type=int, default=96, help="sentences translated")
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=32, help="target tokens before the end of sentence")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--engines", default="attnmt-fp32,attnmt-int8,ct2-int8,ct2-float32,transformers")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    hf = build_model(out, args.text or args.sentences)
    ckpt = out / "attnmt.pt"
    if not ckpt.is_file():
        subprocess.run([sys.executable, "-m", "attnmt.cli", "import-hf", str(hf), "-o", str(ckpt)], check=True)
    lines = read_lines(args.sentences, args.n)
    lines.sort(key=lambda s: len(s.split()))  # every engine gets the same length-sorted batches
    batches = [lines[i:i + args.batch_size] for i in range(0, len(lines), args.batch_size)]
    results = {}
    engines = args.engines.split(",")

    for mode in ("fp32", "int8"):
        if f"attnmt-{mode}" not in engines:
            continue
        from attnmt import Translator

        t = Translator(ckpt, beam=args.beam, lenpen=0.0, max_len_a=0, max_len_b=args.max_len, min_len=0,
                       threads=args.threads, batch_size=args.batch_size, max_tokens=100000,
                       quantize="int8" if mode == "int8" else "none", precision="fp32")
        ids = [t.encode(s) for s in lines]

        def run_attnmt(t=t, ids=ids):
            return sum(len(r.tokens) for r in t.translate_encoded(ids, details=True))

        results[f"attnmt {mode}"] = timed(run_attnmt, args.repeats)
        t.close()

    if any(e.startswith("ct2") for e in engines):
        import ctranslate2

        ct2_dir = out / "ct2"
        if not ct2_dir.is_dir():
            subprocess.run([sys.executable, "-m", "ctranslate2.converters.transformers", "--model", str(hf),
                            "--output_dir", str(ct2_dir)],
                           check=True, capture_output=True)
        from transformers import MarianTokenizer

        tok = MarianTokenizer.from_pretrained(str(hf))
        pieces = [[tok.convert_ids_to_tokens(i) for i in tok(b)["input_ids"]] for b in batches]
        for compute in ("int8", "float32"):
            if f"ct2-{compute}" not in engines:
                continue
            tr = ctranslate2.Translator(str(ct2_dir), device="cpu", compute_type=compute, intra_threads=args.threads)

            def run_ct2(tr=tr):
                n = 0
                for p in pieces:
                    for r in tr.translate_batch(p, beam_size=args.beam, max_decoding_length=args.max_len + 1,
                                                length_penalty=0.0, max_batch_size=args.batch_size):
                        n += len(r.hypotheses[0]) + 1  # + the end of sentence
                return n

            results[f"CTranslate2 {compute}"] = timed(run_ct2, args.repeats)

    if "transformers" in engines:
        from transformers import MarianMTModel, MarianTokenizer

        tok = MarianTokenizer.from_pretrained(str(hf))
        model = MarianMTModel.from_pretrained(str(hf)).eval()
        encoded = [tok(b, return_tensors="pt", padding=True) for b in batches]

        def run_hf():
            n = 0
            with torch.inference_mode():
                for e in encoded:
                    seqs = model.generate(**e, num_beams=args.beam, max_new_tokens=args.max_len + 1,
                                          length_penalty=0.0, early_stopping=True, do_sample=False)
                    n += int((seqs[:, 1:] != tok.pad_token_id).sum())
            return n

        results["transformers"] = timed(run_hf, max(1, args.repeats - 1))

    print(f"{len(lines)} sentences, beam {args.beam}, batches of {args.batch_size}, {args.threads} threads, "
          f"at most {args.max_len} tokens + </s>")
    print(f"{'engine':<22} {'target tokens':>13} {'seconds':>8} {'tokens/s':>9}")
    rate = {}
    for name, (sec, toks) in results.items():
        rate[name] = toks / sec
        print(f"{name:<22} {toks:>13} {sec:>8.2f} {rate[name]:>9.1f}")
    best = max((v for k, v in rate.items() if k.startswith("attnmt")), default=None)
    for ref in ("CTranslate2 int8", "transformers"):
        if best is not None and ref in rate:
            print(f"attnmt's best / {ref}: {best / rate[ref]:.2f}x")


if __name__ == "__main__":
    main()
