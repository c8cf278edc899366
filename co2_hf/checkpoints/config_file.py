"""``co2_config.json``: the settings as they ran and the world that ran them, written beside every
saved model and checkpoint; a resume on another world (``elastic.py``) reads the world back."""

from __future__ import annotations

import json
import os

from ..config import CO2Config
from ..core.schedule import Plan
from . import bounded
from .manifest import is_count

CONFIG_FILE = "co2_config.json"
# the settings, the world and the resolved plan: about 2 KB; 64 KiB is ample for settings yet to come
MAX_CONFIG_BYTES = 64 << 10
CONFIG_NEEDS = "some 30 settings, the world and the plan take about 2 KB"


def write_co2_config(directory: str, config: CO2Config, *, plan: Plan, world_size: int) -> None:
    """``co2_config.json``: the settings as they ran (``co2_fragments`` the plan's F), the world, and
    the resolved ``plan`` under ``co2_plan``."""
    payload = {**plan.settings(config), "world_size": world_size, "co2_plan": plan.describe()}
    payload["num_workers"] = world_size // config.co2_worker_size
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        json.dump(payload, f, indent=2, sort_keys=True)


def saved_world(directory: str) -> tuple[int, int]:
    """(world size, ``co2_worker_size``) of the run that saved ``directory``, from its config file
    (verified with the folder first: `check_shared`)."""
    if not os.path.lexists(os.path.join(directory, CONFIG_FILE)):
        raise ValueError(
            f"checkpoint {directory} has no {CONFIG_FILE}, which records the world that saved it: it can "
            "only be resumed on the same world size"
        )
    saved = bounded.read_json(directory, CONFIG_FILE, max_bytes=MAX_CONFIG_BYTES, why=CONFIG_NEEDS)
    world, k = saved.get("world_size") if isinstance(saved, dict) else None, None
    if isinstance(saved, dict):
        k = saved.get("co2_worker_size")
    if not (is_count(world, 1) and is_count(k, 1) and world % k == 0):
        raise ValueError(
            f"checkpoint {directory}: its {CONFIG_FILE} does not record a world (world_size {world!r}, "
            f"co2_worker_size {k!r}: integers >= 1, the second dividing the first)"
        )
    return world, k
