"""Drawing one object of the synthetic world in one visual domain (numpy + Pillow).

Why: the world needs images where shape, colour, surface pattern and size decide the class,
with nuisances (position, rotation, background texture, clutter) that do not, and several
domains (photo, sketch, painting) that share classes but not looks, so domain
generalisation can be shown. Everything random comes from the ``rng`` passed in, so an
image is a pure function of (class, domain, rng state): same seed, same bytes.
Images are drawn at ``CANVAS`` px and downsampled for anti-aliasing.
"""

from __future__ import annotations

import colorsys
import math

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from fedmvp.synthetic.world import COLOURS, SHAPES, SIZES, WorldClass

CANVAS = 64
IMAGE_SIZE = 32
PAPER = np.array([244, 242, 233], dtype=np.float32)


# ---- geometry ----------------------------------------------------------------------------------

def _unit_outline(shape: str) -> np.ndarray:
    """Outline of ``shape`` in unit coordinates (radius ~1, y down), as an [N, 2] array."""
    if shape == "circle":
        t = np.linspace(0, 2 * np.pi, 48, endpoint=False)
        return np.stack([np.cos(t), np.sin(t)], 1)
    if shape == "square":
        return np.array([[-1, -1], [1, -1], [1, 1], [-1, 1]], dtype=float) * 0.78
    if shape == "triangle":
        t = np.array([-90, 30, 150]) * np.pi / 180
        return np.stack([np.cos(t), np.sin(t)], 1) * 1.05 + [0, 0.15]
    if shape == "star":
        t = np.arange(10) * np.pi / 5 - np.pi / 2
        rad = np.where(np.arange(10) % 2 == 0, 1.05, 0.45)
        return np.stack([np.cos(t) * rad, np.sin(t) * rad], 1)
    if shape == "cross":
        a, b = 0.34, 0.95
        return np.array([[-a, -b], [a, -b], [a, -a], [b, -a], [b, a], [a, a], [a, b], [-a, b], [-a, a],
                         [-b, a], [-b, -a], [-a, -a]], dtype=float)
    if shape == "heart":
        t = np.linspace(0, 2 * np.pi, 48, endpoint=False)
        x = 16 * np.sin(t) ** 3
        y = -(13 * np.cos(t) - 5 * np.cos(2 * t) - 2 * np.cos(3 * t) - np.cos(4 * t))
        return np.stack([x, y + 2.5], 1) / 16.5
    if shape == "diamond":
        return np.array([[0, -1.08], [0.58, 0], [0, 1.08], [-0.58, 0]], dtype=float)
    raise ValueError(f"unknown shape {shape!r}")


def _place(points: np.ndarray, cx: float, cy: float, r: float, angle: float) -> list[tuple[float, float]]:
    c, s = math.cos(angle), math.sin(angle)
    rot = points @ np.array([[c, s], [-s, c]])
    return [(cx + x * r, cy + y * r) for x, y in rot]


def shape_mask(shape: str, cx: float, cy: float, r: float, angle: float, size: int = CANVAS) -> np.ndarray:
    """Float mask in [0, 1] of one shape, [size, size]."""
    img = Image.new("L", (size, size), 0)
    draw = ImageDraw.Draw(img)
    if shape == "crescent":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=255)
        ox, oy = 0.45 * r * math.cos(angle), 0.45 * r * math.sin(angle)
        rr = 0.82 * r
        draw.ellipse([cx + ox - rr, cy + oy - rr, cx + ox + rr, cy + oy + rr], fill=0)
    else:
        draw.polygon(_place(_unit_outline(shape), cx, cy, r, angle), fill=255)
    return np.asarray(img, dtype=np.float32) / 255.0


