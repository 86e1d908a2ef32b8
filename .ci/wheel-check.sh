#!/usr/bin/env bash
# The project as a user gets it from a wheel (no -e): build the wheel, install it in a fresh virtualenv (torch's
# local CPU build first, the ctranslate2 extra for the export), then, from outside the source tree, run every
# command's --help and a real pipeline: preprocess a small generated corpus, train a tiny model for a few updates,
# translate, and export it to CTranslate2 with a score check.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip wheel -q --no-deps -w "$work/dist" .
python3 -m venv "$work/venv"
. "$work/venv/bin/activate"
python -m pip install -q --upgrade pip
pip install -q torch==2.13.0
wheel=$(ls "$work"/dist/attnmt-*.whl)
pip install -q "$wheel[ctranslate2]"
cd "$work"
python -c "import attnmt, sys; sys.exit(0 if attnmt.__file__.startswith('$work/venv') else 'attnmt imported from ' + attnmt.__file__)"
commands=$(attnmt --help | awk '/^Commands:/ {on=1; next} on && NF {print $1}')
[ -n "$commands" ] || { echo "wheel check: attnmt --help lists no commands" >&2; exit 1; }
for c in $commands; do attnmt "$c" --help > /dev/null; done
attnmt plot curves --help > /dev/null && attnmt plot attention --help > /dev/null
python - <<'PY'
import random
random.seed(0)
words = "a man woman child dog cat rides walks sees the red blue big small house street bike park".split()
with open("train.en", "w") as en, open("train.de", "w") as de:
    for _ in range(400):
        s = random.choices(words, k=random.randint(3, 9))
        en.write(" ".join(s) + "\n")
        de.write(" ".join(w.upper() for w in reversed(s)) + "\n")
PY
head -40 train.en > valid.en && head -40 train.de > valid.de
attnmt preprocess -q -s en -t de --trainpref train --validpref valid --destdir bin --bpe sentencepiece \
    --vocab-size 60 --joined-dictionary
attnmt train bin --arch transformer_small --encoder-layers 1 --decoder-layers 1 --encoder-embed-dim 16 \
    --decoder-embed-dim 16 --encoder-ffn-embed-dim 32 --decoder-ffn-embed-dim 32 --encoder-attention-heads 2 \
    --decoder-attention-heads 2 --max-tokens 1024 --max-update 3 --save-dir ckpt --progress none
head -3 valid.en | attnmt translate --path ckpt/checkpoint_last.pt > /dev/null
attnmt export --path ckpt/checkpoint_last.pt --to ctranslate2 --output-dir ct2 --check valid.en
test -f ct2/model.bin
echo "wheel check: $(basename "$wheel") installs, every command's --help runs, export to CTranslate2 works"
