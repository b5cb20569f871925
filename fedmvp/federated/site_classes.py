"""A site's class set held to the run's before it trains or evaluates (docs/security.md), or taken from
the server's message (`fedmvp join --classes-from-server`).

Why: a site's labels are indices into the class list its own attribute file gives, and its text
side is built from that file's phrases. A site whose file lists other classes, the same ones in
another order, or other phrases, would train other indices under the run's names, and its reply
would be averaged in without a word. Each train and evaluate message carries the run's class set
(``fedmvp_formats.messages.CLASS_SET``: digest, names, one phrases digest per class and the phrases);
the site compares its own (``fedmvp.run_classes.class_set_classes`` of its preset, no image read) and
refuses with one line naming what differs and the first differing class. Its replies name the digest it
used (``classes-digest``), which the server checks too (``replies.check_reply``).

A site that joined with ``--classes-from-server`` holds no copy of the file: it takes the names and
phrases from the message once they are checked (each class's phrases against its digest, the digest
against the whole), writes them as an attribute file under the cache root, named by the digest, and
uses that file in place of its preset's (``with_attributes``), exactly as if it held the run's file;
its folder's class subfolders are then matched to the run's class names when its data is built.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from fedmvp_formats.class_set import ClassSet, read_class_set
from fedmvp_formats.files import cache_root
from fedmvp_formats.messages import Instruction, MessageError
from fedmvp_formats.shown import name_shown

FROM_SERVER = "classes-from-server"  # the node config's flag (`fedmvp join --classes-from-server`)
RECEIVED_DIR = "classes"  # under the cache root: one attribute file per class set taken, named by its digest


class ClassSetMismatch(ValueError):
    """This site's class set is not the run's; one line: what differs and how to get the run's."""


@dataclass(frozen=True)
class SiteClasses:
    """The class set a site trains and evaluates with: its digest (None: not checked, a message without
    one or a paper preset) and, where taken from the server, the attribute file written of it."""

    digest: str | None
    attributes: str | None = None


def site_classes(preset_path: str, instruction: Instruction, from_server: bool = False) -> SiteClasses:
    """This site's class set, once it is the run's (`ClassSetMismatch` otherwise; `MessageError` where the
    message's record does not check). ``from_server``: taken from the message, not the preset's file."""
    from fedmvp.presets.schema import load_preset

    if instruction.class_set is None:
        if from_server:
            raise MessageError("the server's message carries no class set to take (a server of an older fedmvp): "
                               "join without --classes-from-server, with a copy of the run's attribute file")
        return SiteClasses(None)
    preset = load_preset(preset_path, check_roots=False)
    if preset.federation is None:  # its classes come from the preset's own datasets, the server's too
        return SiteClasses(None)
    try:
        run = read_class_set(instruction.class_set, with_texts=from_server)
    except ValueError as err:
        raise MessageError(f"the server's message: {err}") from None
    if from_server:
        return _taken(preset, run, instruction.run_id)
    ours = _ours(preset)
    difference = ours.difference(run)
    if difference is not None:
        raise ClassSetMismatch(
            f"{name_shown(str(preset.federation.attributes_path()))}: refused before training: this site's class set "
            f"is not run {name_shown(instruction.run_id)}'s: {difference}; copy the run's attribute file "
            f"(the server preset's [federation] attributes) to this path, or join with --classes-from-server "
            f"(docs/howto/open-federation.md)")
    return SiteClasses(ours.digest)


def _ours(preset) -> ClassSet:
    from fedmvp.run_classes import class_set, class_set_classes

    return class_set(class_set_classes(preset))


def _taken(preset, run: ClassSet, run_id: str) -> SiteClasses:
    """The run's class set written as this site's attribute file, and held to what the site's preset makes
    of it: its [federation] new_classes and [train] num_attributes must be the run's too."""
    from fedmvp.attributes.files import META_KEY
    from fedmvp.presets.schema import PresetError

    if META_KEY in run.names:
        raise MessageError(f"the server's message: class name {META_KEY!r} is reserved in an attribute file")
    path = received_file(run)
    why = f"refused before training: the class set of run {name_shown(run_id)} taken from the server"
    try:
        difference = _ours(with_attributes(preset, path)).difference(run)
    except PresetError as err:
        raise ClassSetMismatch(f"{preset.path}: {why} does not fit this preset: {err}") from None
    if difference is not None:
        raise ClassSetMismatch(
            f"{preset.path}: {why} is not what this preset makes of it: {difference}; the preset's [federation] "
            f"new_classes and [train] num_attributes must be the server's (copy the server's preset)")
    return SiteClasses(run.digest, str(path))


def received_file(run: ClassSet) -> Path:
    """The run's class set as an attribute file ``{class: [phrases]}`` in the set's order, under the cache
    root and named by its digest; written (atomically) only where it is not there already as it should be."""
    from fedmvp import atomic

    path = cache_root() / RECEIVED_DIR / f"{run.digest}.json"
    content = {name: list(phrases) for name, phrases in zip(run.names, run.texts or ())}
    try:
        if json.loads(path.read_text(encoding="utf-8")) == content:
            return path
    except (OSError, ValueError):
        pass  # absent, unreadable or not JSON: written anew
    atomic.write_json(path, content)
    return path


def with_attributes(preset, path: str | Path):
    """``preset`` with its [federation] attribute file replaced by ``path`` (a received class set's)."""
    path = Path(path)
    return replace(preset, federation=replace(preset.federation, attributes=path.name, base_dir=path.parent))


def taken_line(run: ClassSet) -> str:
    """What a site that took the run's class set from the server says, once per class set."""
    return f"took the class set from the server (digest {run.short}, {len(run.names)} classes)"
