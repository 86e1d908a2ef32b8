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
# Configuration: the training settings below were chosen on val (docs/experiments.md, "Multi30k: what was tried").
# The precision comes from the hardware (bf16 where the CPU computes it natively, fp32 elsewhere); the settings
# come from the speed measured on this machine: a probe of 60 updates before training gives the updates the time
# budget buys, and the settings follow from that count: below ~3,500 updates (still under-fitted at the end)
# residual dropout 0.2 and the inverse square root schedule; from 3,500 on dropout 0.3 and a learning rate that
# decays linearly to 0 at the expected count or when the time is up, whichever comes first (the run is annealed
# when the budget ends instead of over-fitting, even if the probe over-estimated the speed);
# from 8,000 on (more than one model can use: its validation loss stops falling near update 5,700) the budget
# trains two models of half the updates each (seeds 1 and 2, the settings for that half) and translates with their
# ensemble when val prefers it.
# The model: transformer_small, unless a second probe finds transformer_mini (4+4 layers, d 128) at least
# MINI_SPEEDUP times as fast on this machine and the budget buys it at least MINI_MIN_UPDATES updates (while
# transformer_small gets fewer than 8,000): then transformer_mini, with the settings for its own expected updates.
# Its extra updates pay where they are many (fp32 on a fast CPU: 2.6x, ~10,000 updates, val +0.5 to +0.9), tie
# where its speed-up is small (bf16: 1.8x) and lose where they are few (a slow AVX2 CPU: 3,818 updates, val -3.6).
# The probes, the expected updates and the choice are printed. The averaging windows tried on val include the
# checkpoints around the best validation loss (a run that over-fits late still gets its best stretch), next to the
# last ones.
#
# Knobs (environment variables):
#   SRC, TGT          language pair                                       [en, de]
#   DATA_DIR          local copies of the Multi30k .gz files (e.g. ../shared/data/multi30k); empty: download them
#   WORK              output directory                                    [runs/multi30k_SRC_TGT]
#   PROFILE           auto (the probe decides), or a fixed choice: long (bf16, dropout 0.3), bf16 (dropout 0.2),
#                     fp32 (dropout 0.2), all three with the inverse square root schedule; amx is long's earlier
#                     name                                                                [auto]
#   DROPOUT           residual dropout, overriding the profile's                          [the profile's]
#   MEMBERS           auto (the probe decides), or how many models share the budget (seeds 1..N, each with
#                     1/N of the time and of the updates) and translate as an ensemble    [auto]
#   SCHEDULE          auto (the probe decides), inverse_sqrt, or linear (decay to 0 at MAX_UPDATE, or at the
#                     probe's expected updates, or when the time is up if that comes first)  [auto]
#   ARCH              named architecture                                  [the probes' choice]
#   MINI_SPEEDUP      train transformer_mini when it is at least this many times as fast as transformer_small [2.2]
#   MINI_MIN_UPDATES  ... and when the budget buys it at least this many updates                            [8000]
#   MAX_TIME_MINUTES  training time budget                                [60]
#   MAX_UPDATE        stop after this many updates as well (0: no limit)  [0]
#   THREADS           CPU threads                                         [number of cores]
#   AVG               how many last epoch checkpoints to average; several values ("5 10"): the one with the
#                     best val BLEU is used for the test sets             [5 10]
#   AVG_BEST          also average the N checkpoints of the lowest validation loss (0: not)   [5]
#   LENPEN            length penalty of the beam search; several values: chosen on val as AVG   [the profile's]
#   MBR_SAMPLES       also decode val with minimum Bayes risk over this many samples (the beam's hypothesis of
#                     highest mean chrF against them) with the chosen model and length penalty, and use it for
#                     the test sets where val prefers it (0: beam search only; 32 won val but not test on a slow
#                     AVX2 CPU's models, docs/experiments.md)   [0]
#   VOCAB             joint SentencePiece vocabulary size                 [the profile's]
#   BPE_DROPOUT       BPE-dropout of the training text: each epoch reads the next of 20 segmentations sampled with
#                     this probability (0: off; 0.1 cost 14 BLEU at ~7,000 updates, docs/experiments.md)  [0]
#   TRAIN_LINES       use only the first N training pairs (smoke tests; 0: all)  [0]
#   EVAL_BLEU         decode the first N valid sentences after each epoch (--eval-bleu), for the valid BLEU
#                     curve; costs training time (0: off, as in the measured runs of docs/experiments.md)  [0]
#   EXTRA_TRAIN_ARGS  more `attnmt train` options (they win over the profile's)
#   GEN_ARGS          more `attnmt generate` options
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
SRC=${SRC:-en}
TGT=${TGT:-de}
DATA_DIR=${DATA_DIR:-${ATTNMT_DATA_DIR:-}}
WORK=${WORK:-runs/multi30k_${SRC}_${TGT}}
PROFILE=${PROFILE:-auto}
MAX_TIME_MINUTES=${MAX_TIME_MINUTES:-60}
MAX_UPDATE=${MAX_UPDATE:-0}
THREADS=${THREADS:-$(nproc)}
TRAIN_LINES=${TRAIN_LINES:-0}
EXTRA_TRAIN_ARGS=${EXTRA_TRAIN_ARGS:-}
GEN_ARGS=${GEN_ARGS:-}
MBR_SAMPLES=${MBR_SAMPLES:-0}
EVAL_BLEU=${EVAL_BLEU:-0}
BLEU_ARGS=""; [ "$EVAL_BLEU" -gt 0 ] && BLEU_ARGS="--eval-bleu --eval-bleu-max-sentences $EVAL_BLEU"
log() { echo "[multi30k $SRC-$TGT $(date +%H:%M:%S)] $*" >&2; }
fail() { echo "multi30k: error: $*" >&2; exit 2; }

