#!/usr/bin/env bash
# attnmt generate --fairseq against fairseq-generate 0.12.2 at its defaults, on the same model and sentences.
#
#   bash benchmarks/fairseq_generate_compare.sh PEER_VENV MODEL DATA_BIN SRC_GZ TGT_GZ [N]
#     PEER_VENV  a venv with fairseq 0.12.2 (../shared/peers/install_fairseq.sh)
#     MODEL      an attnmt checkpoint with a SentencePiece model (exported to fairseq here)
#     DATA_BIN   its attnmt data-bin (for spm.model)
#     SRC_GZ, TGT_GZ  raw test sentences (.gz), the first N (default 1000) are used
# Prints how many hypotheses (D- lines) and references (T- lines) are identical, the largest difference of the
# H- scores, and both closing BLEU lines. EXTRA="--print-alignment" (or other options) goes to both commands; the
# A- lines are then compared too. Run it from an empty directory (a stray module in the working directory
# would shadow the peers' imports).
set -euo pipefail
P=$1/bin; M=$2; BIN=$3; SRC=$4; TGT=$5; N=${6:-1000}
HERE=$(cd "$(dirname "$0")/.." && pwd)
W=$(mktemp -d)
export TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1  # fairseq checkpoints hold pickled objects
# the export needs fairseq, so it runs in the peers' Python with this tree (cli/ placed as attnmt/cli)
mkdir -p "$W/tree" && (cd "$HERE" && git archive HEAD | tar -x -C "$W/tree") && cp -r "$W/tree/cli" "$W/tree/attnmt/cli"
"$P/pip" install -q click rich > /dev/null 2>&1 || true
PYTHONPATH="$W/tree" "$P/python" -m attnmt.cli export --path "$M" --to fairseq --output-dir "$W/fsx" > /dev/null
for pair in "en:$SRC" "de:$TGT"; do
  lang=${pair%%:*}; file=${pair#*:}
  "$P/python" - "$BIN/spm.model" "$file" "$N" > "$W/test.$lang" <<'PY'
import gzip, sys
import sentencepiece as spm
sp = spm.SentencePieceProcessor(model_file=sys.argv[1])
for _, line in zip(range(int(sys.argv[3])), gzip.open(sys.argv[2], "rt", encoding="utf-8")):
    print(" ".join(sp.encode(line.rstrip("\n"), out_type=str)))
PY
done
"$P/fairseq-preprocess" -s en -t de --srcdict "$W/fsx/dict.en.txt" --tgtdict "$W/fsx/dict.de.txt" \
  --testpref "$W/test" --destdir "$W/fsbin" --workers 1 > "$W/preprocess.log" 2>&1
"$P/fairseq-generate" "$W/fsbin" --path "$W/fsx/checkpoint.pt" --gen-subset test --cpu --batch-size 32 \
  --post-process sentencepiece ${EXTRA:-} > "$W/fairseq.out" 2> "$W/fairseq.err"
attnmt generate "$W/fsbin" --path "$M" --gen-subset test --fairseq --quiet ${EXTRA:-} > "$W/attnmt.out"
python3 - "$W/fairseq.out" "$W/attnmt.out" <<'PY'
import sys

def lines(path, tag, field):
    return {int(ln.split("\t")[0][2:]): ln.rstrip("\n").split("\t")[field] for ln in open(path, encoding="utf-8")
            if ln.startswith(tag + "-")}

fs, at = sys.argv[1:3]
for tag, field, what in (("D", 2, "hypotheses (D- lines)"), ("T", 1, "references (T- lines)"),
                         ("A", 1, "alignments (A- lines)")):
    a, b = lines(fs, tag, field), lines(at, tag, field)
    if a:
        print(f"{what} identical: {sum(a[k] == b.get(k) for k in a)}/{len(a)}")
    if tag == "A" and a and "," in next(iter(a.values())):  # soft alignments: how far apart the weights are
        gap = max(abs(float(x) - float(y)) for k in a for x, y in
                  zip(a[k].replace(",", " ").split(), b.get(k, "").replace(",", " ").split()))
        same = sum(len(a[k].split()) == len(b.get(k, "").split()) for k in a)
        print(f"  soft: the same shape {same}/{len(a)}, largest weight difference {gap:.1e}")
ha, hb = lines(fs, "H", 1), lines(at, "H", 1)
print(f"largest H- score difference (base 2): {max(abs(float(ha[k]) - float(hb[k])) for k in ha):.2e}")
for name, path in (("fairseq-generate", fs), ("attnmt generate --fairseq", at)):
    print(f"{name}: " + "".join(ln.strip() for ln in open(path, encoding="utf-8") if ln.startswith("Generate ")))
PY
rm -rf "$W"
