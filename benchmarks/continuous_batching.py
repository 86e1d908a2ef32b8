"""Sentences in flight: static calls against continuous batching, in one process (no HTTP), against translate.

    python benchmarks/continuous_batching.py --path CKPT --input ../shared/data/multi30k/test_2016_flickr.en.gz \
        [--sentences 512] [--in-flight 32] [--rounds 3] [-- TRANSLATOR OPTIONS, e.g. beam=4 lenpen=1.0]

What a service with ``--in-flight`` clients of one sentence each can do at best, without the HTTP side: the same
``Translator`` searches the shuffled sentences (1) as ``attnmt translate`` does (the whole list, sorted by length
into ``--max-tokens`` batches), (2) in static calls of ``--in-flight`` sentences (each call runs until its last
sentence ends), and (3) with continuous batching, a new sentence joining at the next step whenever one leaves, so
that ``--in-flight`` sentences are always being decoded. Prints sentences/s per way and round (interleaved,
after one warm-up of each), the medians, and whether the continuous translations equal translate's.
"""

from __future__ import annotations

import argparse
import gzip
import random
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", required=True)
    ap.add_argument("--input", required=True, help="source sentences, one per line (.gz read as gzip)")
    ap.add_argument("--sentences", type=int, default=512)
    ap.add_argument("--in-flight", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("options", nargs="*", help="Translator options as name=value")
    args = ap.parse_args()

    from attnmt.api import Translator
    from attnmt.generation.continuous import ContinuousSearch

    options = {}
    for item in args.options:
        name, _, value = item.partition("=")
        options[name] = int(value) if value.lstrip("-").isdigit() else float(value) if _is_float(value) else value
    opener = gzip.open if args.input.endswith(".gz") else open
    with opener(args.input, "rt", encoding="utf-8") as f:
        lines = [line.strip() for line in f if line.strip()]
    random.Random(0).shuffle(lines)
    lines = (lines * (args.sentences // max(1, len(lines)) + 1))[: args.sentences]
    t = Translator(args.path, **options)
    ids = t.encode_batch(lines)
    n, m = len(ids), args.in_flight

    def translate() -> list[str]:
        return [r.text for r in t.translate_encoded(ids, details=True)]

    def static() -> list[str]:
        out = []
        for i in range(0, n, m):
            out += [r.text for r in t.translate_encoded(ids[i:i + m], details=True)]
        return out

    stream = ContinuousSearch(t.generator)

    def continuous() -> list[str]:
        got: dict[int, str] = {}
        nxt = 0
        while nxt < n or stream.size:
            if stream.size < m and nxt < n:
                k = min(m - stream.size, n - nxt)
                stream.add(ids[nxt:nxt + k], range(nxt, nxt + k))
                nxt += k
            for key, hyps in stream.step():
                got[key] = t.bundle.detokenize(t.bundle.target_pieces(hyps[0].tokens)) if hyps else ""
        return [got[i] for i in range(n)]

    ways = {"translate (sorted batches)": translate, f"static calls of {m}": static,
            f"continuous, {m} in flight": continuous}
    rates: dict[str, list[float]] = {w: [] for w in ways}
    texts = {w: f() for w, f in ways.items()}  # warm-up, and the translations
    for r in range(args.rounds):
        for w, f in ways.items():
            t0 = time.perf_counter()
            f()
            rates[w].append(n / (time.perf_counter() - t0))
        print(f"round {r}: " + ", ".join(f"{w} {rates[w][-1]:.1f}" for w in ways), flush=True)
    base = statistics.median(rates["translate (sorted batches)"])
    print(f"\n{n} sentences, {t.generator.search_cfg.describe()}, precision {t.precision}")
    print("| way | sentences/s (median; rounds) | vs translate |")
    print("|---|---|---|")
    for w in ways:
        med = statistics.median(rates[w])
        print(f"| {w} | {med:.1f} ({', '.join(f'{x:.1f}' for x in rates[w])}) | {med / base:.2f} |")
    same = sum(a == b for a, b in zip(texts[f"continuous, {m} in flight"], texts["translate (sorted batches)"]))
    print(f"continuous translations equal to translate's: {same}/{n}")


def _is_float(value: str) -> bool:
    try:
        float(value)
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    main()
