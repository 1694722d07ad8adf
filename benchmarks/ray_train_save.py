"""Ray Train's report: ray_ckpt's ``Checkpointer`` vs Ray Train's own checkpoints, SYNC and ASYNC
upload, on a real ``TorchTrainer`` (issue 46).

Three arms, one after the other in one run, each a ``ray.train.torch.TorchTrainer`` (Ray Train v2,
``ScalingConfig(num_workers=2, use_gpu=False)``, gloo) training the same DDP model (a stack of
``--hidden`` x ``--hidden`` Linear layers sized so that weights + AdamW's two moments come to about
``--mb`` MB) for ``--steps`` steps, with a checkpoint every ``--every`` steps:

* ``ray_ckpt``: ``ray_ckpt.integrations.ray_train.Checkpointer`` (model and optimizer registered
  ``replicated=True``: rank 0's copy is pushed), ``ckpt.report(metrics, step)`` every step. It
  writes its versions to a local tier ``<dir>/rc_local`` (node-local disk) and a remote tier
  ``file://<dir>/rc_remote``; Ray Train's ``storage_path`` ``<dir>/train`` gets only the small
  pointer checkpoints.
* ``sync``: each rank ``dcp.save``s ``get_state_dict(model, opt)`` (torch DCP; replicated tensors
  are written once, split between the ranks) into its own staging directory ``<dir>/staging/...``,
  then ``ray.train.report(metrics, checkpoint=Checkpoint.from_directory(d), checkpoint_dir_name=
  "stepNNNNNN", checkpoint_upload_mode=SYNC, delete_local_checkpoint_after_upload=True)``: Ray Train
  copies both ranks' files into one checkpoint directory under ``storage_path`` ``<dir>/train``
  (pyarrow copy, no fsync) before the call returns.
* ``async``: the same with ``checkpoint_upload_mode=ASYNC``: the copy runs on Ray Train's upload
  thread while the loop goes on.

On the steps between checkpoints every arm calls ``ray.train.report(metrics)`` (Ray Train wants a
report from every worker; ray_ckpt's ``report`` does that itself). Each step is padded to
``--step-s`` (2.5 s) with a sleep, an accelerator's compute with the CPU free: Ray Train's controller
takes the workers' results every 2 s and a worker's result queue holds one, so with steps closer
together every report waits for that poll, whatever it carries, and the arms cannot be told apart.

``--s3``: Ray Train's ``storage_path`` (a ``pyarrow.fs.S3FileSystem``) and ray_ckpt's remote tier
on the same real S3 server (SeaweedFS, ``tests/s3server.py``, on this machine) instead of local
directories; the staging directories and ray_ckpt's local tier stay on the local disk. Ray Train's
restore then downloads the checkpoint (``Checkpoint.as_directory``) before ``dcp.load``.

Measured inside the train loop (``time.perf_counter`` around the call, per rank; a step's figure is
the slower rank's, the loop being collective):

* **report blocks**: for ``sync`` / ``async`` the ``dcp.save`` into the staging directory plus the
  ``ray.train.report`` call (the save has to happen before the report can name it; both parts are
  shown); for ray_ckpt the ``ckpt.report`` call on a step it pushes (split, by timing wrappers, into
  its pushes, ``engine.submit``: the copy into the object store, and the ``ray.train.report`` it makes).
* **time to durable**, from the start of the save: ``sync``: when ``report`` returned on every rank;
  ``async``: when Ray Train's upload thread has copied the rank's files and deleted its staging
  directory (a watcher thread polls for that, every 5 ms), the later rank; ray_ckpt: a watcher
  thread on rank 0 waits on the step's save handles (the Checkpointer's ``_handles`` new since the
  call), ``durability="local"`` (committed on the local
  tier: written, checksummed, fsync'ed) and ``"remote"`` (committed on the remote tier too: the
  counterpart of Ray Train's copy under ``storage_path``).
* **restart to first step** (``ray_ckpt`` and ``sync`` arms): worker rank 1 raises right after its
  report of step ``--kill-at`` (``FailureConfig(max_failures=1)``); measured from the raise
  (``time.time()`` just before it) to the end of the first training step the restarted group
  completes after its restore (rank 0's ``opt.step()`` returned), split into the group's restart
  (the raise to ``train_func`` entered again), model build, restore (ray_ckpt: ``ckpt.restore()``
  from the local tier; Ray Train: ``ray.train.get_checkpoint()`` + ``dcp.load`` from
  ``storage_path`` + ``set_state_dict``) and the step itself. The restored step is shown: ray_ckpt
  restores its newest committed version, Ray Train the last checkpoint it registered. The group's
  restart (Ray Train noticing the failure, then starting two worker processes that import torch) is
  the same work in both arms and, on a shared 2-core machine, by far the noisiest part: the table
  also gives the checkpoint layer's own part (Checkpointer connect + restore + first step).

Goals (issue 46): report blocks <= 0.1x Ray Train's SYNC and <= 0.5x its ASYNC; restart to first
step no slower than Ray Train's own.

    python benchmarks/ray_train_save.py [--quick] [--s3] [--mb 150 --steps 10 --every 2 --kill-at 7 --step-s 2.5]
                                        [--arms ray_ckpt,sync,async] [--dir /tmp/ray_train_bench] [--json FILE]

``--quick``: 100 MB, 6 steps, a checkpoint every 2, the kill after step 5 (4.5-5.5 min on the
2-core VM shared with other work); the default (150 MB, 10 steps, the kill after step 7) 6 min,
7 min with ``--s3``. Results: benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time
import uuid

import ray

T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def layers_for(mb: float, hidden: int) -> int:
    """Linear layers of hidden x hidden whose weights + AdamW's two moments come to about ``mb`` MB."""
    per_layer = 3 * 4 * (hidden * hidden + hidden)
    return max(1, round(mb * 1e6 / per_layer))


