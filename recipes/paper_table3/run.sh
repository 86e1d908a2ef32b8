#!/usr/bin/env bash
# The paper's Table 3 (Vaswani et al. 2017, 6.2: variations on the Transformer) as one run: every row of the table
# trained for the same number of updates, scored on dev with a fixed protocol (the last checkpoint, no averaging;
# beam 4, lenpen 0.6; perplexity per piece), parameters counted, the table printed in the paper's layout beside the
# paper's own dev figures and written as markdown, JSON and a PNG of dev BLEU per row.
#
# Run from the repository root:  bash recipes/paper_table3/run.sh                  (Multi30k en-de, CPU)
#                                 BUDGET_HOURS=1.5 bash recipes/paper_table3/run.sh (updates to fit 1.5 hours)
#                                 DEVICE=cuda PARALLEL=4 SEEDS=1,2 UPDATES=3000 BASE=paper bash recipes/...
# The data: Multi30k en-de (text only, joint SentencePiece 8k, dev = val), fetched and preprocessed as the Multi30k
# recipe does; or any DATA_BIN with its raw dev source and reference (e.g. the WMT14 recipe's data-bin with
# newstest2013, the paper's own dev set): DATA_BIN=... VALID_SOURCE=... VALID_REFERENCE=...
#
# Knobs (environment variables):
#   ROWS              groups and rows of the table: A, B, C, D, E, big, or single rows (A1..A4, B1, B2, C1..C7,
#                     D1..D4); base is always trained                                  [A,B,C,D,E]
#   UPDATES           updates of every row                                            [600]
#   BUDGET_HOURS      instead of UPDATES: pick the updates so that the whole table fits this many hours here
#                     (a 50-update probe of the base; each row's time from its multiply-adds per token)
#   BASE              multi30k (N 3, d_model 128, d_ff 512, h 8: a CPU trains a row in minutes) or paper (the
#                     paper's base: N 6, d_model 512, d_ff 2048, h 8)                 [multi30k]
#   SEEDS             comma-separated seeds; with two or more, the table gives mean ± standard deviation  [1]
#   DEVICE            cpu or cuda                                                     [cpu]
#   PARALLEL          trials side by side (on a GPU several small trials share it; on a CPU they share its
#                     THREADS)                                                        [1]
#   THREADS           CPU threads in all                                              [number of cores]
#   PRECISION         auto, fp32, bf16 (the same for every row)                       [auto]
#   MAX_TOKENS        tokens per batch                                                [4096]
#   LR                the base's peak learning rate (rows that change d_model scale it by d_model^-0.5)  [2e-3]
#   WORK              output directory                                                [runs/paper_table3]
#   DATA_DIR          local copies of the Multi30k .gz files (e.g. ../shared/data/multi30k); empty: download
#   DATA_BIN, VALID_SOURCE, VALID_REFERENCE   another preprocessed corpus and its dev set, instead of Multi30k
#   SMOKE             1: every row for 3 updates on 400 training pairs, dev cut to 8 sentences (the tests' run)
#
# Output in $WORK/table3: table3.md, table3.json, table3_bleu.png; ROW.seedN/ holds each trial's log and model.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
WORK=${WORK:-runs/paper_table3}
THREADS=${THREADS:-$(nproc)}
ROWS=${ROWS:-A,B,C,D,E}
BASE=${BASE:-multi30k}
SEEDS=${SEEDS:-1}
DEVICE=${DEVICE:-cpu}
PARALLEL=${PARALLEL:-1}
PRECISION=${PRECISION:-auto}
MAX_TOKENS=${MAX_TOKENS:-4096}
LR=${LR:-2e-3}
SMOKE=${SMOKE:-0}
BUDGET_HOURS=${BUDGET_HOURS:-}
UPDATES=${UPDATES:-}

log() { echo "[paper_table3 $(date +%H:%M:%S)] $*" >&2; }
fail() { echo "paper_table3: error: $*" >&2; exit 2; }

