"""Capture: a provider's state -> parts that the object store moves without copies.

``snapshot`` (a state flattened and put into the object store, in the provider's process),
``restored`` (a restored state read, verified and held in the provider's process, then applied),
``calls`` (the engine's snapshot calls to its providers), ``providers`` (actors, actor methods,
callables), ``overlap`` (copies in the background, fences before a change; ``fence_hooks``: the optimizer
and BatchNorm hooks that fence by themselves), ``mailbox`` (where
overlapped snapshots announce their bytes), ``object_store`` (mapping the store's pages ahead of a
save), ``rng`` (RNG state as a state).

May import ``formats``, ``storage`` and the root's vocabulary; never ``writers``, ``coordinator`` or
``client``. Nothing is imported at package import.
"""