def train_func(config):
    import torch
    import torch.distributed.checkpoint as dcp
    import ray.train
    # every arm imports ray_ckpt here, at the loop's top, before t_enter: in the group restart and
    # alike for every arm (an import inside the checkpoint layer's timed part would charge one arm only)
    from ray_ckpt.integrations.ray_train import Checkpointer
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    t_enter = time.time()
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    arm, out = config["arm"], config["out"]
    marker = os.path.join(out, "killed")
    attempt = 2 if os.path.exists(marker) else 1
    torch.set_num_threads(1)
    torch.manual_seed(0)
    h = config["hidden"]
    model = torch.nn.Sequential(*[torch.nn.Linear(h, h) for _ in range(config["layers"])])
    model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    t_built = time.time()
    s3 = config.get("s3")  # remote_options of the S3 server, or None (local directories)

    rec = {"arm": arm, "rank": rank, "attempt": attempt, "t_enter": t_enter, "t_built": t_built,
           "steps": [], "durable": {}, "restored": None}
    lock = threading.Lock()
    path = os.path.join(out, f"{arm}-a{attempt}-r{rank}.json")

    def flush():
        with lock:
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(rec, f)
            os.replace(tmp, path)

    watchers = []

    # ------------------------------------------------------------------ restore
    ckpt = None
    t_restore0 = time.time()
    if arm == "ray_ckpt":
        ckpt = Checkpointer(config["run"], local_dir=config["local"], remote_uri=config["remote"],
                            every=config["every"], **({"remote_options": s3} if s3 else {}),
                            **config["rc_options"])
        ckpt.register("model", model, replicated=True)
        ckpt.register("optimizer", opt, replicated=True)
        # where a report's time goes: the pushes (engine.submit: the copy into the object store) and
        # Ray Train's own report call inside it (timing wrappers, nothing else changed)
        spent = {"push": 0.0, "train_report": 0.0}

        def timed(fn, key):
            def call(*a, **k):
                t = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    spent[key] += time.perf_counter() - t
            return call

        ckpt.engine.submit = timed(ckpt.engine.submit, "push")
        ray.train.report = timed(ray.train.report, "train_report")
        t_restore0 = time.time()
        start = ckpt.restore()
    else:
        start = None
        c = ray.train.get_checkpoint()
        if c is not None:
            with c.as_directory() as d:
                msd, osd = get_state_dict(model, opt)
                sd = {"model": msd, "optim": osd}
                dcp.load(sd, checkpoint_id=d)
                set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            start = int(os.path.basename(c.path.rstrip("/"))[len("step"):])
    rec["t_restore0"], rec["t_restored"], rec["restored"] = t_restore0, time.time(), start
    flush()

    mode = {"sync": ray.train.CheckpointUploadMode.SYNC,
            "async": ray.train.CheckpointUploadMode.ASYNC}.get(arm)
    g = torch.Generator().manual_seed(rank)
    for step in range((start or 0) + 1, config["steps"] + 1):
        t_step = time.perf_counter()
        x, y = torch.randn(16, h, generator=g), torch.randn(16, h, generator=g)
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rec.get("t_first") is None:
            rec["t_first"] = time.time()
        # the rest of the step: an accelerator's compute, the CPU left free (see --step-s)
        time.sleep(max(0.0, config["step_s"] - (time.perf_counter() - t_step)))
        save = step % config["every"] == 0
        metrics = {"loss": loss.item(), "step": step}
        entry = {"step": step, "save": save}
        w0 = time.time()
        t0 = time.perf_counter()
        if arm == "ray_ckpt":
            before = {id(hd) for hd in ckpt._handles}
            spent.update(push=0.0, train_report=0.0)
            ckpt.report(metrics, step)
            entry["block"] = time.perf_counter() - t0
            entry["push"], entry["train_report"] = spent["push"], spent["train_report"]
            new = [hd for hd in ckpt._handles if id(hd) not in before]
            if new:  # this rank pushed this step: when does it commit, locally and on the remote tier?
                def watch(handles=new, step=step, w0=w0):
                    try:
                        for hd in handles:
                            hd.wait(timeout=600, durability="local")
                        t_local = time.time()
                        for hd in handles:
                            hd.wait(timeout=600, durability="remote")
                        with lock:
                            rec["durable"][str(step)] = {"local": t_local - w0, "remote": time.time() - w0}
                    except Exception as exc:  # a failed push: shown, not timed
                        with lock:
                            rec["durable"][str(step)] = {"error": repr(exc)[:300]}
                    flush()

                th = threading.Thread(target=watch, daemon=True)
                th.start()
                watchers.append(th)
        elif save:
            d = os.path.join(config["staging"], f"{arm}-a{attempt}-r{rank}-s{step}-{uuid.uuid4().hex[:6]}")
            os.makedirs(d)
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=d)
            entry["dcp_save"] = time.perf_counter() - t0
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d),
                             checkpoint_dir_name=f"step{step:06d}", checkpoint_upload_mode=mode,
                             delete_local_checkpoint_after_upload=True)
            entry["block"] = time.perf_counter() - t0
            entry["report"] = entry["block"] - entry["dcp_save"]
            if arm == "sync":
                rec["durable"][str(step)] = {"remote": entry["block"]}
            else:
                def watch(d=d, step=step, w0=w0):
                    deadline = time.time() + 600
                    while os.path.exists(d) and time.time() < deadline:
                        time.sleep(0.005)
                    with lock:
                        rec["durable"][str(step)] = {"remote": time.time() - w0} if not os.path.exists(d) \
                            else {"error": "upload not done in 600 s"}
                    flush()

                th = threading.Thread(target=watch, daemon=True)
                th.start()
                watchers.append(th)
        else:
            ray.train.report(metrics)
            entry["block"] = time.perf_counter() - t0
        rec["steps"].append(entry)
        flush()
        if config.get("kill_at") == step and rank == 1 and attempt == 1:
            open(marker, "w").close()
            rec["t_fail"] = time.time()
            flush()
            raise RuntimeError(f"benchmark: worker rank 1 fails after its report of step {step}")
    for th in watchers:
        th.join(timeout=600)
    if ckpt is not None:
        ckpt.close()
    rec["t_done"] = time.time()
    flush()


