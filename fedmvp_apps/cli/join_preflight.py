"""A ``[federation]`` site's checks that need the backbone, run by the site's own warm executor.

The checks load the frozen CLIP (torch, open_clip, peft: about 5 CPU-seconds an interpreter) and read
the run's class set: does the backbone load offline, can it tell the classes apart by text
(`fedmvp.vocabulary_check`). The executor loads the same libraries anyway for the site's first
message, so `fedmvp join` hands these checks to it instead of loading everything twice: the executor
runs them before the join starts its SuperNode, so a refused site still connects nothing
(`fedmvp_apps.deploy.supernode.become_supernode`, docs/architecture.md "Sites that hold their own data").
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

MODULE = __name__  # what `fedmvp join` names to the executor (warm_executor --preflight)


@dataclass(frozen=True)
class SiteChecks:
    """What to check: the preset (a name or a TOML file's absolute path) and, for a site that takes the
    class set from the server, the backbone alone."""

    preset: str
    backbone_only: bool = False

    def argument(self) -> str:
        """The executor's ``--preflight-arg``: JSON, no pickling across processes."""
        return json.dumps(asdict(self))


def preflight(argument: str) -> str | None:
    """Run the checks ``argument`` (`SiteChecks.argument`) names; the refusal as one line, None when they
    pass. A vocabulary warning, if any, goes to stderr as the checks print it (once)."""
    from fedmvp.clip_errors import ClipLoadError
    from fedmvp.presets.schema import PresetError, load_preset
    from fedmvp.vocabulary_check import check_preset, load_backbone

    checks = SiteChecks(**json.loads(argument))
    try:
        preset = load_preset(checks.preset, check_roots=False)
        if checks.backbone_only:  # no class set on this site: the backbone alone
            load_backbone(preset.model.clip, preset.model.pretrained, preset.seed)
        else:  # the backbone loads offline and tells the classes apart (one warning line if not)
            check_preset(preset)
    except (PresetError, ClipLoadError) as err:
        return str(err)
    return None
