#!/usr/bin/env bash
# Every simulated-worker sweep behind docs/choosing_settings.md, in the order it ran (each line
# appends one JSON line per run to its file; about 5 minutes per micro 600-step run on one core).
set -u
cd "$(dirname "$0")/.."
S="nice -n 5 .venv/bin/python scripts/sim_sweep.py --model micro --jobs 2"
# screening, seed 0, tau 12, 600 steps
$S --steps 600 --seeds 0 --out results/screen_micro_600.jsonl --configs dp slowmo co2_default eager \
  win2 win2_eager local_sgd diloco co2_nopen co2_b0 win2_eager_b0 eager_b0 win1_eager_b0 win3_eager_b0 \
  win6_eager_b0 win2_eager_b2 eager_b0_pen
# finalists, seeds 0-2 (seed 0 reruns the screening's runs bit for bit)
$S --steps 600 --seeds 0 1 2 --configs dp local_sgd slowmo eager_b0 win2_eager_b0 --out results/finalists_micro_600.jsonl
# tau 4 and 48, seed 0, 600 steps
$S --steps 600 --seeds 0 --tau 4 --configs slowmo eager_b0 --out results/screen_micro_600_tau4.jsonl
$S --steps 600 --seeds 0 --tau 48 --configs slowmo eager_b0 --out results/screen_micro_600_tau48.jsonl
# 2400 steps: SlowMo-style and the full-overlap finalist (3 seeds), data parallel (1 seed)
$S --steps 2400 --eval_every 200 --seeds 0 1 2 --configs slowmo eager_b0 --out results/finalists_micro_2400.jsonl
$S --steps 2400 --eval_every 200 --seeds 0 --configs dp --out results/finalists_micro_2400.jsonl
# 2400 steps, seed 0: local SGD, the window and outer momentum 0.2 under the eager start
$S --steps 2400 --eval_every 200 --seeds 0 --configs win2_eager_b0 eager local_sgd --out results/screen_micro_2400.jsonl
# the lookahead start (docs/algorithm.md section 7): 600-step screen, 2400 steps with full overlap
$S --steps 600 --seeds 0 --configs look_b5 look_b2 --out results/screen_micro_600_lookahead.jsonl
$S --steps 2400 --eval_every 200 --seeds 0 1 --configs look_b5 --out results/finalists_micro_2400.jsonl
# ... and with the window k = 2, 3 seeds at both budgets
$S --steps 2400 --eval_every 200 --seeds 0 1 2 --configs win2_look_b5 --out results/screen_micro_2400.jsonl
$S --steps 600 --seeds 0 1 2 --configs win2_look_b5 --out results/screen_micro_600_lookahead.jsonl
# streaming fragments (co2_fragments = F, each applied tau/F steps after its launch; docs/algorithm.md
# section 7b), configurations f{F}_{eager|look|anchor}_b{beta*10}: 600-step screen, seed 0 ...
$S --steps 600 --seeds 0 --out results/screen_micro_600_fragments.jsonl --configs f12_eager_b0 eager_b0 \
  f6_eager_b0 f3_eager_b0 f2_eager_b0 f12_look_b5 f12_eager_b5 f3_look_b5 f12_anchor_b0 f12_anchor_b5
$S --steps 600 --seeds 0 --jobs 1 --out results/screen_micro_600_fragments.jsonl --configs f12_look_b2 f12_look_b3
# ... and 2400 steps
$S --steps 2400 --eval_every 200 --seeds 0 --configs f12_look_b2 f12_look_b5 --out results/finalists_micro_2400_fragments.jsonl
# the finalist (the defaults: co2_fragments = tau, lookahead start, beta 0.2), seeds 1 and 2 at both budgets
$S --steps 2400 --eval_every 200 --seeds 1 2 --configs f12_look_b2 --out results/finalists_micro_2400_fragments.jsonl
$S --steps 600 --seeds 1 2 --jobs 1 --configs f12_look_b2 --out results/finalists_micro_600_fragments.jsonl
# streaming with the eager start and beta 0, seeds 1 and 2 at 600 steps
$S --steps 600 --seeds 1 2 --jobs 1 --configs f12_eager_b0 --out results/finalists_micro_600_fragments.jsonl
# the wire (issue 17): CO2Config() with fp32 (reproduces f12_look_b2 above), bf16, int8 and int4
# codes (rounded to nearest or stochastically; blocks of 128 or 32): 600-step screen, seed 0 ...
$S --steps 600 --seeds 0 --out results/screen_micro_600_wire.jsonl --configs co2 co2_int8 co2_int8_sr \
  co2_int4 co2_int4_sr co2_int8_b32 co2_int4_b32 co2_bf16
