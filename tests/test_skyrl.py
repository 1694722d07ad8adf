"""SkyRL, for real (issue 48): ``RayCkptFSDPStrategy`` against SkyRL's own ``FSDPStrategy`` (FSDP2),
on CPU (gloo), Ray actors as ranks. Runs in the SkyRL environment (Python >= 3.12, ``make
install-skyrl``; ``make test-skyrl``); skipped where SkyRL is not installed.

Three rank actors (``tests/skyrl_rank.py``) import SkyRL once, with its CUDA calls stood in for
(``ray_ckpt.integrations.skyrl.cpu``); each group of 1, 2 or 3 of them builds a tiny Qwen2 with
SkyRL's ``setup_distributed`` / ``prepare`` (``fully_shard``, AdamW, LR scheduler) and trains
with its ``backward`` / ``optimizer_step``.

* 2 ranks train 2 steps and save ``global_step_2/policy`` with a client_state; SkyRL's tracker names
  step 2 once it commits; 2 fresh ranks load it (full parameters, AdamW moments, scheduler
  bit-equal; the replayed step 3 gives bit-identical logits), 1 rank and 3 ranks (other processes
  first) load it bit-equal, and ``load_checkpoint`` returns SkyRL's ``states`` (the client_state,
  the saving world size);
* the committed version exports to a Hugging Face folder that ``from_pretrained`` loads with the
  trained weights, bit-equal;
* a rank killed before its push of step 5 fails that version alone: the failure names step 5, the
  tracker keeps naming step 4, step 4 still loads, loading step 5 is an error naming it;
* SkyRL's trainer (``RayPPOTrainer.save_checkpoints``, its own method with ``RayCkptTrainerMixin``)
  leaves the tracker to the commit of every role;
* ``install()`` makes SkyRL's FSDP worker module build our strategy when ``$RAY_CKPT_SKYRL`` names
  a run, SkyRL's own otherwise;
* docs/skyrl.md's CPU recipe runs as written.
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys
import tempfile
from pathlib import Path

import pytest
import ray
import torch

import gloo_util
import skyrl_rank
from gloo_util import free_port, same_bits

if importlib.util.find_spec("skyrl") is None:
    pytest.skip("SkyRL is not installed: make install-skyrl, then make test-skyrl (docs/skyrl.md)",
                allow_module_level=True)

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]  # SkyRL's import and the ranks' start: minutes on 2 cores

for _m in (sys.modules[__name__], gloo_util, skyrl_rank):
    ray.cloudpickle.register_pickle_by_value(_m)

RANK_TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def ranks(ray_session):
    actors = [skyrl_rank.SkyRLRank.remote() for _ in range(3)]
    ray.get([a.pid.remote() for a in actors], timeout=300)
    yield actors
    for a in actors:
        ray.kill(a)


def group(actors, n):
    port = free_port()
    ray.get([a.join.remote(r, n, port) for r, a in enumerate(actors[:n])], timeout=60)
    return list(actors[:n])


@pytest.fixture(scope="module")
def setup(ranks, tmp_path_factory):
    root = tmp_path_factory.mktemp("skyrl")
    return {"root": root, "actors": ranks,
            "ck": {"run": f"sk{os.getpid()}", "local_dir": str(root / "local"), "rank_timeout_s": RANK_TIMEOUT_S}}


def full_equal(want, got, what):
    bad = [k for k in want["tensors"] if not same_bits(want["tensors"][k], got["tensors"][k])]
    assert not bad, f"{what}: {len(bad)} tensors differ, e.g. {bad[:4]}"
    assert set(want["tensors"]) == set(got["tensors"]) and want["plain"] == got["plain"], what


def tracker(ckpt_path):
    with open(os.path.join(ckpt_path, "latest_ckpt_global_step.txt")) as f:
        return int(f.read().strip())


@pytest.fixture(scope="module")
def saved(setup):
    """2 ranks train 2 steps and save step 2; the full state and the replayed step 3's logits."""
    actors, ck = setup["actors"], setup["ck"]
    ckpt_path = str(setup["root"] / "ckpt")
    d = os.path.join(ckpt_path, "global_step_2", "policy")
    rk = group(actors, 2)
    assert ray.get([r.build.remote(ck, 0) for r in rk], timeout=180) == ["RayCkptFSDPStrategy"] * 2
    ray.get([r.train.remote(1, 2) for r in rk], timeout=180)
    blocked = ray.get([r.save.remote(d, {"consumed_samples": 8, "epoch": 1}) for r in rk], timeout=120)
    want = ray.get([r.full.remote() for r in rk], timeout=60)[0]
    assert ray.get([r.wait.remote(120) for r in rk], timeout=150) == [None, None]
    step3 = ray.get([r.train.remote(3, 1) for r in rk], timeout=120)
    return {"dir": d, "ckpt_path": ckpt_path, "want": want, "step3": step3, "blocked": blocked}


