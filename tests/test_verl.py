"""verl, for real (issue 28): ``RayCkptCheckpointManager`` against the verl package itself.

Three Ray rank actors (gloo on CPU) are started once. Each builds a tiny Qwen2
(``transformers.Qwen2Config``, ``from_config``, no download) wrapped by verl's own
``verl.utils.fsdp_utils.apply_fsdp2``, AdamW and verl's cosine LR scheduler, and gets its checkpoint
manager from verl's FSDP engine module after ``install()`` (``transformer_impl.FSDPCheckpointManager``)
with a ``checkpoint_config`` built by verl's own hydra path (``omega_conf_to_dataclass``,
``_target_: RayCkptCheckpointConfig``). The first rank creates the run, the others connect.

* 2 ranks train 2 steps and save step 2 (model, optimizer, extra, hf_model); train step 3 (its
  logits are the replay's reference), train step 4 and only rank 0 saves it: rank 1 "crashed";
* verl's tracker names step 2 only, ``find_latest_ckpt_path`` (verl's code) returns global_step_2;
  loading step 4 is an error naming it once it failed (rank timeout), and rank 0's next save raises
  naming step 4;
* 1 rank (another process) loads step 2 right after save returns (waiting for the commit), 3 ranks
  (other processes first) load it: full parameters, AdamW moments and the scheduler are bit-equal;
  2 ranks load it and replay step 3: bit-identical logits (RNG restored); verl's own manager, which
  saved the same state beside it, gives back the same bytes (same world size);
* the hf_model export loads with ``AutoModelForCausalLM.from_pretrained`` and gives the trained
  model's logits.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import time

import pytest
import ray
import torch

import gloo_util
from gloo_util import free_port, same_bits
from ray_ckpt.ray_internals import actor_ready

if importlib.util.find_spec("verl") is None:  # (not importorskip: importing verl here costs the driver ~10 s)
    pytest.skip('verl is not installed: pip install -e ".[verl]"', allow_module_level=True)

pytestmark = pytest.mark.timeout(300)

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(gloo_util)

RANK_TIMEOUT_S = 4.0  # the run's rank_timeout_s: step 4, which rank 1 never pushes, fails after it


def qwen2_config():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False, attn_implementation="eager")


@ray.remote(num_cpus=0.1)
class VerlRank:
    def __init__(self):
        torch.set_num_threads(1)
        os.environ.setdefault("VERL_LOGGING_LEVEL", "WARN")
        # what a verl worker imports before it builds its engine (the import time is paid here, once)
        from transformers import AutoModelForCausalLM  # noqa: F401
        from verl.utils.fsdp_utils import apply_fsdp2  # noqa: F401
        from verl.workers.engine.fsdp import transformer_impl  # noqa: F401

        self.mgr = None

    def join(self, rank: int, world: int, port: int) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        self.rank, self.world = rank, world

    def leave(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    def build(self, seed: int, ckpt: dict) -> str:
        from omegaconf import OmegaConf
        from torch.distributed.device_mesh import init_device_mesh
        from transformers import AutoModelForCausalLM
        from verl.utils.config import omega_conf_to_dataclass
        from verl.utils.fsdp_utils import apply_fsdp2
        from verl.utils.torch_functional import get_cosine_schedule_with_warmup
        from verl.workers.engine.fsdp import transformer_impl

        import ray_ckpt.integrations.verl as rv

        torch.manual_seed(seed)  # the same initial model on every rank (fully_shard keeps each rank's shard)
        model = AutoModelForCausalLM.from_config(qwen2_config())
        mesh = init_device_mesh("cpu", (self.world,), mesh_dim_names=("fsdp",))
        apply_fsdp2(model, {"mesh": mesh, "reshard_after_forward": True}, {})
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        self.sched = get_cosine_schedule_with_warmup(self.opt, num_warmup_steps=2, num_training_steps=20)
        torch.manual_seed(10_000 * seed + self.rank)  # each rank's own data stream
        rv.install()  # verl's FSDP engine now builds RayCkptCheckpointManager for a ray_ckpt config
        config = omega_conf_to_dataclass(OmegaConf.create(ckpt))
        self.mgr = transformer_impl.FSDPCheckpointManager(
            model=model, optimizer=self.opt, lr_scheduler=self.sched, processing_class=None,
            checkpoint_config=config, trust_remote_code=False)
        return type(self.mgr).__name__

    def train(self, steps: int) -> torch.Tensor:
        """``steps`` AdamW steps on tokens drawn from the global torch RNG; the last step's logits."""
        for _ in range(steps):
            tokens = torch.randint(0, 256, (2, 12))
            out = self.model(input_ids=tokens, labels=tokens)
            out.loss.backward()
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad(set_to_none=True)
        return out.logits.detach().clone()

    def save(self, path: str, step: int, keep: int = None) -> float:
        self.mgr.save_checkpoint(path, None, global_step=step, max_ckpt_to_keep=keep)
        return self.mgr.last_block_s

    def wait(self, timeout: float):
        try:
            self.mgr.wait_until_finished(timeout=timeout)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def load(self, path: str):
        try:
            self.mgr.load_checkpoint(path)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def full(self) -> dict:
        """Full parameters, AdamW moments (collective) and the scheduler / optimizer scalars."""
        out = {f"model/{n}": p.full_tensor() for n, p in self.model.named_parameters()}
        ids = {id(p): i for i, p in enumerate(self.model.parameters())}
        for p, st in self.opt.state.items():
            for k in ("exp_avg", "exp_avg_sq"):
                out[f"optim/{ids[id(p)]}/{k}"] = st[k].full_tensor()
            out[f"optim/{ids[id(p)]}/step"] = st["step"].clone()
        sched = self.sched.state_dict()
        plain = {"sched": {k: sched[k] for k in ("last_epoch", "_step_count", "base_lrs", "_last_lr")},
                 "lr": [g["lr"] for g in self.opt.param_groups]}
        return {"tensors": out, "plain": plain} if self.rank == 0 else {}

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.model(input_ids=tokens).logits

    def stock_manager(self):
        """verl's own FSDPCheckpointManager on the same model (for the side-by-side check)."""
        from verl.trainer.config import CheckpointConfig
        from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

        return FSDPCheckpointManager(model=self.model, optimizer=self.opt, lr_scheduler=self.sched,
                                     processing_class=None, checkpoint_config=CheckpointConfig())

    def stock_save(self, path: str, step: int) -> float:
        t0 = time.perf_counter()
        self.stock_manager().save_checkpoint(path, None, global_step=step)
        return time.perf_counter() - t0

    def stock_load(self, path: str) -> None:
        self.stock_manager().load_checkpoint(path)

    def load_wait_s(self) -> float:
        return self.mgr.last_load_wait_s

    def call(self, fn, *args):
        return fn(*args)

    def hf_logits(self, path: str, tokens: torch.Tensor) -> tuple:
        """The export loaded by transformers (the trained model's attention kernel): its logits and weights."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
        with torch.no_grad():
            return model(input_ids=tokens).logits, {n: p.detach().clone() for n, p in model.named_parameters()}


def verl_find_latest(path: str):
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    return find_latest_ckpt_path(path)


def actor_config_with_ray_ckpt(run: str, local_dir: str) -> tuple:
    """docs/verl.md's config diff applied to verl's own generated ppo_trainer.yaml, turned into
    verl's FSDPActorConfig by verl's own path: the checkpoint block becomes RayCkptCheckpointConfig."""
    import verl
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    cfg = OmegaConf.load(os.path.join(os.path.dirname(verl.__file__), "trainer/config/_generated_ppo_trainer.yaml"))
    OmegaConf.set_struct(cfg, False)
    actor = cfg.actor_rollout_ref.actor
    actor.ppo_micro_batch_size_per_gpu = 2  # verl's config check wants one of the micro batch sizes
    actor.checkpoint._target_ = "ray_ckpt.integrations.verl.RayCkptCheckpointConfig"
    actor.checkpoint.async_save = True
    actor.checkpoint.ray_ckpt = {"run": run, "local_dir": local_dir}
    resolved = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True)).actor_rollout_ref.actor
    a = omega_conf_to_dataclass(resolved)
    return type(a).__name__, type(a.checkpoint).__name__, dict(a.checkpoint.ray_ckpt), a.checkpoint.async_save


def group(actors, world: int) -> list:
    port = free_port()
    ray.get([a.join.remote(r, world, port) for r, a in enumerate(actors[:world])], timeout=60)
    return actors[:world]


def leave(actors) -> None:
    ray.get([a.leave.remote() for a in actors], timeout=60)


@pytest.fixture(scope="module")
def verl_run(ray_session, tmp_path_factory):
    t0 = time.perf_counter()
    actors = [VerlRank.remote() for _ in range(3)]
    tmp = tmp_path_factory.mktemp("verl")
    run = "verl-e2e"
    ckpt = {"_target_": "ray_ckpt.integrations.verl.RayCkptCheckpointConfig",
            "save_contents": ["model", "optimizer", "extra", "hf_model"],
            "load_contents": ["model", "optimizer", "extra"],
            "ray_ckpt": {"run": run, "local_dir": str(tmp / "ckpt"), "critical_writers": 1,
                         "best_effort_writers": 0, "load_wait_s": 60,
                         "engine_options": {"rank_timeout_s": RANK_TIMEOUT_S}}}
    ray.get([actor_ready(a) for a in actors], timeout=180)
    print(f"\n3 verl rank actors ready: {time.perf_counter() - t0:.1f} s")
    yield {"actors": actors, "ckpt": ckpt, "run": run, "root": tmp / "trainer"}
    import ray_ckpt as rc

    for a in actors:
        ray.kill(a)
    try:
        rc.CheckpointEngine.connect(run).shutdown(stop_coordinator=True)
    except rc.CheckpointError:
        pass


def step_path(root, step: int) -> str:
    return str(root / f"global_step_{step}" / "actor")  # what verl's trainer passes


@pytest.fixture(scope="module")
def saved(verl_run):
    t0 = time.perf_counter()
    actors, root = verl_run["actors"], verl_run["root"]
    ranks = group(actors, 2)
    names = ray.get([r.build.remote(0, verl_run["ckpt"]) for r in ranks], timeout=120)
    assert names == ["RayCkptCheckpointManager"] * 2  # built by verl's module, through install()
    loader = group(actors[2:], 1)[0]  # another process, a group of 1: it loads step 2 as soon as save returns
    ray.get(loader.build.remote(1, verl_run["ckpt"]), timeout=120)
    ray.get([r.train.remote(2) for r in ranks], timeout=120)
    blocked = ray.get([r.save.remote(step_path(root, 2), 2) for r in ranks], timeout=60)
    early_load = loader.load.remote(step_path(root, 2))  # the step is (most likely) still in flight
    want = ray.get([r.full.remote() for r in ranks], timeout=60)[0]
    stock_s = ray.get([r.stock_save.remote(str(root / "stock" / "global_step_2" / "actor"), 2) for r in ranks],
                      timeout=60)  # verl's own manager, same state: the side-by-side check
    probe = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(3))
    want_logits = ray.get([r.logits.remote(probe) for r in ranks], timeout=60)[0]
    replay = ray.get([r.train.remote(1) for r in ranks], timeout=60)  # step 3: the replay's reference
    assert ray.get(early_load, timeout=120) is None
    one_rank = {"full": ray.get(loader.full.remote(), timeout=60), "waited": ray.get(loader.load_wait_s.remote())}
    leave([loader])
    assert ray.get([r.wait.remote(60) for r in ranks], timeout=90) == [None, None]
    ray.get([r.train.remote(1) for r in ranks], timeout=60)  # step 4
    ray.get(ranks[0].save.remote(step_path(root, 4), 4), timeout=60)  # rank 1 crashed before its save
    tracker_after_4 = (root / "latest_checkpointed_iteration.txt").read_text()
    leave(ranks)
    print(f"2 ranks trained, saved steps 2 (+hf) and 4 (rank 0 only): {time.perf_counter() - t0:.1f} s; "
          f"save_checkpoint blocked {max(blocked) * 1e3:.0f} ms (verl's manager: {max(stock_s) * 1e3:.0f} ms); "
          f"the 1-rank load waited {one_rank['waited']:.2f} s for the commit")
    return {"want": want, "probe": probe, "want_logits": want_logits, "replay": replay,
            "tracker_after_4": tracker_after_4, "blocked": blocked, "one_rank": one_rank}


def assert_same_state(got: dict, want: dict) -> None:
    assert got["tensors"].keys() == want["tensors"].keys()
    for k, v in want["tensors"].items():
        assert same_bits(got["tensors"][k], v), k
    assert got["plain"] == want["plain"]


def test_tracker_names_only_the_newest_committed_step(verl_run, saved):
    import ray_ckpt.integrations.verl as rv

    root = verl_run["root"]
    assert saved["tracker_after_4"] == "2"  # step 4 was in flight when save returned
    # the rank that did save step 4 learns of its failure (rank 1's part never came)
    err = ray.get(verl_run["actors"][0].wait.remote(RANK_TIMEOUT_S + 30), timeout=60)
    assert err and err.startswith("SaveError") and "step 4" in err, err
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "2"
    # verl's own resume lookup, run in a rank actor (verl is imported there already, not in pytest)
    assert ray.get(verl_run["actors"][2].call.remote(verl_find_latest, str(root)), timeout=60) == \
        str(root / "global_step_2")
    pointer = rv.read_pointer(step_path(root, 2))
    assert pointer["run"] == verl_run["run"] and pointer["step"] == 2 and pointer["world_size"] == 2
    assert rv.read_pointer(step_path(root, 4)) is None
    assert max(saved["blocked"]) < 5.0  # a push, not a write (generous: 2 shared cores)


def test_step_that_never_committed_is_an_error_naming_it(verl_run, saved):
    actors, root = verl_run["actors"], verl_run["root"]
    ranks = group(actors[::-1], 1)  # another process than the saving ranks
    ray.get(ranks[0].build.remote(7, verl_run["ckpt"]), timeout=120)
    err = ray.get(ranks[0].load.remote(step_path(root, 4)), timeout=120)
    leave(ranks)
    assert err and err.startswith("RestoreError") and "step 4" in err and "never committed" in err, err


def test_load_on_one_rank_right_after_save_is_bit_equal(saved):
    """The group of 1 loaded step 2 as soon as save_checkpoint returned (waiting for the commit)."""
    assert_same_state(saved["one_rank"]["full"], saved["want"])


def test_reload_on_three_ranks_is_bit_equal(verl_run, saved):
    t0 = time.perf_counter()
    actors, root = verl_run["actors"], verl_run["root"]
    ranks = group(actors[::-1], 3)  # the last actor first: rank 0 is not the saving rank 0
    ray.get([r.build.remote(103, verl_run["ckpt"]) for r in ranks], timeout=120)
    errors = ray.get([r.load.remote(step_path(root, 2)) for r in ranks], timeout=120)
    got = ray.get([r.full.remote() for r in ranks], timeout=60)[0]
    leave(ranks)
    assert errors == [None] * 3
    assert_same_state(got, saved["want"])
    print(f"load onto 3 ranks: {time.perf_counter() - t0:.1f} s")


def test_verls_own_manager_gives_back_the_same_bytes(verl_run, saved):
    """Side by side: verl's FSDPCheckpointManager saved the same state (same world size only)."""
    actors, root = verl_run["actors"], verl_run["root"]
    ranks = group(actors[::-1], 2)
    ray.get([r.build.remote(66, verl_run["ckpt"]) for r in ranks], timeout=120)
    ray.get([r.stock_load.remote(str(root / "stock" / "global_step_2" / "actor")) for r in ranks], timeout=120)
    got = ray.get([r.full.remote() for r in ranks], timeout=60)[0]
    leave(ranks)
    assert_same_state(got, saved["want"])


