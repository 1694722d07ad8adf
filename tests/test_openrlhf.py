"""OpenRLHF with real DeepSpeed (issue 30): ``RayCkptDeepspeedStrategy`` against OpenRLHF's
``DeepspeedStrategy`` and DeepSpeed ZeRO-1/2/3 themselves, on CPU (gloo), Ray actors as ranks.

Three rank actors (``tests/openrlhf_rank.py``) import OpenRLHF and DeepSpeed once; each group of
1, 2 or 3 of them builds a tiny Qwen2 (``from_config``, no download) with OpenRLHF's own
``prepare`` at the stage under test, its embedding frozen (``requires_grad=False``: stored as its
16-bit values, the other 16-bit weights are cast from their fp32 masters on load). For each ZeRO
stage, 2 ranks train 2 steps and save ``global_step<N>`` with a client_state, then train one more
step (the replay's reference):

* 2 fresh ranks load it: the full fp32 masters, Adam moments and 16-bit weights (gathered with
  DeepSpeed's ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` /
  ``GatheredParameters``), scheduler and engine counters are bit-equal, the client_state comes
  back, and the replayed step gives bit-identical logits;
* 1 and 3 ranks (other processes first) load it: the same full tensors, bit-equal;
* ZeRO-2's version loads into ZeRO-3 and ZeRO-3's into ZeRO-2, bit-equal;
* DeepSpeed's other optimizers (issue 44): ``BF16_Optimizer`` (ZeRO-1, bf16 + fp32 gradient
  accumulation), ZeRO-2 with fp32 accumulation, ``--ds.adam_offload`` (``DeepSpeedCPUAdam``) on
  ZeRO-1 and ZeRO-3: save on 2, reload on 2 (replayed step identical), on 3 and on plain ZeRO of
  another stage, bit-equal; ZeRO-2's version loads into ``BF16_Optimizer``; settings the strategy
  cannot save are refused when it is built, naming the flag;
* ``load_module_only``: the 16-bit weights, fp32 masters refreshed from them (ZeRO-2, ZeRO-3);
* an overlapped save (the default) between a backward and its optimizer step, and the next one:
  each version holds the state at its call, bit-exact (ZeRO-2, ZeRO-3);
* the partition flattened once and reused across saves follows the optimizer's buffers: saves
  before the first step, after it, and after the moments were replaced each hold their call's state;
* a version of layout 1 (the whole 16-bit module state stored, as before) still loads;
* docs/openrlhf.md's CPU recipe runs as written (one rank, ZeRO-2, save and load);
* retention (``max_num``) keeps the newest committed versions only after a commit; a rank killed
  before its push fails that version alone: the previous one stays, ``latest`` does not move,
  loading the failed tag is an error naming it.

The first test needs no DeepSpeed: ``TensorChunk`` boxes (what the strategy pushes) pushed by two
ranks and read back as other boxes.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import ray
import torch

import gloo_util
import openrlhf_rank
from gloo_util import free_port, same_bits

if importlib.util.find_spec("openrlhf") is None or importlib.util.find_spec("deepspeed") is None:
    pytest.skip('OpenRLHF / DeepSpeed are not installed: see docs/openrlhf.md (install)', allow_module_level=True)

pytestmark = pytest.mark.timeout(420)

for _m in (sys.modules[__name__], gloo_util, openrlhf_rank):
    ray.cloudpickle.register_pickle_by_value(_m)

RANK_TIMEOUT_S = 4.0
FREEZE = ("model.embed_tokens.weight",)  # a frozen parameter: no fp32 master, its 16-bit values stored


def test_tensor_chunks_are_resharded_by_their_boxes(engine_factory):
    """Two ranks push uneven, arbitrary ranges of a flattened tensor (a ZeRO-1/2 partition starts
    and ends anywhere; one rank holds nothing of ``b``); three other boxes read back bit-equal."""
    from ray_ckpt.formats.sharded_leaf import TensorChunk

    eng = engine_factory()
    eng.register("optim", world_size=2)
    a, b = torch.randn(37), torch.randn(5)
    parts = [{"a": TensorChunk(a[:11], (37,), (0,)), "b": TensorChunk(b[:0], (5,), (0,))},
             {"a": TensorChunk(a[11:], (37,), (11,)), "b": TensorChunk(b, (5,), (0,))}]
    handles = [eng.submit(1, "optim", parts[r], rank=r) for r in range(2)]
    [h.wait(timeout=60) for h in handles]
    for lo, hi in [(0, 37), (5, 30), (36, 37)]:
        target = {"a": TensorChunk(torch.empty(hi - lo), (37,), (lo,)), "b": TensorChunk(torch.empty(5), (5,), (0,))}
        eng.load_into("optim", target, step=1, rank=0)
        assert same_bits(target["a"].local, a[lo:hi]) and same_bits(target["b"].local, b)
    full = eng.load("optim", step=1, rank=None)
    assert same_bits(full["a"], a) and same_bits(full["b"], b)


def test_package_imports_neither_openrlhf_nor_deepspeed():
    code = ("import sys, ray_ckpt.integrations.openrlhf as o; o.read_settings(None); "
            "print(sorted(m for m in ('deepspeed', 'openrlhf', 'flash_attn') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def _settings_from_flags(self, argv):
    """OpenRLHF's own argparse + ``hierarchize`` path, and the strategy's check of its settings."""
    import argparse

    from openrlhf.utils.config import hierarchize

    import ray_ckpt as rc
    from ray_ckpt.integrations.openrlhf import RayCkptDeepspeedStrategy, add_arguments, read_settings

    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt.max_num", type=int, default=3)
    args = hierarchize(add_arguments(parser).parse_args(argv))
    s = read_settings(args)
    sync = read_settings(hierarchize(add_arguments(argparse.ArgumentParser()).parse_args(
        ["--ray_ckpt.run", "x", "--ray_ckpt.overlap", "false"])))
    try:
        read_settings(argparse.Namespace(ray_ckpt={"run": "x", "overlap": "sometimes"}))
        bad = None
    except rc.InvalidArgumentError as exc:
        bad = str(exc)
    assert s.overlap is True and sync.overlap is False and bad and "overlap" in bad, (s, sync, bad)
    try:
        RayCkptDeepspeedStrategy(args=openrlhf_rank.strategy_args())
        missing = None
    except rc.InvalidArgumentError as exc:
        missing = str(exc)
    return s.run, s.create, s.run_of("/ckpt/_critic"), s.load_wait_s, missing


def test_settings_come_from_ray_ckpt_flags(setup):
    run, create, critic, wait, missing = ray.get(setup["actors"][0].call.remote(
        _settings_from_flags, ["--ray_ckpt.run", "ppo", "--ray_ckpt.local_dir", "/ckpt/{node_id}",
                               "--ray_ckpt.rank_timeout_s", "30", "--ray_ckpt.load_wait_s", "5"]), timeout=120)
    assert (run, critic, wait) == ("ppo", "ppo-critic", 5.0)
    assert create == {"local_dir": "/ckpt/{node_id}", "rank_timeout_s": 30.0}
    assert missing and "args.ray_ckpt.run" in missing


@pytest.fixture(scope="module")
def ranks(ray_session):
    actors = [openrlhf_rank.DSRank.remote() for _ in range(3)]
    ray.get([a.pid.remote() for a in actors], timeout=240)
    yield actors
    for a in actors:
        ray.kill(a)


def group(actors, n):
    port = free_port()
    ray.get([a.join.remote(r, n, port) for r, a in enumerate(actors[:n])], timeout=60)
    return list(actors[:n])


@pytest.fixture(scope="module")
def setup(ranks, tmp_path_factory):
    root = tmp_path_factory.mktemp("openrlhf")
    run = f"or{os.getpid()}"
    return {"root": root, "actors": ranks, "saved": {},
            "ck": {"run": run, "local_dir": str(root / "local"), "rank_timeout_s": RANK_TIMEOUT_S}}


@pytest.fixture(autouse=True)
def _stop_the_tests_own_runs(request):
    """A test that makes a run of its own (overlap, partition reuse, layout 1, the docs recipe) stops
    it at its end: the run is created inside a rank actor and outlives it, and each run's writers
    hold CPUs of the session's 4, so the later tests' runs could not start. The stage tests' shared
    run (``<run>-actor``) stays for the tests that follow it."""
    if "setup" not in request.fixturenames:
        yield
        return
    from ray_ckpt.protocol import NAMESPACE

    shared = request.getfixturevalue("setup")["ck"]["run"] + "-actor"

    def ours():
        return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a.get("namespace") == NAMESPACE}

    before = ours()
    yield
    for name in ours() - before:
        if shared not in name.split("."):  # its coordinator, mailbox and writers are named after it
            try:
                ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
            except (ValueError, ray.exceptions.RayError):
                pass


def save_dir(setup, stage):
    return str(setup["root"] / f"zero{stage}" / "_actor")  # one run ("<run>-actor"), a folder per stage


def full_equal(want, got, what):
    bad = [k for k in want["tensors"] if not same_bits(want["tensors"][k], got["tensors"][k])]
    assert not bad, f"{what}: {len(bad)} tensors differ, e.g. {bad[:4]}"
    assert set(want["tensors"]) == set(got["tensors"])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_reloads_bit_exact_on_2_1_and_3_ranks(setup, stage):
    t0 = time.perf_counter()
    actors, ck = setup["actors"], setup["ck"]
    step = 10 * stage + 2  # one run for the three stages: its steps increase
    tag = f"global_step{step}"
    client = {"consumed_samples": 4 * stage, "dataloader": {"epoch": 0, "position": 7 + stage}}
    rk = group(actors, 2)
    ray.get([r.build.remote(stage, ck, 0, freeze=FREEZE) for r in rk], timeout=120)
    ray.get([r.train.remote(1, 2) for r in rk], timeout=120)
    blocked = ray.get([r.save.remote(save_dir(setup, stage), tag, client) for r in rk], timeout=120)
    want = ray.get([r.full.remote() for r in rk], timeout=60)[0]
    replay_ref = ray.get([r.train.remote(3, 1) for r in rk], timeout=60)
    assert ray.get([r.wait.remote(60) for r in rk], timeout=90) == [None, None]
    setup["saved"][stage] = (tag, want)
    assert os.path.isfile(os.path.join(save_dir(setup, stage), tag, "ray_ckpt.json"))
    with open(os.path.join(save_dir(setup, stage), "latest")) as f:
        assert f.read().strip() == tag  # DeepSpeed's tracker, written at the commit

    rk = group(actors, 2)  # fresh engines (another seed): everything comes from the checkpoint
    ray.get([r.build.remote(stage, ck, 5, freeze=FREEZE) for r in rk], timeout=120)
    loaded = ray.get([r.load.remote(save_dir(setup, stage)) for r in rk], timeout=120)
    assert [states for _, states in loaded] == [client, client], loaded
    full_equal(want, ray.get([r.full.remote() for r in rk], timeout=60)[0], f"ZeRO-{stage} on 2 ranks")
    assert ray.get([r.full.remote() for r in rk], timeout=60)[0]["scalars"] == want["scalars"]
    replay = ray.get([r.train.remote(3, 1) for r in rk], timeout=60)
    assert all(same_bits(a, b) for a, b in zip(replay_ref, replay)), "the replayed step differs"

    for n, order in ((1, actors[2:]), (3, actors[::-1])):  # other processes than the saving ranks first
        rk = group(order, n)
        ray.get([r.build.remote(stage, ck, 9, freeze=FREEZE) for r in rk], timeout=120)
        errors = [x for x in ray.get([r.load.remote(save_dir(setup, stage), tag) for r in rk], timeout=120)
                  if isinstance(x, str)]
        assert not errors, errors
        got = ray.get([r.full.remote() for r in rk], timeout=60)[0]
        full_equal(want, got, f"ZeRO-{stage} saved on 2, loaded on {n}")
        assert got["scalars"] == want["scalars"]
    print(f"ZeRO-{stage}: save blocked {max(blocked) * 1e3:.0f} ms; all loads {time.perf_counter() - t0:.1f} s")


@pytest.mark.parametrize("saved_stage,load_stage,ds", [(2, 3, None), (3, 2, None), (2, 1, {"grad_accum_dtype": "fp32"})],
                         ids=["2-as-3", "3-as-2", "2-as-bf16-optimizer"])
def test_another_zero_stage_loads_it(setup, saved_stage, load_stage, ds):
    """A version loads on another stage bit-equal; ZeRO-2's also into DeepSpeed's BF16_Optimizer
    (ZeRO-1 with fp32 gradient accumulation)."""
    if saved_stage not in setup["saved"]:
        pytest.skip(f"ZeRO-{saved_stage}'s save did not run")
    tag, want = setup["saved"][saved_stage]
    rk = group(setup["actors"], 2)
    ray.get([r.build.remote(load_stage, setup["ck"], 11, ds=ds, freeze=FREEZE) for r in rk], timeout=120)
    if ds:
        assert ray.get(rk[0].optimizers.remote(), timeout=60)[0] == "BF16_Optimizer"
    errors = [x for x in ray.get([r.load.remote(save_dir(setup, saved_stage), tag) for r in rk], timeout=120)
              if isinstance(x, str)]
    assert not errors, errors
    full_equal(want, ray.get([r.full.remote() for r in rk], timeout=60)[0],
               f"ZeRO-{saved_stage} loaded as ZeRO-{load_stage}")


# (ZeRO stage, args.ds, DeepSpeed's optimizer and the one it wraps): bf16 parameters throughout.
# DeepSpeed 0.19 builds its BF16_Optimizer for bf16 + fp32 gradient accumulation on ZeRO-1 only,
# and not with an offloaded optimizer (engine._do_optimizer_sanity_check); ZeRO-2 then keeps its
# ZeRO optimizer, accumulating in fp32. --ds.adam_offload lets DeepSpeed choose DeepSpeedCPUAdam
# (a C++ op, compiled on first use).
OPTIMIZERS = {
    "bf16-optimizer-zero1": (1, {"grad_accum_dtype": "fp32"}, ("BF16_Optimizer", "AdamW")),
    "fp32-accumulation-zero2": (2, {"grad_accum_dtype": "fp32"}, ("DeepSpeedZeroOptimizer", "AdamW")),
    "adam-offload-zero1": (1, {"adam_offload": True}, ("DeepSpeedZeroOptimizer", "DeepSpeedCPUAdam")),
    "adam-offload-zero3": (3, {"adam_offload": True}, ("DeepSpeedZeroOptimizer_Stage3", "DeepSpeedCPUAdam")),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_other_deepspeed_optimizers_reload_bit_exact(setup, kind):
    """Issue 44: each optimizer DeepSpeed builds for these settings (checked by class) saves on 2
    ranks and loads bit-equal (fp32 masters, moments, 16-bit weights, scalars) on 2 ranks of the
    same settings, whose replayed step gives identical logits; on 3 ranks of the same settings;
    and on 2 ranks of plain ZeRO at another stage."""
    stage, ds, optimizers = OPTIMIZERS[kind]
    actors = setup["actors"]
    ck = dict(setup["ck"], run=setup["ck"]["run"] + "opt")
    d = str(setup["root"] / kind / "_actor")
    step = 5 + list(OPTIMIZERS).index(kind)  # one run for every kind: its steps increase
    tag = f"global_step{step}"
    rk = group(actors, 2)
    ray.get([r.build.remote(stage, ck, 0, ds=ds, freeze=FREEZE) for r in rk], timeout=300)
    assert ray.get(rk[0].optimizers.remote(), timeout=60) == optimizers
    ray.get([r.train.remote(1, 2) for r in rk], timeout=120)
    ray.get([r.save.remote(d, tag, {"kind": kind}) for r in rk], timeout=120)
    want = ray.get([r.full.remote() for r in rk], timeout=60)[0]
    replay_ref = ray.get([r.train.remote(3, 1) for r in rk], timeout=60)
    assert ray.get([r.wait.remote(60) for r in rk], timeout=90) == [None, None]

    rk = group(actors, 2)
    ray.get([r.build.remote(stage, ck, 5, ds=ds, freeze=FREEZE) for r in rk], timeout=300)
    out = ray.get([r.load.remote(d, tag) for r in rk], timeout=120)
    assert [x[1] if isinstance(x, tuple) else x for x in out] == [{"kind": kind}] * 2, out
    got = ray.get([r.full.remote() for r in rk], timeout=60)[0]
    full_equal(want, got, f"{kind} on 2 ranks")
    assert got["scalars"] == want["scalars"]
    replay = ray.get([r.train.remote(3, 1) for r in rk], timeout=60)
    assert all(same_bits(a, b) for a, b in zip(replay_ref, replay)), f"{kind}: the replayed step differs"

    for n, load_stage, load_ds in ((3, stage, ds), (2, 3 if stage != 3 else 2, None)):
        rk = group(actors[::-1], n)
        ray.get([r.build.remote(load_stage, ck, 9, ds=load_ds, freeze=FREEZE) for r in rk], timeout=300)
        load_ok(rk, d, tag)
        got = ray.get([r.full.remote() for r in rk], timeout=60)[0]
        full_equal(want, got, f"{kind} saved on 2, loaded on {n} ranks of ZeRO-{load_stage} {load_ds or ''}")
        assert got["scalars"] == want["scalars"]


def _refused_settings(self):
    """What the strategy's constructor says to settings it cannot save."""
    import ray_ckpt as rc
    from ray_ckpt.integrations.openrlhf import RayCkptDeepspeedStrategy

    out = []
    for stage, ds in ((0, {}), (2, {"ring_attn_size": 2}), (2, {"tensor_parallel_size": 2})):
        args = openrlhf_rank.strategy_args({"run": "x"})
        vars(args.ds).update(ds)
        try:
            RayCkptDeepspeedStrategy(zero_stage=stage, args=args)
            out.append(None)
        except rc.InvalidArgumentError as exc:
            out.append(str(exc))
    return out


