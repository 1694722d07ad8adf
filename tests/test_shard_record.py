"""The shard record a writer hands the coordinator, and the shard index the manifest keeps from it.

A sharded state is laid out as the writer lays it out (``checkpoint_io.write_flat`` +
``shard_record`` per rank, without Ray: each rank's part is a flattened state whose "w" leaf is a
DTensor ("DT") node holding that rank's rows) and committed through the coordinator's bookkeeping
(``Catalogue.part_written`` -> ``manifest_for``). The manifest's shard index must stay byte for
byte what earlier releases wrote (versions on disk must keep loading); the record's JSON form
round-trips; a malformed header record is refused by name before a byte of the state is used.
"""
from __future__ import annotations

import json

import pytest
import torch

from ray_ckpt.coordinator.catalogue import Catalogue
from ray_ckpt.errors import IntegrityError, RestoreError
from ray_ckpt.formats.manifest import Manifest
from ray_ckpt.formats.tree import flatten
from ray_ckpt.protocol import ShardHead, ShardRecord, WrittenPart
from ray_ckpt.storage import sharded_io
from ray_ckpt.storage.checkpoint_io import shard_record, write_flat
from ray_ckpt.storage.tier import Tier

WORLD, ROWS, COLS = 3, 9, 4

# the shard index (with rank 0's head) of the state below as releases before the typed record
# wrote it into the manifest, keys sorted as the manifest writes them
EARLIER = (
    '{"format":1,"heads":{"0":{"n":584,"plain":[[1,632,4,"53b3d4843e78814e1683ffa8354f9a19"],[2,636,16,'
    '"8852304960645e65c790ab1c20deb2f0"]],"xxh3":"0c5d30907e321dec3bae2bbe8234859d"}},"tensors":{"w":{"chunks":'
    '[{"at":584,"file":"v000000000001/model/rank0.safetensors","n":48,"o":[0,0],"ps":64,"s":[3,4],"xxh3":'
    '["bdb3f41b7b694e4bb6d47b1326c96fde"]},{"at":584,"file":"v000000000001/model/rank1.safetensors","n":48,'
    '"o":[3,0],"ps":64,"s":[3,4],"xxh3":["a8999e61798de087812760c7f6885885"]},{"at":584,"file":'
    '"v000000000001/model/rank2.safetensors","n":48,"o":[6,0],"ps":64,"s":[3,4],"xxh3":'
    '["7bdd5b7d0d503b84a8eb4ce5db16b607"]}],"dtype":"float32","mesh":[3],"path":["w"],"placements":["S(0)"],'
    '"shape":[9,4]}}}')


def full_tensor() -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)


def write_ranks(tier: Tier):
    """(files, records) of the state {"w": DTensor Shard(0) over WORLD ranks, "step", "nested"}."""
    full, rows = full_tensor(), ROWS // WORLD
    files, recs = [], []
    for r in range(WORLD):
        flat = flatten({"w": full[r * rows:(r + 1) * rows].clone(), "step": torch.tensor(3.0),
                        "nested": {"v": full[r].clone(), "k": 7}})
        node = flat.structure["d"][0][1]
        flat.structure["d"][0][1] = {"DT": node["T"], "dt": "float32", "sh": [rows, COLS], "g": [ROWS, COLS],
                                     "o": [r * rows, 0], "m": [WORLD], "p": ["S(0)"], "c": [r], "r": r, "w": r}
        entries = write_flat(tier, 1, "model", r, flat)
        files.append(entries)
        recs.append(shard_record(flat, entries[0].path, piece_size=64))
    return files, recs


def committed_entry(tmp_path):
    """(tier, the state's manifest entry) after the catalogue committed the ranks' parts."""
    tier = Tier(str(tmp_path))
    files, recs = write_ranks(tier)
    cat = Catalogue("rec")
    cat.declare("model", "critical", WORLD)
    for r in range(WORLD):
        cat.accept_push(1, 1, "model", r)
        cat.part_written(1, "model", r, WrittenPart(tuple(files[r]), sum(f.size for f in files[r]), shards=recs[r]))
    assert cat.pending[1].error is None, cat.pending[1].error
    m = Manifest.from_json(cat.manifest_for(1).to_json())  # what a reader gets back from storage
    return tier, m.states["model"]


def test_manifest_index_is_what_earlier_releases_wrote(tmp_path):
    tier, entry = committed_entry(tmp_path)
    assert json.dumps(entry.shards, separators=(",", ":"), sort_keys=True) == EARLIER
    full, _ = sharded_io.load_full([tier], entry, "model")
    assert torch.equal(full["w"], full_tensor()) and full["nested"]["k"] == 7


def test_record_json_round_trips(tmp_path):
    _files, recs = write_ranks(Tier(str(tmp_path)))
    rec = recs[1]
    assert isinstance(rec, ShardRecord) and isinstance(rec.head, ShardHead)
    assert [p.index for p in rec.head.plain] == [1, 2]  # "step" and "nested/v": not sharded
    back = ShardRecord.from_json(json.loads(json.dumps(rec.to_json())))
    assert back == rec
    with pytest.raises(IntegrityError, match="not a ray_ckpt shard record"):
        ShardRecord.from_json({"tensors": {}})


@pytest.mark.parametrize("change", [{"n": "584"}, {"xxh3": "not a digest"}, {"plain": [[1, 632, 4]]},
                                    {"plain": None}])
def test_malformed_head_is_refused_by_name(tmp_path, change):
    tier, entry = committed_entry(tmp_path)
    entry.shards["heads"]["0"].update(change)
    with pytest.raises((TypeError, ValueError, KeyError)):
        ShardHead.from_json(entry.shards["heads"]["0"])
    with pytest.raises(IntegrityError, match="shard heads are malformed"):
        sharded_io.load_full([tier], entry, "model")
    target = {"w": torch.zeros(ROWS, COLS), "step": torch.tensor(0.0), "nested": {"v": torch.zeros(COLS), "k": 0}}
    with pytest.raises(RestoreError, match="shard heads are malformed.*nothing was loaded") as err:
        sharded_io.load_into_state([tier], entry, "model", target)
    assert str(err.value).count("state 'model'") == 1  # named once, not by each layer it passed
    assert not target["w"].any()  # nothing was filled


def test_show_summarises_the_index_and_names_a_damaged_one(tmp_path):
    from ray_ckpt.cli.show import sharded_summary

    _tier, entry = committed_entry(tmp_path)
    assert sharded_summary(entry.shards) == {"w": {
        "shape": [ROWS, COLS], "dtype": "float32", "mesh": [WORLD], "placements": ["S(0)"], "chunks": WORLD,
        "chunk_bytes": ROWS * COLS * 4, "files": WORLD}}
    entry.shards["tensors"]["w"]["chunks"].pop()  # a rank's chunk gone: the rows it held are a hole
    assert sharded_summary(entry.shards) == {"problem": "malformed shard index (shard index: w: the stored chunks "
                                             "hold 24 of the 36 elements of shape [9, 4]: a rank's part is missing "
                                             "or chunks repeat)"}