def test_same_world_size_replays_bit_identical_logits(verl_run, saved):
    actors, root = verl_run["actors"], verl_run["root"]
    ranks = group(actors[::-1], 2)
    ray.get([r.build.remote(55, verl_run["ckpt"]) for r in ranks], timeout=120)
    assert ray.get([r.load.remote(step_path(root, 2)) for r in ranks], timeout=120) == [None, None]
    replay = ray.get([r.train.remote(1) for r in ranks], timeout=60)
    leave(ranks)
    for r in range(2):
        assert same_bits(replay[r], saved["replay"][r]), r


def test_hf_model_export_loads_with_from_pretrained(verl_run, saved):
    path = os.path.join(step_path(verl_run["root"], 2), "huggingface")
    assert os.path.isfile(os.path.join(path, "config.json"))
    logits, weights = ray.get(verl_run["actors"][2].hf_logits.remote(path, saved["probe"]), timeout=120)
    want = saved["want"]["tensors"]
    assert {f"model/{n}" for n in weights} == {k for k in want if k.startswith("model/")}
    for n, w in weights.items():
        assert same_bits(w, want[f"model/{n}"]), n
    assert same_bits(logits, saved["want_logits"])


def test_config_diff_gives_verls_actor_config_our_checkpoint_config(verl_run):
    got = ray.get(verl_run["actors"][2].call.remote(actor_config_with_ray_ckpt, "r", "/tmp/x"), timeout=120)
    assert got == ("FSDPActorConfig", "RayCkptCheckpointConfig", {"run": "r", "local_dir": "/tmp/x"}, True)


