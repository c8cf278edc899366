"""How much memory CO2's outer state takes per process, against the paper form's 12 bytes per parameter / k.

    python scripts/outer_memory.py [--width 2048] [--depth 4] [--rounds 2]

Four CPU processes over gloo as two workers of two (``co2_worker_size=2``, so each process holds
1/k = 1/2 of the outer state), tau 12, an MLP of ``depth`` square layers. For each setting, one
JSON line with, per process (max over the four; the median of ``--repeats`` runs):

- ``outer_state_nbytes``: what `CO2.outer_state_nbytes()` counts (anchor, momentum, buffers, the
  start rule's offset, a quantizer's residuals), and its ratio to ``12 P / k``;
- the process's resident memory, against its resident memory just before CO2 was built, as ratios
  to ``12 P / k``: ``resident_increase_ratio`` after the first round (what stays: the outer state,
  CO2's process groups, the allocator's slack), ``first_round_peak_ratio`` (the peak over
  construction and the first round) and ``steady_round_peak_ratio`` (the peak over the ``--rounds``
  rounds after it; Linux resets the peak through ``/proc/self/clear_refs`` in between). The peaks
  include a boundary's transient scratch (one chunk) and, inside a worker of two, the flat fp32 copy
  of the gradients that ``average_gradients`` sums at every step (4 P bytes: 0.67 here).

Settings: ``paper`` (one fragment, the anchor start: anchor, momentum and one buffer), ``default``
(``CO2Config()``: streaming fragments, F = tau, the lookahead start) and ``default_int8``.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from torch import nn

SETTINGS = {
    "paper": dict(co2_fragments=1, co2_start_rule="anchor"),
    "default": dict(),
    "default_int8": dict(co2_comm_dtype="int8"),
}
WORKER_SIZE, TAU = 2, 12


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size


def measure(rank: int, world: int, name: str, width: int, depth: int, rounds: int) -> dict:
    """One setting in fresh processes (memory freed by an earlier one would hide this one's peak)."""
    from co2_hf import CO2, CO2Config

    torch.set_num_threads(1)
    knobs = SETTINGS[name]
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = torch.randn(8, width, generator=torch.Generator().manual_seed(rank))

    def step(co2=None) -> None:
        optimizer.zero_grad()
        model(batch).square().mean().backward()
        if co2 is not None:
            co2.average_gradients()  # inside the worker
        optimizer.step()
        if co2 is not None:
            co2.step()

    step()  # gradients exist before the baseline is read
    before = _status_kib("VmRSS") * 1024
    _reset_peak()
    co2 = CO2(model, CO2Config(co2_local_steps=TAU, co2_worker_size=WORKER_SIZE, **knobs), optimizer=optimizer)
    for _ in range(TAU):  # the first round: every buffer and scratch is made
        step(co2)
    resident, first_peak = _status_kib("VmRSS") * 1024, _status_kib("VmHWM") * 1024
    _reset_peak()
    for _ in range(rounds * TAU):  # steady rounds: nothing new should stay
        step(co2)
    steady_peak = _status_kib("VmHWM") * 1024
    params = sum(p.numel() for p in model.parameters())
    paper = 12 * params / WORKER_SIZE
    return {
        "setting": name,
        "params": params,
        "fragments": len(co2.fragments),
        "paper_form_bytes": paper,
        "outer_state_nbytes": co2.outer_state_nbytes(),
        "outer_state_ratio": round(co2.outer_state_nbytes() / paper, 4),
        "resident_increase_ratio": round((resident - before) / paper, 4),
        "first_round_peak_ratio": round((first_peak - before) / paper, 4),
        "steady_round_peak_ratio": round((steady_peak - before) / paper, 4),
    }


def main() -> None:
    from co2_hf.testing import run_processes

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per setting; the median is printed")
    args = parser.parse_args()
    for name in SETTINGS:
        repeats = []  # resident memory is noisy (the allocator, gloo's buffers): the median of repeats
        for _ in range(args.repeats):
            lines = run_processes(measure, 2 * WORKER_SIZE, name, args.width, args.depth, args.rounds, timeout_s=900)
            repeats.append({key: max(line[key] for line in lines) for key in lines[0] if key.endswith("_ratio")})
        line = dict(lines[0], repeats=args.repeats)
        for key in repeats[0]:
            line[key] = statistics.median(r[key] for r in repeats)
            line[key + "_runs"] = [r[key] for r in repeats]
        print(json.dumps(line))


if __name__ == "__main__":
    main()
