"""A site's class set held to the run's before it trains or evaluates (docs/security.md).

Why: a site's labels are indices into the class list its own attribute file gives, and its text
side is built from that file's phrases. A site whose file lists other classes, the same ones in
another order, or other phrases, would train other indices under the run's names, and its reply
would be averaged in without a word. Each train and evaluate message carries the run's class set
(``fedmvp_formats.messages.CLASS_SET``: digest, names, one phrases digest per class); the site
compares its own (``fedmvp.run_classes.class_set_classes`` of its preset, no image read) and refuses
with one line naming what differs and the first differing class. Its replies name the digest it used
(``classes-digest``), which the server checks too (``replies.check_reply``).
"""

from __future__ import annotations

from fedmvp_formats.class_set import read_class_set
from fedmvp_formats.messages import Instruction, MessageError
from fedmvp_formats.shown import name_shown


class ClassSetMismatch(ValueError):
    """This site's class set is not the run's; one line: what differs and how to get the run's."""


def site_class_digest(preset_path: str, instruction: Instruction) -> str | None:
    """This site's class-set digest, once it is the run's (`ClassSetMismatch` otherwise). None where the
    message carries no class set (a run of an older fedmvp) or the preset is a paper preset (its classes
    come from the preset's own datasets, the server's too)."""
    from fedmvp.presets.schema import load_preset
    from fedmvp.run_classes import class_set, class_set_classes

    if instruction.class_set is None:
        return None
    preset = load_preset(preset_path, check_roots=False)
    if preset.federation is None:
        return None
    try:
        run = read_class_set(instruction.class_set)
    except ValueError as err:
        raise MessageError(f"the server's message: {err}") from None
    ours = class_set(class_set_classes(preset))
    difference = ours.difference(run)
    if difference is not None:
        raise ClassSetMismatch(
            f"{name_shown(str(preset.federation.attributes_path()))}: refused before training: this site's class set "
            f"is not run {name_shown(instruction.run_id)}'s: {difference}; copy the run's attribute file "
            f"(the server preset's [federation] attributes) to this path (docs/howto/open-federation.md)")
    return ours.digest