def test_unsupported_settings_are_refused_when_the_strategy_is_built(setup):
    zero0, ring, tp = ray.get(setup["actors"][0].call.remote(_refused_settings), timeout=120)
    assert zero0 and "--ds.zero_stage 0" in zero0
    assert ring and "--ds.ring_attn_size" in ring
    assert tp and "--ds.tensor_parallel_size" in tp


@pytest.mark.parametrize("stage", [2, 3])
def test_load_module_only_takes_the_weights_and_refreshes_fp32_from_them(setup, stage):
    """As DeepSpeed's ``load_module_only``: the 16-bit weights come back, the fp32 masters are
    their up-cast (``refresh_fp32_params``), the optimizer's moments and counters are left alone."""
    if stage not in setup["saved"]:
        pytest.skip(f"ZeRO-{stage}'s save did not run")
    tag, want = setup["saved"][stage]
    rk = group(setup["actors"], 2)
    ray.get([r.build.remote(stage, setup["ck"], 13, freeze=FREEZE) for r in rk], timeout=120)
    out = ray.get([r.load.remote(save_dir(setup, stage), tag, load_module_only=True) for r in rk], timeout=120)
    assert not [x for x in out if isinstance(x, str)], out
    got = ray.get([r.full.remote(moments=False) for r in rk], timeout=60)[0]  # a fresh engine has none
    lp = [k for k in want["tensors"] if k.startswith("lp/")]
    assert lp and all(same_bits(want["tensors"][k], got["tensors"][k]) for k in lp)
    for k in lp:
        if k[3:] not in FREEZE:
            assert same_bits(got["tensors"]["fp32/" + k[3:]], want["tensors"][k].float())
    assert got["scalars"]["global_steps"] == 0  # module only: the engine's counters are not loaded


