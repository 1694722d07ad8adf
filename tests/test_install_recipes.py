"""Every guide's install recipe runs as written in a fresh virtual environment, and the guide's code runs
in what it installed.

A recipe is the ```bash block that follows an ``<!-- install-recipe -->`` line in a guide; the test reads it
from the markdown, so the guide and the test cannot drift apart. It runs the block with bash in an empty
directory (the block's own ``python3 -m venv .venv && . .venv/bin/activate`` makes the environment and
puts its pip first on PATH), with one change: ``-e "."`` / ``-e ".[extra]"`` name this checkout. Then, in
that environment, the guide's code (``CHECKS``): getting-started's block ends with ``ray-ckpt demo`` itself;
RLlib runs part 1 of its guide's program (the plain loop, its checkpoint directories moved into the test's
own; the Tune sweep and PBT parts are ``tests/test_rllib_tune.py``'s); OpenRLHF imports ``openrlhf`` and
runs the guide's "Try it on a CPU" block (one ZeRO-2 rank, save, load, bit-equal); verl imports verl and
checks that ``install()`` rebinds verl's ``FSDPCheckpointManager`` (the guide's config needs a verl run on
GPUs).

The environments use this machine's wheels and pip cache, as ``make install`` does: pip's retries are one
(the Makefile's ``--retries 1``), so where PyTorch's index cannot be reached pip falls back at once to the
local wheels instead of retrying; every recipe installs the CPU torch before anything that needs torch
(checked before it runs), so no CUDA build is downloaded. Slow: on the 2-core machine with other tests
running (load 25-50) the four took 32 minutes (getting-started 641 s, openrlhf 530, rllib 454, verl 315);
without other load OpenRLHF's recipe took 84 s and its snippet 35 s.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARK = "<!-- install-recipe -->"
RECIPE = re.compile(r"^" + re.escape(MARK) + r"\n```bash\n(.*?)^```", re.M | re.S)
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
EDITABLE_HERE = re.compile(r"""-e (["']?)\.(\[[\w,-]*\])?\1(?=\s|$)""")
TORCH_CPU = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
FIRST_LINES = ("python3 -m venv .venv && . .venv/bin/activate", "pip install --upgrade pip")

_RLLIB_PART_1 = """
import re, sys
text = open(sys.argv[1], encoding="utf-8").read()
program = re.findall(r"^```python\\n(.*?)^```", text, re.M | re.S)[0]
part1 = program.split("# 2. a Tune sweep")[0]
assert "wait_for_saves" in part1 and "restore_algorithm" in part1, part1
exec(compile(part1.replace("/tmp/ckpt", sys.argv[2]), "docs/rllib.md", "exec"), {"__name__": "__main__"})
"""

_OPENRLHF = """
import re, sys
from importlib.metadata import version
import openrlhf  # noqa: F401  (the import that failed without pylatexenc)
text = open(sys.argv[1], encoding="utf-8").read()
section = re.search(r"^## Try it on a CPU$(.*?)(?=^## |\\Z)", text, re.M | re.S).group(1)
(block,) = re.findall(r"^```python\\n(.*?)^```", section, re.M | re.S)
exec(compile(block, "docs/openrlhf.md", "exec"), {"__name__": "__main__"})
print("openrlhf", version("openrlhf"), "snippet ran")
"""

_VERL = """
import verl
import verl.utils.checkpoint.checkpoint_manager as cm
import verl.workers.engine.fsdp.transformer_impl as impl
from ray_ckpt.integrations.verl import RayCkptCheckpointConfig, RayCkptCheckpointManager, install, uninstall
verls, verls_find = impl.FSDPCheckpointManager, cm.find_latest_ckpt_path
install()
assert impl.FSDPCheckpointManager is not verls, "install() did not rebind verl's FSDPCheckpointManager"
assert cm.find_latest_ckpt_path is not verls_find, "install() did not wrap verl's find_latest_ckpt_path"
uninstall()
assert impl.FSDPCheckpointManager is verls and cm.find_latest_ckpt_path is verls_find
print("verl", verl.__version__)
"""

# guide -> (what runs in the new environment after the recipe: python code, its argv; the recipe's time
# limit, the check's, in seconds: room over what each took on the loaded 2-core machine (module docstring).
CHECKS: dict[str, tuple[str | None, list[str], int, int]] = {
    "docs/getting-started.md": (None, [], 900, 1),  # the recipe runs the demo itself
    "docs/rllib.md": (_RLLIB_PART_1, ["docs/rllib.md", "{tmp}/ckpt"], 600, 400),
    "docs/verl.md": (_VERL, [], 900, 180),
    "docs/openrlhf.md": (_OPENRLHF, ["docs/openrlhf.md"], 600, 300),
}


# guides whose install block is a Makefile target's recipe, which CI runs (``make test-all``) instead of
# this test: the block must install what the target installs, in the same order (_make_installs)
MAKE_RECIPES = {"docs/skyrl.md": "$(SKYRL_VENV)/.installed"}


def _pip_args(line: str) -> list[str]:
    """What one ``pip install`` line installs: its arguments less quiet flags, constraints, index
    options and ``-U pip`` (the venv's own pip upgrade)."""
    words = re.sub(r"-c\s+(<\([^)]*\)|\S+)", " ", line.split("pip install", 1)[1]).split()
    out, skip = [], False
    for w in words:
        if skip:
            skip = False
        elif w in ("--index-url", "--extra-index-url", "--retries", "--timeout"):
            skip = True
        elif w not in ("-q", "-U", "--upgrade"):
            out.append(w.strip("'\""))
    return [] if out == ["pip"] else out


def _make_installs(target: str) -> list[list[str]]:
    """The ``pip install`` steps of a Makefile target's recipe, its variables expanded."""
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    values = dict(re.findall(r"^(\w+) \??:?= *([^\n$]*)$", text, re.M))
    body = text.split(f"\n{target}:", 1)[1].split("\n\n", 1)[0]
    steps = []
    for line in body.splitlines():
        line = re.sub(r"\$\((\w+)\)", lambda m: values.get(m.group(1), ""), line)
        if "pip install" in line and _pip_args(line):
            steps.append(_pip_args(line))
    return steps


def _guides() -> list[Path]:
    return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def _recipes(guide: Path) -> list[str]:
    return RECIPE.findall(guide.read_text(encoding="utf-8"))


def _environment(tmp: Path) -> dict[str, str]:
    """The caller's environment without its Python (the recipe makes its own) and with local Ray."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    here = Path(sys.executable).parent
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p and Path(p) != here)
    env.update(PIP_RETRIES="1", PIP_NO_INPUT="1", RAY_ADDRESS="local", RAY_TMPDIR="/tmp", TMPDIR=str(tmp))
    return env


def test_every_install_command_in_the_guides_is_a_tested_recipe():
    """Each fenced block that installs with pip is a marked recipe and has its check here; every recipe
    starts a fresh venv with a current pip and installs the CPU torch before the package; an extra that
    any guide names (inline too) exists; nothing says to install ray-ckpt from PyPI, where it is not."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
                 ["optional-dependencies"])
    marked = {}
    for guide in _guides():
        text = guide.read_text(encoding="utf-8")
        name = str(guide.relative_to(ROOT))
        recipes = _recipes(guide)
        assert len(recipes) <= 1, f"{name} has {len(recipes)} install recipes; one per guide"
        for block in FENCE.findall(text):
            if "pip install" in block and name in MAKE_RECIPES:
                steps = [_pip_args(ln) for ln in block.splitlines() if "pip install" in ln and _pip_args(ln)]
                assert steps == _make_installs(MAKE_RECIPES[name]), \
                    f"{name}: its install block and `make` {MAKE_RECIPES[name]} install different things"
            elif "pip install" in block:
                assert block in recipes, f"{name}: a code block installs with pip without {MARK}:\n{block}"
        for extra_list in re.findall(r"""\.\[([\w,-]+)\]""", text):
            unknown = set(extra_list.split(",")) - extras
            assert not unknown, f"{name} names extras pyproject.toml does not define: {unknown}"
        assert not re.search(r"pip install [\"']?ray-ckpt", text), f"{name}: ray-ckpt is not on PyPI"
        if recipes:
            marked[name] = recipes[0]
    assert sorted(marked) == sorted(CHECKS), f"recipes in the guides {sorted(marked)} vs checked {sorted(CHECKS)}"
    for name, recipe in marked.items():
        lines = [ln.split("#")[0].strip() for ln in recipe.splitlines() if ln.split("#")[0].strip()]
        assert tuple(lines[:2]) == FIRST_LINES, f"{name}: the recipe must start with {FIRST_LINES}"
        torch_at = [i for i, ln in enumerate(lines) if ln.startswith(TORCH_CPU)]
        package_at = [i for i, ln in enumerate(lines) if EDITABLE_HERE.search(ln)]
        assert torch_at and package_at and torch_at[0] < package_at[0], \
            f"{name}: the recipe must install the CPU torch ({TORCH_CPU}) before the package"


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.timeout(CHECKS[n][2] + CHECKS[n][3] + 120))
                                  for n in CHECKS])
