#!/usr/bin/env bash
# The head's GPU recipe, in one call on a CUDA machine that has torch and transformers but no vLLM and
# no network (the device lent for minutes): rebuild the target from its GGUF, fill distilled-reply
# slices of data/replies for GEN_MINUTES, then extract features and train a head for TRAIN_MINUTES.
# The new slices and the head are packed into $OUT as replies.tar and head.tar; unpack them into the
# repo and commit (the replies outlive the machine; features are rebuilt from them in minutes).
#
#   GGUF=/path/SmolLM2-135M-Instruct.Q4_1.gguf OUT=/tmp/out scripts/gpu_make_head.sh
#
# Needs the gguf package beside transformers (prepare_smollm2.py). Every size is an environment
# variable, so the same script dry-runs on a CPU at a tiny scale first.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
: "${GGUF:?path of the target GGUF}" "${OUT:?folder for replies.tar, head.tar}"
PY=${PY:-python3}
TARGET=${TARGET:-models/smollm2-135m-instruct}
DATA=${DATA:-data/replies}
HEAD=${HEAD:-/tmp/eagle-head}
FEATURES=${FEATURES:-/tmp/eagle-features}
GEN_MINUTES=${GEN_MINUTES:-4}       # no new ShareGPT slice starts after this
SLICE=${SLICE:-2048}                # prompts per slice
GEN_BATCH=${GEN_BATCH:-1024}        # prompts per generate call
MAX_NEW=${MAX_NEW:-384}             # ShareGPT reply cap (MT-bench: MAX_NEW_EVAL)
MAX_NEW_EVAL=${MAX_NEW_EVAL:-512}
TEMPERATURE=${TEMPERATURE:-0}       # > 0: fill the sampled series sharegpt-t<T> instead of the greedy one
EPOCHS=${EPOCHS:-4}
LR=${LR:-1e-3}
INIT_FROM=${INIT_FROM:-}            # a trained head to fine-tune (e.g. heads/smollm2-135m-eagle); empty: from scratch
TRAIN_MINUTES=${TRAIN_MINUTES:-2.5}  # at most (0: replies only, no features or head); with DEADLINE (seconds from the start), less if time is short
# TRAIN_TOK_S (optional): measured training tokens/s; then EPOCHS is an upper bound, lowered to what fits
RESERVE=${RESERVE:-130}             # seconds kept for features, evaluations and packing
BATCH_TOKENS=${BATCH_TOKENS:-4096}
DEPTHS=${DEPTHS:-3}
export PYTHONUNBUFFERED=1

t0=$SECONDS
stamp() { echo "[gpu_make_head] $(( SECONDS - t0 )) s: $*" >&2; }
stamp "target from $GGUF"
[ -f "$TARGET/config.json" ] || "$PY" scripts/prepare_smollm2.py --gguf "$GGUF" --output "$TARGET" --smoke-tokens 0
stamp "MT-bench answers (held out)"
"$PY" scripts/generate_replies.py --data "$DATA" --target "$TARGET" --set mtbench --slice-size 80 \
    --max-new-tokens "$MAX_NEW_EVAL" --batch-size 80
stamp "ShareGPT replies for $GEN_MINUTES min"
gen_start=$SECONDS
sharegpt() {  # $1: prompts per generate call, $2: minutes after which no slice starts
    "$PY" scripts/generate_replies.py --data "$DATA" --target "$TARGET" --set sharegpt --slice-size "$SLICE" \
        --max-new-tokens "$MAX_NEW" --batch-size "$1" --max-minutes "$2" --temperature "$TEMPERATURE"
}
# Slices are written whole, so a failed call (out of memory at a large GEN_BATCH) loses only the slice
# in flight: the rest of the minutes go to half the batch.
sharegpt "$GEN_BATCH" "$GEN_MINUTES" || {
    left=$(awk -v m="$GEN_MINUTES" -v s=$(( SECONDS - gen_start )) 'BEGIN { printf "%.2f", m - s / 60 }')
    stamp "generation failed at batch $GEN_BATCH; $left min left at batch $(( GEN_BATCH / 2 ))"
    sharegpt $(( GEN_BATCH / 2 )) "$left"
}
tar -cf "$OUT/replies.tar" -C "$(dirname "$DATA")" "$(basename "$DATA")"
if [ "$TRAIN_MINUTES" = 0 ]; then
    stamp "done (TRAIN_MINUTES=0: replies only)"
    exit 0
fi
if [ -n "${DEADLINE:-}" ]; then
    TRAIN_MINUTES=$(awk -v d="$DEADLINE" -v now=$(( SECONDS - t0 )) -v r="$RESERVE" -v m="$TRAIN_MINUTES" \
        'BEGIN { x = (d - now - r) / 60; if (x > m) x = m; if (x < 0.5) x = 0.5; printf "%.2f", x }')
fi
if [ -n "${TRAIN_TOK_S:-}" ]; then
    # As many epochs as the minutes left hold at the measured speed (scripts/bench_train_step.py), so
    # the cosine schedule ends instead of being cut. Tokens: replies plus prompts (about 1.3x replies).
    EPOCHS=$("$PY" -c "import json; m = json.load(open('$DATA/manifest.json'))
n = 1.3 * sum(s['reply_tokens'] for s in m['slices'] if s['prompts'] == 'sharegpt')
print(max(1, min($EPOCHS, int(0.9 * $TRAIN_MINUTES * 60 * $TRAIN_TOK_S / n))))")
fi
stamp "features and training ($EPOCHS epochs, at most $TRAIN_MINUTES min of training)"
"$PY" scripts/train_eagle_head.py --target "$TARGET" --replies "$DATA" --eval-replies mtbench \
    --num-conversations 0 --eval-conversations 0 --max-tokens-per-conversation 1024 \
    --batch-tokens "$BATCH_TOKENS" --epochs "$EPOCHS" --train-depths "$DEPTHS" --lr "$LR" --min-lr-ratio 0.05 \
    --ce-weight 0.1 --max-minutes "$TRAIN_MINUTES" --feature-dir "$FEATURES" --output "$HEAD" --seed 0 \
    ${INIT_FROM:+--init-from "$INIT_FROM"}
tar -cf "$OUT/head.tar" -C "$(dirname "$HEAD")" "$(basename "$HEAD")"
stamp "done"