def load_ok(rk, d, tag):
    out = ray.get([r.load.remote(d, tag) for r in rk], timeout=120)
    assert not [x for x in out if isinstance(x, str)], out


@pytest.mark.parametrize("stage", [2, 3])
def test_overlapped_save_holds_the_state_at_its_call(setup, stage):
    """``save_ckpt`` (overlapped: the default) between a backward and its optimizer step, which
    changes the fp32 masters and moments in place right after the call returns, then the next
    step the same way: each version loads bit-equal to the state at its call (the second one: the
    first one reloaded plus the step replayed). The run checks every copy against its source after
    the copy (``overlap_check``): a torn copy would fail the version."""
    actors = setup["actors"]
    ck = dict(setup["ck"], run=setup["ck"]["run"] + "ov", engine_options={"overlap_check": True})
    d = str(setup["root"] / f"overlap{stage}" / "_actor")
    rk = group(actors, 2)
    ray.get([r.build.remote(stage, ck, 0, 128, 2, freeze=FREEZE) for r in rk], timeout=120)
    first = 10 * stage  # one run for both stages: its steps increase
    ray.get([r.train.remote(first + 1, 1) for r in rk], timeout=120)
    want = ray.get([r.full.remote() for r in rk], timeout=60)[0]
    stats = [ray.get([r.save_between_backward_and_step.remote(d, f"global_step{step}", step) for r in rk],
                     timeout=120) for step in (first + 2, first + 3)]
    assert ray.get([r.wait.remote(60) for r in rk], timeout=90) == [None, None]

    rk = group(actors, 2)
    ray.get([r.build.remote(stage, ck, 5, 128, 2, freeze=FREEZE) for r in rk], timeout=120)
    load_ok(rk, d, f"global_step{first + 2}")
    full_equal(want, ray.get([r.full.remote() for r in rk], timeout=60)[0], f"ZeRO-{stage}: the first version")
    ray.get([r.train.remote(first + 2, 1) for r in rk], timeout=60)  # the step that ran beside its copy
    after = ray.get([r.full.remote() for r in rk], timeout=60)[0]
    load_ok(rk, d, f"global_step{first + 3}")
    full_equal(after, ray.get([r.full.remote() for r in rk], timeout=60)[0], f"ZeRO-{stage}: the second version")
    print(f"ZeRO-{stage} overlapped saves: blocked {[round(x['blocked_s'] * 1e3, 1) for s in stats for x in s]} ms; "
          f"fences that waited {sum(x['fence_waits'] for s in stats for x in s)}")


