"""``export_hf``: a committed SkyRL version as a Hugging Face folder (safetensors). No SkyRL import:
it runs in any process of the cluster (the driver, a Ray task), not only in a worker."""
from __future__ import annotations

import json
import os

from ..committed import read_pointer
from ...errors import RestoreError


def export_hf(ckpt_dir: str, out_dir: str, max_shard_size: str = "5GB") -> str:
    """Write the committed version ``ckpt_dir`` names as a Hugging Face folder (sharded safetensors
    + index, ``config.json`` and the tokenizer files saved beside the shards) into ``out_dir``: every
    DTensor assembled from all ranks' chunks, each piece verified. Runs in any process of the
    cluster; the same export the verl integration writes at its commits."""
    from ..verl.hf_export import export_hf as write

    pointer = read_pointer(ckpt_dir)
    if pointer is None:
        raise RestoreError(f"{ckpt_dir}: no committed ray_ckpt version here (no ray_ckpt.json)")
    hf_dir = os.path.join(ckpt_dir, "huggingface")
    config_json = None
    if os.path.isfile(os.path.join(hf_dir, "config.json")):
        with open(os.path.join(hf_dir, "config.json")) as f:
            config_json = json.dumps(json.load(f))
    write(str(pointer["run"]), int(pointer["step"]), out_dir, config_json, None, max_shard_size=max_shard_size)
    for name in sorted(os.listdir(hf_dir)) if os.path.isdir(hf_dir) else []:  # the tokenizer's files
        if name != "config.json" and os.path.isfile(os.path.join(hf_dir, name)):
            with open(os.path.join(hf_dir, name), "rb") as src, open(os.path.join(out_dir, name), "wb") as dst:
                dst.write(src.read())
    return out_dir
