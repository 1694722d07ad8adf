"""The ``hf_model`` export: full Hugging Face weights of a committed version, written by a Ray task
on rank 0's node (not by rank 0 inline, and never before the version commits).

The task reads the version's ``model`` state with ``engine.load("model", step, rank=None)`` (every
DTensor assembled from all ranks' chunks, each piece verified) and writes
``<local_path>/huggingface/``: sharded safetensors + index (``huggingface_hub.save_torch_state_dict``),
``config.json`` and what ``processing_class.save_pretrained`` writes (the tokenizer files), first
into a temporary folder renamed into place at the end. Weights keep the dtype they were trained in."""
from __future__ import annotations

import os
import shutil
from typing import Any


def export_hf(run: str, step: int, out_dir: str, config_json: Any, processing_class: Any,
              max_shard_size: str = "5GB") -> str:
    """``config_json``: the model config as ``config.to_json_string()`` (the task then needs no
    transformers import unless a ``processing_class`` comes with it)."""
    import json

    import ray_ckpt as rc
    from huggingface_hub import save_torch_state_dict

    engine = rc.CheckpointEngine.connect(run)
    full = engine.load("model", step=step, rank=None)
    config = json.loads(config_json) if config_json else None
    if config is not None and config.get("tie_word_embeddings", False):
        full.pop("lm_head.weight", None)  # tied to the input embeddings: from_pretrained ties it back
    tmp = f"{out_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_torch_state_dict(full, tmp, max_shard_size=max_shard_size, safe_serialization=True)
    if config_json:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            f.write(config_json)
    if processing_class is not None:
        processing_class.save_pretrained(tmp)
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


def start_export(run: str, step: int, out_dir: str, config: Any, processing_class: Any, cpus: float) -> Any:
    """Start :func:`export_hf` as a Ray task on this node; returns its ObjectRef. ``config``: the
    model's ``PretrainedConfig`` (written as ``config.json``, as ``save_pretrained`` writes it)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    task = ray.remote(export_hf).options(num_cpus=cpus, max_retries=1,
                                         scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
    config_json = config.to_json_string(use_diff=False) if config is not None else None
    return task.remote(run, step, out_dir, config_json, processing_class)
