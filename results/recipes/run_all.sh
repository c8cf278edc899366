#!/usr/bin/env bash
# Every table of recipes/README.md's "Results on this machine", in the order it ran (about 2 hours
# on 2 cores). Each compare_methods.py call writes <out>/runs.jsonl and <out>/curves.png.
set -eu
cd "$(dirname "$0")/../.."
C=".venv/bin/python scripts/compare_methods.py"
# GPT: the methods side by side
$C --recipe gpt --max_steps 300 --seeds 0 1 2 --out results/recipes/gpt
# ViT: data parallel, local SGD and CO2, then two attempts at CO2's gap
$C --recipe vit --methods dp local_sgd co2 --seeds 0 1 2 --max_steps 250 --out results/recipes/vit
$C --recipe vit --methods --seeds 0 1 2 --max_steps 250 --out results/recipes/vit_tuning \
  --method "co2_window1=--co2_overlap_steps 1"
$C --recipe vit --methods --seeds 0 1 2 --max_steps 250 --out results/recipes/vit_tuning2 \
  --method "co2_syncwarm50=--co2_sync_warmup_steps 50"
# GPT: staleness-penalty ablation ("off" is the co2 row of the GPT table)
$C --recipe gpt --methods --seeds 0 1 --max_steps 300 --out results/recipes/gpt_penalty \
  --method "co2_gap_aware=--co2_gap_penalty 1.0 --co2_gap_penalty_mode gap_aware" \
  --method "co2_constant=--co2_gap_penalty 1.0 --co2_gap_penalty_mode constant"
# GPT: clipping ablation, 10x the inner lr for round 10 (steps 120-131); phi 2.0 is about 1.3x the
# ||m|| of that round without a spike (1.6 in results/recipes/gpt/co2_seed0's log)
$C --recipe gpt --methods --seeds 0 --max_steps 300 --out results/recipes/gpt_clip \
  --plot_co2_metric co2/momentum_norm \
  --method "no_spike=" \
  --method "spike=--lr_spike_round 10" \
  --method "spike_clip2=--lr_spike_round 10 --co2_clip_threshold 2.0" \
  -- --logging_steps 12
# GPT: the constant penalty at lambda 2 (at lambda 1 it is P = 1, the same update as off)
$C --recipe gpt --methods --seeds 0 1 --max_steps 300 --out results/recipes/gpt_penalty2 \
  --method "co2_constant_lam2=--co2_gap_penalty 2.0 --co2_gap_penalty_mode constant"
