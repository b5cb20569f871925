"""edge_client.images: awkward files become RGB images or one-line ImageReadErrors."""

from __future__ import annotations

import io
import pickle
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from edge_client.images import ImageReadError, iter_image_paths, load_image


def _save(im: Image.Image, path: Path, **kw) -> Path:
    im.save(path, **kw)
    return path


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def _png_header_only(path: Path, width: int, height: int) -> Path:
    """A PNG whose IHDR claims width x height, with no pixel data at all."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IEND", b""))
    return path


def _noise(w: int, h: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def _read_error(path: Path, **kw) -> ImageReadError:
    with pytest.raises(ImageReadError) as info:
        load_image(path, **kw)
    err = info.value
    assert isinstance(err, ValueError)
    msg = str(err)
    assert "\n" not in msg and str(path) in msg
    return err


# --------------------------------------------------------------------- errors


def test_empty_file(tmp_path):
    p = tmp_path / "empty.jpg"
    p.write_bytes(b"")
    err = _read_error(p)
    assert "empty" in err.reason
    again = pickle.loads(pickle.dumps(err))  # errors may cross process boundaries
    assert str(again) == str(err) and again.path == err.path


def test_missing_file_and_directory(tmp_path):
    assert "no such file" in _read_error(tmp_path / "nope.png").reason
    assert "directory" in _read_error(tmp_path).reason


def test_text_file_named_jpg(tmp_path):
    p = tmp_path / "notes.jpg"
    p.write_text("this is not a picture\nsecond line\n")
    assert "not an image" in _read_error(p).reason


def test_random_bytes(tmp_path):
    p = tmp_path / "noise.png"
    p.write_bytes(np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    assert "not an image" in _read_error(p).reason


def test_corrupt_png_data(tmp_path):
    ihdr = struct.pack(">IIBBBBB", 16, 16, 8, 2, 0, 0, 0)
    garbage = b"\x00garbage-that-is-not-zlib" * 8
    p = tmp_path / "corrupt.png"
    p.write_bytes(b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", garbage)
                  + _png_chunk(b"IEND", b""))
    reason = _read_error(p).reason
    assert "corrupt" in reason or "truncated" in reason


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_truncated(tmp_path, fmt):
    full = io.BytesIO()
    _noise(64, 48).save(full, format=fmt)
    p = tmp_path / f"cut.{fmt.lower()}"
    p.write_bytes(full.getvalue()[: len(full.getvalue()) // 2])
    assert "truncated" in _read_error(p).reason


def test_huge_header_rejected_before_decoding(tmp_path):
    p = _png_header_only(tmp_path / "bomb.png", 100_000, 100_000)
    assert "too many pixels" in _read_error(p).reason


def test_own_pixel_limit_is_checked_from_header(tmp_path):
    # 9000x9000 is under Pillow's own guard: our limit must catch it, and since the file
    # has no pixel data a decode attempt would say "truncated", not "too many pixels".
    p = _png_header_only(tmp_path / "big.png", 9000, 9000)
    err = _read_error(p, max_pixels=1_000_000)
    assert "too many pixels" in err.reason and "9000x9000" in err.reason
    ok = _save(_noise(100, 100), tmp_path / "ok.png")
    assert "too many pixels" in _read_error(ok, max_pixels=5000).reason
    assert load_image(ok, max_pixels=10_000).size == (100, 100)


# --------------------------------------------------------------------- modes


def _rgb(path: Path) -> np.ndarray:
    im = load_image(path)
    assert im.mode == "RGB"
    return np.asarray(im)


def test_one_pixel(tmp_path):
    p = _save(Image.new("RGB", (1, 1), (10, 20, 30)), tmp_path / "one.png")
    assert _rgb(p).tolist() == [[[10, 20, 30]]]


def test_grayscale_and_bilevel(tmp_path):
    a = _rgb(_save(Image.new("L", (5, 3), 77), tmp_path / "g.png"))
    assert a.shape == (3, 5, 3) and (a == 77).all()
    b = _rgb(_save(Image.new("1", (4, 4), 1), tmp_path / "b.png"))
    assert (b == 255).all()


def test_rgba_and_la_drop_alpha_like_open_clip(tmp_path):
    im = Image.new("RGBA", (4, 4), (200, 100, 50, 0))  # fully transparent
    assert (_rgb(_save(im, tmp_path / "a.png")) == [200, 100, 50]).all()
    la = Image.new("LA", (4, 4), (90, 10))
    assert (_rgb(_save(la, tmp_path / "la.png")) == 90).all()


def test_palette_with_and_without_transparency(tmp_path):
    p = Image.new("P", (6, 6), 1)
    p.putpalette([0, 0, 0, 10, 200, 30] + [0] * (256 * 3 - 6))
    assert (_rgb(_save(p, tmp_path / "p.png")) == [10, 200, 30]).all()
    assert (_rgb(_save(p, tmp_path / "pt.png", transparency=1)) == [10, 200, 30]).all()
    assert (_rgb(_save(p, tmp_path / "p.gif")) == [10, 200, 30]).all()


def test_16bit_png_is_scaled_not_clipped(tmp_path):
    a = np.array([[0, 257, 32896, 65535]], dtype=np.uint16)
    p = _save(Image.fromarray(a), tmp_path / "g16.png")
    with Image.open(p) as raw:
        assert raw.mode.startswith("I;16") or raw.mode == "I"
    out = _rgb(p)
    assert out[0, :, 0].tolist() == [0, 1, 128, 255]
    assert (out[..., 0] == out[..., 1]).all() and (out[..., 1] == out[..., 2]).all()


def test_32bit_int_and_float_tiff(tmp_path):
    i32 = np.array([[0, 65535]], dtype=np.int32)
    assert _rgb(_save(Image.fromarray(i32, mode="I"), tmp_path / "i.tif"))[0, :, 0].tolist() == [0, 255]
    f32 = np.array([[0.0, 0.5, 1.0]], dtype=np.float32)
    assert _rgb(_save(Image.fromarray(f32, mode="F"), tmp_path / "f.tif"))[0, :, 0].tolist() == [0, 128, 255]


def test_cmyk_jpeg(tmp_path):
    p = _save(Image.new("CMYK", (16, 16), (0, 255, 255, 0)), tmp_path / "c.jpg", quality=95)
    with Image.open(p) as raw:
        assert raw.mode == "CMYK"
    px = _rgb(p)[8, 8].astype(int)
    assert px[0] > 200 and px[1] < 60 and px[2] < 60  # cyan-free, magenta+yellow -> red


def test_animated_gif_first_frame(tmp_path):
    frames = [Image.new("RGB", (8, 8), c) for c in [(255, 0, 0), (0, 255, 0), (0, 0, 255)]]
    p = tmp_path / "anim.gif"
    frames[0].save(p, save_all=True, append_images=frames[1:], duration=50, loop=0)
    with Image.open(p) as raw:
        assert raw.n_frames == 3
    px = _rgb(p)[4, 4].astype(int)
    assert px[0] > 200 and px[1] < 50 and px[2] < 50


def test_exif_orientation_6_rotates(tmp_path):
    # Stored 40 wide x 20 high: left half red, right half blue. Orientation 6 means
    # "rotate 90 degrees clockwise to display": upright it is 20x40, red on top.
    a = np.zeros((20, 40, 3), dtype=np.uint8)
    a[:, :20] = (255, 0, 0)
    a[:, 20:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = 6
    p = _save(Image.fromarray(a), tmp_path / "rot.jpg", exif=exif.tobytes(), quality=95)
    with Image.open(p) as raw:
        assert raw.size == (40, 20)
    im = load_image(p)
    assert im.size == (20, 40)
    out = np.asarray(im).astype(int)
    top, bottom = out[5, 10], out[35, 10]
    assert top[0] > 200 and top[2] < 60
    assert bottom[2] > 200 and bottom[0] < 60


# --------------------------------------------------------------------- paths


def _touch_image(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return _save(Image.new("RGB", (2, 2)), path)


def test_iter_image_paths_dirs_globs_and_errors(tmp_path):
    d = tmp_path / "photos"
    b = _touch_image(d / "b.png")
    a = _touch_image(d / "a.JPG")
    nested = _touch_image(d / "sub" / "c.webp")
    (d / "readme.txt").write_text("x")
    _touch_image(d / ".hidden.png")
    _touch_image(d / ".cache" / "x.png")
    explicit = tmp_path / "weird.dat"
    explicit.write_bytes(b"named explicitly, kept")
    other = _touch_image(tmp_path / "other" / "z.gif")
    (tmp_path / "emptydir").mkdir()

    errors: list[ImageReadError] = []
    got = iter_image_paths(
        [str(d), str(explicit), str(tmp_path / "other" / "*.gif"), str(d / "b.png"),
         str(tmp_path / "missing.jpg"), str(tmp_path / "none*.png"), str(tmp_path / "emptydir")],
        errors=errors,
    )
    assert got == [a, b, nested, explicit, other]  # sorted in dir, input order, no duplicates
    assert len(errors) == 3
    assert all("\n" not in str(e) for e in errors)
    reasons = " | ".join(e.reason for e in errors)
    assert "no such file" in reasons and "match" in reasons and "no image files" in reasons

    recursive = iter_image_paths([str(tmp_path / "**" / "*.png")])
    assert b in recursive and all(not p.name.startswith(".") for p in recursive)

    with pytest.raises(ImageReadError, match="missing.jpg"):
        iter_image_paths([str(d), str(tmp_path / "missing.jpg")])
