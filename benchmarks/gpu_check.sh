#!/usr/bin/env bash
# One whole GPU measurement, before and after, for a GPU machine without network, from the project's root.
#
# Prepare .gpu/ first, on a machine with the data and the package index (data-bins binarized there):
#   mkdir -p .gpu/whl .gpu/data && git archive BEFORE_COMMIT --prefix=before/ | tar -x -C .gpu
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d .gpu/whl sacremoses==0.1.1 \
#       starlette uvicorn httptools uvloop anyio sniffio h11 idna   (the serve extra, for the tests step)
#   WMT: newstest2014 x10 as train, its first 500 lines as valid, SentencePiece 16k joined -> .gpu/data/wmt-bin
#   Multi30k: train/val/test_2016_flickr, SentencePiece 8k joined -> .gpu/data/m30k-bin; its German test -> .gpu/data/test.de,
#   its English test -> .gpu/data/test.en; newstest2014 as text -> .gpu/data/nt14.en, .gpu/data/nt14.de (step base)
#   For STEPS=sweep (not in the default): the Multi30k val.en.gz and val.de.gz -> .gpu/data/m30k-raw
#   (TRIALS=FILE picks the trials, SWEEP_PARALLEL/SWEEP_THREADS/SWEEP_SECONDS how they run; .gpu/before only for
#   the train and generate steps)
# Then: bash benchmarks/gpu_check.sh (results under $OUT). STEPS chooses the parts (default: all but sweep, in this
# order).
set -u
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
R=$(pwd); G=$R/.gpu
STEPS=${STEPS:-train generate base serve valid compile tests}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $G/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
# the checkout (after) and the tree before, each with cli/ placed as attnmt/cli (no install)
rm -rf /tmp/after /tmp/before && mkdir -p /tmp/after
tar --exclude=.gpu --exclude=.git --exclude=.venv -cf - . | tar -xf - -C /tmp/after && cp -r /tmp/after/cli /tmp/after/attnmt/cli
if [ -d $G/before ]; then cp -r $G/before /tmp/before && cp -r /tmp/before/cli /tmp/before/attnmt/cli; fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__)"
T0=$(date +%s); t() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
W=$G/data/wmt-bin; M=$G/data/m30k-bin; export M
tg() { local tree=$1 limit=$2; shift 2; (cd /tmp/$tree && PYTHONPATH=/tmp/site:/tmp/$tree timeout $limit python3 benchmarks/train_gpu.py "$@" 2>&1); }
gg() { local tree=$1 limit=$2; shift 2; (cd /tmp/$tree && PYTHONPATH=/tmp/site:/tmp/$tree timeout $limit python3 benchmarks/generate_gpu.py "$@" 2>&1); }
A="python3 -m attnmt.cli"
has() { case " $STEPS " in *" $1 "*) return 0;; esac; return 1; }

if has train; then
  [ -d /tmp/before ] && { echo "== train: before"; tg before 120 $W --archs transformer_big,transformer --precisions bf16 --updates 100 --warmup 10 --json | tee $OUT/train_before.txt | grep -v '^{'; }
  echo "== train: after"; tg after 150 $W --archs transformer_big,transformer --precisions bf16 --updates 100 --warmup 10 --profile 3 --json | tee $OUT/train_after.txt | grep -v '^{'
  t train done
fi
if has generate; then
  (cd /tmp/after && PYTHONPATH=/tmp/site:/tmp/after timeout 170 $A train $M --arch transformer_small --precision auto --max-tokens 4096 \
    --lr 2e-3 --warmup-updates 500 --max-update 2500 --save-dir /tmp/cks --disable-validation --no-epoch-checkpoints \
    --progress simple > $OUT/small.log 2>&1); tail -1 $OUT/small.log
  if [ -d /tmp/before ]; then
    echo "== generate: before"; gg before 100 --path /tmp/cks/checkpoint_last.pt --data-bin $M --gen-subset test --precisions fp32,bf16 --max-tokens 16000 --repeats 2 --json | tee $OUT/generate_before.txt | grep -v '^{'
  fi
  echo "== generate: beam steps as CUDA graphs (on) and launched one by one (off)"
  gg after 240 --path /tmp/cks/checkpoint_last.pt --data-bin $M --gen-subset test --precisions fp32,bf16 --max-tokens 16000,0 --graphs off,on --repeats 3 --profile --hypotheses --json > $OUT/generate_after.txt; grep -v '^{' $OUT/generate_after.txt
  python3 - $OUT/generate_after.txt <<'EOF2'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
for p in ("fp32", "bf16"):
    for m in sorted({r["max_tokens"] for r in rows}):
        pair = {r.get("graphs", "on"): r for r in rows if r["precision"] == p and r["max_tokens"] == m}
        if len(pair) == 2:
            a, b = pair["off"]["hypotheses"], pair["on"]["hypotheses"]
            print(f"{p} at {m} tokens: graphs on vs off: {sum(x == y for x, y in zip(a, b))}/{len(a)} identical, "
                  f"BLEU {pair['on']['bleu']} vs {pair['off']['bleu']}, "
                  f"{pair['on']['tokens_per_s'] / pair['off']['tokens_per_s']:.2f}x target tok/s")