def test_save_on_2_ranks_loads_bit_equal_on_2_1_and_3(setup, saved):
    actors, ck, d = setup["actors"], setup["ck"], saved["dir"]
    assert tracker(saved["ckpt_path"]) == 2
    assert sorted(os.listdir(d)) == ["huggingface", "ray_ckpt.json"]  # no torch.save file: the shards are the run's

    rk = group(actors, 2)  # the same processes, a fresh model (another seed) loads it and replays step 3
    ray.get([r.build.remote(ck, 5) for r in rk], timeout=180)
    out = ray.get([r.load.remote(d) for r in rk], timeout=120)
    assert all(isinstance(o, tuple) for o in out), out
    path, states = out[0]
    assert path == d and states["client_state"] == {"consumed_samples": 8, "epoch": 1}
    assert states["world_size"] == 2 and [o[1]["rank"] for o in out] == [0, 1]
    full_equal(saved["want"], ray.get([r.full.remote() for r in rk], timeout=60)[0], "2 ranks")
    again = ray.get([r.train.remote(3, 1) for r in rk], timeout=120)
    assert all(same_bits(a, b) for a, b in zip(again, saved["step3"]))

    solo = group(actors[2:], 1)  # another process
    ray.get(solo[0].build.remote(ck, 7), timeout=180)
    assert isinstance(ray.get(solo[0].load.remote(d), timeout=120), tuple)
    full_equal(saved["want"], ray.get(solo[0].full.remote(), timeout=60), "1 rank")

    three = group(actors[::-1], 3)  # rank 0 is the process that was not in the saving group
    ray.get([r.build.remote(ck, 9) for r in three], timeout=180)
    out = ray.get([r.load.remote(d) for r in three], timeout=120)
    assert all(isinstance(o, tuple) for o in out), out
    full_equal(saved["want"], ray.get([r.full.remote() for r in three], timeout=60)[0], "3 ranks")


def _export(self, d, out):
    from transformers import AutoModelForCausalLM

    from ray_ckpt.integrations.skyrl import export_hf

    export_hf(d, out)
    model = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    return sorted(os.listdir(out)), {n: p.detach().clone() for n, p in model.named_parameters()}


def test_a_committed_version_exports_to_hugging_face(setup, saved):
    out = str(setup["root"] / "hf")
    files, params = ray.get(setup["actors"][0].call.remote(_export, saved["dir"], out), timeout=180)
    assert "config.json" in files and any(f.endswith(".safetensors") for f in files), files
    want = saved["want"]["tensors"]
    assert params and all(same_bits(p, want[f"model/{n}"]) for n, p in params.items())


def _install_check(self, settings):
    from skyrl.backends.skyrl_train.workers.fsdp import fsdp_worker

    import ray_ckpt.integrations.skyrl as rs

    rs.install()
    try:
        kw = skyrl_rank.skyrl_configs()
        os.environ.pop(rs.ENV, None)
        stock = type(fsdp_worker.FSDPStrategy(**kw)).__name__
        os.environ[rs.ENV] = settings
        ours = type(fsdp_worker.FSDPStrategy(**kw)).__name__
    finally:
        os.environ.pop(rs.ENV, None)
        rs.uninstall()
    return stock, ours, rs.installed()


