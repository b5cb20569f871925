"""Protocol presets: TOML files naming the datasets, roots, splits and clients of one experiment.

Why strict: a typo in a preset ("classes_per_clinet") silently falling back to a default would
waste a whole federated run, so every unknown key, bad value or missing root stops the load
with ONE line that starts with the preset file's path (``PresetError``). Shipped presets live in
``fedmvp/presets/<name>.toml``; a name resolves there, anything else is a path.

Paths: ``${VAR}``/``$VAR`` and ``~`` are expanded; a relative ``root`` is relative to the
preset file's folder (or ``base_dir``, which a run's recorded copy of its preset sets), and
``split_file``, ``image_dir``, ``class_names_file`` and ``attributes``
are relative to the dataset's ``root``. ``attributes`` may contain ``{domain}`` for one attribute
file per domain. ``root = ""`` (synthetic layout only) means the cached default world.
``layout`` names a registered layout (``fedmvp/data/layout_table.py``), which checks its own fields.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
import typing
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from fedmvp_formats.method import field_problem, method_field
from fedmvp_formats.privacy import PrivacyRecord

from fedmvp.data.layout_table import find_layout, layout_names
from fedmvp.presets.fields import is_float
from fedmvp.presets.fields import spec_field as _help
from fedmvp.presets.fields import type_name as _type_name
from fedmvp.presets.fields import type_ok as _type_ok
from fedmvp.presets.server import ServerSpec

PRESET_DIR = Path(__file__).parent
PROTOCOLS = ("base-to-new", "msst", "ssmt")
PROTOCOL_ALIASES = {"base2new": "base-to-new", "multi-source-single-target": "msst",
                    "single-source-multi-target": "ssmt"}
ROLES = ("train", "test")
EVAL_KINDS = ("base", "new", "domain")


class PresetError(ValueError):
    """A preset that cannot be used; the one-line message starts with the preset file path."""


def _method(name: str) -> Any:
    """A [train] key that becomes the method record's field ``name``: its default, help and range are
    the record's (``fedmvp_formats.method``, the one definition); ``method_keys`` lists these keys."""
    spec = method_field(name)
    return field(default=spec.default, metadata={"help": spec.metadata["help"], "method": name})


def method_keys(cls: type | None = None) -> dict[str, str]:
    """{[train] key: method record field} of the keys that shape the model (``federated/prepare.py``)."""
    return {f.name: f.metadata["method"] for f in fields(cls or TrainSpec) if "method" in f.metadata}


@dataclass
class ModelSpec:
    """The frozen CLIP backbone (docs/method.md §1)."""

    clip: str = _help("open_clip model name or a registered fedmvp config", "ViT-B-16")
    pretrained: str = _help("open_clip pretrained tag or a local weights file", "openai")


@dataclass
class TrainSpec:
    """Optimisation and round settings (docs/method.md §4-6); defaults are the paper's."""

    rounds: int = _help("federated rounds")
    local_epochs: int = _help("local epochs per round (one step per batch)", 1)
    batch_size: int = _help("local mini-batch size", 128)
    shots: int | None = _help("training images per class per client (k-shot, sampled once); default 8 with "
                              "[[datasets]], unset with [federation]: a site trains on all its images", None)
    lr: float = _help("SGD learning rate (cosine decay over the rounds)", 0.003)
    momentum: float = _help("SGD momentum", 0.9)
    weight_decay: float = _help("SGD weight decay", 1e-5)
    sigma: float = _help("LoRA switch: a client's mean round loss below this freezes the PromptFormer", 0.5)
    alpha: float = _method("alpha")
    num_prompts: int = _method("num_prompts")
    use_lora: bool = _method("use_lora")
    lora_rank: int = _method("lora_rank")
    num_attributes: int = _help("attribute phrases per class (K)", 10)
    fraction_fit: float = _help("fraction of clients sampled each round", 1.0)


