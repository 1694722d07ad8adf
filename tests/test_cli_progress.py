"""Progress on stderr, one shape for every long command (``--progress`` / ``--no-progress``, on by
itself past a size): what a person reading a CI log sees — ten lines, the last one at 100 %, with
a rate and the time left — and nothing on stdout, which stays the command's result (``--json``)."""
import json
import re

from test_cli_output import V, cli, make_run

LINE = re.compile(r"^(?P<label>[a-z: ]+): (?P<done>\S+(?: \S+)?) / (?P<total>\S+(?: \S+)?)(?: directories)? "
                  r"\((?P<pct>\d+)%\)(?:, [^,]+/s, \d+s left)?$")


def progress_lines(err: str):
    lines = [ln for ln in err.splitlines() if "%" in ln]
    for ln in lines:
        assert LINE.match(ln), ln
    return lines


def test_gc_shows_progress_per_directory_deleted_and_keeps_stdout_for_the_result(tmp_path, capsys):
    root = make_run(tmp_path / "r", versions=range(1, 25))
    code, out, err = cli(capsys, "gc", root, "--keep-last", "2", "--json")  # 22 to delete: on by itself
    assert code == 0, err
    assert json.loads(out)["versions_deleted"] == 22  # stdout is the JSON document alone
    lines = progress_lines(err)
    assert lines and lines[-1].startswith("gc: 22 / 22 directories (100%)"), err
    assert len(lines) <= 11  # a line per tenth when stderr is not a terminal
    assert sorted(p.name for p in root.iterdir()) == [V(23), V(24)]

    code, out, err = cli(capsys, "gc", make_run(tmp_path / "s", versions=range(1, 25)), "--keep-last", "2",
                         "--no-progress")
    assert code == 0 and not progress_lines(err) and "deleted" in out


def test_gc_dry_run_and_small_runs_show_no_progress_unless_asked(tmp_path, capsys):
    root = make_run(tmp_path / "r", versions=(1, 2, 3))
    code, _out, err = cli(capsys, "gc", root, "--keep-last", "1", "--dry-run", "--progress")
    assert code == 0 and not progress_lines(err)  # a dry run deletes nothing: nothing to wait for
    code, _out, err = cli(capsys, "gc", root, "--keep-last", "1")
    assert code == 0 and not progress_lines(err)
    code, _out, err = cli(capsys, "gc", make_run(tmp_path / "s", versions=(1, 2, 3)), "--keep-last", "1",
                          "--progress")
    assert code == 0 and progress_lines(err)[-1].startswith("gc: 2 / 2 directories (100%)"), err


def test_export_shows_reading_and_writing_progress_when_asked(tmp_path, capsys):
    root = make_run(tmp_path / "r")
    code, out, err = cli(capsys, "export", root, "2", "--state", "policy", "--to", tmp_path / "out", "--progress",
                         "--json")
    assert code == 0, err
    assert json.loads(out)["verified"]
    lines = progress_lines(err)
    assert lines[-1].startswith("export: reading: ") and lines[-1].endswith("(100%)") or "(100%)," in lines[-1], err
    code, _out, err = cli(capsys, "export", root, "2", "--state", "policy", "--to", tmp_path / "f.safetensors",
                          "--progress")
    assert code == 0, err
    labels = [ln.split(":")[0] + ":" + ln.split(":")[1] for ln in progress_lines(err)]
    assert "export: reading" in labels and "export: writing" in labels, err
    code, _out, err = cli(capsys, "export", root, "3", "--state", "policy", "--to", tmp_path / "o3")
    assert code == 0 and not progress_lines(err)  # a few bytes: no progress by itself