LANGS=$(cut -f1 "$HERE/manifest.tsv" | grep -v '^#' | sed -E 's/.*\.([a-z]+)\.gz$/\1/' | sort -u | xargs)
[ "$SRC" != "$TGT" ] || fail "SRC and TGT are both '$SRC'; pick two different languages of: $LANGS"
for l in "$SRC" "$TGT"; do
  case " $LANGS " in *" $l "*) ;; *) fail "no Multi30k data for language '$l'; SRC and TGT take: $LANGS";; esac
done

# ---- the configuration: precision from the hardware, settings from the measured speed (step 3; printed) ----
case "$PROFILE" in
  auto) PRECISION=$(python -c "import torch; from attnmt.backends.precision import resolve_precision; \
print(resolve_precision('auto', torch.device('cpu')))") ;;
  long|amx) PRECISION=bf16; PROFILE_DROPOUT=0.3 ;;
  bf16) PRECISION=bf16; PROFILE_DROPOUT=0.2 ;;
  fp32) PRECISION=fp32; PROFILE_DROPOUT=0.2 ;;
  *) fail "PROFILE=$PROFILE: use auto, long, bf16 or fp32" ;;
esac
LONG_RUN_UPDATES=3500  # from this many expected updates on, dropout 0.3 and the linear decay (docs/experiments.md,
                       # "Multi30k: what was tried")
ENSEMBLE_UPDATES=8000  # from this many expected updates on, two models of half the updates each, as an ensemble
MEMBERS=${MEMBERS:-auto}
[[ "$MEMBERS" =~ ^(auto|[1-9][0-9]*)$ ]] || fail "MEMBERS=$MEMBERS: use auto or the number of models (1: one)"
[[ "$MAX_TIME_MINUTES" =~ ^([0-9]+\.?[0-9]*|\.[0-9]+)$ ]] \
  && python -c "import sys; sys.exit(float('$MAX_TIME_MINUTES') <= 0)" \
  || fail "MAX_TIME_MINUTES=$MAX_TIME_MINUTES: give the training budget in minutes, such as 60"