def test_settings_block_is_checked_and_verl_imported_lazily():
    import subprocess

    import ray_ckpt as rc
    from ray_ckpt.integrations.verl import read_settings

    assert read_settings(None) is None and read_settings({"save_contents": ["model"]}) is None
    s = read_settings({"ray_ckpt": {"run": "r", "local_dir": "/d", "keep_last": 3,
                                    "engine_options": {"rank_timeout_s": 5}, "load_wait_s": 9}})
    assert s.run == "r" and s.creates and s.load_wait_s == 9
    assert s.create == {"local_dir": "/d", "keep_last": 3, "rank_timeout_s": 5}
    assert not read_settings({"ray_ckpt": {"run": "r"}}).creates  # no local_dir: every rank connects
    with pytest.raises(rc.InvalidArgumentError, match="keep_lst"):
        read_settings({"ray_ckpt": {"run": "r", "keep_lst": 3}})
    with pytest.raises(rc.InvalidArgumentError, match="keep_last"):
        read_settings({"ray_ckpt": {"run": "r", "keep_last": 3, "engine_options": {"keep_last": 2}}})
    code = "import sys, ray_ckpt.integrations.verl; print('verl' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


def test_a_resume_after_the_newest_version_was_lost_goes_back_to_the_one_before(verl_run, tmp_path):
    """A version that committed (verl's tracker names it) and was lost with its node since: verl's
    trainer picks the folder it resumes from with ``find_latest_ckpt_path``, which ``install()``
    wraps to return the newest committed step's folder and move the tracker back (so do
    ``rewind_lost_tracker`` in the driver, and, with neither, the workers' load of the lost step,
    which then fails saying so: verl's next start loads it, bit-equal); that
    step, redone, is not saved again (the coordinator would refuse it); the next one is. A load of
    step 1 again, back past the committed step 3: step 3's redo is not saved either, step 4 is."""
    import copy
    import glob
    import shutil

    import ray_ckpt as rc
    import ray_ckpt.integrations.verl as rv

    actors, run = verl_run["actors"], "verl-lost"
    root = tmp_path / "trainer"
    ckpt = copy.deepcopy(verl_run["ckpt"])
    ckpt["save_contents"] = ["model", "optimizer", "extra"]
    ckpt["ray_ckpt"].update(run=run, local_dir=str(tmp_path / "ckpt"))
    rank = group(actors, 1)[0]
    try:
        ray.get(rank.build.remote(11, ckpt), timeout=120)
        ray.get(rank.train.remote(1), timeout=60)
        ray.get(rank.save.remote(step_path(root, 1), 1), timeout=60)
        assert ray.get(rank.wait.remote(60), timeout=90) is None
        want = ray.get(rank.full.remote(), timeout=60)
        ray.get(rank.train.remote(1), timeout=60)
        ray.get(rank.save.remote(step_path(root, 2), 2), timeout=60)
        assert ray.get(rank.wait.remote(60), timeout=90) is None
        assert (root / "latest_checkpointed_iteration.txt").read_text() == "2"
        rc.CheckpointEngine.connect(run).shutdown(stop_coordinator=True)
        lost = glob.glob(str(tmp_path / "ckpt" / "**" / "v000000000002"), recursive=True)
        assert lost
        for d in lost:
            shutil.rmtree(d)  # gone with its node's disk
        ray.get(rank.build.remote(12, ckpt), timeout=120)  # the job starts again: a new coordinator
        tracker = root / "latest_checkpointed_iteration.txt"
        # verl's trainer picks its folder with verl's find_latest_ckpt_path, which install() wrapped:
        # step 1's folder, and the tracker goes back to it, in this start
        assert ray.get(rank.call.remote(verl_find_latest, str(root)), timeout=60) == str(root / "global_step_1")
        assert tracker.read_text() == "1"
        assert ray.get(rank.call.remote(verl_find_latest, str(root)), timeout=60) == str(root / "global_step_1")
        # a driver that does not install(): the call before fit() does the same
        tracker.write_text("2")
        assert rv.rewind_lost_tracker(run, str(root)) == 1 and tracker.read_text() == "1"
        assert rv.rewind_lost_tracker(run, str(root)) == 1  # nothing lost at step 1: unchanged
        # neither: verl's trainer loads step 2; the load moves the tracker back and fails saying so
        tracker.write_text("2")
        err = ray.get(rank.load.remote(step_path(root, 2)), timeout=120)
        assert err and err.startswith("RestoreError") and "step 2" in err and "lost with a node" in err \
            and "step 1" in err and "start the run again" in err, err
        assert tracker.read_text() == "1"
        assert ray.get(rank.call.remote(verl_find_latest, str(root)), timeout=60) == str(root / "global_step_1")
        assert ray.get(rank.load.remote(step_path(root, 1)), timeout=120) is None
        assert_same_state(ray.get(rank.full.remote(), timeout=60), want)
        ray.get(rank.train.remote(1), timeout=60)
        ray.get(rank.save.remote(step_path(root, 2), 2), timeout=60)  # step 2 redone: not saved again
        assert rv.read_pointer(step_path(root, 2)) is None  # the lost version's pointer went with it
        ray.get(rank.train.remote(1), timeout=60)
        ray.get(rank.save.remote(step_path(root, 3), 3), timeout=60)
        assert ray.get(rank.wait.remote(60), timeout=90) is None
        assert rc.CheckpointEngine.connect(run).all_steps() == [1, 3]
        assert (root / "latest_checkpointed_iteration.txt").read_text() == "3"
        # back to step 1 again (verl's resume_from_path): step 3, committed since, stays listed and
        # its redo is not saved again (before: "step 3 ... is already committed"); step 4 is
        assert ray.get(rank.load.remote(step_path(root, 1)), timeout=120) is None
        for step in (2, 3, 4):
            ray.get(rank.train.remote(1), timeout=60)
            ray.get(rank.save.remote(step_path(root, step), step), timeout=60)
        assert ray.get(rank.wait.remote(60), timeout=90) is None
        assert rc.CheckpointEngine.connect(run).all_steps() == [1, 3, 4]
    finally:
        leave([rank])
        try:
            rc.CheckpointEngine.connect(run).shutdown(stop_coordinator=True)
        except rc.CheckpointError:
            pass


