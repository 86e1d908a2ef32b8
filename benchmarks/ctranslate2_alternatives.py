"""Target prefixes and alternatives: ``Translator.translate(prefix=..., return_alternatives=True)`` against
CTranslate2's ``translate_batch(target_prefix=..., return_alternatives=True)`` on the same model (exported with
``attnmt export --to ctranslate2``, run in float32) and the same sentences.

Each of the first N test sentences gets a prefix: the first 1-3 words of its reference (a fixed seed). Both search
with beam 4 and CTranslate2's length normalisation (score / length ** LENPEN, attnmt's ``--lenpen-style fairseq``;
``--lenpen``, default 1) and stop as CTranslate2 does (``--early-stop beam``); ``--alternatives K`` asks for K of
them. CTranslate2 leaves a forced prefix out of the score it normalises (an alternative's continuation is scored
alone), attnmt keeps the prefix tokens' log-probabilities in it, so with a length penalty the two may rank
continuations of different lengths differently; ``--lenpen 0`` compares the searches alone. The script prints how
many of attnmt's plain prefixed translations start with the prefix verbatim, how many equal CTranslate2's, and how
many of the alternatives (the tokens and their order) are identical to CTranslate2's, with the differing ones listed.

    python benchmarks/ctranslate2_alternatives.py --model ck/checkpoint_best.pt --src test.en --ref test.de -n 200
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
from pathlib import Path


def prefixes_for(refs: list[str], seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(r.split()[: rng.randint(1, 3)]) for r in refs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--src", required=True)
    ap.add_argument("--ref", required=True)
    ap.add_argument("-n", type=int, default=200)
    ap.add_argument("--alternatives", type=int, default=5)
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--lenpen", type=float, default=1.0, help="both: score / length ** LENPEN (0: the sum)")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    import ctranslate2

    from attnmt import Translator

    src = Path(a.src).read_text(encoding="utf-8").splitlines()[: a.n]
    refs = Path(a.ref).read_text(encoding="utf-8").splitlines()[: a.n]
    prefixes = prefixes_for(refs, a.seed)
    search = dict(beam=a.beam, lenpen=a.lenpen, lenpen_style="fairseq", early_stop="beam", max_len_a=0.0, max_len_b=200)
    ours = Translator(a.model, **search)
    alts = ours
    bundle = ours.bundle
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ct2"
        subprocess.run([sys.executable, "-m", "attnmt.cli", "export", "--path", a.model, "--to", "ctranslate2",
                        "--output-dir", str(out)], check=True, capture_output=True)
        ct2 = ctranslate2.Translator(str(out), device="cpu", compute_type="float32")
        source_pieces = [bundle.source_pieces(s).split() for s in bundle.encode_sources(src)]
        prefix_pieces = [bundle.tgt_pipeline.encode(p).split() for p in prefixes]
        opts = dict(beam_size=a.beam, length_penalty=a.lenpen, max_decoding_length=200, return_scores=True)
        theirs_plain = ct2.translate_batch(source_pieces, target_prefix=prefix_pieces, **opts)
        theirs_alt = ct2.translate_batch(source_pieces, target_prefix=prefix_pieces, return_alternatives=True,
                                         num_hypotheses=a.alternatives, **opts)
    plain = ours.translate(src, prefix=prefixes, details=True)
    mine_alt = alts.translate(src, prefix=prefixes, return_alternatives=True, nbest=a.alternatives, details=True)
    n = len(src)
    verbatim = sum(t.tokens[: len(p)] == p for t, p in zip(plain, prefix_pieces))
    same_plain = [i for i in range(n) if plain[i].tokens[:-1] == theirs_plain[i].hypotheses[0]]
    total = same_alt = same_first = 0
    diffs = []
    for i in range(n):
        mine = [h.tokens[:-1] for h in mine_alt[i].hypotheses]
        theirs = [list(h) for h in theirs_alt[i].hypotheses]
        total += len(theirs)
        same_alt += sum(m == t for m, t in zip(mine, theirs))
        same_first += sum(m[len(prefix_pieces[i])] == t[len(prefix_pieces[i])] for m, t in zip(mine, theirs)
                          if len(m) > len(prefix_pieces[i]) and len(t) > len(prefix_pieces[i]))
        if mine != theirs:
            diffs.append((i, mine, theirs))
    print(f"{n} sentences, prefixes of 1-3 reference words, beam {a.beam}, score / length ** {a.lenpen:g}, "
          f"CTranslate2 float32")
    print(f"prefix verbatim in attnmt's translations: {verbatim}/{n}")
    print(f"prefixed translation identical to CTranslate2's: {len(same_plain)}/{n}")
    print(f"alternatives ({a.alternatives} asked): attnmt {sum(len(t.hypotheses) for t in mine_alt)}, "
          f"CTranslate2 {total}; identical {same_alt}/{total}; the same token after the prefix {same_first}/{total}")
    for i, mine, theirs in diffs[:5]:
        print(f"  {i}: prefix {prefixes[i]!r}")
        for m, t in zip(mine, theirs):
            if m != t:
                print(f"     attnmt:      {' '.join(m)}\n     CTranslate2: {' '.join(t)}")


if __name__ == "__main__":
    main()