def _replace_moments_then_step(self, step: int) -> bool:
    """Give the base optimizer new ``exp_avg`` tensors (same values, new memory), as an optimizer
    that does not update in place would, then train ``step``; whether the strategy's reused
    partition was dropped for a new one."""
    cache = self.strategy._partitions
    before = cache.get(self.model)[0]
    state = self.model.optimizer.optimizer.state
    for st in state.values():
        st["exp_avg"] = st["exp_avg"].clone()
    self.train(step, 1)
    return cache.get(self.model)[0] is not before and cache.get(self.model)[0] is cache.get(self.model)[0]


def test_the_reused_partition_follows_the_optimizers_buffers(setup):
    """save_ckpt flattens its partition once and reuses it; a save before the first step (no
    moments yet), after it (moments appear) and after the moments were replaced by new tensors each
    store the state at their call: the reused views never point at memory the optimizer left."""
    ck = dict(setup["ck"], run=setup["ck"]["run"] + "pc")
    d = str(setup["root"] / "reuse" / "_actor")
    solo = group(setup["actors"][2:], 1)
    ray.get(solo[0].build.remote(2, ck, 0, freeze=FREEZE), timeout=120)
    ray.get(solo[0].save.remote(d, "global_step1"), timeout=60)
    ray.get(solo[0].train.remote(1, 1), timeout=60)
    ray.get(solo[0].save.remote(d, "global_step2"), timeout=60)
    want = {2: ray.get(solo[0].full.remote(), timeout=60)}
    assert ray.get(solo[0].call.remote(_replace_moments_then_step, 2), timeout=60)
    ray.get(solo[0].save.remote(d, "global_step3"), timeout=60)
    want[3] = ray.get(solo[0].full.remote(), timeout=60)
    assert ray.get(solo[0].wait.remote(60), timeout=90) is None
    for step in (2, 3):
        ray.get(solo[0].build.remote(2, ck, 5, freeze=FREEZE), timeout=120)
        load_ok(solo, d, f"global_step{step}")
        full_equal(want[step], ray.get(solo[0].full.remote(), timeout=60), f"the save of step {step}")