def test_install_makes_skyrls_fsdp_workers_build_our_strategy(setup):
    import json

    stock, ours, after = ray.get(setup["actors"][0].call.remote(
        _install_check, json.dumps({"run": "x", "local_dir": "/tmp/x"})), timeout=120)
    assert (stock, ours, after) == ("FSDPStrategy", "RayCkptFSDPStrategy", False)


def _trainer_save(self, ckpt_path, step, both):
    """SkyRL's own ``RayPPOTrainer.save_checkpoints`` with the mixin, its models' saves going to this
    rank group's strategy (``save_checkpoint`` of the worker, as SkyRL's dispatch calls it)."""
    from skyrl.train.config import SkyRLTrainConfig
    from skyrl.train.trainer import RayPPOTrainer

    from ray_ckpt.integrations.skyrl import RayCkptTrainerMixin

    class Trainer(RayCkptTrainerMixin, RayPPOTrainer):
        pass

    class Models:  # what WorkerDispatch.save_checkpoint does for one rank: the worker's save_checkpoint
        def save_checkpoint(this, model, ckpt_dir, tokenizer=None):
            if model == "policy" or both:
                self.strategy.save_checkpoint(self.model, ckpt_dir, node_local_rank=self.rank, optimizer=self.opt,
                                              scheduler=self.sched, tokenizer=tokenizer)

        def get_node_ids(this):
            return [ray.get_runtime_context().get_node_id()]

    class Loader:
        def state_dict(this):
            return {"position": step}

    cfg = SkyRLTrainConfig()
    cfg.trainer.ckpt_path, cfg.trainer.max_ckpts_to_keep = ckpt_path, -1
    cfg.trainer.critic.model.path = "critic"  # has_critic: the step needs a policy and a critic
    trainer = Trainer.__new__(Trainer)  # SkyRL's __init__ builds datasets and worker groups: set what the method reads
    trainer.cfg, trainer.global_step, trainer.dispatch, trainer.train_dataloader = cfg, step, Models(), Loader()
    trainer.tokenizer, trainer.all_timings, trainer._node_ids = None, {}, None
    trainer.save_checkpoints()
    path = os.path.join(ckpt_path, "latest_ckpt_global_step.txt")
    return open(path).read().strip() if os.path.exists(path) else None


def test_skyrls_trainer_leaves_its_tracker_to_the_commit_of_every_role(setup):
    """Step 6: the policy commits but the critic never saves: the trainer's own method returns, its
    tracker write is withheld, and the tracker never names 6. Step 7: both roles commit, the
    tracker names 7."""
    actors, ck = setup["actors"], setup["ck"]
    ckpt_path = str(setup["root"] / "trainer")
    rk = group(actors, 1)
    ray.get(rk[0].build.remote(ck, 0), timeout=180)
    ray.get(rk[0].train.remote(1, 1), timeout=60)
    assert ray.get(rk[0].call.remote(_trainer_save, ckpt_path, 6, False), timeout=120) is None
    assert ray.get(rk[0].wait.remote(60), timeout=90) is None
    assert not os.path.exists(os.path.join(ckpt_path, "latest_ckpt_global_step.txt"))
    assert os.path.isfile(os.path.join(ckpt_path, "global_step_6", "trainer_state.pt"))
    ray.get(rk[0].call.remote(_trainer_save, ckpt_path, 7, True), timeout=120)
    assert ray.get(rk[0].wait.remote(60), timeout=90) is None
    assert tracker(ckpt_path) == 7


def _run_snippet(self, code: str) -> None:
    self.leave()  # the snippet forms its own one-rank group
    os.chdir(tempfile.mkdtemp())
    exec(compile(code, "docs/skyrl.md", "exec"), {"__name__": "docs_skyrl"})


