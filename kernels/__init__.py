"""redraft.kernels: Triton kernels and their plain-torch twins.

Triton decides once per process, when it is first imported, whether it interprets kernels (TRITON_INTERPRET).
torch imports triton as a side effect of ordinary calls (building a model on the meta device does), so the
choice is made here, as early as anything of redraft's kernels is imported: on a machine without a CUDA
device, and unless the variable is already set, TRITON_INTERPRET=1 so that kernel_backend="triton" runs on
CPU through the interpreter. CPU-only torch builds are recognised without touching any CUDA API.
"""

import os as _os
import sys as _sys


def _no_gpu() -> bool:
    import torch

    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return True
    return not torch.cuda.is_available()


if "triton" not in _sys.modules and "TRITON_INTERPRET" not in _os.environ and _no_gpu():
    _os.environ["TRITON_INTERPRET"] = "1"