# ... and int8 at 2400 steps, seed 0
# (fp32 at 2400 steps is f12_look_b2 in finalists_micro_2400_fragments.jsonl: CO2Config() is that
# configuration, and the sweep reproduces it bit for bit: co2 and f12_look_b2 at 600 steps, seed 0,
# both reach 5.474588394165039)
$S --steps 2400 --eval_every 200 --seeds 0 --jobs 1 --configs co2_int8 --out results/finalists_micro_2400_wire.jsonl
# ... seeds 1 and 2 of int8 at 2400 steps, and of int8 and int4 at 600 (fp32: f12_look_b2 above)
$S --steps 2400 --eval_every 200 --seeds 1 2 --jobs 1 --configs co2_int8 --out results/finalists_micro_2400_wire.jsonl
$S --steps 600 --seeds 1 2 --jobs 1 --configs co2_int8 co2_int4 --out results/finalists_micro_600_wire.jsonl
# The bytes frontier's sparse 4/256 2-bit row at 2400 steps, seeds 1 and 2 (seed 0 and the rest:
# `python scripts/bytes_frontier.py --run --jobs 2`, which appends to results/frontier_micro.jsonl)
$S --steps 2400 --eval_every 200 --seeds 1 2 --jobs 2 --configs co2_sparse_k4_b2 --out results/frontier_micro.jsonl
# The sparse wire, issue 26 (stop 39): SparseLoCo's fading error feedback (co2_sparse_feedback_decay,
# "_d{d}"), with and without outer momentum, 4 of 256 at 2 bits, seed 0 ...
$S --steps 600 --seeds 0 --configs co2_sparse_k4_b2_d95 co2_sparse_k4_b2_d95_m0 co2_sparse_k4_b2_d90 \
  co2_sparse_k4_b2_d90_m0 --out results/screen_micro_600_sparse_decay.jsonl
# ... and each worker keeping its unsent progress (co2_sparse_keep_unsent, "_keep"),
# 3 seeds at 600 steps and 4 of 256 at 2400 (two invocations side by side, --jobs 1 each)
$S --steps 600 --seeds 0 1 2 --jobs 1 --configs co2_sparse_k4_b2_keep co2_sparse_k3_b2_keep co2_sparse_k8_b2_keep \
  --out results/frontier_micro.jsonl
$S --steps 2400 --eval_every 200 --seeds 0 1 2 --jobs 1 --configs co2_sparse_k4_b2_keep --out results/frontier_micro.jsonl
# ... and beside them, seed 0: 3 of 256 with plain error feedback, 2 of 256 kept, and 4 of 256 kept without
# outer momentum and with the fading residual
$S --steps 600 --seeds 0 --jobs 1 --configs co2_sparse_k3_b2 co2_sparse_k2_b2_keep co2_sparse_k4_b2_keep_m0 \
  co2_sparse_k4_b2_keep_d95 --out results/screen_micro_600_sparse_keep.jsonl
# ... and 4 of 256 kept and plain with 2 workers (the GPT recipe's count), seed 0
$S --workers 2 --steps 600 --seeds 0 --configs co2_sparse_k4_b2_keep co2_sparse_k4_b2 --out results/screen_micro_600_sparse_keep_w2.jsonl
# The worker-count study, issue 50 (stop 60): seed 0, 8 workers first: data parallel at three learning
# rates, the defaults and local SGD at the same rates, the outer step (outer lr, momentum, Nesterov),
# data parallel for the first 30/60 steps, and the inner AdamW moments averaged for free (a probe) ...
$S --workers 8 --steps 600 --seeds 0 --configs dp co2 local_sgd dp_lr2e-3 co2_olr15 co2_olr2 dp_lr4e-3 co2_m5 \
  co2_nesterov09 --out results/workers_micro_600.jsonl
$S --workers 8 --steps 600 --seeds 0 --configs co2_lr2e-3 local_sgd_lr2e-3 co2_lr3e-3 dp_lr3e-3 \
  --out results/workers_micro_600.jsonl
$S --workers 8 --steps 600 --seeds 0 --configs co2_avg_m co2_avg_mv co2_sync60 co2_sync30 --out results/workers_micro_600.jsonl
$S --workers 8 --steps 600 --seeds 0 --configs co2_lr4e-3 local_sgd_lr4e-3 --out results/workers_micro_600.jsonl
# ... then the finalists at 16, 4 and 2 workers
$S --workers 16 4 2 --steps 600 --seeds 0 --configs dp co2 local_sgd co2_sync60 dp_lr2e-3 dp_lr4e-3 \
  --out results/workers_micro_600.jsonl
