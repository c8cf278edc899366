"""Convergence sweeps of CO2 settings with simulated workers (scripts/sim.py) on the GPT recipe's task.

    python scripts/sim_sweep.py --configs dp slowmo co2_default co2_eager --steps 600 --seeds 0 \\
        --out results/sweep.jsonl [--jobs 2] [--model tiny] [--tau 12] [--workers 4 8 16]
    python scripts/sim_sweep.py --list          # the named configurations

The task: the GPT-2 shape of recipes/pretrain_gpt.py (``--model tiny`` ~1.3M parameters, ``micro``
~0.3M) on the Shakespeare plays of its offline default (same BPE, two plays held out), each worker
drawing its own micro-batches of 8 blocks of 128 tokens, AdamW (lr 1e-3, or the lr of a dp_lr*
config, 5% warm-up, cosine decay, no dropout). Validation loss of the global model (the anchor) on 64
held-out blocks is recorded every ``--eval_every`` steps and at the end. One JSON line per run, with
its ``workers``. Runs are independent processes, so ``--jobs 2`` uses both cores.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if not __package__:  # run as `python scripts/sim_sweep.py`: import scripts.sim from the repository root
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "recipes"))  # the recipe's corpus and tokenizer (recipes/ is not a package)
CACHE = ROOT / "outputs" / "sim_cache"
MODELS = {"micro": (64, 2, 2), "tiny": (128, 4, 4)}
BLOCK, MICRO_BATCH, EVAL_BLOCKS = 128, 8, 64

# The configurations below override the SPEC's defaults, which were CO2Config()'s when the study
# began (results/ holds their runs); "co2" alone is CO2Config() as it was before the second-moment
# exchange became the default ("co2_gm4" is CO2Config() now).
SPEC_DEFAULTS = dict(co2_fragments=1, co2_start_rule="anchor", co2_outer_momentum=0.2, co2_gap_penalty=1.0)
# name -> CO2Config overrides (None: data parallel). Tau comes from --tau unless a config sets it.
CONFIGS: dict[str, dict | None] = {
    "dp": None,
    "local_sgd": dict(co2_overlap=False, co2_outer_momentum=0.0),
    "slowmo": dict(co2_overlap=False, co2_outer_momentum=0.5),
    "diloco": dict(co2_overlap=False, co2_nesterov=True, co2_outer_lr=0.7, co2_outer_momentum=0.9),
    # overlapped, anchor start
    "co2_default": dict(),
    "co2_nopen": dict(co2_gap_penalty=0.0),
    "co2_b0": dict(co2_outer_momentum=0.0),
    "co2_b0_nopen": dict(co2_outer_momentum=0.0, co2_gap_penalty=0.0),
    "co2_b5": dict(co2_outer_momentum=0.5),
    "co2_lam2": dict(co2_gap_penalty=2.0),
    "co2_const2": dict(co2_gap_penalty=2.0, co2_gap_penalty_mode="constant"),
    "co2_clip": dict(co2_clip_threshold=0.5),
    "co2_lr05": dict(co2_outer_lr=0.5),
    "co2_lr05_b0": dict(co2_outer_lr=0.5, co2_outer_momentum=0.0),
    "co2_nesterov": dict(co2_nesterov=True, co2_outer_lr=0.7, co2_outer_momentum=0.9),
    # overlapped, eager start
    "eager": dict(co2_start_rule="eager", co2_gap_penalty=0.0),
    "eager_pen": dict(co2_start_rule="eager"),
    "eager_b0": dict(co2_start_rule="eager", co2_outer_momentum=0.0, co2_gap_penalty=0.0),
    "eager_b0_pen": dict(co2_start_rule="eager", co2_outer_momentum=0.0),
    "eager_b0_lr08": dict(co2_start_rule="eager", co2_outer_momentum=0.0, co2_gap_penalty=0.0, co2_outer_lr=0.8),
    "eager_b0_lr12": dict(co2_start_rule="eager", co2_outer_momentum=0.0, co2_gap_penalty=0.0, co2_outer_lr=1.2),
    "eager_b0_clip": dict(co2_start_rule="eager", co2_outer_momentum=0.0, co2_gap_penalty=0.0, co2_clip_threshold=1.0),
    "eager_b0_const2": dict(
        co2_start_rule="eager", co2_outer_momentum=0.0, co2_gap_penalty=2.0, co2_gap_penalty_mode="constant"
    ),
    "eager_b2_nesterov": dict(co2_start_rule="eager", co2_gap_penalty=0.0, co2_nesterov=True),
    # eager with the worker's own outer gradient weighted by gamma and the anchor's last move by
    # 1 - gamma (co2_eager_weight; 0.2 = 1/(G+1), the variance-minimising weight for 4 workers)
    "eager_b0_w02": dict(co2_start_rule="eager", co2_outer_momentum=0.0, co2_gap_penalty=0.0, co2_eager_weight=0.2),
    "eager_b0_w05": dict(co2_start_rule="eager", co2_outer_momentum=0.0, co2_gap_penalty=0.0, co2_eager_weight=0.5),
    "eager_b0_w0": dict(co2_start_rule="eager", co2_outer_momentum=0.0, co2_gap_penalty=0.0, co2_eager_weight=0.0),
    "look_b5": dict(co2_start_rule="lookahead", co2_outer_momentum=0.5, co2_gap_penalty=0.0),
    "look_b2": dict(co2_start_rule="lookahead", co2_outer_momentum=0.2, co2_gap_penalty=0.0),
    "look_b5_pen": dict(co2_start_rule="lookahead", co2_outer_momentum=0.5),
    "win2_look_b5": dict(co2_start_rule="lookahead", co2_outer_momentum=0.5, co2_gap_penalty=0.0, co2_overlap_steps=2),
    "eager_b5": dict(co2_start_rule="eager", co2_outer_momentum=0.5, co2_gap_penalty=0.0),
    "eager_clip": dict(co2_start_rule="eager", co2_gap_penalty=0.0, co2_clip_threshold=0.5),
    "eager_lr08": dict(co2_start_rule="eager", co2_gap_penalty=0.0, co2_outer_lr=0.8),
    "eager_nesterov": dict(
        co2_start_rule="eager", co2_gap_penalty=0.0, co2_nesterov=True, co2_outer_lr=0.7, co2_outer_momentum=0.9
    ),
    # partial overlap window (co2_overlap_steps = k): SlowMo's anchor recursion, k steps late
    "win1": dict(co2_overlap_steps=1, co2_outer_momentum=0.5),
    "win2": dict(co2_overlap_steps=2, co2_outer_momentum=0.5),
    "win3": dict(co2_overlap_steps=3, co2_outer_momentum=0.5),
    "win6": dict(co2_overlap_steps=6, co2_outer_momentum=0.5),
    "win2_eager": dict(co2_overlap_steps=2, co2_outer_momentum=0.5, co2_start_rule="eager"),
    "win1_eager_b0": dict(co2_overlap_steps=1, co2_outer_momentum=0.0, co2_start_rule="eager"),
    "win2_eager_b0": dict(co2_overlap_steps=2, co2_outer_momentum=0.0, co2_start_rule="eager"),
    "win3_eager_b0": dict(co2_overlap_steps=3, co2_outer_momentum=0.0, co2_start_rule="eager"),
    "win6_eager_b0": dict(co2_overlap_steps=6, co2_outer_momentum=0.0, co2_start_rule="eager"),
    "win2_eager_b2": dict(co2_overlap_steps=2, co2_outer_momentum=0.2, co2_start_rule="eager"),
    "win3_eager": dict(co2_overlap_steps=3, co2_outer_momentum=0.5, co2_start_rule="eager"),
    "win6_eager": dict(co2_overlap_steps=6, co2_outer_momentum=0.5, co2_start_rule="eager"),
}
# streaming fragments (co2_fragments = F, each applied tau/F steps after its launch): f{F}_{rule}_b{beta}
_RULES = {"eager": "eager", "look": "lookahead", "anchor": "anchor"}
CONFIGS.update(
    {
        f"f{F}_{rule}_b{beta_name}": dict(
            co2_fragments=F, co2_start_rule=_RULES[rule], co2_outer_momentum=beta, co2_gap_penalty=0.0
        )
        for F in (2, 3, 4, 6, 12)
        for rule in _RULES
        for beta_name, beta in (("0", 0.0), ("2", 0.2), ("3", 0.3), ("5", 0.5))
    }
)
CONFIGS = {name: None if knobs is None else {**SPEC_DEFAULTS, **knobs} for name, knobs in CONFIGS.items()}
CONFIGS["co2"] = {}
# CO2Config() with another wire: bf16, and block-quantized codes with error feedback (core/codecs/quant.py),
# rounded to the nearest code or stochastically ("_sr"), in blocks of 128 values or of b{block}
CONFIGS.update(
    {
        "co2_bf16": dict(co2_comm_dtype="bfloat16"),
        "co2_int8": dict(co2_comm_dtype="int8"),
        "co2_int8_sr": dict(co2_comm_dtype="int8", co2_quant_rounding="stochastic"),
        "co2_int8_b32": dict(co2_comm_dtype="int8", co2_quant_block=32),
        "co2_int4": dict(co2_comm_dtype="int4"),
        "co2_int4_sr": dict(co2_comm_dtype="int4", co2_quant_rounding="stochastic"),
        "co2_int4_b32": dict(co2_comm_dtype="int4", co2_quant_block=32),
    }
)
# CO2Config() with the sparse wire (core/codecs/sparse.py) in blocks of 256, co2_sparse_k{kept per block}_b{bits}:
# "_keep" is co2_sparse_keep_unsent=True (each worker's model keeps its unsent progress); the names
# without it are the plain error feedback (False, the default).
# Suffixes: "_m0" without outer momentum (SparseLoCo's choice), "_anchor" with every round starting at
# the anchor (the lookahead start predicts the anchor's move from the worker's own dense outer
# gradient, which the sparse average does not follow), "_d{d}" with a fading error-feedback residual
# (co2_sparse_feedback_decay = d/100; SparseLoCo pairs 0.95 with no outer momentum).
_SPARSE_SUFFIXES = {
    "": {},
    "_m0": dict(co2_outer_momentum=0.0),
    "_anchor": dict(co2_start_rule="anchor"),
    "_anchor_m0": dict(co2_start_rule="anchor", co2_outer_momentum=0.0),
    **{
        f"_d{d}{m0}": dict(co2_sparse_feedback_decay=d / 100, **momentum)
        for d in (80, 90, 95)
        for m0, momentum in (("", {}), ("_m0", dict(co2_outer_momentum=0.0)))
    },
}
CONFIGS.update(
    {
        f"co2_sparse_k{keep}_b{bits}{held_name}{suffix}": dict(
            co2_comm_dtype="sparse",
            co2_quant_block=256,
            co2_sparse_density=keep / 256,
            co2_sparse_bits=bits,
            co2_sparse_keep_unsent=held,
            **knobs,
        )
        for keep in (2, 3, 4, 8)
        for bits in (2, 4)
        for held_name, held in (("", False), ("_keep", True))
        for suffix, knobs in _SPARSE_SUFFIXES.items()
    }
)

# the sparse wire's own defaults (blocks of 128, 2 values kept, 2 bits, plain error feedback), and
# with the unsent progress kept
CONFIGS["co2_sparse"] = dict(co2_comm_dtype="sparse")
CONFIGS["co2_sparse_keep"] = dict(co2_comm_dtype="sparse", co2_sparse_keep_unsent=True)

# CO2Config() with another outer step, for the worker-count study: the outer learning rate raised
# (the average of more workers is less noisy, so it can be trusted further), more outer momentum, and
# DiLoCo's Nesterov outer step, each with the library's streaming fragments and lookahead start
CONFIGS.update(
    {
        "co2_olr15": dict(co2_outer_lr=1.5),
        "co2_olr2": dict(co2_outer_lr=2.0),
        "co2_m5": dict(co2_outer_momentum=0.5),
        "co2_nesterov09": dict(co2_nesterov=True, co2_outer_lr=0.7, co2_outer_momentum=0.9),
    }
)

# data parallel with its AdamW learning rate raised for its global batch (workers x 8 blocks), so that
# the baseline is tuned as well as the methods it is compared with; a config not named here uses 1e-3
LEARNING_RATES = {"dp_lr2e-3": 2e-3, "dp_lr3e-3": 3e-3, "dp_lr4e-3": 4e-3}
CONFIGS.update({name: None for name in LEARNING_RATES})
# screening probes (scripts/sim.py, average_inner_state): the inner AdamW's moments averaged over the
# workers every tau steps, for free (an upper bound of what sending them would give), and data
# parallel for the first co2_sync_warmup_steps (post-local SGD's warm-up)
# ("_gv": AdamW's second moment replaced by the averaged gradient's, estimated from the moments)
INNER_STATE = {
    "co2_avg_m": ("exp_avg",),
    "co2_avg_mv": ("exp_avg", "exp_avg_sq"),
    "local_sgd_avg_m": ("exp_avg",),
    "co2_avg_gv": ("global_exp_avg_sq",),
    "local_sgd_avg_gv": ("global_exp_avg_sq",),
}
CONFIGS.update({name: CONFIGS[name.rsplit("_avg_", 1)[0]] for name in INNER_STATE})
CONFIGS.update({f"co2_sync{n}": dict(co2_sync_warmup_steps=n) for n in (30, 60, 120)})
# the engine's setting that the "_gv" probe screened: co2_global_second_moment_every = K rounds
# ({config}_gm{K}; the exchange travels through the simulated network, one round late, as on a wire)
CONFIGS.update({f"co2_gm{k}": dict(co2_global_second_moment_every=k) for k in (1, 2, 4, 8)})
CONFIGS.update({f"co2_bf16_gm{k}": dict(co2_comm_dtype="bfloat16", co2_global_second_moment_every=k) for k in (1, 4)})
CONFIGS.update({f"local_sgd_gm{k}": {**CONFIGS["local_sgd"], "co2_global_second_moment_every": k} for k in (1, 4)})

# Every configuration above ran before co2_global_second_moment_every = 4 was the default (co2_gm4 is
# the defaults now): the others pin it off, so that they reproduce their runs in results/
CONFIGS = {
    name: knobs if knobs is None else {"co2_global_second_moment_every": 0, **knobs} for name, knobs in CONFIGS.items()
}

# ... and the local methods at the same raised learning rates, so that a gain of data parallel from
# its lr is not mistaken for a gain from its batch: {config}_lr{lr}
for _base in ("co2", "local_sgd", "co2_default", "co2_sync60", "co2_gm1", "co2_gm4"):
    for _lr in ("2e-3", "3e-3", "4e-3"):
        CONFIGS[f"{_base}_lr{_lr}"] = CONFIGS[_base]
        LEARNING_RATES[f"{_base}_lr{_lr}"] = float(_lr)


def corpus_blocks() -> tuple[torch.Tensor, torch.Tensor]:
    """Train and held-out token blocks of the recipe's corpus, cached after the first call."""
    path = CACHE / f"shakespeare_blocks{BLOCK}.pt"
    if path.exists():
        return torch.load(path)
    from pretrain_gpt import shakespeare_plays, train_bpe

    train_text, val_text = shakespeare_plays()
    tokenizer = train_bpe(train_text, 4096)

    def blocks(texts):
        ids = [i for t in texts for i in tokenizer(t + tokenizer.eos_token)["input_ids"]]
        n = len(ids) // BLOCK * BLOCK
        return torch.tensor(ids[:n]).view(-1, BLOCK)

    data = (blocks(train_text), blocks(val_text)[:EVAL_BLOCKS])
    CACHE.mkdir(parents=True, exist_ok=True)
    torch.save(data, path)
    return data


