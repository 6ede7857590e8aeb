"""`lightning_smp.checkpoint.torch_file`: a ``torch.save`` file written one tensor at a time, and the private names
of torch it uses (`private_torch`), checked against the installed torch, so an upgrade that changes one fails here,
by name.
"""

import inspect
import zipfile

import torch

from lightning_smp.checkpoint import private_torch
from lightning_smp.checkpoint.torch_file import write_torch_file


def test_torch_rebuild_tensor_takes_a_dtype_and_is_allowed_in_weights_only_loads():
    assert list(inspect.signature(private_torch.REBUILD_TENSOR).parameters)[:7] == [
        "storage",
        "storage_offset",
        "size",
        "stride",
        "requires_grad",
        "backward_hooks",
        "dtype",
    ]
    assert private_torch.REBUILD_TENSOR in torch._weights_only_unpickler._get_allowed_globals().values()


def test_torch_zip_file_writer_writes_what_torch_load_reads_one_tensor_at_a_time(tmp_path):
    """Both entries together: a file of stand-ins filled one at a time loads as ``torch.save``'s would, memory-mapped
    too (each storage aligned), with valid zip CRC-32s, beside an ordinary tensor, a parameter and plain values."""
    stand_ins = {"w": torch.empty(3, 4, device="meta"), "b": torch.empty(5, dtype=torch.bfloat16, device="meta")}
    values = {"w": torch.arange(12.0).view(3, 4), "b": torch.arange(5).to(torch.bfloat16)}
    by_id = {id(t): values[name] for name, t in stand_ins.items()}
    obj = {"state_dict": stand_ins, "step": 7, "score": torch.tensor(0.5), "p": torch.nn.Parameter(torch.ones(2))}
    written = []
    write_torch_file(tmp_path / "f.pt", obj, lambda t: by_id[id(t)], written.append)
    assert written == [48, 10, 4, 8]
    for mmap in (False, True):
        loaded = torch.load(tmp_path / "f.pt", weights_only=True, mmap=mmap)
        assert torch.equal(loaded["state_dict"]["w"], values["w"]) and loaded["state_dict"]["b"].dtype == torch.bfloat16
        assert torch.equal(loaded["state_dict"]["b"], values["b"]) and loaded["step"] == 7
        assert loaded["score"].item() == 0.5 and isinstance(loaded["p"], torch.nn.Parameter)
    assert zipfile.ZipFile(tmp_path / "f.pt").testzip() is None
    assert [name.split("/", 1)[1] for name in zipfile.ZipFile(tmp_path / "f.pt").namelist()][:5] == [
        "data.pkl",
        ".format_version",
        ".storage_alignment",
        "byteorder",
        "data/0",
    ]
