#!/usr/bin/env bash
# WMT14 English -> German with the paper's Transformer base or big (Vaswani et al. 2017, Table 3), end to end:
#   data (sha256-checked) -> joint SentencePiece BPE, ~37k vocabulary -> train -> average the last checkpoints
#   (saved every 10 minutes) -> beam 4, lenpen 0.6, max length source + 50 -> newstest2014 sacreBLEU and the
#   paper's tokenized, compound-split BLEU (expected: 27.3 base, 28.4 big).
#
# The paper's batch: about 25k source + 25k target tokens per update = max-tokens x GPUs x update-freq.
#   8 GPUs:  MAX_TOKENS=3125 UPDATE_FREQ=1  (3125 x 8 x 1 = 25,000)
#   1 GPU:   MAX_TOKENS=3125 UPDATE_FREQ=8  (3125 x 1 x 8 = 25,000)
#   4 GPUs:  MAX_TOKENS=6250 UPDATE_FREQ=1  (6250 x 4 x 1 = 25,000), memory permitting
# (--max-tokens counts padded tokens of the longer side, so 25,000 per update is ~25k target and ~25k source.)
# Multi-GPU: NPROC=8 runs `attnmt train --nproc-per-node 8` (torchrun); see docs/distributed.md.
#
# Run from the repository root:  CONFIG=base bash recipes/wmt14_en_de/run.sh
# Knobs (environment variables):
#   CONFIG       base | big                                                       [base]
#   DATA_DIR     local copies: newstest2014.{en,de}.gz, newstest2013.stanford-tok.{en,de}.gz and the three
#                training-parallel-*.tgz archives; empty: download them            []
#   WORK         output directory                                                  [runs/wmt14_en_de_$CONFIG]
#   NPROC        processes (GPUs) on this node                                     [1]
#   MAX_TOKENS, UPDATE_FREQ  see above                                             [3125, 8/NPROC]
#   MAX_UPDATE   100000 (base) / 300000 (big), as the paper
#   PRECISION    auto (bf16 where the hardware computes it natively) | bf16 | fp16 | fp32   [auto]
#   SMOKE=1      no training data needed: train a few updates on a slice of newstest2013 (a stand-in, clearly
#                not WMT14 training data), then run every later step for real on newstest2014
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
CONFIG=${CONFIG:-base}
DATA_DIR=${DATA_DIR:-${ATTNMT_DATA_DIR:-}}
WORK=${WORK:-runs/wmt14_en_de_$CONFIG}
NPROC=${NPROC:-1}
MAX_TOKENS=${MAX_TOKENS:-3125}
UPDATE_FREQ=${UPDATE_FREQ:-$(( 8 / NPROC > 0 ? 8 / NPROC : 1 ))}
PRECISION=${PRECISION:-auto}
GEN_PRECISION=$PRECISION; [ "$PRECISION" = fp16 ] && GEN_PRECISION=auto  # fp16 is a training precision
SMOKE=${SMOKE:-0}
THREADS=${THREADS:-$(nproc)}
case "$CONFIG" in
  base) ARCH=transformer;     MAX_UPDATE=${MAX_UPDATE:-100000}; AVG=5;  LR=7e-4 ;;  # 512^-0.5 x 4000^-0.5
  big)  ARCH=transformer_big; MAX_UPDATE=${MAX_UPDATE:-300000}; AVG=20; LR=5e-4 ;;  # 1024^-0.5 x 4000^-0.5 ~ 4.9e-4
  *) echo "CONFIG must be base or big, got '$CONFIG'" >&2; exit 2 ;;
esac
NPROC_ARGS=""; [ "$NPROC" -gt 1 ] && NPROC_ARGS="--nproc-per-node $NPROC"
RAW=$WORK/raw; BIN=$WORK/data-bin; CKPT=$WORK/checkpoints; OUT=$WORK/results
mkdir -p "$RAW" "$OUT"
log() { echo "[wmt14 $CONFIG $(date +%H:%M:%S)] $*" >&2; }

