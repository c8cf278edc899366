"""G simulated workers (``co2_hf.testing.SimulatedNetwork``) on the tiny task of tests/workers.py,
trained step by step in one process, which can be saved and rebuilt mid-run (tests/test_fragments.py,
tests/test_quant.py): a test module imports it from here, never from another test module.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from workers import TinyNet, loss_on, make_optimizer

from co2_hf import CO2Config
from co2_hf.core import CO2
from co2_hf.testing import SimulatedNetwork


class Workers:
    """G simulated workers trained step by step, which can be saved and rebuilt mid-run."""

    def __init__(self, config: CO2Config, workers: int = 3, saved: list[dict] | None = None, **engine: Any) -> None:
        """``engine``: further keyword arguments of every `CO2` (e.g. ``stage_state``)."""
        self.config, self.network = config, SimulatedNetwork(workers)
        self.models = [TinyNet(seed=i) for i in range(workers)]
        self.optimizers = [make_optimizer(m) for m in self.models]
        self.pool = ThreadPoolExecutor(workers)
        self.engines = self._each(
            lambda i: CO2(
                self.models[i],
                config,
                optimizer=self.optimizers[i],
                communicator=self.network.communicator(i),
                **engine,
            )
        )
        for i, state in enumerate(saved or []):
            self.models[i].load_state_dict(state["model"])
            self.optimizers[i].load_state_dict(state["optimizer"])
            self.engines[i].load_state_dict(state["co2"])

    def _each(self, fn):
        return list(self.pool.map(fn, range(len(self.models))))

    def train(self, start: int, stop: int, poison: tuple[int, int] | None = None) -> None:
        """Steps ``start .. stop - 1``; ``poison = (worker, step)`` puts a NaN in that worker's
        weights after that step's optimizer step."""
        for step in range(start, stop):
            for i, (model, optimizer) in enumerate(zip(self.models, self.optimizers)):
                optimizer.zero_grad()
                loss_on(model, i, step).backward()
                optimizer.step()
                if poison == (i, step):
                    with torch.no_grad():
                        model.hidden.weight[0, 0] = float("nan")
            self._each(lambda i: self.engines[i].step())

    def save(self) -> list[dict]:
        """Every worker's state, cloned (state_dict tensors are references)."""
        states = self._each(lambda i: self.engines[i].state_dict())  # waits for the fragment in flight
        return [
            {
                "model": {k: v.clone() for k, v in m.state_dict().items()},
                "optimizer": clone(o.state_dict()),
                "co2": clone(s),
            }
            for m, o, s in zip(self.models, self.optimizers, states)
        ]

    def finish(self) -> list[dict[str, torch.Tensor]]:
        self._each(lambda i: self.engines[i].finalize())
        return [{k: v.clone() for k, v in m.state_dict().items()} for m in self.models]


def clone(obj):
    """A deep copy of nested dicts and lists whose tensors are cloned."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clone(v) for v in obj]
    return obj