[[ "$MAX_UPDATE" =~ ^[0-9]+$ ]] || fail "MAX_UPDATE=$MAX_UPDATE: give a whole number of updates (0: no limit)"
SCHEDULE=${SCHEDULE:-auto}
BPE_DROPOUT=${BPE_DROPOUT:-0}
[[ "$BPE_DROPOUT" =~ ^(0|0?\.[0-9]+)$ ]] || fail "BPE_DROPOUT=$BPE_DROPOUT: use 0 (off) or a probability such as 0.1"
case "$SCHEDULE" in auto|inverse_sqrt|linear) ;; *) fail "SCHEDULE=$SCHEDULE: use auto, inverse_sqrt or linear" ;; esac
# The profiles share the model and schedule chosen on val; see docs/experiments.md for what each was measured against.
ARCH_FORCED=${ARCH:+ARCH}
ARCH=${ARCH:-transformer_small}
MINI_ARCH=transformer_mini
MINI_SPEEDUP=${MINI_SPEEDUP:-2.2}  # fp32 on 2 cores: 2.6x, val +0.5 to +0.9; bf16: 1.8x, a tie (docs/experiments.md)
[[ "$MINI_SPEEDUP" =~ ^([0-9]+\.?[0-9]*|\.[0-9]+)$ ]] \
  || fail "MINI_SPEEDUP=$MINI_SPEEDUP: give a speed ratio, such as 2.2"