[[ "$DEVICE" =~ ^(cpu|cuda)$ ]] || fail "DEVICE=$DEVICE: use cpu or cuda"
[[ "$PARALLEL" =~ ^[1-9][0-9]*$ ]] || fail "PARALLEL=$PARALLEL: give how many trials run side by side (1 or more)"
[[ "$THREADS" =~ ^[1-9][0-9]*$ ]] || fail "THREADS=$THREADS: give a number of CPU threads (1 or more)"
[[ "$SEEDS" =~ ^[0-9]+(,[0-9]+)*$ ]] || fail "SEEDS=$SEEDS: give seeds separated by commas, such as 1,2"
[[ "$SMOKE" =~ ^[01]$ ]] || fail "SMOKE=$SMOKE: use 1 (a few updates per row) or 0"
[[ "$BASE" =~ ^(multi30k|paper)$ ]] || fail "BASE=$BASE: use multi30k or paper"
python "$HERE/table3.py" --check-rows "$ROWS" || exit 2
if [ -n "$BUDGET_HOURS" ]; then
  [ -z "$UPDATES" ] || fail "give UPDATES or BUDGET_HOURS, not both"
  [[ "$BUDGET_HOURS" =~ ^([0-9]+\.?[0-9]*|\.[0-9]+)$ ]] && python -c "import sys; sys.exit(float('$BUDGET_HOURS') <= 0)" \
    || fail "BUDGET_HOURS=$BUDGET_HOURS: give the hours the whole table may take, such as 1.5"
  LENGTH=(--budget-hours "$BUDGET_HOURS")
else
  UPDATES=${UPDATES:-600}
  [ "$SMOKE" = 1 ] && UPDATES=3
  [[ "$UPDATES" =~ ^[1-9][0-9]*$ ]] || fail "UPDATES=$UPDATES: give a whole number of updates (1 or more)"
  LENGTH=(--updates "$UPDATES")
fi

if [ -n "${DATA_BIN:-}" ]; then
  [ -d "$DATA_BIN" ] || fail "DATA_BIN=$DATA_BIN: not a directory (give an attnmt preprocess output)"
  [ -f "${VALID_SOURCE:-}" ] && [ -f "${VALID_REFERENCE:-}" ] \
    || fail "DATA_BIN needs VALID_SOURCE and VALID_REFERENCE: the raw dev source and its reference (files)"
  BIN=$DATA_BIN
else
  RAW=$WORK/raw
  BIN=$WORK/data-bin
  M30K=$HERE/../multi30k
  mkdir -p "$RAW"
  log "1/3 data (en, de) -> $RAW"
  python "$HERE/../fetch_data.py" "$M30K/manifest.tsv" --out "$RAW" --langs en,de ${DATA_DIR:+--data-dir "$DATA_DIR"}
  TRAIN=$RAW/train VOCAB=8000
  if [ "$SMOKE" = 1 ]; then
    for l in en de; do gzip -cd "$RAW/train.$l.gz" | sed -n "1,400p" > "$RAW/train_slice.$l"; done
    TRAIN=$RAW/train_slice VOCAB=500
  fi
  if [ ! -f "$BIN/preprocess.json" ]; then
    log "2/3 preprocess -> $BIN (joint SentencePiece $VOCAB)"
    attnmt preprocess -s en -t de --trainpref "$TRAIN" --validpref "$RAW/val" --destdir "$BIN" \
      --bpe sentencepiece --vocab-size "$VOCAB" --joined-dictionary --workers "$THREADS"
  fi
  VALID_SOURCE=$RAW/val.en.gz VALID_REFERENCE=$RAW/val.de.gz
fi

SMOKE_ARGS=()
[ "$SMOKE" = 1 ] && SMOKE_ARGS=(--smoke --max-tokens 1024)
log "3/3 Table 3 rows $ROWS (base: $BASE; seeds $SEEDS; $DEVICE, $PARALLEL side by side) -> $WORK/table3"
python "$HERE/table3.py" --data-bin "$BIN" --valid-source "$VALID_SOURCE" --valid-reference "$VALID_REFERENCE" \
  --out "$WORK/table3" --rows "$ROWS" --base "$BASE" --seeds "$SEEDS" --device "$DEVICE" --parallel "$PARALLEL" \
  --threads "$THREADS" --precision "$PRECISION" --max-tokens "$MAX_TOKENS" --lr "$LR" "${LENGTH[@]}" \
  "${SMOKE_ARGS[@]}"
log "done: $WORK/table3/table3.md, table3.json, table3_bleu.png"