def fit(args, arm: str, kill_at) -> dict:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    name = f"{arm}-{uuid.uuid4().hex[:6]}"
    out = os.path.join(args.dir, "out", name)
    os.makedirs(out)
    os.makedirs(os.path.join(args.dir, "staging"), exist_ok=True)
    srv = args.s3_server
    cfg = {"arm": arm, "run": f"rtb-{name}", "out": out, "staging": os.path.join(args.dir, "staging"),
           "local": os.path.join(args.dir, "rc_local"),
           "remote": srv.uri("rc_remote") if srv else "file://" + os.path.join(args.dir, "rc_remote"),
           "s3": srv.options if srv else None,
           "steps": args.steps, "every": args.every, "kill_at": kill_at, "hidden": args.hidden,
           "step_s": args.step_s, "rc_options": args.rc_options,
           "layers": layers_for(args.mb, args.hidden)}
    if srv:  # Ray Train's storage_path on the same S3 server, through a pyarrow S3FileSystem
        import pyarrow.fs as pafs

        storage = {"storage_path": f"{srv.bucket}/train", "storage_filesystem": pafs.S3FileSystem(**srv.options)}
    else:
        storage = {"storage_path": os.path.join(args.dir, "train")}
    trainer = TorchTrainer(train_func, train_loop_config=cfg,
                           scaling_config=ScalingConfig(num_workers=2, use_gpu=False,
                                                        resources_per_worker={"CPU": 0.5}),
                           run_config=RunConfig(name=name, failure_config=FailureConfig(max_failures=1),
                                                **storage))
    t0 = time.time()
    result = trainer.fit()
    wall = time.time() - t0
    if result.error is not None:
        raise RuntimeError(f"arm {arm}: the Train run failed: {result.error}")
    recs = {}
    for f in os.listdir(out):
        if f.endswith(".json"):
            with open(os.path.join(out, f)) as fh:
                r = json.load(fh)
            recs[(r["attempt"], r["rank"])] = r
    if arm == "ray_ckpt":
        try:
            import ray_ckpt as rc

            rc.CheckpointEngine.connect(cfg["run"], timeout=30).shutdown(stop_coordinator=True)
        except Exception as exc:
            say(f"ray_ckpt run {cfg['run']}: shutdown: {exc!r}")
    say(f"arm {arm}: fit took {wall:.1f} s; Ray Train's checkpoint: {result.checkpoint}")
    return {"recs": recs, "wall": wall, "cfg": cfg}


