"""The coordinator: one ``CheckpointCoordinator`` actor per run (``actor``), an asyncio shell over
Ray-free parts.

``catalogue`` (the book of versions and their parts; ``pending``: a version in flight),
``commits`` (parts written, manifest, commit), ``run_guards`` (owner fencing, gc notices),
``queries`` (list, status, stored states), ``waits`` (a version's outcome on each tier),
``write_dispatch`` (parts to writers),
``upload_plan`` and ``uploader`` (what is owed to the remote tier, and its uploads),
``deletions`` (retention), ``recovery`` (a run's versions found on storage at start),
``rank_deadline`` (ranks whose part never came), ``live_options`` (options a running run's
coordinator takes or refuses), ``lease`` (the owning driver's lease; the coordinator fences commits
with it).

May import ``writers``, ``capture``, ``formats``, ``storage`` and the root's vocabulary; never
``client``. Nothing is imported at package import.
"""
