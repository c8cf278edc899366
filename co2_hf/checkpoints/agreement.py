"""Every rank the same answer: a checkpoint refused everywhere when one rank refuses it, and resumed
from one step and, per disk, one manifest.

Collective, over the default process group (a no-op in a world of one). A rank that refused a
checkpoint alone would leave the others to train into their first collective and stop only at the
timeout, with an error that says nothing of the file.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from .manifest import MANIFEST_FILE

T = TypeVar("T")


def agree(check: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``check(*args, **kwargs)`` on every rank; when it raises on any rank, raise ``ValueError`` on
    every rank, at once.

    Collective. A rank that refused a checkpoint alone would leave the others to train into their
    first collective and stop only at the timeout, with an error that says nothing of the file. Any
    exception counts (a file that cannot be read is as final as one that does not verify)."""
    try:
        result, error = check(*args, **kwargs), None
    except ValueError as refused:
        result, error = None, str(refused)
    except Exception as failed:  # noqa: BLE001 - reported on every rank, with its type
        result, error = None, f"{type(failed).__name__}: {failed}"
    errors = [(r, e) for r, e in enumerate(all_gather(error)) if e is not None]
    if error is not None:
        raise ValueError(error)
    if errors:
        r, other = errors[0]
        raise ValueError(f"rank {r} refused the checkpoint: {other}")
    return result


def agree_on_checkpoint(directory: str, *, step: int | None, digest: str, leader: int) -> None:
    """Every rank resumes from the same step, and the ranks of one leader (one disk) from the same
    manifest; else ``ValueError`` on every rank. Per-node disks can hold different checkpoints under
    one name. Collective."""
    seen = all_gather((step, digest, leader))
    steps = {s for s, _, _ in seen}
    if len(steps) > 1:
        where = ", ".join(f"rank {r}: step {s}" for r, (s, _, _) in enumerate(seen))
        raise ValueError(
            f"the ranks would resume {directory} from different steps ({where}): each disk holds another checkpoint"
        )
    for r, (_, other, lead) in enumerate(seen):
        if lead == leader and other != digest:
            raise ValueError(
                f"the ranks would resume {directory} from different checkpoints: rank {r}'s {MANIFEST_FILE} "
                "differs from this rank's, although they share a disk"
            )


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_gather(obj: Any) -> list[Any]:
    if not _distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