def gpt2_config(model: str):
    """The GPT-2 shape ``model`` ("micro", "tiny") over the corpus's 4096-token BPE, without dropout."""
    from transformers import GPT2Config

    n_embd, n_layer, n_head = MODELS[model]
    return GPT2Config(
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        n_positions=BLOCK,
        vocab_size=4096,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )


def draw_batch(train: torch.Tensor, seed: int, worker: int, step: int) -> torch.Tensor:
    """Worker ``worker``'s micro-batch at ``step``: the same blocks for every method that draws it."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + worker * 100_003 + step)
    return train[torch.randint(0, len(train), (MICRO_BATCH,), generator=g)]


def make_task(model: str, steps: int, seed: int, lr: float = 1e-3):
    from transformers import GPT2LMHeadModel, get_cosine_schedule_with_warmup
    from transformers.utils import logging

    from scripts.sim import Task

    logging.set_verbosity_error()
    train, val = corpus_blocks()
    config = gpt2_config(model)

    def build_model(worker_seed):
        torch.manual_seed(seed * 7919 + worker_seed)
        return GPT2LMHeadModel(config)

    def batch(worker, step):
        return draw_batch(train, seed, worker, step)

    def loss(model, tokens):
        return model(input_ids=tokens, labels=tokens).loss

    @torch.no_grad()
    def evaluate(model, params):
        was_training = model.training
        model.eval()
        if params is None:
            out = model(input_ids=val, labels=val)
        else:
            out = torch.func.functional_call(model, params, (), {"input_ids": val, "labels": val})
        model.train(was_training)
        return float(out.loss)

    return Task(
        build_model=build_model,
        build_optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.1),
        build_scheduler=lambda o: get_cosine_schedule_with_warmup(o, max(1, steps // 20), steps),
        batch=batch,
        loss=loss,
        evaluate=evaluate,
    )


def run_one(job: dict) -> dict:
    torch.set_num_threads(1)
    from co2_hf import CO2Config
    from scripts.sim import train_simulated

    overrides = CONFIGS[job["config"]]
    config = None if overrides is None else CO2Config(**{"co2_local_steps": job["tau"], **overrides})
    task = make_task(job["model"], job["steps"], job["seed"], job.get("lr", 1e-3))  # bytes_frontier.py sends no lr
    result = train_simulated(
        workers=job["workers"],
        config=config,
        task=task,
        steps=job["steps"],
        seed=0,
        eval_every=job["eval_every"],
        average_inner_state=INNER_STATE.get(job["config"], ()),
    )
    line = {
        **job,
        "final_val_loss": result.final,
        "seconds": round(result.seconds, 1),
        "history": result.history,
        "settings": overrides,
    }
    if not math.isfinite(result.final):
        line["diverged"] = True
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["dp", "slowmo", "co2_default"])
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--tau", type=int, default=12)
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[4], help="one sweep per worker count, in this order"
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--eval_every", type=int, default=50)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--out", type=Path, required=False)
    args = parser.parse_args()
    if args.list:
        for name, overrides in CONFIGS.items():
            print(f"{name:16s} {overrides}")
        return
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown configs {unknown}; see --list")
    corpus_blocks()  # build the cache once, before the workers start
    jobs = [
        dict(
            config=c,
            seed=s,
            steps=args.steps,
            tau=args.tau,
            workers=w,
            model=args.model,
            eval_every=args.eval_every,
            lr=LEARNING_RATES.get(c, 1e-3),
        )
        for w in args.workers
        for s in args.seeds
        for c in args.configs
    ]
    with mp.get_context("spawn").Pool(args.jobs) as pool:
        for line in pool.imap(run_one, jobs):
            text = json.dumps(line)
            summary = {
                k: line[k] for k in ("config", "workers", "seed", "steps", "tau", "model", "final_val_loss", "seconds")
            }
            print(json.dumps(summary), flush=True)
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                with open(args.out, "a") as f:
                    f.write(text + "\n")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
