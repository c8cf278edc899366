"""A custom Accelerate training loop with CO2, readable top to bottom.

    accelerate launch --config_file recipes/accelerate_configs/cpu_2proc.yaml recipes/accelerate_loop.py
    accelerate launch --config_file recipes/accelerate_configs/multi_gpu_1node.yaml recipes/accelerate_loop.py

A small GPT-2 (built from a config) learns sequences from a fixed random Markov chain; each process
reads its own stream. Every ``--co2_*`` flag is accepted; ``--co2_enabled false`` runs the same
loop as plain data parallel (CO2Accelerate is then a pass-through), the baseline. The final model
(the anchor) is saved with ``co2.save_pretrained``: weights, ``co2_config.json`` and a model card.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser

from co2_hf import CO2Accelerate, CO2Config


@dataclass
class LoopArgs:
    max_steps: int = field(default=120, metadata={"help": "optimizer steps"})
    batch_size: int = field(default=8, metadata={"help": "sequences per step and process"})
    seq_len: int = field(default=32, metadata={"help": "tokens per sequence"})
    lr: float = field(default=3e-3, metadata={"help": "AdamW learning rate"})
    log_every: int = field(default=24, metadata={"help": "print the loss and CO2's metrics every N steps"})
    output_dir: str = field(default="outputs/accelerate_loop", metadata={"help": "where the model goes"})


def markov_batch(vocab: int, batch: int, seq: int, *, stream: int, step: int) -> torch.Tensor:
    probs = torch.softmax(torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(7)) * 3, -1)
    g = torch.Generator().manual_seed(stream * 1_000_003 + step)
    tokens = torch.empty(batch, seq, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
    for i in range(1, seq):
        tokens[:, i] = torch.multinomial(probs[tokens[:, i - 1]], 1, generator=g).squeeze(1)
    return tokens


def main() -> None:
    args, cfg = HfArgumentParser((LoopArgs, CO2Config)).parse_args_into_dataclasses()
    accelerator = Accelerator(cpu=not torch.accelerator.is_available())
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=64, n_positions=args.seq_len, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0
        )
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.print(
        f"{accelerator.num_processes} processes, tau={cfg.co2_local_steps}, overlap={cfg.co2_overlap}, "
        f"co2_enabled={cfg.co2_enabled}"
    )

    with CO2Accelerate(accelerator, model, optimizer, config=cfg) as co2:
        for step in range(args.max_steps):
            tokens = markov_batch(64, args.batch_size, args.seq_len, stream=accelerator.process_index, step=step)
            tokens = tokens.to(accelerator.device)
            loss = model(input_ids=tokens, labels=tokens).loss
            accelerator.backward(loss)
            co2.average_gradients()  # inside a worker of co2_worker_size > 1; a no-op otherwise
            optimizer.step()
            optimizer.zero_grad()
            co2.step()  # a round boundary every tau steps; nothing when CO2 is off
            if (step + 1) % args.log_every == 0:
                stats = " ".join(f"{k[4:]}={v:.3g}" for k, v in co2.pop_metrics().items())
                accelerator.print(f"step {step + 1}: loss {loss.item():.3f} | {stats}")
    # leaving the block finalized CO2: every process now holds the final anchor
    co2.save_pretrained(args.output_dir, dataset="a random Markov chain (recipes/accelerate_loop.py)")
    accelerator.print(f"final loss {loss.item():.3f}; model saved to {args.output_dir}")
    accelerator.wait_for_everyone()
    accelerator.end_training()  # destroy the process groups on every rank before interpreter exit


if __name__ == "__main__":
    main()