def _push_layout_1(self, save_dir: str, step: int) -> None:
    """Push version ``step`` as the strategy did before layout 2: ZeRO-1/2's whole 16-bit module
    state in ``module``, no ``layout`` in extra, no frozen ranges in optim."""
    import ray_ckpt as rc
    from ray_ckpt.integrations.openrlhf import strategy as st
    from ray_ckpt.integrations.openrlhf import zero

    s, m = self.strategy, self.model
    rank, world = s._world()
    run = s._run(save_dir)
    if run.declared != (s.STATES, world):
        s._declare(run, s.STATES)
    extra = {"client_state": {"old": 1}, "lr_scheduler": m.lr_scheduler.state_dict(), "tag": f"global_step{step}",
             "optimizer": zero.optimizer_scalars(m), "moments": zero.moment_keys(m), "zero_stage": zero.stage_of(m),
             "world_size": world, "global_steps": int(m.global_steps), "global_samples": int(m.global_samples),
             "skipped_steps": int(m.skipped_steps)} if rank == 0 else {}
    module = m.module.state_dict() if rank == 0 else {}
    handles = [run.engine.submit(step, st.EXTRA, extra, rank=rank),
               run.engine.submit(step, st.OPTIM, zero.partition_state(m), rank=rank),
               run.engine.submit(step, st.MODULE, module, rank=rank),
               run.engine.submit(step, st.RNG, rc.rng_state(), rank=rank)]
    for h in handles:
        h.wait(timeout=60)