def test_docs_cpu_recipe_runs_as_written(setup):
    """docs/skyrl.md's "Try it on a CPU" block, run as written in a rank actor's process."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "skyrl.md").read_text(encoding="utf-8")
    section = re.search(r"^## Try it on a CPU$(.*?)(?=^## |\Z)", text, re.M | re.S).group(1)
    blocks = re.findall(r"^```python\n(.*?)^```", section, re.M | re.S)
    assert len(blocks) == 1
    ray.get(setup["actors"][0].call.remote(_run_snippet, blocks[0]), timeout=300)


def test_a_resume_after_the_newest_version_was_lost_goes_back_to_the_step_before(setup):
    """SkyRL's tracker names a step whose version committed and was lost with its node since: its
    trainer has taken the step count from that folder, so the load fails saying so and moves the
    tracker back to the newest complete step (which then loads bit-equal); the redone step is not
    saved again (the coordinator would refuse it) and its stale pointer goes; the next step saves."""
    import glob
    import shutil

    import ray_ckpt as rc

    actors = setup["actors"]
    ck = dict(setup["ck"], run=f"{setup['ck']['run']}-lost", local_dir=str(setup["root"] / "lost-local"))
    ckpt_path, run = str(setup["root"] / "lost"), f"{ck['run']}-policy"
    d1, d2, d3 = (os.path.join(ckpt_path, f"global_step_{s}", "policy") for s in (1, 2, 3))
    solo = group(actors, 1)
    try:
        ray.get(solo[0].build.remote(ck, 0), timeout=180)
        ray.get(solo[0].train.remote(1, 1), timeout=60)
        ray.get(solo[0].save.remote(d1, {"s": 1}), timeout=60)
        assert ray.get(solo[0].wait.remote(60), timeout=90) is None
        want = ray.get(solo[0].full.remote(), timeout=60)
        ray.get(solo[0].train.remote(2, 1), timeout=60)
        ray.get(solo[0].save.remote(d2, {"s": 2}), timeout=60)
        assert ray.get(solo[0].wait.remote(60), timeout=90) is None
        assert tracker(ckpt_path) == 2
        rc.CheckpointEngine.connect(run).shutdown(stop_coordinator=True)
        lost = glob.glob(str(setup["root"] / "lost-local" / "**" / "v000000000002"), recursive=True)
        assert lost
        for folder in lost:
            shutil.rmtree(folder)  # gone with its node's disk
        ray.get(solo[0].build.remote(ck, 5), timeout=180)  # the job starts again: a new coordinator
        err = ray.get(solo[0].load.remote(d2), timeout=120)
        assert isinstance(err, str) and err.startswith("RestoreError") and "step 2" in err \
            and "lost with a node" in err and "start the run again" in err, err
        assert tracker(ckpt_path) == 1
        path, states = ray.get(solo[0].load.remote(d1), timeout=120)
        assert path == d1 and states["client_state"] == {"s": 1}
        full_equal(want, ray.get(solo[0].full.remote(), timeout=60), "resumed from step 1")
        ray.get(solo[0].train.remote(2, 1), timeout=60)
        ray.get(solo[0].save.remote(d2, {"s": 2}), timeout=60)  # step 2 redone: not saved again
        assert not os.path.exists(os.path.join(d2, "ray_ckpt.json"))  # the lost version's pointer went
        ray.get(solo[0].train.remote(3, 1), timeout=60)
        ray.get(solo[0].save.remote(d3, {"s": 3}), timeout=60)
        assert ray.get(solo[0].wait.remote(60), timeout=90) is None
        assert rc.CheckpointEngine.connect(run).all_steps() == [1, 3] and tracker(ckpt_path) == 3
    finally:
        try:
            rc.CheckpointEngine.connect(run).shutdown(stop_coordinator=True)
        except rc.CheckpointError:
            pass


def _trainer_load(self, ckpt_path):
    """SkyRL's own ``RayPPOTrainer.load_checkpoints`` (resume mode ``latest``) with the mixin, its
    models' loads going to this rank group's strategy; (step, path, tracker after, folders after)."""
    from skyrl.train.config import SkyRLTrainConfig
    from skyrl.train.trainer import RayPPOTrainer, ResumeMode

    from ray_ckpt.integrations.skyrl import RayCkptTrainerMixin

    class Trainer(RayCkptTrainerMixin, RayPPOTrainer):
        pass

    class Models:  # what WorkerDispatch.load_checkpoint does for one rank: the worker's load_checkpoint
        def load_checkpoint(this, model, ckpt_dir, **kw):
            out = self.strategy.load_checkpoint(self.model, ckpt_dir, optimizer=self.opt, scheduler=self.sched)
            self.loaded = getattr(self, "loaded", []) + [(model, out[0])]

    class Loader:
        def load_state_dict(this, state):
            self.data_state = state

    cfg = SkyRLTrainConfig()
    cfg.trainer.ckpt_path, cfg.trainer.ckpt_interval = ckpt_path, 1
    cfg.trainer.critic.model.path = "critic"
    trainer = Trainer.__new__(Trainer)
    trainer.cfg, trainer.dispatch, trainer.train_dataloader = cfg, Models(), Loader()
    trainer.resume_mode = ResumeMode.LATEST
    self.loaded = []
    step, path = trainer.load_checkpoints()
    return step, path, open(os.path.join(ckpt_path, "latest_ckpt_global_step.txt")).read().strip(), \
        sorted(os.listdir(ckpt_path)), self.loaded, self.data_state


def test_skyrls_trainer_resumes_past_a_lost_version_in_the_same_start(setup):
    """SkyRL's tracker names step 3, whose policy version was lost with its node (the critic's is
    still listed): the mixin's ``load_checkpoints`` moves the tracker back to step 1, the newest step
    both roles still have (step 2's policy version is gone too), moves global_step_2 and _3 aside
    (SkyRL's own check refuses a tracker more than ckpt_interval behind its newest folder) and SkyRL
    loads step 1, both roles bit-equal to what was saved. Training then goes on: the redone steps 2
    and 3 are saved by neither role (the critic's committed ones stay listed; its first redone save
    failed with "already committed" before), step 4 by both, and the tracker names 4; the folders
    moved aside stay until then and are removed at step 4's commit."""
    import glob
    import shutil

    import ray_ckpt as rc

    actors = setup["actors"]
    ck = dict(setup["ck"], run=f"{setup['ck']['run']}-mix", local_dir=str(setup["root"] / "mix-local"))
    ckpt_path = str(setup["root"] / "mix")
    solo = group(actors, 1)
    try:
        ray.get(solo[0].build.remote(ck, 0), timeout=180)
        for step in (1, 2, 3):
            ray.get(solo[0].train.remote(step, 1), timeout=60)
            ray.get(solo[0].call.remote(_trainer_save, ckpt_path, step, True), timeout=120)
            assert ray.get(solo[0].wait.remote(60), timeout=90) is None
            if step == 1:
                want = ray.get(solo[0].full.remote(), timeout=60)
        assert tracker(ckpt_path) == 3
        policy = f"{ck['run']}-policy"
        rc.CheckpointEngine.connect(policy).shutdown(stop_coordinator=True)
        for v in (2, 3):
            for folder in glob.glob(str(setup["root"] / "mix-local" / "**" / policy / "**" / f"v00000000000{v}"),
                                    recursive=True):
                shutil.rmtree(folder)  # gone with its node's disk
        engine = rc.CheckpointEngine.create(policy, ck["local_dir"], critical_writers=1, best_effort_writers=0,
                                            rank_timeout_s=ck["rank_timeout_s"])
        assert engine.all_steps() == [1], engine.all_steps()
        ray.get(solo[0].build.remote(ck, 5), timeout=180)  # the job starts again
        step, path, after, folders, loaded, data = ray.get(solo[0].call.remote(_trainer_load, ckpt_path), timeout=180)
        assert step == 1 and path.endswith("global_step_1") and after == "1" and data == {"position": 1}
        assert "global_step_2" not in folders and "global_step_3" not in folders
        assert "ray_ckpt_lost.global_step_2" in folders and "ray_ckpt_lost.global_step_3" in folders
        assert [m for m, _ in loaded] == ["policy", "critic"]
        full_equal(want, ray.get(solo[0].full.remote(), timeout=60), "resumed from step 1")
        # the redone steps: 2 and 3 are saved by neither role (the policy's are lost; the critic's
        # were committed before the resume went back past them), step 4 by both
        for step in (2, 3, 4):
            ray.get(solo[0].train.remote(step, 1), timeout=60)
            ray.get(solo[0].call.remote(_trainer_save, ckpt_path, step, True), timeout=120)
            assert ray.get(solo[0].wait.remote(60), timeout=90) is None
            if step == 3:  # the folders moved aside stay until a step past them is complete
                assert tracker(ckpt_path) == 1 and {"ray_ckpt_lost.global_step_2", "ray_ckpt_lost.global_step_3"} \
                    <= set(os.listdir(ckpt_path))
        assert rc.CheckpointEngine.connect(policy).all_steps() == [1, 4]
        assert rc.CheckpointEngine.connect(f"{ck['run']}-critic").all_steps() == [1, 2, 3, 4]
        assert tracker(ckpt_path) == 4
        assert not [f for f in os.listdir(ckpt_path) if f.startswith("ray_ckpt_lost.")]  # removed at step 4
    finally:
        for role in ("policy", "critic"):
            try:
                rc.CheckpointEngine.connect(f"{ck['run']}-{role}").shutdown(stop_coordinator=True)
            except rc.CheckpointError:
                pass


def test_a_rank_killed_before_its_push_fails_that_version_alone(setup):
    """Step 4 commits on 2 ranks; rank 1 is killed before it pushes step 5: step 5 fails
    (rank_timeout_s), the failure names it, the tracker keeps naming step 4, step 4 still loads on
    another rank, loading step 5 is an error naming it. Runs last: it kills a rank."""
    import ray_ckpt as rc

    actors, ck = setup["actors"], setup["ck"]
    ckpt_path = str(setup["root"] / "killed")
    rk = group(actors, 2)
    ray.get([r.build.remote(ck, 0) for r in rk], timeout=180)
    ray.get([r.train.remote(1, 1) for r in rk], timeout=60)
    d4, d5 = (os.path.join(ckpt_path, f"global_step_{s}", "policy") for s in (4, 5))
    ray.get([r.save.remote(d4, {"s": 4}) for r in rk], timeout=60)
    assert ray.get([r.wait.remote(60) for r in rk], timeout=90) == [None, None]
    assert tracker(ckpt_path) == 4

    ray.get(rk[0].save.remote(d5, {"s": 5}), timeout=60)
    ray.kill(rk[1])  # rank 1 dies before its push of step 5
    err = ray.get(rk[0].wait.remote(RANK_TIMEOUT_S + 60), timeout=RANK_TIMEOUT_S + 90)
    assert err and "step 5" in err, err
    engine = rc.CheckpointEngine.connect(f"{ck['run']}-policy")
    assert 4 in engine.all_steps() and 5 not in engine.all_steps()
    assert tracker(ckpt_path) == 4 and not os.path.exists(os.path.join(d5, "ray_ckpt.json"))

    solo = group(actors[2:], 1)
    ray.get(solo[0].build.remote(ck, 3), timeout=180)
    path, states = ray.get(solo[0].load.remote(d4), timeout=120)
    assert path == d4 and states["client_state"] == {"s": 4}
    err = ray.get(solo[0].load.remote(d5), timeout=120)
    assert isinstance(err, str) and "step 5" in err, err
