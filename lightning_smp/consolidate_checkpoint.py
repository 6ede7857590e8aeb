"""``python -m lightning_smp.consolidate_checkpoint SRC [--output_file DST]``: one plain file from a sharded checkpoint.

The same shape as Lightning's ``python -m lightning.pytorch.utilities.consolidate_checkpoint``; the work is
`lightning_smp.checkpoint.consolidate_checkpoint`, which ``lightning_smp.consolidate_checkpoint(src, dst)`` calls too.
"""

from __future__ import annotations

import argparse
import sys
import types
from collections.abc import Sequence

from lightning_smp.checkpoint import CheckpointError, consolidate_checkpoint

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Convert a sharded lightning_smp checkpoint (a directory) into one file whose `state_dict` "
        "loads with `load_state_dict(strict=True)` into the un-parallelized LightningModule (fp32, global names)."
    )
    parser.add_argument("checkpoint_folder", help="the sharded checkpoint directory, e.g. epoch=3-step=800.ckpt")
    parser.add_argument(
        "--output_file", default=None, help="where to write the file; default: <checkpoint_folder>.consolidated"
    )
    args = parser.parse_args(argv)
    try:
        target = consolidate_checkpoint(args.checkpoint_folder, args.output_file)
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"Consolidated {args.checkpoint_folder} into {target}")
    return 0


class _CallableModule(types.ModuleType):
    """``import lightning_smp.consolidate_checkpoint`` rebinds that package attribute from the function to this
    module; calling the module keeps ``lightning_smp.consolidate_checkpoint(src, dst)`` working either way."""

    def __call__(self, src: str, dst: str | None = None) -> object:
        return consolidate_checkpoint(src, dst)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