# and only for as many updates as it was measured to win with: ~10,000 beat transformer_small's ~4,000; 3,818 lost
# 3.6 val to transformer_small's 2,100 on the same AVX2 CPU (docs/experiments.md)
MINI_MIN_UPDATES=${MINI_MIN_UPDATES:-8000}
[[ "$MINI_MIN_UPDATES" =~ ^[0-9]+$ ]] || fail "MINI_MIN_UPDATES=$MINI_MIN_UPDATES: give a whole number of updates"
VOCAB=${VOCAB:-8000}
AVG=${AVG:-5 10}
AVG_BEST=${AVG_BEST:-5}
LENPEN=${LENPEN:-0.6 1.0}
AVG=${AVG//,/ }; LENPEN=${LENPEN//,/ }
for k in $AVG; do [[ "$k" =~ ^[1-9][0-9]*$ ]] || fail "AVG=$AVG: give one or more positive whole numbers"; done
[[ "$AVG_BEST" =~ ^[0-9]+$ ]] || fail "AVG_BEST=$AVG_BEST: give a whole number (0: off)"
[[ "$MBR_SAMPLES" =~ ^[0-9]+$ ]] || fail "MBR_SAMPLES=$MBR_SAMPLES: give a whole number of samples (0: off)"
for lp in $LENPEN; do [[ "$lp" =~ ^-?[0-9]+(\.[0-9]+)?$ ]] || fail "LENPEN=$LENPEN: give one or more numbers"; done
KEEP=$(printf '%s\n' $AVG | sort -n | tail -1)
BASE_TRAIN_ARGS="--max-tokens 4096 --label-smoothing 0.1 --weight-decay 0.0001"
INVSQRT_ARGS="--lr 2e-3 --warmup-updates 500 --warmup-init-lr 1e-7"  # peak 2e-3 after 500 updates for both schedules
LINEAR_ARGS="--lr-scheduler polynomial_decay --lr 2e-3 --warmup-updates 500"
[ "$TRAIN_LINES" -gt 0 ] && VOCAB=${SMOKE_VOCAB:-500}

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
SAMPLING=""
python -c "import sys; sys.exit(0 if float('$BPE_DROPOUT') > 0 else 1)" \
  && SAMPLING="--bpe-dropout $BPE_DROPOUT --bpe-dropout-samples 20"
# shellcheck disable=SC2086
attnmt preprocess -s "$SRC" -t "$TGT" --trainpref "$TRAIN" --validpref "$RAW/val" --testpref "$TESTPREF" \
  --destdir "$BIN" --bpe sentencepiece --vocab-size "$VOCAB" --joined-dictionary --workers "$THREADS" $SAMPLING

probe() {  # ARCH: 60 updates of ARCH on the real data, nothing saved; prints the rate of the last 40 (updates/s;
  # the first 20 build the kernels of new batch shapes), which stands for the whole run
  local dir=$WORK/probe
  rm -rf "$dir"
  # shellcheck disable=SC2086
  attnmt train "$BIN" --arch "$1" --save-dir "$dir" --precision "$PRECISION" --threads "$THREADS" \
    $BASE_TRAIN_ARGS $INVSQRT_ARGS --max-update 60 --no-save --disable-validation --log-interval 20 --progress none \
    --seed 1 $EXTRA_TRAIN_ARGS 2> "$WORK/probe.$1.log" || { cat "$WORK/probe.$1.log" >&2; fail "the speed probe of $1 failed"; }
  python - "$dir/train.jsonl" <<'PY'
import json, sys
recs = [json.loads(x) for x in open(sys.argv[1], encoding="utf-8")]
rates = sorted(r["ups"] for r in [r for r in recs if r["type"] == "train"][1:])
summary = next(r for r in recs if r["type"] == "summary")
ups = rates[len(rates) // 2] if rates else summary["updates_this_run"] / max(summary["train_time"], 1e-9)
print(f"{ups:.3f}")  # the counts follow from the rate as printed
PY
  rm -rf "$dir"
}
budget() {  # UPS CAP: the updates MAX_TIME_MINUTES buy at UPS updates/s, at most CAP (0: no cap)
  python -c "n = int($1 * $MAX_TIME_MINUTES * 60); print(min(n, $2) if $2 > 0 else n)"
}

EXPECTED=$MAX_UPDATE
if [ "$PROFILE" = auto ] || { [ "$SCHEDULE" = linear ] && [ "$MAX_UPDATE" -eq 0 ]; }; then
  UPS=$(probe "$ARCH")
  EXPECTED=$(budget "$UPS" "$MAX_UPDATE")
  CAP=""; [ "$MAX_UPDATE" -gt 0 ] && CAP=" (at most MAX_UPDATE=$MAX_UPDATE)"
  PROBED="probe: $UPS updates/s ($PRECISION) -> about $EXPECTED updates in $MAX_TIME_MINUTES minutes$CAP"
  if [ "$PROFILE" = auto ] && [ -z "$ARCH_FORCED" ] && [ "$EXPECTED" -lt "$ENSEMBLE_UPDATES" ]; then
    MINI_UPS=$(probe "$MINI_ARCH")
    SPEEDUP=$(python -c "print(f'{$MINI_UPS / $UPS:.2f}')")
    # MAX_UPDATE stands for a slower machine's count of transformer_small updates: the same time buys
    # transformer_mini SPEEDUP times as many
    MINI_MAX_UPDATE=$(python -c "print(round($MAX_UPDATE * $SPEEDUP))")
    MINI_EXPECTED=$(budget "$MINI_UPS" "$MINI_MAX_UPDATE")
    MINI_RULE="from ${MINI_SPEEDUP}x and $MINI_MIN_UPDATES updates on it is trained"
    if python -c "import sys; sys.exit(0 if $SPEEDUP >= $MINI_SPEEDUP and $MINI_EXPECTED >= $MINI_MIN_UPDATES else 1)"
    then
      ARCH=$MINI_ARCH
      MAX_UPDATE=$MINI_MAX_UPDATE
      EXPECTED=$MINI_EXPECTED
      PROBED="$PROBED; $MINI_ARCH: $MINI_UPS updates/s, ${SPEEDUP}x -> about $EXPECTED updates ($MINI_RULE)"
    else
      PROBED="$PROBED; $MINI_ARCH: $MINI_UPS updates/s, ${SPEEDUP}x -> about $MINI_EXPECTED updates (not trained: \
$MINI_RULE)"
    fi
  fi
fi
FORCED=()
[ -n "$ARCH_FORCED" ] && FORCED+=("ARCH")
if [ "$MEMBERS" = auto ]; then
  MEMBERS=1; [ "$PROFILE" = auto ] && [ "$ARCH" != "$MINI_ARCH" ] && [ "$EXPECTED" -ge "$ENSEMBLE_UPDATES" ] \
    && MEMBERS=2
else FORCED+=("MEMBERS"); fi
EXPECTED=$((EXPECTED / MEMBERS))  # each model's share of the updates (0: no limit)
MEMBER_MINUTES=$(python -c "print(f'{$MAX_TIME_MINUTES / $MEMBERS:g}')")
LONG=0; [ "$PROFILE" = auto ] && [ "$EXPECTED" -ge "$LONG_RUN_UPDATES" ] && LONG=1
if [ -n "${DROPOUT:-}" ]; then FORCED+=("DROPOUT")
elif [ -n "${PROFILE_DROPOUT:-}" ]; then DROPOUT=$PROFILE_DROPOUT; FORCED+=("PROFILE=$PROFILE")
else DROPOUT=0.2; [ "$LONG" = 1 ] && DROPOUT=0.3; fi
if [ "$SCHEDULE" = auto ]; then SCHEDULE=inverse_sqrt; [ "$LONG" = 1 ] && SCHEDULE=linear; else FORCED+=("SCHEDULE"); fi
SAMPLED=""; SAMPLED_TEXT=""
if [ -n "$SAMPLING" ]; then
  FORCED+=("BPE_DROPOUT")
  SAMPLED="--sampled-segmentations"
  SAMPLED_TEXT=", BPE-dropout $BPE_DROPOUT (20 sampled segmentations, one epoch each in turn)"
fi
WHY=""; [ "${#FORCED[@]}" -gt 0 ] && WHY=" (forced: ${FORCED[*]})"
MEMBERS_TEXT=""
[ "$MEMBERS" -gt 1 ] && MEMBERS_TEXT=", $MEMBERS models of $MEMBER_MINUTES minutes each (seeds 1-$MEMBERS; \
settings and updates per model), translated as their ensemble"
if [ "$SCHEDULE" = linear ]; then
  [ "$EXPECTED" -gt 500 ] || fail "SCHEDULE=linear decays over the run's updates after 500 of warm-up, but only \
$EXPECTED are expected; give MAX_UPDATE above 500 or use SCHEDULE=inverse_sqrt"
  # the decay follows the training clock as well, should the updates come slower than the probe said
  TRAIN_ARGS="$BASE_TRAIN_ARGS $LINEAR_ARGS --total-num-update $EXPECTED --total-train-minutes $MEMBER_MINUTES \
--dropout $DROPOUT $SAMPLED"
  MAX_UPDATE=$EXPECTED  # the learning rate is 0 from there on
  SCHEDULE_TEXT="a linear decay to 0 at update $EXPECTED or minute $MEMBER_MINUTES, whichever comes first"
else
  TRAIN_ARGS="$BASE_TRAIN_ARGS $INVSQRT_ARGS --dropout $DROPOUT $SAMPLED"
  SCHEDULE_TEXT="the inverse square root schedule"
fi
log "3/6 ${PROBED:+$PROBED; }chosen: $ARCH, precision $PRECISION, dropout $DROPOUT, $SCHEDULE_TEXT$SAMPLED_TEXT\
$MEMBERS_TEXT$WHY (below $LONG_RUN_UPDATES expected updates: dropout 0.2, inverse square root; from \
$LONG_RUN_UPDATES: dropout 0.3, linear decay; from $ENSEMBLE_UPDATES: two models of half the updates each)"
BEST_ARGS=""; [ "$AVG_BEST" -gt 0 ] && BEST_ARGS="--keep-best-checkpoints $AVG_BEST"
CKPTS=()
for i in $(seq 1 "$MEMBERS"); do
  DIR=$CKPT; [ "$i" -gt 1 ] && DIR=$CKPT$i  # checkpoints, checkpoints2, ...
  CKPTS+=("$DIR")
  MODEL_TEXT=""; [ "$MEMBERS" -gt 1 ] && MODEL_TEXT=" (model $i of $MEMBERS, seed $i)"
  log "3/6 train $ARCH$MODEL_TEXT for at most $MEMBER_MINUTES minutes -> $DIR: vocabulary $VOCAB, $TRAIN_ARGS; \
average {last $AVG, best $AVG_BEST}, lenpen {$LENPEN} (chosen on val)"
  # shellcheck disable=SC2086
  attnmt train "$BIN" --arch "$ARCH" --save-dir "$DIR" --precision "$PRECISION" --threads "$THREADS" \
    $TRAIN_ARGS --max-time-minutes "$MEMBER_MINUTES" --max-update "$MAX_UPDATE" \
    --keep-last-epochs "$KEEP" $BEST_ARGS --seed "$i" --log-interval 50 $BLEU_ARGS $EXTRA_TRAIN_ARGS
done

log "4/6 average the last {$AVG} epoch checkpoints and the $AVG_BEST of the lowest validation loss; choose the \
window and the length penalty on val${MEMBERS_TEXT:+, for each model and for the ensemble of their choices}"
translate() {  # MODEL SUBSET LENPEN OUTFILE [more generate options]
  # shellcheck disable=SC2086
  attnmt generate "$BIN" --path "$1" --gen-subset "$2" --beam 4 --lenpen "$3" \
    --precision "$PRECISION" --threads "$THREADS" --quiet "${@:5}" $GEN_ARGS > "$4"
}
gzip -cd "$RAW/val.$TGT.gz" > "$OUT/val.ref.$TGT"
printf 'average\tlenpen\tval_bleu\n' > "$OUT/val_choice.tsv"
BEST_BLEU=-1
describe() { if [ "$1" = ensemble ]; then echo "the ensemble of the $MEMBERS models"; else echo "average $1"; fi; }
MBR=""  # the chosen decoding's extra options: none, or --mbr-samples N
try_on_val() {  # LABEL MODEL LENPEN HYP [MBR]: decode and score val, record the row, keep the best of all rows
  # shellcheck disable=SC2086
  translate "$2" valid "$3" "$4" ${5:-}
  TRIED=$(attnmt score --ref "$OUT/val.ref.$TGT" --sys "$4" --json \
    | python -c "import json, sys; print(round(json.load(sys.stdin)['score'], 2))")
  printf '%s\t%s\t%s\n' "$1${5:+ ${5#--}}" "$3" "$TRIED" >> "$OUT/val_choice.tsv"
  log "val: $(describe "$1"), lenpen $3${5:+, $5} -> BLEU $TRIED"
  if python -c "import sys; sys.exit(0 if $TRIED > $BEST_BLEU else 1)"; then
    BEST_LABEL=$1; BEST_MODEL=$2; LP=$3; BEST_HYP=$4; BEST_BLEU=$TRIED; MBR=${5:-}
  fi
}
ENSEMBLE=()
for i in "${!CKPTS[@]}"; do
  DIR=${CKPTS[$i]}; TAG=""; [ "$MEMBERS" -gt 1 ] && TAG="m$((i + 1))"  # the rows of model 2 read m2:5, m2:best5...
  N=$(find "$DIR" -maxdepth 1 -name 'checkpoint[0-9]*.pt' | wc -l)
  MODELS=()
  if [ "$N" -ge 2 ]; then
    for k in $AVG; do
      [ "$k" -le "$N" ] || { log "only $N epoch checkpoints in $DIR: averaging $k skipped"; continue; }
      attnmt average-checkpoints --inputs "$DIR" --num-epoch-checkpoints "$k" --output "$DIR/averaged$k.pt"
      MODELS+=("$k:$DIR/averaged$k.pt")
    done
    [ "${#MODELS[@]}" -gt 0 ] || { attnmt average-checkpoints --inputs "$DIR" --num-epoch-checkpoints "$N" \
      --output "$DIR/averaged$N.pt"; MODELS+=("$N:$DIR/averaged$N.pt"); }
  else
    MODELS+=("1:$DIR/checkpoint_last.pt")
  fi
  mapfile -t BEST_CKPTS < <(find "$DIR" -maxdepth 1 -name 'checkpoint.best_loss_*.pt' | sort)
  if [ "$AVG_BEST" -gt 0 ] && [ "${#BEST_CKPTS[@]}" -ge 2 ]; then
    attnmt average-checkpoints --inputs "${BEST_CKPTS[@]}" --output "$DIR/averaged_best.pt"
    MODELS+=("best${#BEST_CKPTS[@]}:$DIR/averaged_best.pt")
  fi
  OWN_BLEU=-1
  for m in "${MODELS[@]}"; do
    k=${m%%:*}; model=${m#*:}
    for lp in $LENPEN; do
      try_on_val "${TAG:+$TAG:}$k" "$model" "$lp" "$OUT/val.${TAG:+$TAG.}avg$k.lenpen$lp.hyp.$TGT"
      if python -c "import sys; sys.exit(0 if $TRIED > $OWN_BLEU else 1)"; then OWN=$model; OWN_BLEU=$TRIED; fi
    done
  done
  cp "$OWN" "$DIR/averaged.pt.tmp" && mv "$DIR/averaged.pt.tmp" "$DIR/averaged.pt"
  ENSEMBLE+=("$DIR/averaged.pt")
done
if [ "$MEMBERS" -gt 1 ]; then  # each model's own choice of average, together
  for lp in $LENPEN; do
    try_on_val ensemble "$(IFS=:; echo "${ENSEMBLE[*]}")" "$lp" "$OUT/val.ensemble.lenpen$lp.hyp.$TGT"
  done
fi
if [ "$MBR_SAMPLES" -gt 0 ]; then  # the choice's minimum Bayes risk decoding, kept where val prefers it
  try_on_val "$BEST_LABEL" "$BEST_MODEL" "$LP" "$OUT/val.mbr$MBR_SAMPLES.hyp.$TGT" "--mbr-samples $MBR_SAMPLES"
fi
MODEL=$BEST_MODEL
[ "$MEMBERS" -eq 1 ] && MODEL=$CKPT/averaged.pt  # the same weights, under the name the docs use
log "chosen on val: $(describe "$BEST_LABEL"), lenpen $LP${MBR:+, $MBR} (val BLEU $BEST_BLEU) -> $MODEL"

log "5/6 generate (beam 4, lenpen $LP${MBR:+, $MBR}) and score"
SPLITS=("valid:val")
for i in "${!TESTS[@]}"; do
  subset=test; [ "$i" -gt 0 ] && subset=test$i
  SPLITS+=("$subset:${TESTS[$i]}")
done
for split in "${SPLITS[@]}"; do
  subset=${split%%:*}; name=${split#*:}
  if [ "$name" = val ]; then
    cp "$BEST_HYP" "$OUT/val.hyp.$TGT"
  else
    # shellcheck disable=SC2086
    translate "$MODEL" "$subset" "$LP" "$OUT/$name.hyp.$TGT" $MBR
    gzip -cd "$RAW/$name.$TGT.gz" > "$OUT/$name.ref.$TGT"
  fi
  attnmt score --ref "$OUT/$name.ref.$TGT" --sys "$OUT/$name.hyp.$TGT" | tee "$OUT/$name.bleu"
  attnmt score --ref "$OUT/$name.ref.$TGT" --sys "$OUT/$name.hyp.$TGT" --json > "$OUT/$name.bleu.json"
done

log "6/6 plots -> $OUT"
for i in "${!CKPTS[@]}"; do
  n=""; [ "$i" -gt 0 ] && n=$((i + 1))
  attnmt plot curves --log "${CKPTS[$i]}/train.jsonl" --out "$OUT/training_curves$n.png"
done
n=0
while IFS= read -r src && [ $n -lt 3 ]; do
  n=$((n + 1))
  attnmt plot attention --path "${MODEL%%:*}" --input "$src" --out "$OUT/attention_$n.png"
done < <(gzip -cd "$RAW/${TESTS[0]}.$SRC.gz" | sed -n "1,3p")
log "done: BLEU in $OUT/*.bleu, plots in $OUT/*.png"
