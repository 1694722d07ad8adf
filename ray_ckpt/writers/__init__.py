"""Writers: ``pools.WriterActor`` (the thin Ray shell) over ``part_writer.PartWriter`` (plain, no Ray):
serialise a snapshot, checksum it while writing, persist it to the local tier, upload committed
files; ``pools.WriterPools``: the coordinator's critical and best-effort pools.

May import ``capture`` (a snapshot's mailbox), ``formats``, ``storage`` and the root's vocabulary;
never ``coordinator`` or ``client``. Nothing is imported at package import.
"""