def pattern_mask(pattern: str, cx: float, cy: float, angle: float, period: float, phase: tuple[float, float],
                 size: int = CANVAS) -> np.ndarray:
    """Where the surface pattern's ink goes (1) in object-aligned coordinates."""
    if pattern == "solid":
        return np.zeros((size, size), dtype=np.float32)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    x, y = xx - cx, yy - cy
    c, s = math.cos(angle), math.sin(angle)
    u = (x * c + y * s) / period + phase[0]
    v = (-x * s + y * c) / period + phase[1]
    if pattern == "striped":
        return ((u % 1.0) < 0.5).astype(np.float32)
    if pattern == "dotted":
        du, dv = (u % 1.0) - 0.5, (v % 1.0) - 0.5
        return ((du * du + dv * dv) < 0.3 ** 2).astype(np.float32)
    if pattern == "checkered":
        return ((np.floor(u * 2) + np.floor(v * 2)) % 2).astype(np.float32)
    raise ValueError(f"unknown pattern {pattern!r}")


# ---- textures ---------------------------------------------------------------------------------

def smooth_noise(rng: np.random.Generator, cells: int, channels: int = 1, size: int = CANVAS) -> np.ndarray:
    """Low-frequency noise in [0, 1]: a random ``cells`` x ``cells`` grid upsampled bicubically."""
    grid = (rng.random((cells, cells, channels)) * 255).astype(np.uint8)
    mode = "L" if channels == 1 else "RGB"
    img = Image.fromarray(grid[..., 0] if channels == 1 else grid, mode).resize((size, size), Image.BICUBIC)
    out = np.asarray(img, dtype=np.float32) / 255.0
    return out[..., None] if channels == 1 else out


def _hsv(h: float, s: float, v: float) -> np.ndarray:
    return np.array(colorsys.hsv_to_rgb(h % 1.0, min(max(s, 0), 1), min(max(v, 0), 1)), dtype=np.float32) * 255