@dataclass
class DatasetSpec:
    """One dataset of a preset: where its images are, how it is split and cut into clients."""

    name: str = _help("dataset name; also picks the sentence suffix (e.g. OxfordFlowers)")
    layout: str = _help(f"a registered layout: {', '.join(layout_names())}")
    root: str = _help("dataset folder (${VAR} and ~ expanded); '' = the default synthetic world")
    role: str = _help("'train': clients train on it; 'test': evaluation only", "train")
    world_seed: int = _help("synthetic, root = '': seed of the generated default world", 0)
    attributes: str | None = _help("attribute JSON {class: [phrases]}, relative to root; "
                                   "may contain {domain}", None)
    split_file: str | None = _help("coop: split_zhou_<Dataset>.json, relative to root", None)
    image_dir: str = _help("coop: image folder the split's paths are relative to", "")
    class_names_file: str | None = _help("imagefolder: class order and names "
                                         "('<folder> <name>' lines or JSON)", None)
    train_split: str = _help("split (coop key / imagefolder or synthetic sub-folder) for training", "train")
    test_split: str = _help("split for test images; '' = root itself (imagefolder)", "test")
    domain: str | None = _help("domain of a single-domain dataset (picks the sentence prefix)", None)
    train_domains: list[str] = _help("domainbed/synthetic: source domains (one client set each)", [])
    test_domains: list[str] = _help("domainbed/synthetic: held-out target domains (evaluation)", [])
    holdout_fraction: float = _help("domainbed: share of each source domain kept for local test", 0.2)
    base_classes: int | None = _help("base classes (default ceil(C/2); synthetic: first N seen)", None)
    new_classes: int | None = _help("new classes (default the rest; synthetic: first N held-out)", None)
    classes_per_client: int | None = _help("classes per client (default 20; ssmt 5; msst all)", None)
    num_clients: int | None = _help("number of clients (default: enough for every class)", None)
    clients: list[list[str]] | None = _help("explicit client class lists (names), instead of the cut", None)
    dirichlet_alpha: float | None = _help("Dirichlet label skew over the base classes "
                                          "(needs num_clients) instead of the class cut", None)
    mix_domains: bool = _help("one client set over all train_domains instead of one per domain", False)
    eval_kind: str = _help(f"role='test': kind of its evaluation ({', '.join(EVAL_KINDS)})", "domain")
    base_dir: Path = field(default=Path("."), repr=False, metadata={"internal": True})

    @property
    def synthetic_default(self) -> bool:
        """``root = ""`` of a layout that makes its own default folder (the synthetic world)."""
        layout = find_layout(self.layout)
        return layout is not None and layout.default_root and self.root.strip() == ""

    def root_path(self) -> Path:
        """The expanded root (``ValueError`` naming the variable if one is unset)."""
        return expand_path(self.root, self.base_dir)

    def file_path(self, value: str, root: Path | None = None) -> Path:
        """``value`` expanded, relative to the dataset root."""
        return expand_path(value, root if root is not None else self.root_path())


@dataclass
class FederationSpec:
    """A federation defined by its class set, not by datasets: real sites bring their own folders
    (docs/architecture.md "Sites that hold their own data")."""

    attributes: str = _help("the class set: every class of this attribute JSON {class: [phrases]}, relative "
                            "to the preset file; its order is the federation's class order")
    new_classes: list[str] = _help("classes held out: never trained on anywhere, evaluated where sites hold "
                                   "them", [])
    eval_fraction: float = _help("share of each class a site keeps for evaluation (a stable split by file "
                                 "name), in (0, 1); a site folder with train/ and test/ uses those instead", 0.2)
    base_dir: Path = field(default=Path("."), repr=False, metadata={"internal": True})

    def attributes_path(self) -> Path:
        return expand_path(self.attributes, self.base_dir)


