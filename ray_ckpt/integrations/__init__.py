"""Integrations of ray_ckpt with training frameworks.

Each integration is its own module and imports its framework lazily, so ``import ray_ckpt`` never
requires them. Integrations may import every layer below them (``client`` first, and the layers
under it where a framework needs them); nothing in the package imports an integration.
What the verl and OpenRLHF integrations share: ``committed.py`` (the pointer file written next to a
framework's checkpoint folder when a version commits, the background wait for each save's commit,
and a load's wait for a step in flight), ``settings_block.py`` (their ``ray_ckpt`` settings block's
engine options) and ``lazy.py`` (their names imported on first use).

- :mod:`ray_ckpt.integrations.rllib` -- RLlib (new API stack): ``RayCkptCallback`` /
  ``make_callback(...)`` save an Algorithm's learner, connector, counter and RNG state every N
  iterations without blocking ``train()``; ``restore_algorithm(...)`` brings an Algorithm back from a
  version and synchronises (and verifies) the weights on every env runner before it returns;
  ``make_callback(..., resume=True)`` does that itself when the Algorithm is built (e.g. a Tune trial
  retried after a failure). A package: capture, callback, restore, env_runners, replay/, and
  base/ (conversion, names, ``_rllib_internals``: the RLlib internals it relies on, checked by a test). Needs
  ``pip install "ray-ckpt[rllib]"``.
- :mod:`ray_ckpt.integrations.verl` -- verl 0.9 (FSDP2): ``RayCkptCheckpointManager``, a verl
  ``BaseCheckpointManager`` built like verl's ``FSDPCheckpointManager``, with its settings under
  ``checkpoint_config.ray_ckpt``; ``install()`` makes verl's FSDP engine build it (see docs/verl.md).
  Needs ``pip install "ray-ckpt[verl]"``.
- :mod:`ray_ckpt.integrations.dcp` -- torch Distributed Checkpoint: ``rc.dcp.reader(run, step)``, a
  ``StorageReader`` that lets ``dcp.load`` read a committed sharded version on any world size
  (verified ranged reads, no Ray needed), and ``rc.dcp.writer(engine, step)``, a ``StorageWriter``
  that stores ``dcp.save`` / ``dcp.async_save`` as one ray_ckpt version (see docs/dcp.md).
- :mod:`ray_ckpt.integrations.openrlhf` -- OpenRLHF with DeepSpeed ZeRO-1/2/3:
  ``RayCkptDeepspeedStrategy``, OpenRLHF's ``DeepspeedStrategy`` whose ``save_ckpt`` / ``load_ckpt``
  store each rank's ZeRO partition world-size independently (see docs/openrlhf.md).
"""