EOF2
  for g in on off; do  # the command a user runs, cold: wall time, time to the first line out, BLEU
    python3 - $g "$G/data/test.de" <<'EOF2'
import os, subprocess, sys, time
env = dict(os.environ, ATTNMT_CUDA_GRAPHS="1" if sys.argv[1] == "on" else "0")
t = time.perf_counter()
p = subprocess.Popen([sys.executable, "-m", "attnmt.cli", "generate", os.environ["M"], "--path", "/tmp/cks/checkpoint_last.pt",
                      "--gen-subset", "test"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd="/tmp/after", env=env)
first = p.stdout.readline(); t1 = time.perf_counter() - t
rest = p.stdout.read(); p.wait(); t2 = time.perf_counter() - t
open(f"/tmp/h_{sys.argv[1]}.de", "w").write(first + rest)
print(f"attnmt generate, graphs {sys.argv[1]}: first line after {t1:.2f} s, all {t2:.2f} s (exit {p.returncode})")
EOF2
    (cd /tmp/after && PYTHONPATH=/tmp/site:/tmp/after $A score --ref $G/data/test.de --sys /tmp/h_$g.de | tail -1 | cut -c1-100)
  done
  t generate done
fi
if has base; then  # transformer (base) on WMT-length sentences: a short training on newstest2014 x10, then translate it
  # pre-norm: the paper's post-norm stack at lr 1e-3 after 300 warm-up updates stays at the unigram loss (11.2-11.4 bits
  # on the GPU and on a CPU); pre-norm leaves it (10.3 after 400 updates of 6,000 tokens on a CPU); the same kernels
  (cd /tmp/after && PYTHONPATH=/tmp/site:/tmp/after timeout 150 $A train $W --arch transformer --bf16 --max-tokens 25000 \
    --encoder-normalize-before --decoder-normalize-before \
    --lr 1e-3 --warmup-updates 300 --max-update ${BASE_UPDATES:-1200} --save-dir /tmp/ckb --disable-validation --no-epoch-checkpoints \
    --progress simple > $OUT/base.log 2>&1); tail -1 $OUT/base.log
  echo "== generate: transformer (base), newstest2014 (the sentences it trained on: a speed run)"
  gg after 200 --path /tmp/ckb/checkpoint_last.pt --src $G/data/nt14.en --ref $G/data/nt14.de --precisions bf16,fp32 --max-tokens 0 --graphs off,on --repeats 2 --json > $OUT/generate_base.txt; grep -v '^{' $OUT/generate_base.txt
  t base done
fi
if has serve; then  # after generate (its model): static calls against continuous batching, in one process
  for n in 32 128; do
    (cd /tmp/after && PYTHONPATH=/tmp/site:/tmp/after timeout 100 python3 benchmarks/continuous_batching.py \
      --path /tmp/cks/checkpoint_last.pt --input $G/data/test.en --in-flight $n --rounds 2 device=cuda 2>&1 | tail -7)
  done | tee $OUT/serve.txt
  t serve done
fi
if has valid; then
  echo "== valid loss after 200 updates of transformer bf16 (lr 1e-3, 100 warm-up), seeds 1 and 2 as before, 1 after"
  for s in "--as-before --seed 1" "--as-before --seed 2" "--seed 1"; do
    tg after 90 $W --archs transformer --precisions bf16 --updates 200 --warmup 0 --lr 1e-3 --warmup-updates 100 --valid --save none $s --json | tee -a $OUT/valid.txt | grep -v '^{' | tail -1
  done
  t valid done
fi
if has compile; then
  echo "== train: after, --compile"; tg after 240 $W --archs ${COMPILE_ARCHS:-transformer_big} --precisions bf16 --updates 100 --warmup 10 --compile --profile 3 --json | tee $OUT/train_compile.txt | grep -v '^{'
  t compile done
fi
if has sweep; then  # the Multi30k recipe's trials (default: ~9,000 updates, both directions), side by side (val only)
  (cd /tmp/after && PYTHONPATH=/tmp/site:/tmp/after python3 benchmarks/multi30k_sweep.py --data-bin $M \
    --refs $G/data/m30k-raw --out /tmp/sweep --parallel ${SWEEP_PARALLEL:-8} --threads ${SWEEP_THREADS:-2} \
    --device cuda --attnmt "$A" --seconds ${SWEEP_SECONDS:-420} \
    --trials-file ${TRIALS:-benchmarks/multi30k_trials_9k.txt} 2>&1 | tail -12 | cut -c1-600)
  cp /tmp/sweep/trials.jsonl $OUT/sweep_trials.jsonl
  t sweep done
fi
if has tests; then
  (cd /tmp/after && PYTHONPATH=/tmp/site:/tmp/after timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tail -6)
  t tests done
fi