def summarise(run: dict) -> dict:
    """Per arm: the save steps' blocks (slower rank), the other steps' report, durability, restart."""
    recs = run["recs"]
    saves, others, parts, every_step = {}, [], {}, {}
    for (attempt, rank), r in recs.items():
        for e in r["steps"]:
            key = (attempt, e["step"])
            every_step[key] = max(every_step.get(key, 0.0), e["block"])
            if e["save"]:
                saves[key] = max(saves.get(key, 0.0), e["block"])
                if rank == 0 and ("dcp_save" in e or "push" in e):  # rank 0's split (ray_ckpt: the rank
                    a, b = ("dcp_save", "report") if "dcp_save" in e else ("push", "train_report")  # that pushes;
                    parts[key] = [e[a], e[b], e["block"] - e[a] - e[b]]  # rank 1 waits at Ray Train's report)
            else:
                others.append(e["block"])
    durable_remote, durable_local, errors = {}, {}, []
    for (attempt, _rank), r in recs.items():
        for s, d in r["durable"].items():
            if "error" in d:
                errors.append(d["error"])
                continue
            key = (attempt, int(s))
            durable_remote[key] = max(durable_remote.get(key, 0.0), d["remote"])
            if "local" in d:
                durable_local[key] = max(durable_local.get(key, 0.0), d["local"])
    out = {"blocks": [saves[k] for k in sorted(saves)], "others": others,
           "dcp": [parts[k][0] for k in sorted(parts)], "report": [parts[k][1] for k in sorted(parts)],
           "rest": [parts[k][2] for k in sorted(parts)],
           "per_ckpt": [sum(every_step.values()) / max(1, len(saves))],
           "durable": [durable_remote[k] for k in sorted(durable_remote)],
           "durable_local": [durable_local[k] for k in sorted(durable_local)], "errors": errors, "restart": None}
    fail = [r["t_fail"] for r in recs.values() if "t_fail" in r]
    r2 = recs.get((2, 0))
    if fail and r2 is not None and r2.get("t_first") is not None:
        tf = fail[0]
        out["restart"] = {"total": r2["t_first"] - tf, "group": r2["t_enter"] - tf,
                          "build": r2["t_built"] - r2["t_enter"], "connect": r2["t_restore0"] - r2["t_built"],
                          "restore": r2["t_restored"] - r2["t_restore0"],
                          "step": r2["t_first"] - r2["t_restored"], "restored": r2["restored"],
                          "killed_after": max(e["step"] for r in recs.values() if "t_fail" in r for e in r["steps"])}
    return out