# ... and seed 1 of the main cells at 8 and 16 workers (a file of its own: the doc's table is seed 0's)
$S --workers 8 16 --steps 600 --seeds 1 --configs dp co2 co2_sync60 dp_lr2e-3 --out results/workers_micro_600_seed1.jsonl
# ... seed 2 of the main cells, a 120-step warm-up, the second-moment probe ("_avg_gv"), and 2400 steps
# at 4 and 16 workers (stop 61)
$S --workers 16 8 --steps 600 --seeds 0 --configs co2_sync120 --out results/workers_micro_600.jsonl
$S --workers 16 8 --steps 600 --seeds 2 --configs dp co2 co2_sync60 dp_lr2e-3 --out results/workers_micro_600_seed2.jsonl
$S --workers 8 --steps 600 --seeds 0 --configs co2_avg_gv local_sgd_avg_gv --out results/workers_micro_600.jsonl
$S --workers 4 --steps 2400 --eval_every 200 --seeds 0 --configs dp co2 co2_sync60 local_sgd dp_lr2e-3 \
  --out results/workers_micro_2400.jsonl
$S --workers 16 --steps 2400 --eval_every 200 --seeds 0 --configs dp co2 --out results/workers_micro_2400.jsonl
# ... and the probe at 16 workers (seed 0) and at 8 (seed 1)
$S --workers 16 --steps 600 --seeds 0 --configs co2_avg_gv --out results/workers_micro_600.jsonl
$S --workers 8 --steps 600 --seeds 1 --configs co2_avg_gv --out results/workers_micro_600_seed1.jsonl
# The engine setting built on the probe, co2_global_second_moment_every = K ("_gm{K}", stop 62): seed 0 at
# 8 and 16 workers, seeds 1 and 2, then 4 and 2 workers (3 seeds, with dp and the defaults at seeds 1
# and 2 there), and 2400 steps at 4 workers
$S --workers 8 --steps 600 --seeds 0 --configs co2_gm1 co2_gm4 --out results/workers_micro_600.jsonl
$S --workers 16 --steps 600 --seeds 0 --configs co2_gm1 co2_gm4 --out results/workers_micro_600.jsonl
$S --workers 8 --steps 600 --seeds 1 --configs co2_gm1 co2_gm4 --out results/workers_micro_600_seed1.jsonl
$S --workers 8 --steps 600 --seeds 2 --configs co2_gm1 co2_gm4 co2_avg_gv --out results/workers_micro_600_seed2.jsonl
$S --workers 16 --steps 600 --seeds 1 --configs co2_gm1 --out results/workers_micro_600_seed1.jsonl
$S --workers 16 --steps 600 --seeds 2 --configs co2_gm1 --out results/workers_micro_600_seed2.jsonl
$S --workers 4 2 --steps 600 --seeds 0 --configs co2_gm1 local_sgd_gm1 --out results/workers_micro_600.jsonl
$S --workers 4 2 --steps 600 --seeds 1 --configs dp co2 co2_gm1 --out results/workers_micro_600_seed1.jsonl
$S --workers 4 2 --steps 600 --seeds 2 --configs dp co2 co2_gm1 --out results/workers_micro_600_seed2.jsonl
$S --workers 4 --steps 2400 --eval_every 200 --seeds 0 --configs co2_gm1 co2_gm4 --out results/workers_micro_2400.jsonl
# ... and K = 4 at raised AdamW learning rates (8 workers, seed 0)
$S --jobs 1 --workers 8 --steps 600 --seeds 0 --configs co2_gm4_lr2e-3 co2_gm4_lr4e-3 --out results/workers_micro_600.jsonl
# ... and 32 workers (seed 0): data parallel only finished in the stop's time (co2_gm4 and co2 were cut)
$S --jobs 1 --workers 32 --steps 600 --seeds 0 --configs dp --out results/workers_micro_600.jsonl
# K = 4 at 2 and 4 workers, 3 seeds: does the second-moment setting lose where the gap is small?
$S --workers 2 4 --steps 600 --seeds 0 --configs co2_gm4 --out results/workers_micro_600.jsonl
$S --workers 2 4 --steps 600 --seeds 1 --configs co2_gm4 --out results/workers_micro_600_seed1.jsonl
$S --workers 2 4 --steps 600 --seeds 2 --configs co2_gm4 --out results/workers_micro_600_seed2.jsonl
# 16 workers, the second-moment default (co2_gm4) at seeds 1 and 2 (2026-12-07)
$S --workers 16 --steps 600 --seeds 1 --configs co2_gm4 --out results/workers_micro_600_seed1.jsonl
$S --workers 16 --steps 600 --seeds 2 --configs co2_gm4 --out results/workers_micro_600_seed2.jsonl
# 32 workers (seed 0): the two CO2 runs cut in an earlier stop, the default now and before (2026-12-07)
$S --jobs 1 --workers 32 --steps 600 --seeds 0 --configs co2_gm4 co2 --out results/workers_micro_600.jsonl
