#!/usr/bin/env bash
# Every table of recipes/README.md's "Results on this machine", in the order it ran (about 80 minutes
# on 2 cores). Each compare_methods.py call appends to <out>/runs.jsonl and redraws <out>/curves.png.
set -eu
# Every line up to the streaming one below ran before co2_fragments existed, when the recipes' CO2
# was full overlap: "co2" there meant `--co2_fragments 1 --co2_start_rule eager --co2_outer_momentum 0
# --co2_gap_penalty 0` (GPT; the "co2_full" method now) and `... --co2_outer_momentum 0.2
# --co2_local_steps 2` (ViT). Add those flags to a method to rerun it as it ran then. Every line up to
# the second-moment one at the end ran before co2_global_second_moment_every = 4 was the default:
# they ran with 0 (the streaming lines say so; add it to the others' CO2 methods to rerun them). The
# ViT recipe has set 0 itself since the vit_moments lines, so its earlier lines rerun as they ran.
cd "$(dirname "$0")/../.."
C=".venv/bin/python scripts/compare_methods.py"
R=results/recipes
# ViT: data parallel, local SGD and CO2 at tau 2, 4 and 12, 5 seeds (the recipe's CO2 is tau 2,
# outer momentum 0.2; every other method names its tau)
$C --recipe vit --methods dp --max_steps 250 --seeds 0 1 2 3 4 --out $R/vit \
  --method "local_sgd_tau4=--co2_overlap false --co2_outer_lr 1.0 --co2_outer_momentum 0.0 --co2_local_steps 4" \
  --method "co2_tau4=--co2_local_steps 4" \
  --method "local_sgd_tau12=--co2_overlap false --co2_outer_momentum 0.0 --co2_local_steps 12" \
  --method "co2_tau12_b0=--co2_local_steps 12 --co2_outer_momentum 0.0" \
  --method "co2_tau4_b0=--co2_local_steps 4 --co2_outer_momentum 0.0" \
  --method "co2_tau2=--co2_local_steps 2"
# ViT: other knobs (the eager weight; outer momentum 0.5 ran for seed 0 only)
$C --recipe vit --methods --max_steps 250 --seeds 0 1 2 3 4 --port 29544 --out $R/vit_tuning \
  --method "co2_w033=--co2_local_steps 4 --co2_eager_weight 0.33" \
  --method "co2_w05=--co2_local_steps 4 --co2_eager_weight 0.5" \
  --method "co2_tau2_w05=--co2_local_steps 2 --co2_eager_weight 0.5"
$C --recipe vit --methods --max_steps 250 --seeds 0 --port 29544 --out $R/vit_tuning \
  --method "co2_b5=--co2_local_steps 4 --co2_outer_momentum 0.5"
# GPT: the methods side by side, 3 seeds (data parallel ran first, then the others into the same folder)
$C --recipe gpt --methods dp --max_steps 300 --seeds 0 1 2 --out $R/gpt
$C --recipe gpt --methods co2 local_sgd slowmo diloco --max_steps 300 --seeds 0 1 2 --out $R/gpt
# GPT: the lookahead start with outer momentum 0.5 and the window k = 2 (docs/choosing_settings.md)
$C --recipe gpt --methods --max_steps 300 --seeds 0 1 2 --out $R/gpt \
  --method "co2_win2_look_b5=--co2_start_rule lookahead --co2_outer_momentum 0.5 --co2_overlap_steps 2"
# GPT: bf16 on the wire against fp32, 3 seeds (ran before the recipes seeded their initial weights)
$C --recipe gpt --methods co2 --max_steps 300 --seeds 0 1 2 --out $R/gpt_wire \
  --method "co2_bf16_wire=--co2_comm_dtype bfloat16"
# GPT: staleness-penalty ablation, seeds 0 and 1 (this and the clipping ablation ran before the
# recipes seeded their initial weights; "off" is the co2 row of the GPT table at commit 63d7ed3)
$C --recipe gpt --methods --seeds 0 1 --max_steps 300 --out $R/gpt_penalty \
  --method "co2_gap_aware=--co2_gap_penalty 1.0 --co2_gap_penalty_mode gap_aware" \
  --method "co2_constant=--co2_gap_penalty 1.0 --co2_gap_penalty_mode constant"
$C --recipe gpt --methods --seeds 0 1 --max_steps 300 --out $R/gpt_penalty2 \
  --method "co2_constant_lam2=--co2_gap_penalty 2.0 --co2_gap_penalty_mode constant"
# GPT: clipping ablation, 10x the inner lr for round 10 (steps 120-131)
$C --recipe gpt --methods --seeds 0 --max_steps 300 --out $R/gpt_clip --plot_co2_metric co2/momentum_norm \
  --method "no_spike=" --method "spike=--lr_spike_round 10" \
  --method "spike_clip2=--lr_spike_round 10 --co2_clip_threshold 2.0" -- --logging_steps 12
# GPT: a budget of 2000 steps, one seed (about 35 minutes on the idle machine)
$C --recipe gpt --methods co2 dp slowmo --max_steps 2000 --seeds 0 --out $R/gpt_2000 -- --eval_steps 200
$C --recipe gpt --methods --max_steps 2000 --seeds 0 --out $R/gpt_2000 \
  --method "co2_win2_look_b5=--co2_start_rule lookahead --co2_outer_momentum 0.5 --co2_overlap_steps 2" -- --eval_steps 200
