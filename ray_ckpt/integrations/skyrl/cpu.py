"""Running SkyRL's FSDP strategy on a CPU-only machine (gloo): for tests, the benchmark and trying
the integration out without a GPU. Not needed on GPUs; nothing here changes a SkyRL class.

SkyRL's FSDP path assumes CUDA in a few calls; :func:`prepare` stands in for them the way a CPU
test has to, only when ``torch.cuda.is_available()`` is false:

* ``skyrl.backends.skyrl_train.workers.model_wrapper`` (imported by the strategy) imports
  ``flash_attn.bert_padding`` at module level (no CPU build): empty ``flash_attn`` modules are
  registered when the package is absent (nothing here calls them);
* ``torch.cuda.set_device`` / ``synchronize`` / ``empty_cache`` become no-ops and
  ``torch.cuda.current_device()`` names the CPU;
* ``init_device_mesh("cuda", ...)`` in SkyRL's ``fsdp_utils`` (``create_device_mesh``) builds a
  "cpu" mesh, and ``Tensor.cuda()`` / ``torch.empty(device="cuda")`` (its broadcast of
  non-persistent buffers) make CPU tensors.

Call it before importing SkyRL."""
from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

_DONE = False


def _is_cuda(device: Any) -> bool:
    return device is not None and str(device).split(":")[0] == "cuda"


def _stub_flash_attn() -> None:
    if "flash_attn" in sys.modules or importlib.util.find_spec("flash_attn") is not None:
        return
    names = {"flash_attn": [], "flash_attn.bert_padding": ["index_first_axis", "pad_input", "unpad_input"]}
    for name, attrs in names.items():
        mod = types.ModuleType(name)
        package = name == "flash_attn"
        if package:
            mod.__path__ = []
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
        for attr in attrs:
            setattr(mod, attr, None)
        sys.modules[name] = mod


def prepare() -> None:
    """Call before importing SkyRL in a CPU process (idempotent)."""
    global _DONE
    _stub_flash_attn()
    import torch

    if _DONE or torch.cuda.is_available():
        return
    torch.cuda.set_device = lambda device=None: None
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, device=None, non_blocking=False, **kw: self.to("cpu", copy=True)
    empty = torch.empty

    def empty_on_cpu(*size: Any, device: Any = None, **kw: Any):
        return empty(*size, device="cpu" if _is_cuda(device) else device, **kw)

    torch.empty = empty_on_cpu
    from skyrl.backends.skyrl_train.distributed import fsdp_utils

    mesh = fsdp_utils.init_device_mesh

    def init_device_mesh(device_type: str, *args: Any, **kw: Any):
        return mesh("cpu" if _is_cuda(device_type) else device_type, *args, **kw)

    fsdp_utils.init_device_mesh = init_device_mesh
    _DONE = True
