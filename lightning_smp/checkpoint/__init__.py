"""Sharded checkpoints: every rank writes what it holds under global names; loading reshards; consolidation.

Owns the on-disk format, publishing a checkpoint atomically, verifying it before use, and the mapping between
what a rank holds (fp32 master weights, tensor-parallel shards, optimizer state keyed by parameter position) and
global parameter names. Not owned: when Lightning saves or loads (the strategy's hooks), the masters themselves
(`optimizer.py`), which piece of a parameter a rank holds (`placement.py`, whose `placement_of` we read).
Built on torch.distributed.checkpoint (DCP): it writes one file per rank, keeps one copy of each replicated tensor,
records every tensor's global shape and chunks, and reads any chunk layout into any other, which is resharding.
We add the name mapping, tensor-parallel pieces as chunks of the global tensor (any ``TPShard``, packed blocks
included, without DTensor), a temporary directory renamed into place, per-file checksums, and errors that name
the file, the rank and the parameter.

One module per concern: `names` (global names, masters, optimizer state by name), `storage` (staging, atomic
publish, fsync, removal), `verification` (the meta record, CRC-32s, `CheckpointError`), `dcp_adapter` (shards as
chunks, the planners, the writer that reports progress), `saving` and `loading` (the order of a save and of a
load), `asynchronous` (a save written on a background thread), `consolidation` and `export` (one file, or a
Hugging Face directory, in one process), `whole_tensors` (reading a tensor whole from every rank's chunks),
`torch_file` and `safetensors_file` (writing those formats one tensor at a time), `hugging_face` (the wrapped
transformers model a save records), `tags` (smp's tagged checkpoints) and `rng` (the random generators).

A checkpoint is a directory (Lightning's sharded-checkpoint convention: ``meta.pt`` marks it)::

    epoch=1-step=8.ckpt/
      meta.pt               torch.save, rank 0: Lightning's loops, callbacks, LR schedulers, hyper-parameters,
                            optimizer hyper-parameters and loss scaler, and the "lightning_smp" record (format,
                            package version, layout, precision, smp config, size and CRC-32 of every shard file,
                            the class and configs of each Hugging Face model the module wraps)
      .metadata             DCP: every entry's global shape, dtype and where each of its chunks lies
      __<rank>_<n>.distcp   DCP: the entries rank <rank> wrote

Entries: ``model/<name>`` (the module's ``state_dict`` under global names, parameters in fp32: the master
weights of an fp16/bf16 run), ``optim/<i>/state/<name>/<key>`` (optimizer ``i``'s state by parameter name, shaped
like the parameter; a ZeRO-1 replica writes its flat share of a master or a state as chunks, gathering nothing,
and it loads at any data-parallel degree) and
``rng/<rank>`` (each rank's random generators).
"""

from lightning_smp.checkpoint.asynchronous import forget_process_group as forget_save_group
from lightning_smp.checkpoint.asynchronous import wait as wait_for_saves
from lightning_smp.checkpoint.consolidation import consolidate_checkpoint, consolidated_state_dict
from lightning_smp.checkpoint.export import export_hf
from lightning_smp.checkpoint.loading import load
from lightning_smp.checkpoint.names import model_state_dict, optimizer_state_dict
from lightning_smp.checkpoint.saving import save
from lightning_smp.checkpoint.storage import remove
from lightning_smp.checkpoint.tags import record_newest, tagged_path
from lightning_smp.checkpoint.verification import (
    FORMAT_VERSION,
    META_FILENAME,
    CheckpointError,
    describe_run,
    is_sharded_checkpoint,
    resolve,
)

__all__ = [
    "FORMAT_VERSION",
    "META_FILENAME",
    "CheckpointError",
    "consolidate_checkpoint",
    "consolidated_state_dict",
    "describe_run",
    "export_hf",
    "forget_save_group",
    "is_sharded_checkpoint",
    "load",
    "model_state_dict",
    "optimizer_state_dict",
    "record_newest",
    "remove",
    "resolve",
    "save",
    "tagged_path",
    "wait_for_saves",
]
