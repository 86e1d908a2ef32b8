#!/usr/bin/env bash
# Multi30k (WMT16 multimodal task 1) English -> German on a CPU, end to end:
#   get the data (sha256-checked) -> preprocess (joint SentencePiece BPE 10k) -> train transformer_small (bf16 where
#   the CPU computes it natively, fp32 otherwise) for a fixed time budget -> average the last epoch checkpoints -> beam 4 / lenpen 0.6 -> sacreBLEU on
#   val, test_2016_flickr and test_2017_flickr -> training curves and an attention heat map (PNG).
#
# Run from the repository root:  bash recipes/multi30k_en_de/run.sh
# Knobs (environment variables):
#   DATA_DIR          local copies of the Multi30k .gz files (e.g. ../shared/data/multi30k); empty: download them
#   WORK              output directory                                    [runs/multi30k_en_de]
#   ARCH              named architecture                                  [transformer_small]
#   MAX_TIME_MINUTES  training time budget                                [55]
#   MAX_UPDATE        stop after this many updates as well (0: no limit)  [0]
#   THREADS           CPU threads                                         [number of cores]
#   PRECISION         auto (bf16 on AMX / AVX-512 BF16 CPUs, else fp32), fp32 or bf16   [auto]
#   AVG               how many last epoch checkpoints to average          [5]
#   TRAIN_LINES       use only the first N training pairs (smoke tests; 0: all)  [0]
#   EVAL_BLEU         decode the first N valid sentences after each epoch (--eval-bleu), for the valid BLEU
#                     curve; costs training time (0: off, as in the measured run of docs/results.md)  [0]
#   EXTRA_TRAIN_ARGS  more `attnmt train` options
#   GEN_ARGS          more `attnmt generate` options
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
DATA_DIR=${DATA_DIR:-${ATTNMT_DATA_DIR:-}}
WORK=${WORK:-runs/multi30k_en_de}
ARCH=${ARCH:-transformer_small}
MAX_TIME_MINUTES=${MAX_TIME_MINUTES:-55}
MAX_UPDATE=${MAX_UPDATE:-0}
THREADS=${THREADS:-$(nproc)}
PRECISION=${PRECISION:-auto}
AVG=${AVG:-5}
TRAIN_LINES=${TRAIN_LINES:-0}
EXTRA_TRAIN_ARGS=${EXTRA_TRAIN_ARGS:-}
GEN_ARGS=${GEN_ARGS:-}
EVAL_BLEU=${EVAL_BLEU:-0}
BLEU_ARGS=""; [ "$EVAL_BLEU" -gt 0 ] && BLEU_ARGS="--eval-bleu --eval-bleu-max-sentences $EVAL_BLEU"

RAW=$WORK/raw
BIN=$WORK/data-bin
CKPT=$WORK/checkpoints
OUT=$WORK/results
mkdir -p "$RAW" "$OUT"
log() { echo "[multi30k $(date +%H:%M:%S)] $*" >&2; }

log "1/6 data -> $RAW"
python "$HERE/../fetch_data.py" "$HERE/manifest.tsv" --out "$RAW" ${DATA_DIR:+--data-dir "$DATA_DIR"}
TRAIN=$RAW/train
if [ "$TRAIN_LINES" -gt 0 ]; then
  for l in en de; do gzip -cd "$RAW/train.$l.gz" | sed -n "1,${TRAIN_LINES}p" > "$RAW/train_slice.$l"; done
  TRAIN=$RAW/train_slice
fi

log "2/6 preprocess -> $BIN"
VOCAB=10000; [ "$TRAIN_LINES" -gt 0 ] && VOCAB=${SMOKE_VOCAB:-500}
attnmt preprocess -s en -t de --trainpref "$TRAIN" --validpref "$RAW/val" \
  --testpref "$RAW/test_2016_flickr,$RAW/test_2017_flickr" --destdir "$BIN" \
  --bpe sentencepiece --vocab-size "$VOCAB" --joined-dictionary --workers "$THREADS"

log "3/6 train $ARCH for at most $MAX_TIME_MINUTES minutes -> $CKPT"
# shellcheck disable=SC2086
attnmt train "$BIN" --arch "$ARCH" --save-dir "$CKPT" --precision "$PRECISION" --threads "$THREADS" \
  --max-tokens 4096 --lr 1e-3 --warmup-updates 500 --warmup-init-lr 1e-7 --label-smoothing 0.1 \
  --weight-decay 0.0001 --max-time-minutes "$MAX_TIME_MINUTES" --max-update "$MAX_UPDATE" \
  --keep-last-epochs "$AVG" --seed 1 --log-interval 50 $BLEU_ARGS $EXTRA_TRAIN_ARGS

log "4/6 average the last $AVG epoch checkpoints"
N=$(find "$CKPT" -name 'checkpoint[0-9]*.pt' | wc -l)
if [ "$N" -ge 2 ]; then
  K=$(( N < AVG ? N : AVG ))
  attnmt average-checkpoints --inputs "$CKPT" --num-epoch-checkpoints "$K" --output "$CKPT/averaged.pt"
  MODEL=$CKPT/averaged.pt
else
  MODEL=$CKPT/checkpoint_last.pt
fi

log "5/6 generate (beam 4, lenpen 0.6) and score"
for split in valid:val test:test_2016_flickr test1:test_2017_flickr; do
  subset=${split%%:*}; name=${split#*:}
  # shellcheck disable=SC2086
  attnmt generate "$BIN" --path "$MODEL" --gen-subset "$subset" --beam 4 --lenpen 0.6 --precision "$PRECISION" \
    --threads "$THREADS" --quiet $GEN_ARGS > "$OUT/$name.hyp.de"
  gzip -cd "$RAW/$name.de.gz" > "$OUT/$name.ref.de"
  attnmt score --ref "$OUT/$name.ref.de" --sys "$OUT/$name.hyp.de" | tee "$OUT/$name.bleu"
  attnmt score --ref "$OUT/$name.ref.de" --sys "$OUT/$name.hyp.de" --json > "$OUT/$name.bleu.json"
done

log "6/6 plots -> $OUT"
attnmt plot curves --log "$CKPT/train.jsonl" --out "$OUT/training_curves.png"
n=0
while IFS= read -r src && [ $n -lt 3 ]; do
  n=$((n + 1))
  attnmt plot attention --path "$MODEL" --input "$src" --out "$OUT/attention_$n.png"
done < <(gzip -cd "$RAW/test_2016_flickr.en.gz" | sed -n "1,3p")
log "done: BLEU in $OUT/*.bleu, plots in $OUT/*.png"