def test_install_recipe_runs_as_written_in_a_fresh_venv(name, tmp_path):
    code, argv, install_limit, check_limit = CHECKS[name]
    (recipe,) = _recipes(ROOT / name)
    script, n = EDITABLE_HERE.subn(lambda m: f'-e "{ROOT}{m.group(2) or ""}"', recipe)
    assert n >= 1, f"{name}: the recipe installs no -e '.'"
    work = tmp_path / "work"
    work.mkdir()
    env = _environment(tmp_path)
    started = time.monotonic()
    try:
        out = subprocess.run(["bash", "-euxo", "pipefail", "-c", script], cwd=work, env=env, capture_output=True,
                             text=True, timeout=install_limit)
        took = time.monotonic() - started
        assert out.returncode == 0, f"{name}'s recipe failed after {took:.0f} s:\n{out.stdout[-4000:]}\n{out.stderr[-6000:]}"
        python = work / ".venv" / "bin" / "python"
        torch = subprocess.run([str(python), "-c", "import torch, ray_ckpt; print(torch.__version__, ray_ckpt.__file__)"],
                               cwd=work, env=env, capture_output=True, text=True, timeout=120)
        assert torch.returncode == 0, torch.stderr[-3000:]
        version, where = torch.stdout.split()[-2:]
        assert version.endswith("+cpu"), f"{name}: the recipe installed torch {version}, not the CPU build"
        assert where.startswith(str(ROOT)), f"{name}: ray_ckpt imported from {where}, not this checkout"
        if code is not None:
            args = [a.format(tmp=tmp_path) if "{" in a else str(ROOT / a) for a in argv]
            check_started = time.monotonic()
            ran = subprocess.run([str(python), "-c", code, *args], cwd=work, env=env, capture_output=True, text=True,
                                 timeout=check_limit)
            assert ran.returncode == 0, f"{name}'s check failed:\n{ran.stdout[-4000:]}\n{ran.stderr[-6000:]}"
            print(f"{name}: recipe {took:.0f} s, check {time.monotonic() - check_started:.0f} s")
        else:
            print(f"{name}: recipe {took:.0f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)  # a venv is 1-3 GB
