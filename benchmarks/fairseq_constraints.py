"""Lexically constrained decoding: ``attnmt interactive --constraints`` against ``fairseq-interactive --constraints``
(fairseq 0.12.2) on the same model (exported with ``attnmt export --to fairseq``) and the same sentences.

Each of the first N test sentences gets 1-3 constraints: words of its reference (letters only, at least 4 of them,
drawn with a fixed seed). Both run fairseq-interactive's defaults (beam 5, --lenpen 1, at most 200 tokens, the
fairseq stop); the script prints, per toolkit, how many hypotheses contain every constraint, and how many of
attnmt's hypotheses are identical to fairseq's, with the differing ones listed for a look.

    python benchmarks/fairseq_constraints.py --peer-venv /work/peer-venv --model ck/checkpoint_best.pt \\
        --spm data-bin/spm.model --src test.en --ref test.de -n 200 [--order ordered]
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def constraints_for(refs: list[str], seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    out = []
    for ref in refs:
        words = [w for w in ref.split() if re.fullmatch(r"[^\W\d_]{4,}", w)]
        rng.shuffle(words)
        out.append(sorted(set(words[:rng.randint(1, 3)]), key=ref.split().index))
    return out


def hyps(text: str) -> dict[int, str]:
    return {int(ln.split("\t")[0][2:]): ln.split("\t")[2] for ln in text.splitlines() if ln.startswith("H-")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer-venv", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--spm", required=True, help="the SentencePiece model of the model's data-bin")
    ap.add_argument("--src", required=True)
    ap.add_argument("--ref", required=True)
    ap.add_argument("-n", type=int, default=200)
    ap.add_argument("--order", choices=["unordered", "ordered"], default="unordered")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--none", action="store_true", help="no constraints: the two searches' baseline agreement")
    a = ap.parse_args()
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=a.spm)
    src = Path(a.src).read_text(encoding="utf-8").splitlines()[: a.n]
    refs = Path(a.ref).read_text(encoding="utf-8").splitlines()[: a.n]
    cons = [[] for _ in refs] if a.none else constraints_for(refs, a.seed)
    lines = ["\t".join([s, *c]) for s, c in zip(src, cons)]
    peer = Path(a.peer_venv) / "bin"
    env = {**os.environ, "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        w = Path(tmp)
        tree = w / "tree"
        tree.mkdir()
        subprocess.run(f"git archive HEAD | tar -x -C {tree}", shell=True, check=True, cwd=HERE)
        shutil.copytree(tree / "cli", tree / "attnmt" / "cli")
        subprocess.run([str(peer / "pip"), "install", "-q", "click", "rich"], capture_output=True)
        subprocess.run([str(peer / "python"), "-m", "attnmt.cli", "export", "--path", a.model, "--to", "fairseq",
                        "--output-dir", str(w / "fsx")], check=True, env={**env, "PYTHONPATH": str(tree)},
                       capture_output=True, cwd=w)
        (w / "input.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        fs_cons = [] if a.none else ["--constraints", a.order]  # a bare --constraints is ordered in fairseq
        at_cons = [] if a.none else ["--constraints", a.order]
        fs = subprocess.run([str(peer / "fairseq-interactive"), str(w / "fsx"), "--path", str(w / "fsx/checkpoint.pt"),
                             "--source-lang", "en", "--target-lang", "de", "--bpe", "sentencepiece",
                             "--sentencepiece-model", a.spm, *fs_cons, "--cpu", "--buffer-size", "64",
                             "--batch-size", "64", "--input", str(w / "input.txt")],
                            capture_output=True, text=True, env=env, cwd=w)
        if fs.returncode:
            sys.exit(f"fairseq-interactive failed:\n{fs.stderr[-3000:]}")
        at = subprocess.run([sys.executable, "-m", "attnmt.cli", "interactive", "--path", a.model, "--fairseq",
                             *at_cons, "--buffer-size", "64", "--quiet", "--input",
                             str(w / "input.txt")], capture_output=True, text=True, cwd=w)
        if at.returncode:
            sys.exit(f"attnmt interactive failed:\n{at.stderr[-3000:]}")
    theirs, ours = hyps(fs.stdout), hyps(at.stdout)

    def satisfied(h: str, c: list[str]) -> bool:
        pieces = f" {h} "
        return all(f" {' '.join(sp.encode(p, out_type=str))} " in pieces for p in c)

    n = len(src)
    print(f"{n} sentences, {sum(map(len, cons))} constraints ({a.order}), beam 5, lenpen 1 (fairseq's defaults)")
    for name, got in (("fairseq-interactive", theirs), ("attnmt interactive", ours)):
        ok = sum(satisfied(got.get(i, ""), cons[i]) for i in range(n))
        print(f"{name}: {len(got)}/{n} hypotheses, every constraint present in {ok}/{n}")
    same = [i for i in range(n) if theirs.get(i) == ours.get(i)]
    print(f"identical to fairseq's: {len(same)}/{n}")
    for i in [i for i in range(n) if i not in same][:10]:
        print(f"  {i}: constraints {cons[i]}\n     fairseq: {theirs.get(i)}\n     attnmt:  {ours.get(i)}")


if __name__ == "__main__":
    main()