log "1/6 data -> $RAW"
python "$HERE/../fetch_data.py" "$HERE/manifest_test.tsv" --out "$RAW" ${DATA_DIR:+--data-dir "$DATA_DIR"}
# newstest2013 is only available Moses-tokenized (Stanford release): undo the hyphen marks and escapes, detokenize.
for l in en de; do
  gzip -cd "$RAW/newstest2013.stanford-tok.$l.gz" | sed -e 's/ ##AT##-##AT## /-/g' \
    | sacremoses -l "$l" -j 1 detokenize > "$RAW/newstest2013.$l"
done
if [ "$SMOKE" = 1 ]; then
  SMOKE_LINES=${SMOKE_LINES:-2000}
  log "SMOKE: training on the first $SMOKE_LINES lines of newstest2013 (a stand-in for the WMT14 training data)"
  for l in en de; do sed -n "1,${SMOKE_LINES}p" "$RAW/newstest2013.$l" > "$RAW/train.$l"; done
  VOCAB=${SMOKE_VOCAB:-2000}; MAX_UPDATE=${SMOKE_UPDATES:-4}; AVG=2
  SAVE="--save-interval-updates 1 --no-epoch-checkpoints"
else
  python "$HERE/../fetch_data.py" "$HERE/manifest_train.tsv" --out "$RAW/archives" ${DATA_DIR:+--data-dir "$DATA_DIR"}
  [ -s "$RAW/train.en.gz" ] || python "$HERE/get_train.py" "$RAW/archives" "$RAW/train"
  VOCAB=37000
  SAVE="--save-interval-minutes 10 --keep-interval-updates $AVG --no-epoch-checkpoints"
fi

log "2/6 preprocess: joint SentencePiece BPE, $VOCAB pieces -> $BIN"
attnmt preprocess -s en -t de --trainpref "$RAW/train" --validpref "$RAW/newstest2013" \
  --testpref "$RAW/newstest2014" --destdir "$BIN" --bpe sentencepiece --vocab-size "$VOCAB" \
  --bpe-max-sentences 10000000 --joined-dictionary --workers "$THREADS" --max-len 250

log "3/6 train $ARCH: $MAX_TOKENS tokens x $NPROC process(es) x update-freq $UPDATE_FREQ per update, $MAX_UPDATE updates"
# shellcheck disable=SC2086
attnmt train "$BIN" --arch "$ARCH" --share-all-embeddings --save-dir "$CKPT" --precision "$PRECISION" \
  $NPROC_ARGS --max-tokens "$MAX_TOKENS" --update-freq "$UPDATE_FREQ" \
  --optimizer adam --adam-betas '(0.9, 0.98)' --adam-eps 1e-9 --lr "$LR" --lr-scheduler inverse_sqrt \
  --warmup-updates 4000 --warmup-init-lr 1e-7 --criterion label_smoothed_cross_entropy --label-smoothing 0.1 \
  --max-update "$MAX_UPDATE" $SAVE --log-interval 100 --seed 1 ${EXTRA_TRAIN_ARGS:-}

log "4/6 average the last $AVG interval checkpoints"
attnmt average-checkpoints --inputs "$CKPT" --num-update-checkpoints "$AVG" --output "$CKPT/averaged.pt"

log "5/6 newstest2014: beam 4, lenpen 0.6, max length source + 50"
# shellcheck disable=SC2086
attnmt generate "$BIN" --path "$CKPT/averaged.pt" --gen-subset test --beam 4 --lenpen 0.6 \
  --max-len-a 1 --max-len-b 50 --precision "$GEN_PRECISION" --quiet ${GEN_ARGS:-} > "$OUT/newstest2014.hyp.de"
gzip -cd "$RAW/newstest2014.de.gz" > "$OUT/newstest2014.ref.de"

log "6/6 score: sacreBLEU, and the paper's tokenized compound-split BLEU (compatibility mode)"
attnmt score --ref "$OUT/newstest2014.ref.de" --sys "$OUT/newstest2014.hyp.de" | tee "$OUT/newstest2014.sacrebleu"
attnmt score --ref "$OUT/newstest2014.ref.de" --sys "$OUT/newstest2014.hyp.de" --tokenized-bleu --compound-split \
  --lang de | tee "$OUT/newstest2014.tok-compound-bleu"
attnmt plot curves --log "$CKPT/train.jsonl" --out "$OUT/training_curves.png"
log "done: $OUT"