def _over(base: np.ndarray, colour: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """Alpha-composite ``colour`` (rgb or image) over ``base`` with a per-pixel alpha."""
    a = alpha[..., None] if alpha.ndim == 2 else alpha
    return base * (1 - a) + colour * a


def _clutter(img: np.ndarray, rng: np.random.Generator, sketchy: bool) -> np.ndarray:
    """Distractors that carry no class information: small marks (lines, blobs) and, most of the
    time, one or two small objects of any shape and palette colour, so that colour alone is
    not enough and the model has to find the main (largest) object."""
    pil = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(pil, "RGBA")
    for _ in range(int(rng.integers(2, 6))):
        x, y = rng.uniform(0, CANVAS, 2)
        ink = np.full(3, rng.uniform(60, 120)) if sketchy else _hsv(rng.random(), rng.uniform(0, 0.35),
                                                                    rng.uniform(0.2, 0.9))
        fill = (*(int(v) for v in ink), int(255 * rng.uniform(0.25, 0.55)))
        if sketchy or rng.random() < 0.5:
            dx, dy = rng.uniform(-12, 12, 2)
            draw.line([(x, y), (x + dx, y + dy)], fill=fill, width=int(rng.integers(1, 3)))
        else:
            rad = rng.uniform(1.5, 4)
            draw.ellipse([x - rad, y - rad, x + rad, y + rad], fill=fill)
    img = np.asarray(pil, dtype=np.float32)
    n_objects = int(rng.choice(3, p=[0.25, 0.5, 0.25]))
    for _ in range(n_objects):
        r = rng.uniform(0.07, 0.11) * CANVAS
        cx, cy = rng.uniform(r, CANVAS - r, 2)
        mask = shape_mask(str(rng.choice(list(SHAPES))), cx, cy, r, rng.uniform(0, 2 * math.pi))
        rgb = np.array(COLOURS[str(rng.choice(list(COLOURS)))][0], dtype=np.float32)
        alpha = rng.uniform(0.5, 0.85)
        img = _over(img, rgb * 0.8, _edge(mask, 1) * alpha) if sketchy else _over(img, rgb, mask * alpha)
    return img


def _edge(mask: np.ndarray, width: int) -> np.ndarray:
    img = Image.fromarray((mask * 255).astype(np.uint8), "L")
    inner = np.asarray(img.filter(ImageFilter.MinFilter(2 * width + 1)), dtype=np.float32) / 255.0
    return np.clip(mask - inner, 0, 1)


def _jitter(rgb: tuple[int, int, int], rng: np.random.Generator) -> np.ndarray:
    """The class colour under varying light: small hue shift, weaker saturation, brightness change."""
    h, s, v = colorsys.rgb_to_hsv(*(np.array(rgb) / 255))
    return _hsv(h + rng.uniform(-0.025, 0.025), s * rng.uniform(0.75, 1.05), v * rng.uniform(0.75, 1.1))


def _ink_for(rgb: np.ndarray) -> np.ndarray:
    """Pattern ink that contrasts with the object's colour (dark on light, light on dark)."""
    luminance = float(rgb @ np.array([0.299, 0.587, 0.114])) / 255
    return rgb * 0.28 if luminance > 0.5 else rgb * 0.25 + 255 * 0.75


# ---- domains ----------------------------------------------------------------------------------

def _layout(cls: WorldClass, rng: np.random.Generator) -> dict:
    r = SIZES[cls.size][0] * CANVAS * rng.uniform(0.88, 1.12)
    margin = r + 2
    return dict(r=r, cx=rng.uniform(margin, CANVAS - margin), cy=rng.uniform(margin, CANVAS - margin),
                angle=rng.uniform(0, 2 * math.pi), period=rng.uniform(9.0, 11.0),
                pangle=rng.uniform(-0.3, 0.3), phase=tuple(rng.random(2)))


def _object_masks(cls: WorldClass, lay: dict) -> tuple[np.ndarray, np.ndarray]:
    mask = shape_mask(cls.shape, lay["cx"], lay["cy"], lay["r"], lay["angle"])
    pat = pattern_mask(cls.pattern, lay["cx"], lay["cy"], lay["angle"] + lay["pangle"], lay["period"],
                       lay["phase"])
    return mask, pat


def _photo(cls: WorldClass, rng: np.random.Generator) -> np.ndarray:
    base = _hsv(rng.random(), rng.uniform(0.03, 0.25), rng.uniform(0.35, 0.85))
    ramp = np.linspace(-1, 1, CANVAS, dtype=np.float32)
    gx, gy = rng.uniform(-0.15, 0.15, 2)
    grad = 1 + gx * ramp[None, :, None] + gy * ramp[:, None, None]
    img = base * grad * (0.85 + 0.3 * smooth_noise(rng, 5))
    img = _clutter(img, rng, sketchy=False)
    lay = _layout(cls, rng)
    mask, pat = _object_masks(cls, lay)
    shadow = np.roll(np.roll(mask, 2, 0), 2, 1)
    shadow = np.asarray(Image.fromarray((shadow * 255).astype(np.uint8)).filter(ImageFilter.GaussianBlur(1.5)),
                        dtype=np.float32) / 255.0
    img = img * (1 - 0.35 * shadow[..., None])
    rgb = _jitter(COLOURS[cls.colour][0], rng)
    fill = _over(np.broadcast_to(rgb, img.shape), _ink_for(rgb), pat * rng.uniform(0.6, 0.95))
    yy, xx = np.mgrid[0:CANVAS, 0:CANVAS].astype(np.float32)
    light = 1.0 + 0.18 * ((lay["cx"] - xx) + (lay["cy"] - yy)) / (lay["r"] * 2)
    img = _over(img, fill * light[..., None], mask)
    return img + rng.normal(0, 3.0, img.shape)


def _sketch(cls: WorldClass, rng: np.random.Generator) -> np.ndarray:
    img = np.broadcast_to(PAPER, (CANVAS, CANVAS, 3)) * (0.96 + 0.04 * smooth_noise(rng, 8))
    img = _clutter(img, rng, sketchy=True)
    lay = _layout(cls, rng)
    mask, pat = _object_masks(cls, lay)
    rgb = _jitter(COLOURS[cls.colour][0], rng)
    pencil = rgb * rng.uniform(0.6, 0.85)
    wash = 0.35 if cls.pattern == "solid" else 0.1
    img = _over(img, rgb, mask * wash * rng.uniform(0.8, 1.2))
    strength = {"solid": 0.0, "striped": 0.7, "dotted": 0.9, "checkered": 0.55}[cls.pattern]
    img = _over(img, pencil, pat * mask * strength)
    shaky = np.roll(mask, int(rng.integers(-1, 2)), int(rng.integers(0, 2)))
    img = _over(img, pencil, _edge(shaky, 1) * 0.5)
    img = _over(img, pencil * 0.8, _edge(mask, 1))
    return img + rng.normal(0, 2.0, img.shape)


def _painting(cls: WorldClass, rng: np.random.Generator) -> np.ndarray:
    canvas = smooth_noise(rng, 3, channels=3) * 255
    tint = _hsv(rng.random(), rng.uniform(0.2, 0.5), rng.uniform(0.5, 0.9))
    img = 0.55 * canvas + 0.45 * tint
    streaks = smooth_noise(rng, 12)
    img = img * (0.8 + 0.4 * streaks)
    img = _clutter(img, rng, sketchy=False)
    lay = _layout(cls, rng)
    mask, pat = _object_masks(cls, lay)
    h, s, v = colorsys.rgb_to_hsv(*(np.array(COLOURS[cls.colour][0]) / 255))
    rgb = _hsv(h + rng.uniform(-0.03, 0.03), s * rng.uniform(1.0, 1.2), v * rng.uniform(0.85, 1.05))
    fill = _over(np.broadcast_to(rgb, img.shape), _ink_for(rgb), pat)
    fill = fill * (0.85 + 0.3 * smooth_noise(rng, 10))
    img = _over(img, fill, mask)
    pil = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB")
    pil = pil.filter(ImageFilter.GaussianBlur(rng.uniform(1.0, 1.6)))
    return np.asarray(pil, dtype=np.float32) * rng.uniform(0.9, 1.1, 3)


def _night(cls: WorldClass, rng: np.random.Generator) -> np.ndarray:
    """A photo taken in low light: dark, blue-tinted, with strong sensor noise.

    Why: the tiny CLIP is never pretrained on it (pretrain.PRETRAIN_DOMAINS), so, like a
    real downstream dataset for a real CLIP, it leaves room for prompts to adapt to."""
    img = _photo(cls, rng) * rng.uniform(0.45, 0.6) * np.array([0.8, 0.9, 1.15], dtype=np.float32)
    return img + rng.normal(0, 22.0, img.shape)


def _fog(cls: WorldClass, rng: np.random.Generator) -> np.ndarray:
    """A photo through haze: contrast squeezed towards a warm grey, a little blur (never pretrained on)."""
    haze = np.array([165.0, 150.0, 120.0], dtype=np.float32) * rng.uniform(0.95, 1.05)
    img = haze + (_photo(cls, rng) - haze) * rng.uniform(0.4, 0.5)
    pil = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB").filter(ImageFilter.GaussianBlur(0.8))
    return np.asarray(pil, dtype=np.float32)


_DOMAINS = {"photo": _photo, "sketch": _sketch, "painting": _painting, "night": _night, "fog": _fog}


def render(cls: WorldClass, domain: str, rng: np.random.Generator, size: int = IMAGE_SIZE) -> Image.Image:
    """One RGB image of ``cls`` in ``domain`` (``size`` px, drawn at CANVAS px and downsampled)."""
    try:
        draw = _DOMAINS[domain]
    except KeyError:
        raise ValueError(f"unknown domain {domain!r}; known: {', '.join(_DOMAINS)}") from None
    img = Image.fromarray(np.clip(draw(cls, rng), 0, 255).round().astype(np.uint8), "RGB")
    return img if size == CANVAS else img.resize((size, size), Image.LANCZOS)


def image_rng(seed: int, *key: int) -> np.random.Generator:
    """The generator for one image: independent streams per (seed, domain, split, class, index)."""
    return np.random.default_rng(np.random.SeedSequence([seed, *key]))
