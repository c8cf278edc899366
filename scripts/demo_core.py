"""Two CPU processes train a small causal language model with the CO2 engine (pure torch).

    torchrun --nproc_per_node 2 scripts/demo_core.py [--steps 240] [--co2_local_steps 12] ...

Every ``--co2_*`` flag of `CO2Config` is accepted. The demo defaults to ``--co2_start_rule eager``,
which is stable at this small scale; the spec's ``anchor`` rule (the library default) double-counts
progress here and diverges without tuning (docs/algorithm.md, section 7). Each worker sees its own
stream of sequences from one fixed random Markov chain (so there is something to learn); every other
round, rank 0 prints the training loss, the held-out loss of the shared anchor and CO2's statistics.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from co2_hf import CO2, CO2Config


@dataclass
class DemoArgs:
    steps: int = field(default=240, metadata={"help": "inner optimizer steps"})
    vocab: int = field(default=64, metadata={"help": "vocabulary size of the synthetic language"})
    seq_len: int = field(default=32, metadata={"help": "tokens per sequence"})
    batch_size: int = field(default=16, metadata={"help": "sequences per step and worker"})
    lr: float = field(default=3e-3, metadata={"help": "AdamW learning rate (inner optimizer)"})


class TinyLM(nn.Module):
    def __init__(self, vocab: int, seq_len: int, dim: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq_len, dim))
        layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq_len), False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens) + self.pos[: tokens.shape[1]]
        n = tokens.shape[1]
        return self.head(self.blocks(h, mask=self.mask[:n, :n], is_causal=True))


def markov_batch(args: DemoArgs, stream: int, step: int) -> torch.Tensor:
    """Sequences from one sparse random Markov chain (same chain for everyone, own samples)."""
    chain = torch.Generator().manual_seed(1234)
    logits = torch.randn(args.vocab, args.vocab, generator=chain) * 3.0
    probs = torch.softmax(logits, dim=-1)
    g = torch.Generator().manual_seed(stream * 1_000_003 + step)
    tokens = torch.empty(args.batch_size, args.seq_len, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, args.vocab, (args.batch_size,), generator=g)
    for i in range(1, args.seq_len):
        tokens[:, i] = torch.multinomial(probs[tokens[:, i - 1]], 1, generator=g).squeeze(1)
    return tokens


def lm_loss(model: nn.Module, tokens: torch.Tensor, params=None) -> torch.Tensor:
    logits = model(tokens) if params is None else torch.func.functional_call(model, params, (tokens,))
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def main() -> None:
    from transformers import HfArgumentParser  # only the demo's flag parsing needs it

    parser = HfArgumentParser((DemoArgs, CO2Config))
    parser.set_defaults(co2_start_rule="eager")
    args, cfg = parser.parse_args_into_dataclasses()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg.check_world(world)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    torch.manual_seed(rank)  # different initialisations: CO2's start-up broadcast aligns them
    model = TinyLM(args.vocab, args.seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    co2 = CO2(model, cfg, optimizer=optimizer)
    held_out = markov_batch(args, stream=10_000, step=0)
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(
            f"{world} workers, {n / 1e6:.2f}M parameters, tau={cfg.co2_local_steps}, "
            f"overlap={cfg.co2_overlap}, outer state {co2.outer_state_nbytes() / 1e6:.1f} MB/process"
        )
    start = time.perf_counter()
    for step in range(args.steps):
        optimizer.zero_grad()
        loss = lm_loss(model, markov_batch(args, stream=rank, step=step))
        loss.backward()
        co2.average_gradients()
        optimizer.step()
        if co2.step() and rank == 0 and co2.round % 2 == 0:
            with torch.no_grad():
                anchor_loss = lm_loss(model, held_out, co2.anchor_state()).item()
            stats = " ".join(f"{k[4:]}={v:.3g}" for k, v in co2.pop_metrics().items())
            print(
                f"step {step + 1:4d} | train loss {loss.item():.3f} | anchor held-out loss "
                f"{anchor_loss:.3f} | {stats}",
                flush=True,
            )
    co2.finalize()
    if rank == 0:
        with torch.no_grad():
            final = lm_loss(model, held_out).item()
        print(
            f"done in {time.perf_counter() - start:.0f}s: final held-out loss {final:.3f} "
            f"(uniform guess: {math.log(args.vocab):.3f})"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
