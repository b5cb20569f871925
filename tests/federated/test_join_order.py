"""`fedmvp join` checks the cheap things first: a site's name before the backbone loads."""

from __future__ import annotations

from tests.site_trees import site_preset, world_classes


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
