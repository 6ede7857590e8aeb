"""Delayed (meta-device) initialisation whose values are bit-identical to an eager CPU build with the same seed.

Owns recording the aten ops that give a model built on the meta device its parameter and buffer values, and replaying
them per tensor when a rank materialises what it keeps (the strategy decides what: it passes the cuts). Recording
rather than ``to_empty()`` + ``reset_parameters()``, because only the ops the constructors ran (deep copies,
``post_init`` re-initialisation, the generator state each random op drew from) reproduce an eager build; each tensor
is rebuilt whole, cut and freed (Megatron's CPU initialisation), so the peak is what a rank keeps plus one tensor.

What a custom module needs to be materialisable
------------------------------------------------
Build it inside ``deferred_init()`` (the strategy does this for ``delayed_parameter_initialization=True`` and for
``configure_model`` / ``trainer.init_module(empty_init=True)``). Anything a constructor does with tensors is recorded
and replayed: ``nn.init.*``, in-place ops on parameters or on slices of them, buffers computed from ``torch.arange``
and arithmetic, ``copy.deepcopy``, ``torch.manual_seed``, generators passed to random ops, and real CPU tensors
(``torch.tensor([...])`` constants stay real) copied into parameters. These are not possible, because a deferred
tensor has no data until it is materialised:

- reading a value while building (``.item()``, ``.tolist()``, ``float(t)``, ``if t.any():``, ``torch.nonzero``,
  boolean-mask indexing): compute it from Python numbers instead, or build that module outside ``deferred_init()``
  and pass it in; the error names the op;
- changing parameters after ``deferred_init()`` has exited and before materialisation: such changes are not
  recorded, so do them inside the ``with`` block (or after materialisation). Views taken afterwards (slices,
  ``.t()``, ``nn.Parameter(view)``) stay deferred and materialise to the view of the value; copies do not;
- tensors made on the meta device by hand (``device="meta"``, inside or outside the block) or in an earlier block:
  they are not recorded, and materialising a parameter or buffer computed from one raises an error naming it (one
  that an op of the block writes whole, ``fill_``, ``normal_``, ``copy_``, is known from then on);
- ``orthogonal_``, ``dirac_`` and ``sparse_`` reached other than as ``torch.nn.init.<name>`` or through Hugging
  Face's ``transformers.initialization`` (a copy bound before the block, e.g. ``from torch.nn.init import
  orthogonal_``): torch skips meta tensors in them, so call them through ``torch.nn.init`` (``trunc_normal_`` is
  seen however it is reached).

Parameters, buffers and tensors a module keeps as plain attributes (directly or in a dict or list, as torchmetrics
keeps metric states) are materialised. Random values come from the default CPU generator (or the generator passed
to the op), exactly as an eager CPU build draws them, and the generator ends where the eager build leaves it. Inside
the block the default device still reads as the CPU (so Hugging Face's ``post_init`` initialises); factories without
``device=`` make meta tensors, while ``torch.tensor([...])`` constants and tensors made with an explicit real
``device=`` stay real and are left as they are.

Values from files
-----------------
A value can also come from outside the block's ops: ``deferred_from(source)`` is a deferred tensor whose value a
`Source` (a tensor of a checkpoint file, `lightning_smp.weights`) reads when it is materialised. When nothing but
copies and dtype casts were applied to it, the source reads only the part a rank keeps (a `Cut`), never the whole.
Hugging Face's ``from_pretrained`` inside the block loads this way (`huggingface`), and so does
`lightning_smp.load_weights`.
"""

from lightning_smp.delayed_init import huggingface as huggingface  # registers from_pretrained's deferred loading
from lightning_smp.delayed_init.recording import Source, deferred_from, deferred_init, is_deferred
from lightning_smp.delayed_init.replay import materialize, materialize_module

__all__ = ["Source", "deferred_from", "deferred_init", "is_deferred", "materialize", "materialize_module"]
