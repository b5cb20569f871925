"""`fedmvp join` checks the cheap things first: a site's name before the backbone loads; the backbone's
checks run in the site's executor before anything connects."""

from __future__ import annotations

import pytest

from tests.site_trees import site_preset, world_classes


@pytest.mark.processes  # the backbone's check runs in the site's executor, a process (join_preflight)
def test_join_says_an_unlisted_name_before_it_loads_the_backbone(tmp_path, small_world):
    """The name is checked first: a preset whose backbone cannot load still gets the name's line (the cheap
    check, said in a second, not after CLIP loads)."""
    from click.testing import CliRunner

    from fedmvp_apps.cli import main

    seen, _ = world_classes(small_world)
    preset = site_preset(tmp_path, small_world, {"site-a": seen[:2], "site-b": seen[2:3]}, [])
    preset.write_text(preset.read_text().replace('pretrained = ""', f'pretrained = "{tmp_path / "none.safetensors"}"'))
    args = ["join", "--superlink", "127.0.0.1:1", "--insecure", "--config", str(preset), "--data",
            str(tmp_path / "sites" / "site-a")]
    named = CliRunner().invoke(main, [*args, "--name", "site-c"])
    assert named.exit_code == 2 and "'site-c'" in named.stderr and "none.safetensors" not in named.stderr, named.stderr
    listed = CliRunner().invoke(main, [*args, "--name", "site-a"])  # a listed name: the backbone's line
    assert listed.exit_code == 2 and "none.safetensors" in listed.stderr, listed.stderr


@pytest.mark.processes  # `fedmvp join` and its executor as real processes
def test_the_backbones_refusal_comes_from_the_executor_before_anything_connects(tmp_path, small_world):
    """The join's own process imports no model library (its executor checks the backbone, and would load it
    for the first message anyway); a refusal is its one line, exit 2, and no SuperNode was started."""
    import subprocess
    import sys

    from tests.deadlines import scaled
    from tests.federated.processes import ENV

    seen, _ = world_classes(small_world)
    preset = site_preset(tmp_path, small_world, {"site-a": seen[:2], "site-b": seen[2:3]}, [])
    preset.write_text(preset.read_text().replace('pretrained = ""', f'pretrained = "{tmp_path / "none.safetensors"}"'))
    child = ("import atexit, sys\n"
             "atexit.register(lambda: print('heavy:', [n for n in ('torch', 'open_clip', 'peft') if n in sys.modules],"
             " file=sys.stderr))\n"
             "from fedmvp_apps.cli import main\n"
             "main(sys.argv[1:], prog_name='fedmvp')\n")
    done = subprocess.run([sys.executable, "-c", child, "join", "--superlink", "127.0.0.1:1", "--insecure", "--config",
                           str(preset), "--data", str(tmp_path / "sites" / "site-a"), "--name", "site-a"],
                          capture_output=True, text=True, env=ENV, timeout=scaled(120))
    assert done.returncode == 2, done.stderr
    assert "none.safetensors" in done.stderr and "heavy: []" in done.stderr, done.stderr
    assert "trying the SuperLink" not in done.stdout + done.stderr  # said only as the SuperNode starts
    refusal = [line for line in done.stderr.splitlines() if "none.safetensors" in line]
    assert len(refusal) == 1 and refusal[0].startswith("error: "), done.stderr
