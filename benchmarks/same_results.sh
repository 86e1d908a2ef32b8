#!/usr/bin/env bash
# Bitwise reproducibility across a code change: train 50 updates with a fixed seed, average, translate, and write
# digests that a run of another version of the code must match exactly.
#
#   bash benchmarks/same_results.sh DATA_BIN MODEL OUT
#     DATA_BIN  a binarized Multi30k en-de (the recipe's runs/multi30k_en_de/data-bin)
#     MODEL     a trained checkpoint to translate the test set with (the recipe's checkpoints/averaged.pt)
#     OUT       where the runs and digests go
#   diff -r OUT_BEFORE/digests OUT_AFTER/digests    # no output: bitwise the same
set -euo pipefail
BIN=$1; MODEL=$2; OUT=$3
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT/digests"
for prec in fp32 auto; do
  rm -rf "$OUT/ckpt_$prec"
  attnmt train "$BIN" --arch transformer_small --save-dir "$OUT/ckpt_$prec" --precision "$prec" --threads 2 \
    --max-tokens 4096 --lr 1e-3 --warmup-updates 500 --warmup-init-lr 1e-7 --label-smoothing 0.1 \
    --weight-decay 0.0001 --max-update 50 --seed 1 --log-interval 10 --save-interval-updates 10 \
    --keep-interval-updates 3 2> "$OUT/train_$prec.log"
  python "$HERE/checkpoint_digest.py" "$OUT/ckpt_$prec/checkpoint_last.pt" > "$OUT/digests/checkpoint_last_$prec.json"
done
attnmt average-checkpoints --inputs "$OUT/ckpt_fp32" --num-update-checkpoints 3 --output "$OUT/averaged.pt"
python "$HERE/checkpoint_digest.py" "$OUT/averaged.pt" > "$OUT/digests/averaged.json"
for mode in "fp32" "auto" "fp32 --quantize int8" "fp32 --workers 2 --threads 2" "fp32 --beam 1" "fp32 --nbest 2 --format fairseq" \
    "fp32 --sampling --beam 2 --nbest 2 --format fairseq --seed 3"; do
  name=$(echo "$mode" | tr ' ' '_' | tr -d '-')
  # shellcheck disable=SC2086
  attnmt generate "$BIN" --path "$MODEL" --gen-subset test --quiet --precision $mode > "$OUT/digests/test_$name.txt"
done
attnmt generate "$BIN" --path "$OUT/averaged.pt" --gen-subset test --quiet --beam 2 > "$OUT/digests/test_trained_averaged.txt"
sha256sum "$OUT"/digests/* | sed "s#$OUT/##"
