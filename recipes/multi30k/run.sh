#!/usr/bin/env bash
# Multi30k (WMT16-18 multimodal task 1, text only) on a CPU, end to end, for any of its language pairs:
#   get the data (sha256-checked) -> preprocess (joint SentencePiece BPE) -> train a Transformer for a fixed time
#   budget (bf16 where the CPU computes it natively, fp32 otherwise) -> average the last epoch checkpoints and pick
#   the averaging window and length penalty on val -> beam 4 -> sacreBLEU on val and on every test set the pair
#   has -> training curves and attention heat maps (PNG). No test set takes part in any choice.
#
# Run from the repository root:  bash recipes/multi30k/run.sh            (English -> German)
#                                 SRC=de TGT=en bash recipes/multi30k/run.sh
# Pairs: any two of en, de, fr, cs. Test sets: test_2016_flickr (all), test_2017_flickr (de, fr),
# test_2017_mscoco (de), test_2018_flickr (all); a test set is used when both its sides are in the manifest.
#
# Configuration: the training settings below were chosen on val (docs/results.md, "Multi30k: what was tried").
# PROFILE=auto picks them from the hardware, by how many updates the 55 minutes buy: "amx" on a CPU with AMX
# (bf16, ~8,600 updates), "bf16" where the CPU computes bf16 natively otherwise (AVX-512 BF16, ~4,300-4,600), "fp32"
# elsewhere (~2,300-2,600). They differ in the residual dropout: 0.2 for the shorter runs, which are still
# under-fitted at the end, 0.3 for AMX's twice longer one. The choice is printed.
#
# Knobs (environment variables):
#   SRC, TGT          language pair                                       [en, de]
#   DATA_DIR          local copies of the Multi30k .gz files (e.g. ../shared/data/multi30k); empty: download them
#   WORK              output directory                                    [runs/multi30k_SRC_TGT]
#   PROFILE           auto, amx, bf16 or fp32 (settings and precision, see above)   [auto]
#   ARCH              named architecture                                  [the profile's]
#   MAX_TIME_MINUTES  training time budget                                [55]
#   MAX_UPDATE        stop after this many updates as well (0: no limit)  [0]
#   THREADS           CPU threads                                         [number of cores]
#   AVG               how many last epoch checkpoints to average; several values ("5 10"): the one with the
#                     best val BLEU is used for the test sets             [the profile's]
#   LENPEN            length penalty of the beam search; several values: chosen on val as AVG   [the profile's]
#   VOCAB             joint SentencePiece vocabulary size                 [the profile's]
#   TRAIN_LINES       use only the first N training pairs (smoke tests; 0: all)  [0]
#   EVAL_BLEU         decode the first N valid sentences after each epoch (--eval-bleu), for the valid BLEU
#                     curve; costs training time (0: off, as in the measured runs of docs/results.md)  [0]
#   EXTRA_TRAIN_ARGS  more `attnmt train` options (they win over the profile's)
#   GEN_ARGS          more `attnmt generate` options
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
SRC=${SRC:-en}
TGT=${TGT:-de}
DATA_DIR=${DATA_DIR:-${ATTNMT_DATA_DIR:-}}
WORK=${WORK:-runs/multi30k_${SRC}_${TGT}}
PROFILE=${PROFILE:-auto}
MAX_TIME_MINUTES=${MAX_TIME_MINUTES:-55}
MAX_UPDATE=${MAX_UPDATE:-0}
THREADS=${THREADS:-$(nproc)}
TRAIN_LINES=${TRAIN_LINES:-0}
EXTRA_TRAIN_ARGS=${EXTRA_TRAIN_ARGS:-}
GEN_ARGS=${GEN_ARGS:-}
EVAL_BLEU=${EVAL_BLEU:-0}
BLEU_ARGS=""; [ "$EVAL_BLEU" -gt 0 ] && BLEU_ARGS="--eval-bleu --eval-bleu-max-sentences $EVAL_BLEU"
log() { echo "[multi30k $SRC-$TGT $(date +%H:%M:%S)] $*" >&2; }
fail() { echo "multi30k: error: $*" >&2; exit 2; }

LANGS=$(cut -f1 "$HERE/manifest.tsv" | grep -v '^#' | sed -E 's/.*\.([a-z]+)\.gz$/\1/' | sort -u | xargs)
[ "$SRC" != "$TGT" ] || fail "SRC and TGT are both '$SRC'; pick two different languages of: $LANGS"
for l in "$SRC" "$TGT"; do
  case " $LANGS " in *" $l "*) ;; *) fail "no Multi30k data for language '$l'; SRC and TGT take: $LANGS";; esac