@dataclass
class SiteSpec:
    """A site of a [federation] preset: listed by name for a deployment (its place is its site id), with
    its folder for `fedmvp train` on one machine (the simulation)."""

    name: str = _help("the site's name: its identity in every reply, its site id by its place here; "
                      "`fedmvp join --name` must be one of these")
    data: str = _help("the site's folder DIR/<class>/<image> (or DIR/train + DIR/test), relative to the "
                      "preset file; '' (a deployment's preset): the site brings it (`fedmvp join --data`)", "")
    node_key: str = _help("the site's SuperNode public key (OpenSSH .pub, relative to the preset file); a node "
                          "joining as this site must prove it holds that key (fedmvp serve); '': unbound", "")
    base_dir: Path = field(default=Path("."), repr=False, metadata={"internal": True})

    def data_path(self) -> Path:
        return expand_path(self.data, self.base_dir)

    def node_key_path(self) -> Path:
        return expand_path(self.node_key, self.base_dir)


@dataclass
class Preset:
    """A whole experiment: protocol, model, training settings and datasets."""

    name: str = _help("preset name (default: the file name)")
    protocol: str = _help(f"one of {', '.join(PROTOCOLS)} (with [[datasets]]; a [federation] is base-to-new)", "")
    seed: int = _help("seed for k-shot sampling and partitions", 0)
    description: str = _help("free text", "")
    base_dir: str = _help("folder relative dataset roots are taken from (default: this file's folder); "
                          "a run's recorded copy (runs/<name>/preset.toml) names its preset's folder", "")
    model: ModelSpec = _help("[model] table", None)
    train: TrainSpec = _help("[train] table", None)
    server: ServerSpec = _help("[server] table", None)
    privacy: PrivacyRecord | None = _help("[privacy] table: differential privacy for the LoRA updates "
                                          "(docs/howto/privacy.md); absent: none", None)
    datasets: list[DatasetSpec] = _help("[[datasets]] tables", [])
    federation: FederationSpec | None = _help("[federation] table: the federation by its class set "
                                              "(instead of [[datasets]])", None)
    sites: list[SiteSpec] = _help("[[sites]] tables: the [federation]'s sites by name, with their folders for a "
                                  "simulation; none: open membership (any site joins by name, the server numbers "
                                  "it)", [])
    path: Path | None = field(default=None, metadata={"internal": True})
    raw: dict = field(default_factory=dict, repr=False, metadata={"internal": True})


_VAR = re.compile(r"\$\{(\w+)\}|\$(\w+)")


def expand_path(value: str, base: Path) -> Path:
    """``${VAR}``, ``$VAR`` and ``~`` expanded; relative results are taken from ``base``."""
    def sub(m: re.Match) -> str:
        var = m.group(1) or m.group(2)
        if var not in os.environ:
            raise ValueError(f"environment variable {var} is not set (in {value!r})")
        return os.environ[var]

    path = Path(_VAR.sub(sub, value)).expanduser()
    return path if path.is_absolute() else base / path


def list_presets() -> list[str]:
    """Names of the shipped presets."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def preset_path(name_or_path: str | os.PathLike) -> Path:
    """A shipped preset's file for a bare name, else the path itself."""
    text = str(name_or_path)
    path = Path(text).expanduser()
    if path.is_file() or text.endswith(".toml") or os.sep in text or "/" in text:
        return path
    candidate = PRESET_DIR / f"{text}.toml"
    if candidate.exists():
        return candidate
    raise PresetError(f"{text}: no such preset or file (shipped: {', '.join(list_presets()) or 'none'})")


# ---- parsing --------------------------------------------------------------------------------