# GPT: streaming CO2 (the library's defaults since fragments: co2_fragments = tau, lookahead start,
# beta 0.2) beside local SGD (the better synchronous method at 300 steps), 3 seeds, one invocation
$C --recipe gpt --methods local_sgd --max_steps 300 --seeds 0 1 2 --out $R/gpt_stream --method "co2_stream=--co2_global_second_moment_every 0"
# GPT: streaming CO2 (the defaults) at 2000 steps, seed 0, beside the rows of gpt_2000 above
$C --recipe gpt --methods --max_steps 2000 --seeds 0 --out $R/gpt_2000 --method "co2_stream=--co2_global_second_moment_every 0" -- --eval_steps 200
# ViT: streaming (the library's defaults at the recipe's tau 2: 2 fragments, lookahead start) and, side
# by side, full overlap with the eager start and streaming with the eager start; 5 seeds. (They ran
# while the recipe used the library's defaults; the flags pin what each ran. The ViT recipe now keeps
# full overlap with the eager start, the best of the three.)
$C --recipe vit --methods --max_steps 250 --seeds 0 1 2 3 4 --out $R/vit_stream --method "co2_stream=--co2_fragments 2 --co2_start_rule lookahead --co2_global_second_moment_every 0"
$C --recipe vit --methods --max_steps 250 --seeds 0 1 2 3 4 --out $R/vit_stream \
  --method "co2_full_eager=--co2_fragments 1 --co2_start_rule eager" --method "co2_stream_eager=--co2_fragments 2 --co2_start_rule eager"
# Quantized outer gradients (issue 17): fp32, int8 and int4 on the wire side by side, each recipe
# with its own CO2 settings (GPT: the library's streaming defaults; ViT: tau 2, full overlap, eager)
$C --recipe gpt --methods --max_steps 300 --seeds 0 1 2 --out $R/gpt_quant \
  --method "co2_fp32=" --method "co2_int8=--co2_comm_dtype int8" --method "co2_int4=--co2_comm_dtype int4"
$C --recipe vit --methods --max_steps 250 --seeds 0 1 2 3 4 --out $R/vit_quant \
  --method "co2_fp32=" --method "co2_int8=--co2_comm_dtype int8" --method "co2_int4=--co2_comm_dtype int4"
# GPT at 2000 steps, seed 0: int8 on the wire, beside the streaming (fp32) row of gpt_2000 above
$C --recipe gpt --methods --max_steps 2000 --seeds 0 --out $R/gpt_2000 --method "co2_int8=--co2_comm_dtype int8" -- --eval_steps 200
# The sparse wire (issue 26): 4 of 256 values in 2 bits, beside fp32, 3 seeds, one invocation
$C --recipe gpt --methods --max_steps 300 --seeds 0 1 2 --out $R/gpt_sparse \
  --method "co2_fp32=" --method "co2_sparse_k4_b2=--co2_comm_dtype sparse --co2_quant_block 256 --co2_sparse_density 0.015625 --co2_sparse_bits 2"
# ... and with each worker keeping its unsent progress (co2_sparse_keep_unsent), 4 of 256 in 2 bits, beside
# fp32, 3 seeds (seed 2 of the sparse row in a second invocation); then 3 of 256 with plain error
# feedback (the wire's default), the setting at >= 50x fewer bytes
$C --recipe gpt --methods --max_steps 300 --seeds 0 1 2 --out $R/gpt_sparse_keep --method "co2_fp32=" \
  --method "co2_sparse_k4_b2_keep=--co2_comm_dtype sparse --co2_quant_block 256 --co2_sparse_density 0.015625 --co2_sparse_bits 2 --co2_sparse_keep_unsent true"
$C --recipe gpt --methods --max_steps 300 --seeds 0 1 2 --out $R/gpt_sparse_keep \
  --method "co2_sparse_k3_b2=--co2_comm_dtype sparse --co2_quant_block 256 --co2_sparse_density 0.01171875 --co2_sparse_bits 2"
# The second-moment exchange as the default (co2_global_second_moment_every unset = 4 here) against it
# off, beside data parallel, 3 seeds, 300 steps
$C --recipe gpt --methods dp co2 --max_steps 300 --seeds 0 1 2 --out $R/gpt_moments \
  --method "co2_k0=--co2_global_second_moment_every 0"
# ViT at its own settings with the second-moment exchange as the default (unset = 4) against it off,
# beside data parallel, 10 seeds, then every 1 and 2 rounds. These ran before finetune_vit.py set
# co2_global_second_moment_every=0 (because of them): "co2" here is the exchange at 4, named so that
# a rerun reproduces it now
$C --recipe vit --methods dp --max_steps 250 --seeds 0 1 2 3 4 --out $R/vit_moments \
  --method "co2=--co2_global_second_moment_every 4" --method "co2_k0=--co2_global_second_moment_every 0"
$C --recipe vit --methods dp --max_steps 250 --seeds 5 6 7 8 9 --out $R/vit_moments \
  --method "co2=--co2_global_second_moment_every 4" --method "co2_k0=--co2_global_second_moment_every 0"
$C --recipe vit --methods --max_steps 250 --seeds 0 1 2 3 4 5 6 7 8 9 --out $R/vit_moments \
  --method "co2_k1=--co2_global_second_moment_every 1" --method "co2_k2=--co2_global_second_moment_every 2"