def test_a_layout_1_version_still_loads(setup):
    """A version saved by ZeRO-2 before layout 2 (its 16-bit weights stored, the frozen embedding
    among them) loads on ZeRO-2 (the stored weights) and on ZeRO-3 (its ranges), bit-equal."""
    actors = setup["actors"]
    ck = dict(setup["ck"], run=setup["ck"]["run"] + "l1")
    d = str(setup["root"] / "layout1" / "_actor")
    rk = group(actors, 2)
    ray.get([r.build.remote(2, ck, 0, freeze=FREEZE) for r in rk], timeout=120)
    ray.get([r.train.remote(1, 2) for r in rk], timeout=120)
    want = ray.get([r.full.remote() for r in rk], timeout=60)[0]
    ray.get([r.call.remote(_push_layout_1, d, 7) for r in rk], timeout=120)
    for stage in (2, 3):
        rk = group(actors, 2)
        ray.get([r.build.remote(stage, ck, 5, freeze=FREEZE) for r in rk], timeout=120)
        out = ray.get([r.load.remote(d, "global_step7") for r in rk], timeout=120)
        assert [x[1] if isinstance(x, tuple) else x for x in out] == [{"old": 1}] * 2, out
        full_equal(want, ray.get([r.full.remote() for r in rk], timeout=60)[0], f"layout 1 loaded on ZeRO-{stage}")