def _build(cls: type, table: Any, where: str, err: Any, extra: dict | None = None) -> Any:
    """``cls(**table)`` with unknown keys, missing keys and wrong types reported as one line."""
    if not isinstance(table, dict):
        raise err(f"{where} must be a table, got {type(table).__name__}")
    hints = typing.get_type_hints(cls)
    allowed = [f for f in fields(cls) if not f.metadata.get("internal")
               and not (isinstance(hints[f.name], type) and hints[f.name] in (ModelSpec, TrainSpec, ServerSpec))
               and f.name not in ("datasets", "federation", "sites", "privacy")]
    names = [f.name for f in allowed]
    unknown = [k for k in table if k not in names]
    if unknown:
        tables = ", [model], [train], [server], [privacy], [[datasets]], [federation], [[sites]]" \
            if cls is Preset else ""
        raise err(f"{where}: unknown key {unknown[0]!r} (allowed: {', '.join(names)}{tables})")
    missing = [f.name for f in allowed if f.default is MISSING and f.default_factory is MISSING
               and f.name not in table]
    if missing:
        raise err(f"{where}: missing key {missing[0]!r}")
    values = {}
    for key, value in table.items():
        if not _type_ok(value, hints[key]):
            raise err(f"{where}: {key} must be {_type_name(hints[key])}, got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):  # TOML allows nan and inf; no range check sees NaN
            raise err(f"{where}: {key} must be a finite number, got {value!r}")
        values[key] = float(value) if is_float(hints[key]) and value is not None else value
    return cls(**values, **(extra or {}))


def _check_values(preset: Preset, err: Any) -> None:
    """Range and cross-key checks that need no file system."""
    t = preset.train
    seeds = [("top level: seed", preset.seed)] + [(f"datasets[{i}] ({d.name}): world_seed", d.world_seed)
                                                  for i, d in enumerate(preset.datasets)]
    for where, seed in seeds:  # what torch and numpy accept as a seed, for every use of it
        if not 0 <= seed < 1 << 63:
            raise err(f"{where} must be an integer from 0 to 2**63 - 1, got {seed}")
    for key, name in method_keys().items():  # the method record's ranges
        problem = field_problem(name, getattr(t, key))
        if problem:
            raise err(f"[train]: {problem.replace(name, key, 1)}")
    for key in ("rounds", "local_epochs", "batch_size", "shots", "num_attributes"):
        if getattr(t, key) is not None and getattr(t, key) < 1:
            raise err(f"[train]: {key} must be at least 1, got {getattr(t, key)}")
    for key in ("lr", "momentum", "weight_decay", "sigma"):
        if not (math.isfinite(getattr(t, key)) and getattr(t, key) >= 0):
            raise err(f"[train]: {key} must be a finite number >= 0, got {getattr(t, key)}")
    problem = preset.server.problem()  # the server rules' one range check (fedmvp/presets/server.py)
    if problem:
        raise err(f"[server]: {problem}")
    problem = preset.privacy.problem() if preset.privacy is not None else None  # fedmvp_formats/privacy.py
    if problem:
        raise err(f"[privacy]: {problem}")
    _check_update_rule(preset, err)
    if not 0 < t.fraction_fit <= 1:
        raise err(f"[train]: fraction_fit must be in (0, 1], got {t.fraction_fit}")
    if preset.federation is not None:
        _check_federation(preset, err)
        return
    if not preset.datasets:
        raise err("no [[datasets]]" + (" (or a [federation])" if not preset.sites else ""))
    if not any(d.role == "train" for d in preset.datasets):
        raise err("no dataset with role = 'train'")
    seen: set[str] = set()
    for i, d in enumerate(preset.datasets):
        where = f"datasets[{i}] ({d.name})"
        if d.name in seen:
            raise err(f"{where}: dataset name {d.name!r} used twice")
        seen.add(d.name)
        for key, options in (("layout", layout_names()), ("role", ROLES), ("eval_kind", EVAL_KINDS)):
            if getattr(d, key) not in options:
                raise err(f"{where}: unknown {key} {getattr(d, key)!r} (one of {', '.join(options)})")
        problem = _layout_problem(d)
        if problem:
            raise err(f"{where}: {problem}")
        both = sorted(set(d.train_domains) & set(d.test_domains))
        if both:
            raise err(f"{where}: domains both trained on and held out: {', '.join(both)}")
        if preset.protocol == "msst" and d.role == "train" and not (d.train_domains and d.test_domains):
            raise err(f"{where}: protocol msst needs train_domains and test_domains")
        for key in ("base_classes", "classes_per_client", "num_clients"):
            value = getattr(d, key)
            if value is not None and value < 1:
                raise err(f"{where}: {key} must be at least 1, got {value}")
        if d.new_classes is not None and d.new_classes < 0:
            raise err(f"{where}: new_classes must not be negative, got {d.new_classes}")
        if not 0 <= d.holdout_fraction < 1:
            raise err(f"{where}: holdout_fraction must be in [0, 1), got {d.holdout_fraction}")
        if d.dirichlet_alpha is not None:
            if d.dirichlet_alpha <= 0 or d.num_clients is None or d.clients is not None:
                raise err(f"{where}: dirichlet_alpha must be > 0, needs num_clients and excludes clients")
        if d.clients is not None and (d.num_clients is not None or d.classes_per_client is not None):
            raise err(f"{where}: clients lists exclude num_clients and classes_per_client")


def _check_update_rule(preset: Preset, err: Any) -> None:
    """[server] update_rule and device_rule declare central DP where [privacy] mode = "central"
    (docs/howto/robust.md): one line at preset load. Whether a name is registered is the server's check
    (``prepare.check_startable``): a site's process loads the preset without the rules a server registered
    from outside the package."""
    from fedmvp.federated.update_rules import privacy_problem

    problem = privacy_problem(preset.server, preset.privacy)
    if problem:
        raise err(problem)


def _layout_problem(d: DatasetSpec) -> str | None:
    """What is wrong with ``d``'s fields for its (registered) layout: the rules every layout shares (a
    default root, domains) and the layout's own (``Layout.check``)."""
    layout = find_layout(d.layout)
    if not d.root.strip() and not layout.default_root:
        having = " or ".join(n for n in layout_names() if find_layout(n).default_root) or "no"
        return f"root is empty (only the {having} layout has a default root)"
    problem = layout.check(d)
    if problem is None and (d.train_domains or d.test_domains) and not layout.multi_domain:
        multi = " or ".join(n for n in layout_names() if find_layout(n).multi_domain)
        problem = f"train_domains/test_domains need the {multi} layout"
    return problem


def _check_federation(preset: Preset, err: Any) -> None:
    """A [federation] preset: no [[datasets]], base-to-new, a sane held-out share, unique site names."""
    f = preset.federation
    if preset.datasets:
        raise err("[federation] and [[datasets]] exclude each other: define the federation by its class set "
                  "or by datasets, not both")
    if preset.protocol not in ("", "base-to-new"):
        raise err(f"[federation]: protocol {preset.protocol!r}: a federation of sites is base-to-new")
    if not 0 < f.eval_fraction < 1:  # 0 holds no base image out: Base unmeasured, HM silently New's
        raise err(f"[federation]: eval_fraction must be in (0, 1), got {f.eval_fraction} (a site keeps that share "
                  f"of each class to evaluate on; 0 would leave Base unmeasured)")
    twice = sorted({c for c in f.new_classes if f.new_classes.count(c) > 1})
    if twice:
        raise err(f"[federation]: new_classes names {twice[0]!r} twice")
    names = [s.name for s in preset.sites]
    for i, name in enumerate(names):
        if not name.strip() or len(name) > 128:
            raise err(f"sites[{i}]: name must be 1 to 128 characters, got {name!r}")
        if names.count(name) > 1:
            raise err(f"sites[{i}]: site name {name!r} used twice")


def _check_roots(preset: Preset, err: Any) -> None:
    """Every named root and file exists (the attribute file is checked when data is built; a site
    folder's contents by ``fedmvp.data.site_folder``)."""
    if preset.federation is not None:
        try:
            folders = [(f"sites[{i}] ({s.name})", s.data_path()) for i, s in enumerate(preset.sites) if s.data]
            attributes = preset.federation.attributes_path()
        except ValueError as exc:
            raise err(str(exc)) from None
        if not attributes.is_file():
            raise err(f"[federation]: attributes {attributes} does not exist")
        for where, folder in folders:
            if not folder.is_dir():
                raise err(f"{where}: data {folder} does not exist")
    for i, d in enumerate(preset.datasets):
        where = f"datasets[{i}] ({d.name})"
        if d.synthetic_default:
            continue
        try:
            root = d.root_path()
            files = [("split_file", d.split_file), ("class_names_file", d.class_names_file)]
            paths = [(key, d.file_path(v, root)) for key, v in files if v]
        except ValueError as exc:
            raise err(f"{where}: {exc}") from None
        if not root.is_dir():
            raise err(f"{where}: root {root} does not exist")
        for key, path in paths:
            if not path.is_file():
                raise err(f"{where}: {key} {path} does not exist")


def load_preset(name_or_path: str | os.PathLike, check_roots: bool = True) -> Preset:
    """Parse and validate a preset; ``check_roots=False`` skips file-system checks (for presets
    that point at data this machine does not have)."""
    path = preset_path(name_or_path)

    def err(message: str) -> PresetError:
        return PresetError(f"{path}: {' '.join(str(message).split())}")

    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise err("no such preset file") from None
    except OSError as exc:
        raise err(f"cannot read ({exc.strerror or exc})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise err(f"invalid TOML: {exc}") from None
    top = dict(raw)
    model = _build(ModelSpec, top.pop("model", {}), "[model]", err)
    train = _build(TrainSpec, top.pop("train", {}), "[train]", err)
    server = _build(ServerSpec, top.pop("server", {}), "[server]", err)
    privacy = top.pop("privacy", None)  # no table: no differential privacy
    privacy = None if privacy is None else _build(PrivacyRecord, privacy, "[privacy]", err)
    tables = top.pop("datasets", [])
    federation, sites = top.pop("federation", None), top.pop("sites", [])
    for key, value in (("datasets", tables), ("sites", sites)):
        if not isinstance(value, list):
            raise err(f"{key} must be an array of tables ([[{key}]])")
    if federation is None and sites:
        raise err("[[sites]] belong to a [federation] preset (add [federation] with its attributes)")
    if federation is None and "protocol" not in top:
        raise err("top level: missing key 'protocol'")
    top.setdefault("name", path.stem)
    preset = _build(Preset, top, "top level", err, {"model": model, "train": train, "server": server,
                                                     "privacy": privacy, "path": path, "raw": raw})
    preset.protocol = PROTOCOL_ALIASES.get(preset.protocol, preset.protocol)
    try:
        base = expand_path(preset.base_dir, path.parent).resolve() if preset.base_dir else path.parent.resolve()
    except ValueError as exc:
        raise err(f"base_dir: {exc}") from None
    if preset.protocol not in PROTOCOLS and not (federation is not None and not preset.protocol):
        raise err(f"unknown protocol {preset.protocol!r} (one of {', '.join(PROTOCOLS)}; "
                  f"aliases {', '.join(PROTOCOL_ALIASES)})")
    preset.datasets = [
        _build(DatasetSpec, t, f"datasets[{i}]" + (f" ({t['name']})" if isinstance(t, dict) and
                                                    isinstance(t.get("name"), str) else ""),
               err, {"base_dir": base})
        for i, t in enumerate(tables)]
    if federation is not None:
        preset.federation = _build(FederationSpec, federation, "[federation]", err, {"base_dir": base})
        preset.sites = [_build(SiteSpec, t, f"sites[{i}]", err, {"base_dir": base}) for i, t in enumerate(sites)]
        preset.protocol = preset.protocol or "base-to-new"
    elif preset.train.shots is None:
        preset.train.shots = 8  # the paper's k (docs/method.md §6); a [federation] site trains on all it holds
    _check_values(preset, err)
    if check_roots:
        _check_roots(preset, err)
    return preset
