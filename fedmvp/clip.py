"""Loading the frozen CLIP backbone through open_clip, offline first.

A backbone is a model name plus one weights source: an open_clip pretrained tag
(``openai``), a tag that fedmvp ships (``fedmvp-tiny`` / ``synthetic``), an
``hf-hub:`` or ``local-dir:`` model name, a local weights file (safetensors, or a
torch state dict read with ``weights_only=True``), or nothing (random init).
Nothing is downloaded unless the caller allows it; a source that would need the
network fails with one line that says what to pass instead.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import open_clip
import torch
from torch import nn

from fedmvp.clip_errors import ClipLoadError  # noqa: F401  (its home: caught without open_clip)
from fedmvp.scoped import attribute, environment
from fedmvp.tiny_tokenizer import CompactTokenizer

PACKAGE_DIR = Path(__file__).resolve().parent
MODEL_CONFIG_DIR = PACKAGE_DIR / "model_configs"
REGISTRY = json.loads((MODEL_CONFIG_DIR / "registry.json").read_text())
open_clip.add_model_config(MODEL_CONFIG_DIR)

WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt")


@dataclass
class LoadedClip:
    """A frozen open_clip model with what is needed to use it."""

    model: nn.Module
    preprocess: Callable  # PIL image -> normalised tensor (open_clip's eval transform)
    tokenizer: Callable  # list[str] -> LongTensor[N, context_length]
    name: str
    pretrained: str | None
    identity: str | None  # stable id of the weights for on-disk caches; None for random init

    @property
    def embed_dim(self) -> int:
        return int(self.model.visual.output_dim)

    @property
    def vision_width(self) -> int:
        return int(self.model.visual.conv1.out_channels)

    @property
    def image_size(self) -> int:
        size = self.model.visual.image_size
        return int(size[0] if isinstance(size, (tuple, list)) else size)

    @property
    def num_patches(self) -> int:
        gh, gw = self.model.visual.grid_size
        return int(gh * gw)


def shipped_weights(name: str, tag: str) -> Path | None:
    """Path of weights fedmvp ships for (name, tag), if any."""
    rel = REGISTRY["pretrained"].get(name, {}).get(tag)
    return PACKAGE_DIR / rel if rel else None


def build_tokenizer(name: str) -> Callable:
    """The model's own tokenizer: a registered compact one, else open_clip's."""
    spec = REGISTRY["tokenizers"].get(name)
    if spec and spec["type"] == "compact":
        text_cfg = open_clip.get_model_config(name)["text_cfg"]
        return CompactTokenizer.from_file(PACKAGE_DIR / spec["vocab"], text_cfg["vocab_size"],
                                          text_cfg["context_length"])
    return open_clip.get_tokenizer(name)


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    """``fedmvp_formats.files.sha256_file`` (the one definition) under the name callers here use."""
    from fedmvp_formats.files import sha256_file

    return sha256_file(path, chunk)


def is_torchscript(path: Path) -> bool:
    """A TorchScript archive (how OpenAI ships its CLIP checkpoints), told by its constants table."""
    import zipfile

    if path.suffix == ".safetensors" or not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        return any(name.endswith("constants.pkl") for name in archive.namelist())


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A CLIP state dict from safetensors or a torch file, never unpickling arbitrary objects."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    import pickle
    import warnings

    if is_torchscript(path):  # OpenAI's original checkpoints: TorchScript code + tensors, no pickled objects
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # "torch.jit.load is deprecated": still how they ship
            obj: Any = torch.jit.load(str(path), map_location="cpu").state_dict()
    else:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except (RuntimeError, pickle.UnpicklingError) as err:
            raise ClipLoadError(f"{path}: not a weights-only torch file; refusing to unpickle it "
                                f"(convert it to safetensors)") from err
    if isinstance(obj, dict) and "state_dict" in obj:
        obj = obj["state_dict"]
    if not isinstance(obj, dict):
        raise ClipLoadError(f"{path}: expected a state dict, found {type(obj).__name__}")
    state = {k.removeprefix("module."): v for k, v in obj.items()}
    for key in ("input_resolution", "context_length", "vocab_size"):
        state.pop(key, None)
    return state


@contextlib.contextmanager
def _offline(allow_download: bool) -> Iterator[None]:
    """Keep Hugging Face hub calls local unless downloads are allowed, for this block only (the
    environment and the hub's flag are restored after, also on error: fedmvp.scoped).

    huggingface_hub reads HF_HUB_OFFLINE once, at import, so the environment alone does not
    switch an already imported hub offline (it then tries the network and, offline, waits ~50 s
    for DNS before failing); its module flag is set too, for the duration of the call."""
    if allow_download:
        yield
        return
    try:
        from huggingface_hub import constants as hub_constants
    except ImportError:  # no hub installed: open_clip falls back to URLs (checked by _needs_url_download)
        hub_constants = None
    with contextlib.ExitStack() as stack:
        stack.enter_context(environment({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}))
        if hub_constants is not None:
            stack.enter_context(attribute(hub_constants, "HF_HUB_OFFLINE", True))
        yield


@contextlib.contextmanager
def _random_init_is_expected(dropped: str = "initialized randomly"):
    """Drop open_clip's "No pretrained weights loaded ... initialized randomly" while the
    architecture is built only to receive a weights file: users read it as a failed load.
    (``dropped``: "Failed to download" while downloads are off: ``offline_hint`` says it in one line.)"""

    def keep(record: logging.LogRecord) -> bool:
        return dropped not in record.getMessage()

    root = logging.getLogger()
    root.addFilter(keep)
    try:
        yield
    finally:
        root.removeFilter(keep)


def _needs_url_download(name: str, tag: str, cache_dir: str | None) -> bool:
    """True when open_clip would fetch ``name``/``tag`` from a plain URL (no hub copy) not yet cached."""
    from open_clip import pretrained as oc_pretrained

    cfg = oc_pretrained.get_pretrained_cfg(name, tag) or {}
    if "file" in cfg or not cfg.get("url"):
        return False
    if cfg.get("hf_hub") and oc_pretrained.has_hf_hub():
        return False  # the hub path, kept offline by _offline
    folder = Path(cache_dir).expanduser() if cache_dir else Path("~/.cache/clip").expanduser()
    return not (folder / os.path.basename(cfg["url"])).is_file()


def freeze(model: nn.Module) -> nn.Module:
    """CLIP is never trained: no gradients, eval mode (no dropout)."""
    model.eval()
    for param in model.parameters():
        param.requires_grad_(False)
    return model


def _create(name: str, pretrained: str | None, allow_download: bool, cache_dir: str | None,
            quick_gelu: bool = False):
    quiet = contextlib.nullcontext() if allow_download else _random_init_is_expected("Failed to download")
    try:
        with _offline(allow_download), quiet:
            model, _, preprocess = open_clip.create_model_and_transforms(
                name, pretrained=pretrained, cache_dir=cache_dir, force_quick_gelu=quick_gelu)
    except RuntimeError as err:
        if "Unknown model" in str(err) or "not found" in str(err).lower():
            raise ClipLoadError(f"unknown CLIP model '{name}'; known: fedmvp-tiny, ViT-B-16, ... "
                                f"(see `open_clip.list_models()`)") from err
        raise
    return model, preprocess


def check_clip(name: str, pretrained: str | None) -> None:
    """The checks ``load_clip`` makes before it builds anything (the model name, the weights file or tag):
    ClipLoadError before a run directory is written, not once the server builds round 0."""
    weights, identity = _resolve(name, pretrained or None, hashed=False)
    if name.startswith("local-dir:"):
        if not (Path(name[len("local-dir:"):]).expanduser() / "open_clip_config.json").is_file():
            raise ClipLoadError(f"{name}: no open_clip_config.json in that folder")
    elif name.startswith("hf-hub:"):
        from huggingface_hub import try_to_load_from_cache

        if not downloads_allowed() and not isinstance(try_to_load_from_cache(name[len("hf-hub:"):],
                                                                             "open_clip_config.json"), str):
            raise _not_cached(name, pretrained)
    elif identity is not None and weights is None and not downloads_allowed() \
            and _needs_url_download(name, str(pretrained), None):
        raise _not_cached(name, pretrained)


def _not_cached(name: str, pretrained: str | None) -> ClipLoadError:
    return ClipLoadError(offline_hint(name, pretrained))


def _resolve(name: str, pretrained: str | None, hashed: bool) -> tuple[Path | None, str | None]:
    """(weights file or None, identity) of ``name``/``pretrained``, or ClipLoadError naming what is wrong;
    ``hashed``: the identity of a weights file includes its sha256 (the text-feature cache key)."""
    is_schema = name.startswith(("hf-hub:", "local-dir:"))
    if not is_schema and name not in open_clip.list_models():
        raise ClipLoadError(f"unknown CLIP model '{name}'; try fedmvp-tiny or ViT-B-16 "
                            f"(all names: python -c 'import open_clip; print(open_clip.list_models())')")
    if is_schema:
        return None, name
    if not pretrained:
        return None, None
    shipped = shipped_weights(name, pretrained)
    candidate = Path(pretrained).expanduser()
    if shipped is not None:
        if not shipped.is_file():
            raise ClipLoadError(f"{shipped}: shipped weights for {name}/{pretrained} are missing; "
                                f"rebuild them with `fedmvp pretrain-tiny`")
        # Keyed by the bytes too: rebuilt shipped weights must not reuse stale text features.
        return shipped, f"{name}:{pretrained}:sha256:{file_sha256(shipped)}" if hashed else None
    if candidate.suffix in WEIGHT_SUFFIXES or candidate.exists():
        if not candidate.is_file():
            raise ClipLoadError(f"{candidate}: weights file not found")
        return candidate, f"{name}:sha256:{file_sha256(candidate)}" if hashed else None
    tags = open_clip.list_pretrained_tags_by_model(name)
    if pretrained not in tags:
        raise ClipLoadError(f"'{pretrained}' is neither a pretrained tag of {name} "
                            f"(tags: {', '.join(tags) or 'none'}) nor a weights file")
    return None, f"{name}:{pretrained}"


def load_clip(name: str, pretrained: str | None = None, *, device: str | torch.device = "cpu",
              allow_download: bool | None = None, cache_dir: str | None = None) -> LoadedClip:
    """Build a frozen CLIP. ``pretrained``: None (random init), a tag, or a weights file path.

    ``allow_download`` None follows ``FEDMVP_ALLOW_DOWNLOAD`` (off unless set to 1)."""
    if allow_download is None:
        allow_download = downloads_allowed()
    is_schema = name.startswith(("hf-hub:", "local-dir:"))
    weights_path, identity = _resolve(name, pretrained, hashed=True)
    if weights_path is not None:
        state = read_state_dict(weights_path)
        # OpenAI's own archives were trained with QuickGELU; the `openai` tag switches it on by
        # itself, a file does not say, and plain GELU would run those weights with the wrong
        # activation. Other weight files: name the model `...-quickgelu` when they need it.
        with _random_init_is_expected():  # the weights file is loaded right below
            model, preprocess = _create(name, None, allow_download, cache_dir,
                                        quick_gelu=is_torchscript(weights_path))
        if "logit_scale" in state and state["logit_scale"].ndim != model.logit_scale.ndim:
            state["logit_scale"] = state["logit_scale"].reshape(model.logit_scale.shape)
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as err:
            first = str(err).splitlines()[0] if str(err) else "shape or key mismatch"
            raise ClipLoadError(f"{weights_path}: does not fit {name}: {first}") from err
    else:
        tag = pretrained if (pretrained and not is_schema) else None
        try:
            if tag and not allow_download and _needs_url_download(name, tag, cache_dir):
                raise FileNotFoundError(f"{name}/{tag} is only on a URL and not in the cache")
            model, preprocess = _create(name, tag, allow_download, cache_dir)
        except ClipLoadError:
            raise
        except Exception as err:  # hub / url download attempted while offline
            if allow_download:
                raise ClipLoadError(f"could not fetch {name} / {pretrained}: {err}") from err
            raise _not_cached(name, pretrained) from err
    model = freeze(model.to(device))
    tokenizer = open_clip.get_tokenizer(name) if is_schema else build_tokenizer(name)
    return LoadedClip(model=model, preprocess=preprocess, tokenizer=tokenizer, name=name,
                      pretrained=pretrained, identity=identity)


def offline_hint(name: str, pretrained: str | None) -> str:
    """The line for weights that only a download would bring: what to set instead. The preset's key, not a
    flag: `fedmvp train`, `serve` and `join` read the backbone from the preset alone (docs/howto/weights.md)."""
    return (f"{name} with pretrained '{pretrained}' is not in the local cache and downloads are off; "
            f"set the preset's [model] pretrained to a weights file (pretrained = \"/path/to/{name}.safetensors\") "
            f"or allow downloads "
            f"(FEDMVP_ALLOW_DOWNLOAD=1); see docs/howto/weights.md")


def downloads_allowed() -> bool:
    return os.environ.get("FEDMVP_ALLOW_DOWNLOAD", "") not in ("", "0", "false")