def _run_snippet(self, code: str) -> None:
    self.leave()  # the snippet forms its own one-rank group
    os.chdir(tempfile.mkdtemp())
    exec(compile(code, "docs/openrlhf.md", "exec"), {"__name__": "docs_openrlhf"})


def test_docs_cpu_recipe_runs_as_written(setup):
    """docs/openrlhf.md's "Try it on a CPU" block, run as written in a rank actor's process."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "openrlhf.md").read_text(encoding="utf-8")
    section = re.search(r"^## Try it on a CPU$(.*?)(?=^## |\Z)", text, re.M | re.S).group(1)
    blocks = re.findall(r"^```python\n(.*?)^```", section, re.M | re.S)
    assert len(blocks) == 1
    ray.get(setup["actors"][0].call.remote(_run_snippet, blocks[0]), timeout=240)


def test_a_resume_after_the_newest_version_was_lost_loads_the_one_before(setup):
    """``latest`` names a version that committed and was lost with its node since: ``load_ckpt``
    resumes from the newest committed version (its client_state and bytes), and the redone step is
    not saved again (the coordinator would refuse it: the next save raised); the one after it is."""
    import glob
    import shutil

    import ray_ckpt as rc

    actors = setup["actors"]
    ck = dict(setup["ck"], run=f"{setup['ck']['run']}-lost", local_dir=str(setup["root"] / "lost-local"))
    d, run = str(setup["root"] / "lost" / "_actor"), f"{ck['run']}-actor"
    solo = group(actors, 1)
    ray.get(solo[0].build.remote(2, ck, 0), timeout=120)
    ray.get(solo[0].train.remote(1, 1), timeout=60)
    ray.get(solo[0].save.remote(d, "global_step1", {"s": 1}), timeout=60)
    assert ray.get(solo[0].wait.remote(60), timeout=90) is None
    want = ray.get(solo[0].full.remote(), timeout=60)
    ray.get(solo[0].train.remote(2, 1), timeout=60)
    ray.get(solo[0].save.remote(d, "global_step2", {"s": 2}), timeout=60)
    assert ray.get(solo[0].wait.remote(60), timeout=90) is None
    rc.CheckpointEngine.connect(run).shutdown(stop_coordinator=True)
    lost = glob.glob(str(setup["root"] / "lost-local" / "**" / "v000000000002"), recursive=True)
    assert lost
    for folder in lost:
        shutil.rmtree(folder)  # gone with its node's disk
    engine = rc.CheckpointEngine.create(run, ck["local_dir"], critical_writers=1, best_effort_writers=0)
    try:
        assert engine.all_steps() == [1] and engine.last_saved_step == 2
        with open(os.path.join(d, "latest")) as f:
            assert f.read().strip() == "global_step2"
        ray.get(solo[0].build.remote(2, ck, 5), timeout=120)  # the job starts again
        got = ray.get(solo[0].load.remote(d), timeout=120)
        assert not isinstance(got, str), got
        path, states = got
        assert states == {"s": 1} and path.endswith("global_step1")
        full_equal(want, ray.get(solo[0].full.remote(), timeout=60), "resumed from step 1")
        ray.get(solo[0].train.remote(2, 1), timeout=60)
        ray.get(solo[0].save.remote(d, "global_step2", {"s": 2}), timeout=60)  # redone: not saved again
        ray.get(solo[0].train.remote(3, 1), timeout=60)
        ray.get(solo[0].save.remote(d, "global_step3", {"s": 3}), timeout=60)
        assert ray.get(solo[0].wait.remote(60), timeout=90) is None
        assert engine.all_steps() == [1, 3]
        with open(os.path.join(d, "latest")) as f:
            assert f.read().strip() == "global_step3"
    finally:
        engine.shutdown(stop_coordinator=True)


def test_a_resume_from_an_older_tag_does_not_save_its_redone_steps_again(setup):
    """Steps 1-3 committed; the job starts again from ``global_step1`` (an explicit tag: going back
    past steps the run keeps). Its redo of steps 2 and 3 pushes nothing (before, the first redo's
    save failed: "step 2 ... is already committed"), steps 2 and 3 stay listed, step 4 commits.
    The load comes before the fresh strategy's first save, as in a resumed job."""
    import ray_ckpt as rc

    actors = setup["actors"]
    ck = dict(setup["ck"], run=f"{setup['ck']['run']}-back", local_dir=str(setup["root"] / "back-local"))
    d, run = str(setup["root"] / "back" / "_actor"), f"{ck['run']}-actor"
    solo = group(actors, 1)
    try:
        ray.get(solo[0].build.remote(2, ck, 0), timeout=120)
        for step in (1, 2, 3):
            ray.get(solo[0].train.remote(step, 1), timeout=60)
            ray.get(solo[0].save.remote(d, f"global_step{step}", {"s": step}), timeout=60)
            assert ray.get(solo[0].wait.remote(60), timeout=90) is None
        ray.get(solo[0].build.remote(2, ck, 5), timeout=120)  # the job starts again
        got = ray.get(solo[0].load.remote(d, "global_step1"), timeout=120)
        assert not isinstance(got, str) and got[1] == {"s": 1}, got
        for step in (2, 3, 4):
            ray.get(solo[0].train.remote(step, 1), timeout=60)
            ray.get(solo[0].save.remote(d, f"global_step{step}", {"s": step}), timeout=60)
            assert ray.get(solo[0].wait.remote(60), timeout=90) is None
        engine = rc.CheckpointEngine.connect(run)
        assert engine.all_steps() == [2, 3, 4]  # max_num=3: the three newest
        assert engine.load("extra", step=4)["client_state"] == {"s": 4}
    finally:
        try:
            rc.CheckpointEngine.connect(run).shutdown(stop_coordinator=True)
        except rc.CheckpointError:
            pass


