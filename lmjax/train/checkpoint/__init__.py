"""Checkpoints of a run with orbax (docs/training.md).

A checkpoint is `RUN/checkpoints/<step>/` with two items: `state` (the `TrainState`: params,
optimizer state, step and PRNG key) and `meta` (JSON: the resolved run config, the step and the
data position). orbax writes a step into a temporary directory and renames it into place only
when every file is written, so a process killed mid-save leaves the previous checkpoints intact
and the half-written one is never listed. `keep` bounds how many stay on disk.

Restoring checks the checkpoint's model config against the expected one first (a checkpoint from
another architecture is a `CheckpointError` naming the differing fields) and then every array's
shape and dtype against the expected state. Every save records a checksum of each array in
`meta` (`digest`); a restore recomputes them, so a flipped byte that the storage format
would decode without complaint is an error, never a silently different model. A restored
`params` leaf that holds NaN or infinity is refused too (training never saves one).

Failures come in two kinds. `DamagedCheckpointError` (a `CheckpointError`): a step that is
missing files, truncated, unreadable, or whose arrays, step or checksums disagree with its own
metadata; `restore_complete` (used by `lmjax train --resume`) moves such a newest step aside
to `<step>.corrupt` and continues from the newest complete one. Anything else (another
architecture, another optimizer, non-finite parameters) is a plain `CheckpointError`: the file
is whole but not this run's, and nothing is moved. `remove_temporary` removes the
`<step>.orbax-checkpoint-tmp*` directories killed saves leave behind (the training loop calls
it once resumed), and a save that fails (a full disk, a read-only directory) removes its own
and raises `CheckpointError`.

A step saved before the blocks were stacked (`blocks: {"0": ..., "1": ...}` in the params
and in the optimizer states that mirror them) restores too: read per layer, checked against its
own checksums, stacked, with one line on stderr saying so; its files are left as they are.

`manager`: `Checkpoints` (save, restore, the resume search, temporary directories);
`integrity`: checksums, structure and model checks, `DamagedCheckpointError`; `layers`: the
per-layer steps stacked on load; `quiet`: orbax's noise around a failed read or write silenced.
"""

from lmjax.errors import CheckpointError
from lmjax.train.checkpoint.integrity import (
    DAMAGED_FIX,
    DamagedCheckpointError,
    check_same_model,
    digest,
)
from lmjax.train.checkpoint.layers import note_converted
from lmjax.train.checkpoint.manager import TMP_SUFFIX, Checkpoints

__all__ = [
    "DAMAGED_FIX",
    "TMP_SUFFIX",
    "CheckpointError",
    "Checkpoints",
    "DamagedCheckpointError",
    "check_same_model",
    "digest",
    "note_converted",
]
