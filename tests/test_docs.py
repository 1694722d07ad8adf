"""The documentation holds: the site builds with warnings as errors, the README's tour runs as written
and does what it says, the options table names every option and ``RAY_CKPT_*`` variable the code
has, and the demo's options say what they do."""
import dataclasses
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
TABLE = ROOT / "docs" / "configuration.md"
MAX_README_LINES = 200
MAX_TOUR_LINES = 30


def _section(text: str, heading: str) -> str:
    """The text under a level-2 heading that starts with ``heading``, up to the next one."""
    m = re.search(rf"^## {re.escape(heading)}.*?$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"README has no '## {heading}' section"
    return m.group(1)


def _tour() -> str:
    blocks = re.findall(r"^```python\n(.*?)^```", _section(README.read_text(encoding="utf-8"), "Tour"), re.M | re.S)
    assert blocks, "the README's tour has no python code block"
    return "".join(blocks)


@pytest.mark.timeout(300)
def test_site_builds_with_warnings_as_errors(tmp_path):
    try:
        import mkdocs  # noqa: F401
        import mkdocstrings  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"the docs extra is not installed ({exc}): pip install -e '.[docs]'")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                          "-d", str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    site = tmp_path / "site"
    for page in ("index.html", "configuration/index.html", "reference/engine/index.html"):
        assert (site / page).is_file(), page
    api = (site / "reference" / "engine" / "index.html").read_text(encoding="utf-8")
    for member in ("create", "connect", "register", "save", "load", "load_into", "restore", "shutdown"):
        assert f'id="ray_ckpt.client.engine.CheckpointEngine.{member}"' in api, member  # generated from docstrings


def test_readme_is_short_and_its_links_resolve():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= MAX_README_LINES
    assert "make demo" in text and "make test" in text
    tour = _tour()
    assert len(tour.splitlines()) <= MAX_TOUR_LINES, len(tour.splitlines())
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert local, "the README links no guide"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, f"README links to missing files: {missing}"
    for guide in ("docs/rllib.md", "docs/verl.md", "docs/openrlhf.md", "docs/own-trainers.md", "docs/dcp.md",
                  "benchmarks/RESULTS.md"):
        assert guide in local, f"README does not link {guide}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_readme_tour_runs_as_written(tmp_path):
    """The tour in its own process, as a user runs it: its own local Ray, its checkpoints in a
    temporary directory; the learner restored after its kill holds the saved weights."""
    script = tmp_path / "tour.py"
    script.write_text(_tour(), encoding="utf-8")
    env = dict(os.environ, RAY_ADDRESS="local", TMPDIR=str(tmp_path), RAY_TMPDIR="/tmp",
               PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "SaveResult(version=3, step=3," in out.stdout, out.stdout
    assert re.search(r"^restored step 3 in [\d.]+s$", out.stdout, re.M), out.stdout
    for state in ("policy", "optimizer"):
        assert re.search(rf"^\s+{state}\s+restored\s+tier=local\s+verified=yes", out.stdout, re.M), out.stdout
    assert "bit-identical: True" in out.stdout, out.stdout
    written = [p for p in tmp_path.rglob("manifest.json") if "tour" in p.parts]
    assert written, "the tour's checkpoints are not in its temporary directory"


def _table_rows():
    rows = {}
    for line in TABLE.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("| `") else []
        if len(cells) >= 4:
            rows[cells[0].strip("`")] = cells
    return rows


def test_options_table_lists_every_option_and_environment_variable():
    from ray_ckpt.client.engine import CheckpointEngine
    from ray_ckpt.config import EngineConfig
    from ray_ckpt.coordinator.live_options import LIVE

    rows = _table_rows()
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    params = {name for name, p in inspect.signature(CheckpointEngine.create).parameters.items()
              if name != "cls" and p.kind is not inspect.Parameter.VAR_KEYWORD}
    source = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "ray_ckpt").rglob("*.py"))
    env = set(re.findall(r"\bRAY_CKPT_[A-Z0-9_]+\b", source))
    assert env, "no RAY_CKPT_ variable found in the source"
    expected = fields | params | env
    assert not expected - set(rows), f"{TABLE.name} does not list {sorted(expected - set(rows))}"
    assert not set(rows) - expected, f"{TABLE.name} lists what the code no longer has: {sorted(set(rows) - expected)}"
    live = {name for name, cells in rows.items() if cells[2] == "yes"}
    assert live == set(LIVE), (sorted(live ^ set(LIVE)), "the 'live' column differs from live_options.LIVE")


def test_demo_options_have_help(capsys):
    from ray_ckpt.cli import demo
    from ray_ckpt.cli.main import main

    assert main(["demo", "--help"]) == 0
    out = capsys.readouterr().out
    ours = [a for a in demo.parser()._actions if a.option_strings and "--help" not in a.option_strings]
    assert ours
    for action in ours:
        assert action.help and len(action.help) > 20, action.option_strings
        assert action.option_strings[0] in out
    # the demo itself (python -m ray_ckpt.demo) takes the same options
    from ray_ckpt.cli.demo_run import main as demo_main

    with pytest.raises(SystemExit):
        demo_main(["--help"])
    usage = capsys.readouterr().out
    assert set(re.findall(r"--[a-z][a-z-]*", usage)) - {"--help"} == {a.option_strings[0] for a in ours}