def test_retention_and_a_rank_killed_before_its_push(setup):
    """max_num=1: after each commit only the newest version stays, never fewer; rank 1 is
    killed before it pushes step N: N fails (rank_timeout_s), N-1 is kept and still loads,
    ``latest`` keeps naming it, the failure is reported naming N, loading N names it. A
    client_state that cannot be stored is an error at the call; the next save commits."""
    import ray_ckpt as rc

    actors, ck = setup["actors"], setup["ck"]
    d = save_dir(setup, "r")
    rk = group(actors, 2)
    ray.get([r.build.remote(2, ck, 0) for r in rk], timeout=120)
    ray.get([r.train.remote(1, 1) for r in rk], timeout=60)
    for step in (40, 41):
        ray.get([r.save.remote(d, f"global_step{step}", {"s": step}, 1) for r in rk], timeout=60)
        assert ray.get([r.wait.remote(60) for r in rk], timeout=90) == [None, None]
    engine = rc.CheckpointEngine.connect(f"{ck['run']}-actor")
    assert engine.all_steps() == [41]  # max_num=1 applied after the commit of 41

    ray.get(rk[0].save.remote(d, "global_step42", {"s": 42}, 1), timeout=60)
    ray.kill(rk[1])  # rank 1 dies before its push of step 42
    err = ray.get(rk[0].wait.remote(RANK_TIMEOUT_S + 60), timeout=RANK_TIMEOUT_S + 90)
    assert err and "global_step42" in err, err
    assert engine.all_steps() == [41]  # the failed version deleted nothing
    with open(os.path.join(d, "latest")) as f:
        assert f.read().strip() == "global_step41"
    solo = group(actors[2:], 1)
    ray.get(solo[0].build.remote(2, ck, 3), timeout=120)
    path, states = ray.get(solo[0].load.remote(d), timeout=120)
    assert states == {"s": 41} and path.endswith("global_step41")
    err = ray.get(solo[0].load.remote(d, "global_step42"), timeout=120)
    assert isinstance(err, str) and "step 42" in err, err

    # a client_state ray_ckpt cannot store: an error at the call, nothing of that version pushed
    with pytest.raises(ray.exceptions.RayTaskError, match="UnsupportedTypeError"):
        ray.get(solo[0].save.remote(d, "global_step50", {"sampler": object()}, 1), timeout=60)
    ray.get(solo[0].save.remote(d, "global_step51", {"s": 51}, 1), timeout=60)
    assert ray.get(solo[0].wait.remote(60), timeout=90) is None
    assert engine.all_steps() == [51]