done

# ---- the configuration, from the hardware (decided once, printed) ----
if [ "$PROFILE" = auto ]; then
  PROFILE=$(python -c "import torch; from attnmt.backends import capabilities; \
from attnmt.backends.precision import resolve_precision; p = resolve_precision('auto', torch.device('cpu')); \
print('amx' if p == 'bf16' and capabilities.cpu().bf16_hardware == 'AMX' else p)")
fi
case "$PROFILE" in
  amx) PRECISION=bf16; DROPOUT=0.3 ;;
  bf16) PRECISION=bf16; DROPOUT=0.2 ;;
  fp32) PRECISION=fp32; DROPOUT=0.2 ;;
  *) fail "PROFILE=$PROFILE: use auto, amx, bf16 or fp32" ;;
esac
# The profiles share the model and schedule chosen on val; see docs/results.md for what each was measured against.
ARCH=${ARCH:-transformer_small}
VOCAB=${VOCAB:-8000}
AVG=${AVG:-5 10}
LENPEN=${LENPEN:-0.6 1.0}
AVG=${AVG//,/ }; LENPEN=${LENPEN//,/ }
for k in $AVG; do [[ "$k" =~ ^[1-9][0-9]*$ ]] || fail "AVG=$AVG: give one or more positive whole numbers"; done
for lp in $LENPEN; do [[ "$lp" =~ ^-?[0-9]+(\.[0-9]+)?$ ]] || fail "LENPEN=$LENPEN: give one or more numbers"; done
KEEP=$(printf '%s\n' $AVG | sort -n | tail -1)
PROFILE_TRAIN_ARGS="--max-tokens 4096 --lr 2e-3 --warmup-updates 500 --warmup-init-lr 1e-7 --label-smoothing 0.1 \
--weight-decay 0.0001 --dropout $DROPOUT"
[ "$TRAIN_LINES" -gt 0 ] && VOCAB=${SMOKE_VOCAB:-500}
log "profile $PROFILE (precision $PRECISION): $ARCH, vocabulary $VOCAB, $PROFILE_TRAIN_ARGS; average {$AVG}, \
lenpen {$LENPEN} (chosen on val)"

# ---- the splits this pair has ----
TESTS=()
for t in test_2016_flickr test_2017_flickr test_2017_mscoco test_2018_flickr; do
  grep -q "^$t\.$SRC\.gz" "$HERE/manifest.tsv" && grep -q "^$t\.$TGT\.gz" "$HERE/manifest.tsv" && TESTS+=("$t")
done

RAW=$WORK/raw
BIN=$WORK/data-bin
CKPT=$WORK/checkpoints
OUT=$WORK/results
mkdir -p "$RAW" "$OUT"

log "1/6 data ($SRC, $TGT) -> $RAW"
python "$HERE/../fetch_data.py" "$HERE/manifest.tsv" --out "$RAW" --langs "$SRC,$TGT" ${DATA_DIR:+--data-dir "$DATA_DIR"}
TRAIN=$RAW/train
if [ "$TRAIN_LINES" -gt 0 ]; then
  for l in "$SRC" "$TGT"; do gzip -cd "$RAW/train.$l.gz" | sed -n "1,${TRAIN_LINES}p" > "$RAW/train_slice.$l"; done
  TRAIN=$RAW/train_slice
fi

log "2/6 preprocess -> $BIN (test sets: ${TESTS[*]})"
TESTPREF=$(printf "$RAW/%s," "${TESTS[@]}"); TESTPREF=${TESTPREF%,}
attnmt preprocess -s "$SRC" -t "$TGT" --trainpref "$TRAIN" --validpref "$RAW/val" --testpref "$TESTPREF" \
  --destdir "$BIN" --bpe sentencepiece --vocab-size "$VOCAB" --joined-dictionary --workers "$THREADS"

log "3/6 train $ARCH for at most $MAX_TIME_MINUTES minutes -> $CKPT"
# shellcheck disable=SC2086
attnmt train "$BIN" --arch "$ARCH" --save-dir "$CKPT" --precision "$PRECISION" --threads "$THREADS" \
  $PROFILE_TRAIN_ARGS --max-time-minutes "$MAX_TIME_MINUTES" --max-update "$MAX_UPDATE" \
  --keep-last-epochs "$KEEP" --seed 1 --log-interval 50 $BLEU_ARGS $EXTRA_TRAIN_ARGS

log "4/6 average the last {$AVG} epoch checkpoints; choose the window and the length penalty on val"
N=$(find "$CKPT" -name 'checkpoint[0-9]*.pt' | wc -l)
MODELS=()
if [ "$N" -ge 2 ]; then
  for k in $AVG; do
    [ "$k" -le "$N" ] || { log "only $N epoch checkpoints: averaging $k skipped"; continue; }
    attnmt average-checkpoints --inputs "$CKPT" --num-epoch-checkpoints "$k" --output "$CKPT/averaged$k.pt"
    MODELS+=("$k:$CKPT/averaged$k.pt")
  done
  [ "${#MODELS[@]}" -gt 0 ] || { attnmt average-checkpoints --inputs "$CKPT" --num-epoch-checkpoints "$N" \
    --output "$CKPT/averaged$N.pt"; MODELS+=("$N:$CKPT/averaged$N.pt"); }
else
  MODELS+=("1:$CKPT/checkpoint_last.pt")
fi

translate() {  # MODEL SUBSET LENPEN OUTFILE
  # shellcheck disable=SC2086
  attnmt generate "$BIN" --path "$1" --gen-subset "$2" --beam 4 --lenpen "$3" \
    --precision "$PRECISION" --threads "$THREADS" --quiet $GEN_ARGS > "$4"
}
gzip -cd "$RAW/val.$TGT.gz" > "$OUT/val.ref.$TGT"
printf 'average\tlenpen\tval_bleu\n' > "$OUT/val_choice.tsv"
BEST=""; BEST_BLEU=-1
for m in "${MODELS[@]}"; do
  k=${m%%:*}; model=${m#*:}
  for lp in $LENPEN; do
    translate "$model" valid "$lp" "$OUT/val.avg$k.lenpen$lp.hyp.$TGT"
    b=$(attnmt score --ref "$OUT/val.ref.$TGT" --sys "$OUT/val.avg$k.lenpen$lp.hyp.$TGT" --json \
      | python -c "import json, sys; print(round(json.load(sys.stdin)['score'], 2))")
    printf '%s\t%s\t%s\n' "$k" "$lp" "$b" >> "$OUT/val_choice.tsv"
    log "val: average $k, lenpen $lp -> BLEU $b"
    if python -c "import sys; sys.exit(0 if $b > $BEST_BLEU else 1)"; then BEST="$k:$lp:$model"; BEST_BLEU=$b; fi
  done
done
K=${BEST%%:*}; rest=${BEST#*:}; LP=${rest%%:*}; MODEL=${rest#*:}
cp "$MODEL" "$CKPT/averaged.pt.tmp" && mv "$CKPT/averaged.pt.tmp" "$CKPT/averaged.pt"
MODEL=$CKPT/averaged.pt
log "chosen on val: average $K, lenpen $LP (val BLEU $BEST_BLEU) -> $MODEL"

log "5/6 generate (beam 4, lenpen $LP) and score"
SPLITS=("valid:val")
for i in "${!TESTS[@]}"; do
  subset=test; [ "$i" -gt 0 ] && subset=test$i
  SPLITS+=("$subset:${TESTS[$i]}")
done
for split in "${SPLITS[@]}"; do
  subset=${split%%:*}; name=${split#*:}
  if [ "$name" = val ]; then
    cp "$OUT/val.avg$K.lenpen$LP.hyp.$TGT" "$OUT/val.hyp.$TGT"
  else
    translate "$MODEL" "$subset" "$LP" "$OUT/$name.hyp.$TGT"
    gzip -cd "$RAW/$name.$TGT.gz" > "$OUT/$name.ref.$TGT"
  fi
  attnmt score --ref "$OUT/$name.ref.$TGT" --sys "$OUT/$name.hyp.$TGT" | tee "$OUT/$name.bleu"
  attnmt score --ref "$OUT/$name.ref.$TGT" --sys "$OUT/$name.hyp.$TGT" --json > "$OUT/$name.bleu.json"
done

log "6/6 plots -> $OUT"
attnmt plot curves --log "$CKPT/train.jsonl" --out "$OUT/training_curves.png"
n=0
while IFS= read -r src && [ $n -lt 3 ]; do
  n=$((n + 1))
  attnmt plot attention --path "$MODEL" --input "$src" --out "$OUT/attention_$n.png"
done < <(gzip -cd "$RAW/${TESTS[0]}.$SRC.gz" | sed -n "1,3p")
log "done: BLEU in $OUT/*.bleu, plots in $OUT/*.png"