def merge_rounds(sums: list) -> dict:
    """One arm's summaries of several rounds as one: every sample pooled; the restart's parts as
    their median over the rounds, each round's total kept (``restart_totals``)."""
    out = {k: [x for s in sums for x in s[k]] for k in sums[0] if isinstance(sums[0][k], list)}
    restarts = [s["restart"] for s in sums if s["restart"]]
    out["restart"] = None
    out["restart_totals"] = [r["total"] for r in restarts]
    out["restart_groups"] = [r["group"] for r in restarts]
    if restarts:
        out["restart"] = {k: (med([r[k] for r in restarts]) if k not in ("restored", "killed_after")
                              else restarts[-1][k]) for k in restarts[0]}
    return out


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def fmt(x: float) -> str:
    return "n/a" if x != x else f"{x:.3f} s"


def ratio(a: float, b: float) -> str:
    return "n/a" if (a != a or b != b or b < 1e-3) else f"{a / b:.2f}x"


def table(res: dict, args, load: float) -> None:
    """The side-by-side table of the arms' summaries (``summarise``)."""
    layers = layers_for(args.mb, args.hidden)
    numel = layers * (args.hidden * args.hidden + args.hidden)

    def get(arm, key):
        return med(res[arm][key]) if arm in res else float("nan")

    def restart(arm, key="total"):
        r = res.get(arm, {}).get("restart")
        return r[key] if r else float("nan")

    rc_b, sy_b, as_b = get("ray_ckpt", "blocks"), get("sync", "blocks"), get("async", "blocks")
    rc_d, sy_d, as_d = get("ray_ckpt", "durable"), get("sync", "durable"), get("async", "durable")
    rc_r, sy_r = restart("ray_ckpt"), restart("sync")
    n = {a: len(res[a]["blocks"]) for a in res}
    rounds = max((len(res[a].get("restart_totals", [])) for a in res), default=1)
    print(f"\n{layers} x Linear({args.hidden}, {args.hidden}), DDP on 2 Ray Train workers (gloo, CPU): "
          f"{numel * 12 / 1e6:.0f} MB of model + AdamW state; {args.steps} steps, a checkpoint every "
          f"{args.every} (saves per arm: {n}); {rounds} round(s), the arms' order reversed every other "
          f"round; medians; load average {load:.1f} at the end\n")
    print("| | ray_ckpt `Checkpointer.report` | Ray Train SYNC (dcp.save + report) "
          "| Ray Train ASYNC (dcp.save + report) "
          "| ray_ckpt / SYNC | ray_ckpt / ASYNC | goal |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    def verdict(ok: bool, *xs: float) -> str:
        return "n/a" if any(x != x for x in xs) else ("met" if ok else "NOT met")

    ok_b = rc_b <= 0.1 * sy_b and rc_b <= 0.5 * as_b
    print(f"| report blocks the loop (save step) | {fmt(rc_b)} | {fmt(sy_b)} | {fmt(as_b)} | {ratio(rc_b, sy_b)} | "
          f"{ratio(rc_b, as_b)} | <= 0.1x SYNC, <= 0.5x ASYNC: {verdict(ok_b, rc_b, sy_b, as_b)} |")
    print(f"| of which, rank 0: dcp.save / report (ray_ckpt: its pushes / the ray.train.report inside) | "
          f"{fmt(get('ray_ckpt', 'dcp'))} / {fmt(get('ray_ckpt', 'report'))} | "
          f"{fmt(get('sync', 'dcp'))} / {fmt(get('sync', 'report'))} | "
          f"{fmt(get('async', 'dcp'))} / {fmt(get('async', 'report'))} | | | |")
    print(f"| of which, rank 0, ray_ckpt: the rest of its report (rank 0's decision sent to every rank, "
          f"Ray Train's preemption check, the commit lookup) | {fmt(get('ray_ckpt', 'rest'))} | | | | | |")
    print(f"| report, a step without a checkpoint | {fmt(get('ray_ckpt', 'others'))} | {fmt(get('sync', 'others'))} | "
          f"{fmt(get('async', 'others'))} | | | |")
    pc = {a: get(a, "per_ckpt") for a in ("ray_ckpt", "sync", "async")}
    print(f"| time in report calls per checkpoint (every step's report, slower rank, summed, / checkpoints: "
          f"counts the waits a checkpoint puts on later reports) | {fmt(pc['ray_ckpt'])} | {fmt(pc['sync'])} | "
          f"{fmt(pc['async'])} | {ratio(pc['ray_ckpt'], pc['sync'])} | {ratio(pc['ray_ckpt'], pc['async'])} | |")
    print(f"| to durable off the node-local tier (ray_ckpt: remote tier committed; Ray Train: in storage_path) | "
          f"{fmt(rc_d)} | {fmt(sy_d)} | {fmt(as_d)} | {ratio(rc_d, sy_d)} | {ratio(rc_d, as_d)} | |")
    print(f"| ray_ckpt: committed on the local tier | {fmt(get('ray_ckpt', 'durable_local'))} | | | | | |")
    ok_r = rc_r <= sy_r
    print(f"| restart to first step (raise -> first step after restore) | {fmt(rc_r)} | {fmt(sy_r)} | (same as SYNC) | "
          f"{ratio(rc_r, sy_r)} | | no slower than Ray Train's: {verdict(ok_r, rc_r, sy_r)} |")
    part = {a: sum(restart(a, k) for k in ("connect", "restore", "step")) for a in ("ray_ckpt", "sync")}
    print(f"| the checkpoint layer's part: connect + restore + first step | {fmt(part['ray_ckpt'])} | "
          f"{fmt(part['sync'])} | | {ratio(part['ray_ckpt'], part['sync'])} | | no slower: "
          f"{verdict(part['ray_ckpt'] <= part['sync'], part['ray_ckpt'], part['sync'])} |")
    for key, label in (("group", "group restart (raise -> train_func again)"), ("build", "model + optimizer build"),
                       ("connect", "ray_ckpt: Checkpointer (connect to the run) + register"),
                       ("restore", "restore (ray_ckpt.restore / get_checkpoint + dcp.load)"),
                       ("step", "the first step")):
        print(f"| of which {label} | {fmt(restart('ray_ckpt', key))} | {fmt(restart('sync', key))} | | "
              f"{ratio(restart('ray_ckpt', key), restart('sync', key))} | | |")
    if any(len(res.get(a, {}).get("restart_totals", [])) > 1 for a in ("ray_ckpt", "sync")):
        print("| restart to first step, each round | " + " | ".join(
            ", ".join(f"{x:.1f}" for x in res.get(a, {}).get("restart_totals", [])) or "n/a"
            for a in ("ray_ckpt", "sync")) + " | | | | |")
        print("| group restart, each round | " + " | ".join(
            ", ".join(f"{x:.1f}" for x in res.get(a, {}).get("restart_groups", [])) or "n/a"
            for a in ("ray_ckpt", "sync")) + " | | | | |")
    print(f"| step restored (rank 1 failed after step {args.kill_at}) | {restart('ray_ckpt', 'restored')} | "
          f"{restart('sync', 'restored')} | | | | |")
    errs = {a: res[a]["errors"] for a in res if res[a]["errors"]}
    if errs:
        print(f"\nerrors: {errs}")
    print(f"\nreport-blocks goal {verdict(ok_b, rc_b, sy_b, as_b)}; restart goal {verdict(ok_r, rc_r, sy_r)}")

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="100 MB, 6 steps, every 2, the kill after step 5")
    ap.add_argument("--mb", type=float, default=None, help="model + AdamW state in MB (default 150; quick 100)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=None, help="steps per Train run (default 10; quick 6)")
    ap.add_argument("--every", type=int, default=2, help="a checkpoint every N steps")
    ap.add_argument("--step-s", type=float, default=2.5,
                    help="each training step padded to this many seconds with a sleep (an accelerator's compute, "
                         "the CPU free); above Ray Train's 2 s poll of the workers' results, whose queue holds one "
                         "report: steps closer together make every report wait for that poll, whatever it carries")
    ap.add_argument("--kill-at", type=int, default=None, help="rank 1 raises after this step (default 7; quick 5)")
    ap.add_argument("--arms", default="ray_ckpt,sync,async")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the arms this many times, the order reversed every other round; blocks are "
                         "pooled, the restart's parts are medians over the rounds")
    ap.add_argument("--dir", default="/tmp/ray_train_bench")
    ap.add_argument("--store-gb", type=float, default=2.0, help="Ray's object store size")
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--rc-option", action="append", default=[], metavar="KEY=JSON",
                    help="an extra CheckpointEngine.create option for the Checkpointer, e.g. "
                         "prefault_object_store=true (repeatable)")
    ap.add_argument("--reprint", default=None, metavar="DIR",
                    help="print the table again from the records a run left in its --dir DIR (nothing is run)")
    ap.add_argument("--s3", action="store_true",
                    help="Ray Train's storage_path and ray_ckpt's remote tier on a real S3 server (SeaweedFS, "
                         "tests/s3server.py, on this machine) instead of local directories")
    args = ap.parse_args()
    q = args.quick
    args.mb = args.mb if args.mb is not None else (100.0 if q else 150.0)
    args.steps = args.steps if args.steps is not None else (6 if q else 10)
    args.kill_at = args.kill_at if args.kill_at is not None else (5 if q else 7)
    if not 0 < args.kill_at < args.steps:
        ap.error("--kill-at must be between 1 and --steps - 1")
    args.rc_options = {k: json.loads(v) for k, v in (o.split("=", 1) for o in args.rc_option)}
    if args.reprint:  # the table again from a finished run's per-rank records (give the run's own flags)
        res = {}
        base = os.path.join(args.reprint, "out")
        for d in sorted(os.listdir(base)):
            recs = {}
            for f in os.listdir(os.path.join(base, d)):
                if f.endswith(".json"):
                    with open(os.path.join(base, d, f)) as fh:
                        r = json.load(fh)
                    recs[(r["attempt"], r["rank"])] = r
            res.setdefault(d.rsplit("-", 1)[0], []).append(summarise({"recs": recs}))
        table({arm: merge_rounds(sums) for arm, sums in res.items()}, args, float("nan"))
        return 0
    arms = [a for a in args.arms.split(",") if a]
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    layers = layers_for(args.mb, args.hidden)
    numel = layers * (args.hidden * args.hidden + args.hidden)
    say(f"model: {layers} x Linear({args.hidden}, {args.hidden}) = {numel / 1e6:.1f} M parameters: "
        f"{numel * 4 / 1e6:.0f} MB weights + {numel * 8 / 1e6:.0f} MB AdamW moments; "
        f"{args.steps} steps, a checkpoint every {args.every}, rank 1 fails after step {args.kill_at} "
        f"(ray_ckpt, sync)")
    args.s3_server = None
    if args.s3:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        from s3server import S3Server

        args.s3_server = S3Server(os.path.join(args.dir, "s3")).start()
        say(f"S3 server at {args.s3_server.endpoint_url}: Ray Train's storage_path s3://{args.s3_server.bucket}/train, "
            f"ray_ckpt's remote tier {args.s3_server.uri('rc_remote')}")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             object_store_memory=int(args.store_gb * (1 << 30)))
    rounds = {arm: [] for arm in arms}
    try:
        for i in range(args.rounds):
            # the order flips every round: the first Train run of a Ray instance pays cold starts
            # (worker processes, page cache) that later ones do not
            for arm in (arms if i % 2 == 0 else arms[::-1]):
                say(f"round {i + 1}/{args.rounds}: arm {arm} ...")
                run = fit(args, arm, args.kill_at if arm in ("ray_ckpt", "sync") else None)
                s = summarise(run)
                rounds[arm].append(s)
                say(f"arm {arm}: blocks {[round(b, 3) for b in s['blocks']]}; "
                    f"durable {[round(b, 3) for b in s['durable']]}; "
                    f"restart {s['restart']}; errors {s['errors']}")
    finally:
        ray.shutdown()
        if args.s3_server is not None:
            args.s3_server.stop()

    res = {arm: merge_rounds(sums) for arm, sums in rounds.items() if sums}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "s3_server"}, "results": res}, f, indent=1)
    table(res, args, os.getloadavg()[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