def test_verls_resume_goes_back_to_the_newest_step_every_role_has(ray_session, tmp_path):
    """An actor and a critic, each a run of its own, committed steps 1-3; the critic's versions of
    steps 2 and 3 were lost with a node (the actor's are still listed). verl's own
    ``find_latest_ckpt_path``, as ``RayPPOTrainer._load_checkpoint`` calls it in the driver, with
    ``install()`` there: step 1's folder, the tracker back at 1 (the actor's steps 2 and 3, still
    listed, are then not saved again when redone: ``committed.UsedSteps``). A folder that is not a
    ray_ckpt save is returned as verl found it."""
    import glob
    import shutil

    from verl.utils.checkpoint import checkpoint_manager

    import ray_ckpt as rc
    import ray_ckpt.integrations.verl as rv
    from ray_ckpt.integrations.committed import write_pointer

    root, local = tmp_path / "trainer", str(tmp_path / "ckpt")
    runs = {role: f"verl-roles-{role}" for role in ("actor", "critic")}
    engines = {role: rc.CheckpointEngine.create(run, local, critical_writers=1, best_effort_writers=0)
               for role, run in runs.items()}
    state = {"w": torch.zeros(4)}
    for eng in engines.values():
        eng.register("w", lambda: state)
    rv.install()
    try:
        for step in (1, 2, 3):
            state["w"] = torch.full((4,), float(step))
            for role, eng in engines.items():
                eng.save(step).result(timeout=60)
                write_pointer(str(root / f"global_step_{step}" / role), {"run": runs[role], "step": step})
        (root / "latest_checkpointed_iteration.txt").write_text("3")
        (tmp_path / "plain" / "global_step_5").mkdir(parents=True)
        (tmp_path / "plain" / "latest_checkpointed_iteration.txt").write_text("5")
        assert checkpoint_manager.find_latest_ckpt_path(str(tmp_path / "plain")) == str(tmp_path / "plain" / "global_step_5")
        assert checkpoint_manager.find_latest_ckpt_path(str(root)) == str(root / "global_step_3")  # nothing lost
        engines["critic"].shutdown(stop_coordinator=True)
        for v in (2, 3):
            for folder in glob.glob(f"{local}/**/{runs['critic']}/**/v00000000000{v}", recursive=True):
                shutil.rmtree(folder)  # gone with its node's disk
        engines["critic"] = rc.CheckpointEngine.create(runs["critic"], local, critical_writers=1, best_effort_writers=0)
        assert engines["critic"].all_steps() == [1] and engines["actor"].all_steps() == [1, 2, 3]
        assert checkpoint_manager.find_latest_ckpt_path(str(root)) == str(root / "global_step_1")
        assert (root / "latest_checkpointed_iteration.txt").read_text() == "1"
        assert checkpoint_manager.find_latest_ckpt_path(str(root)) == str(root / "global_step_1")  # stays
    finally:
        rv.uninstall()
        for eng in engines.values():
            eng.shutdown(stop_coordinator=True)


def test_max_ckpt_to_keep_is_the_runs_retention_applied_after_the_commit(verl_run, saved):
    """Last: it prunes the steps the tests above load. verl's trainer passes max_actor_ckpt_to_keep
    to every save_checkpoint; here 1: after step 6 commits, only step 6 is kept (step 2 went only
    then: the engine never prunes below the versions committed)."""
    import ray_ckpt as rc

    actors, root = verl_run["actors"], verl_run["root"]
    ranks = group(actors, 1)
    ray.get(ranks[0].build.remote(5, verl_run["ckpt"]), timeout=120)
    ray.get(ranks[0].save.remote(step_path(root, 6), 6, 1), timeout=60)
    assert ray.get(ranks[0].wait.remote(60), timeout=90) is None
    leave(ranks)
    engine = rc.CheckpointEngine.connect(verl_run["run"])
    deadline = time.monotonic() + 30
    while [m.step for m in engine.list_checkpoints()] != [6]:
        assert time.monotonic() < deadline, [m.step for m in engine.list_checkpoints()]
        time.sleep(0.2)
    assert engine.config.keep_last == 1
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "6"
