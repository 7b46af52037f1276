"""Images for the vision-language model: a built-in synthetic shapes-and-captions set, and
PNG/JPEG loading with Pillow.

The synthetic set ("shapes") is drawn by code, so it needs no download and is identical for a
given seed. Each image holds two groups of coloured shapes, and its caption names both groups and
their relation:

    "two red circles left of a blue square"      (groups side by side: the left group first)
    "a green triangle above three yellow squares" (groups stacked: the top group first)

Shapes have random sizes (min_size..max_size pixels) at random pixel positions: nothing lines up
with a patch grid, so shapes straddle patch borders and many patches hold parts of two shapes,
often of two colours (tests/vlm/test_shapes_data.py measures how often). Every shape of the
first group lies strictly left of (above) every shape of the second, the two groups' extents
overlap in the other direction (so "left of" never also reads as "above"), and shapes never touch
(a one-pixel gap), so the caption is a function of the image and exact match is a fair score.

Splits (SPLIT_SEEDS): "train" (what the model learns from), "validation" (for every choice: stem,
layers, learning rate, steps), "test" (held-out images of the pairs seen in training) and
"novel" (each image holds at least one held-out colour x shape pair). test and novel are only
read to report. Some colour x shape pairs never occur in train, validation or test: the held-out
pairs form a Latin square (colour i loses shape i mod S; HELD_OUT_PAIRS for the full 8 x 5
palette), so every colour is still seen with 4 shapes and every shape with 6 or 7 colours, and
"novel" measures whether the model composes colour and shape or memorises pairs. Sample i of a
split is drawn from a generator seeded by (seed, split, i), so every sample is reproducible on
its own.

Real images: `load_image` opens a file with Pillow and applies one stated rule (IMAGE_RULE):
transparency is composited onto black (the synthetic background is near-black), greyscale and
palette images become RGB, a non-square image is padded with black to a centred square (shapes
keep their aspect ratio) and the square is resized (bicubic) to the model's image size.
Unreadable files and pixel formats that do not map to 8-bit RGB (16-bit or float images, for
which no scaling is implied) raise DataError naming the file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from lmforge.errors import DataError

COLOURS: dict[str, tuple[int, int, int]] = {  # >= 95 apart in some channel: jitter is +-25
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (50, 90, 235),
    "yellow": (235, 205, 30),
    "purple": (150, 60, 210),
    "pink": (245, 120, 190),
    "cyan": (40, 200, 210),
    "white": (230, 230, 230),
}
SHAPES = ("circle", "square", "triangle", "cross", "ring")
PLURALS = {"cross": "crosses"}  # the others add "s"
COUNT_WORDS = {1: "a", 2: "two", 3: "three"}
RELATIONS = {"horizontal": "left of", "vertical": "above"}


def plural(shape: str) -> str:
    return PLURALS.get(shape, shape + "s")


def latin_square_pairs(
    colours: Sequence[str], shapes: Sequence[str]
) -> tuple[tuple[str, str], ...]:
    """One held-out shape per colour, cycling through the shapes: colour i loses shape i mod S.
    Every colour keeps S - 1 shapes and every shape keeps most colours, so both are seen in many
    combinations and only the held-out pairs are new."""
    return tuple((c, shapes[i % len(shapes)]) for i, c in enumerate(colours))


HELD_OUT_PAIRS = latin_square_pairs(tuple(COLOURS), SHAPES)
SPLIT_SEEDS = {"train": 0, "test": 1, "novel": 2, "validation": 3}
IMAGE_RULE = (
    "converted to RGB (transparency composited onto black), padded with black to a centred "
    "square, resized (bicubic) to the model's image size"
)
# Modes Pillow converts to 8-bit RGB without losing meaning; others (I;16, I, F: no implied
# scaling to 0..255) are refused.
RGB_MODES = {"1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBX", "CMYK", "YCbCr", "LAB", "HSV"}


class Group(NamedTuple):
    """`count` shapes of one colour and kind."""

    colour: str
    shape: str
    count: int

    def phrase(self) -> str:
        noun = plural(self.shape) if self.count > 1 else self.shape
        return f"{COUNT_WORDS[self.count]} {self.colour} {noun}"


@dataclass(frozen=True)
class Scene:
    """Two groups: `first` on the left (horizontal) or top (vertical) half, `second` opposite."""

    first: Group
    second: Group
    layout: str

    def caption(self) -> str:
        return f"{self.first.phrase()} {RELATIONS[self.layout]} {self.second.phrase()}"


class Placed(NamedTuple):
    """One drawn shape: its group index (0 = first), top-left corner, size and RGB colour."""

    group: int
    x: int
    y: int
    size: int
    rgb: tuple[int, int, int]


class ShapesDataset:
    """Deterministic synthetic image-caption pairs: `sample(split, i)` -> (uint8 HxWx3, caption)."""

    def __init__(
        self,
        image_size: int = 32,
        seed: int = 0,
        max_count: int = 3,
        min_size: int = 6,
        max_size: int = 10,
        colours: int = len(COLOURS),
        shapes: int = len(SHAPES),
        held_out: Sequence[Sequence[str]] | None = None,
    ):
        if not (isinstance(min_size, int) and isinstance(max_size, int) and 5 <= min_size):
            raise DataError(f"shapes: min_size must be an integer >= 5, got {min_size!r}")
        if max_size < min_size:
            raise DataError(f"shapes: max_size={max_size} is smaller than min_size={min_size}")
        # Room for a shape of max_size on each side of the divider, and for max_count shapes
        # of min_size (with gaps) in one column; rejection sampling draws smaller sizes if needed.
        need = max(2 * max_size + 4, max_count * (min_size + 1))
        if image_size < need:
            raise DataError(
                f"shapes: image_size={image_size} is too small for {max_count} shapes of "
                f"{min_size}..{max_size} pixels per group (need >= {need})"
            )
        if max_count not in COUNT_WORDS:
            raise DataError(f"shapes: max_count must be in {sorted(COUNT_WORDS)}, got {max_count}")
        if not (2 <= colours <= len(COLOURS) and 2 <= shapes <= len(SHAPES)):
            raise DataError(
                f"shapes: colours must be in 2..{len(COLOURS)} and shapes in 2..{len(SHAPES)}, "
                f"got {colours}, {shapes}"
            )
        self.colours, self.shapes = tuple(COLOURS)[:colours], SHAPES[:shapes]
        held_out = latin_square_pairs(self.colours, self.shapes) if held_out is None else held_out
        pairs = [(c, s) for c in self.colours for s in self.shapes]
        if unknown := [p for p in held_out if tuple(p) not in pairs]:
            raise DataError(f"shapes: held-out pairs {unknown} are not colour x shape pairs")
        self.image_size, self.seed, self.max_count = image_size, seed, max_count
        self.min_size, self.max_size = min_size, max_size
        self.held_out = {tuple(p) for p in held_out}
        self.seen_pairs = [p for p in pairs if p not in self.held_out]
        self.novel_pairs = [p for p in pairs if p in self.held_out]

    # ---------------------------------------------------------------- scenes and captions

    def scene(self, split: str, index: int) -> Scene:
        return self._draw_scene(self._rng(split, index), split)

    def sample(self, split: str, index: int) -> tuple[np.ndarray, str]:
        """Image (uint8 [H, W, 3]) and caption of sample `index` of `split`."""
        image, _, scene = self.sample_with_labels(split, index)
        return image, scene.caption()

    def sample_with_labels(self, split: str, index: int) -> tuple[np.ndarray, np.ndarray, Scene]:
        """Image, label map (int [H, W]: 0 = background, k = pixel of the k-th drawn shape) and
        scene of sample `index`: the ground truth behind the caption, for tests and analysis."""
        rng = self._rng(split, index)
        scene = self._draw_scene(rng, split)
        return *self._render(scene, self._place(scene, rng), rng), scene

    def batch(self, split: str, indices) -> tuple[torch.Tensor, list[str]]:
        """Pixel tensor [B, 3, H, W] (see `to_pixels`) and the captions."""
        images, captions = zip(*(self.sample(split, int(i)) for i in indices))
        return to_pixels(np.stack(images)), list(captions)

    def vocabulary_texts(self) -> list[str]:
        """Every caption word, for building the word tokenizer (held-out words included)."""
        words = [*self.colours, *self.shapes, *map(plural, self.shapes), *COUNT_WORDS.values()]
        return [" ".join([*words, *RELATIONS.values()])]  # "left of" joins as its two words

    def _rng(self, split: str, index: int) -> np.random.Generator:
        if split not in SPLIT_SEEDS:
            raise DataError(f"shapes: unknown split {split!r}; choose from {list(SPLIT_SEEDS)}")
        return np.random.default_rng([self.seed, SPLIT_SEEDS[split], index])

    def _draw_scene(self, rng: np.random.Generator, split: str) -> Scene:
        first_pool = second_pool = self.seen_pairs
        if split == "novel":  # at least one held-out pair, in either group
            if rng.random() < 0.5:
                first_pool = self.novel_pairs
            else:
                second_pool = self.novel_pairs
        first = first_pool[rng.integers(len(first_pool))]
        second = first
        while second == first:  # two different pairs, so the caption names two things
            second = second_pool[rng.integers(len(second_pool))]
        counts = rng.integers(1, self.max_count + 1, size=2)
        layout = "horizontal" if rng.random() < 0.5 else "vertical"
        return Scene(Group(*first, int(counts[0])), Group(*second, int(counts[1])), layout)

    # ---------------------------------------------------------------- placement and rendering

    def _place(self, scene: Scene, rng: np.random.Generator) -> list[Placed]:
        """Random sizes and pixel positions. Drawn as if side by side ("along" = x); stacked
        scenes swap x and y at the end. A divider column d is drawn anywhere between the two
        groups' minimum widths; first-group shapes end left of d and second-group shapes start
        right of it, so the relation holds whatever the sizes. Rejection sampling: shapes keep
        a one-pixel gap, and the groups' extents across must overlap."""
        n, lo, hi = self.image_size, self.min_size, self.max_size
        groups = (scene.first, scene.second)
        for _ in range(1000):
            divider = int(rng.integers(hi + 1, n - hi - 1))  # [0, d) and [d + 1, n)
            boxes: list[tuple[int, int, int, int]] = []  # (group, along, across, size)
            for g, group in enumerate(groups):
                # Each group keeps to a band next to the divider, so the two groups sit close
                # together and patches near the divider often hold both colours.
                band = hi + 1
                start, stop = (max(0, divider - band), divider) if g == 0 else (
                    divider + 1, min(n, divider + 1 + band))  # fmt: skip
                for _ in range(group.count):
                    box = self._free_box(rng, g, start, stop, boxes, lo, hi)
                    if box is None:
                        break
                    boxes.append(box)
            if len(boxes) < scene.first.count + scene.second.count:
                continue
            spans = [[(b[2], b[2] + b[3]) for b in boxes if b[0] == g] for g in (0, 1)]
            first_lo, first_hi = min(a for a, _ in spans[0]), max(b for _, b in spans[0])
            second_lo, second_hi = min(a for a, _ in spans[1]), max(b for _, b in spans[1])
            if first_lo < second_hi and second_lo < first_hi:
                break
        else:  # pragma: no cover - the constructor checks that the shapes fit
            raise DataError(f"shapes: could not place {scene.caption()!r} in {n}x{n} pixels")
        flip = scene.layout == "vertical"
        placed = []
        for g, along, across, size in boxes:
            jitter = rng.integers(-25, 26, size=3)
            rgb = tuple(int(v) for v in np.clip(np.add(COLOURS[groups[g].colour], jitter), 0, 255))
            x, y = (across, along) if flip else (along, across)
            placed.append(Placed(g, x, y, size, rgb))
        return placed

    def _free_box(self, rng, group, start, stop, boxes, lo, hi):
        """A (group, along, across, size) box inside [start, stop) along, at least one pixel
        from every box in `boxes`; None after 50 misses."""
        n = self.image_size
        for _ in range(50):
            size = int(rng.integers(lo, min(hi, stop - start) + 1))
            along = int(rng.integers(start, stop - size + 1))
            across = int(rng.integers(0, n - size + 1))
            if all(
                along + size < a or a + s < along or across + size < c or c + s < across
                for _, a, c, s in boxes
            ):
                return group, along, across, size
        return None

    def _render(
        self, scene: Scene, placed: list[Placed], rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray]:
        from PIL import Image, ImageDraw

        n = self.image_size
        shade = int(rng.integers(0, 40))  # dark background of varying brightness
        image = Image.new("RGB", (n, n), (shade, shade, shade))
        labels = Image.new("L", (n, n), 0)
        draw, label_draw = ImageDraw.Draw(image), ImageDraw.Draw(labels)
        groups = (scene.first, scene.second)
        for k, shape in enumerate(placed, start=1):
            kind = groups[shape.group].shape
            _draw_shape(draw, kind, shape.x, shape.y, shape.size, shape.rgb)
            _draw_shape(label_draw, kind, shape.x, shape.y, shape.size, k)
        return np.asarray(image, dtype=np.uint8).copy(), np.asarray(labels, dtype=np.int64)


def _draw_shape(draw, shape: str, x: int, y: int, size: int, colour) -> None:
    end = (x + size - 1, y + size - 1)
    if shape == "circle":
        draw.ellipse([(x, y), end], fill=colour)
    elif shape == "ring":  # a circle's outline, two pixels thick
        draw.ellipse([(x, y), end], outline=colour, width=2)
    elif shape == "square":
        draw.rectangle([(x, y), end], fill=colour)
    elif shape == "cross":  # a plus sign, two pixels thick
        lo, hi = x + (size - 2) // 2, y + (size - 2) // 2
        draw.rectangle([(lo, y), (lo + 1, y + size - 1)], fill=colour)
        draw.rectangle([(x, hi), (x + size - 1, hi + 1)], fill=colour)
    else:  # triangle, apex up
        draw.polygon([(x + (size - 1) / 2, y), (x, y + size - 1), end], fill=colour)


def to_pixels(images: np.ndarray) -> torch.Tensor:
    """uint8 [B, H, W, 3] (or one [H, W, 3]) -> float [B, 3, H, W] scaled to [-1, 1]."""
    x = torch.from_numpy(np.ascontiguousarray(images)).float().div(127.5).sub(1.0)
    if x.dim() == 3:
        x = x.unsqueeze(0)
    return x.permute(0, 3, 1, 2).contiguous()


def load_image(path: str | Path, image_size: int) -> np.ndarray:
    """A PNG/JPEG (any Pillow format) as uint8 [image_size, image_size, 3], by IMAGE_RULE:

    1. mode: palette images are expanded, transparency (RGBA, LA, PA, or a palette/greyscale
       image with a transparent colour) is composited onto black, greyscale is repeated into
       R = G = B, CMYK/YCbCr/LAB/HSV are converted; 16-bit and float modes raise DataError;
    2. shape: a non-square image is padded with black to a centred square, so shapes keep their
       aspect ratio (stretching would turn circles into ellipses);
    3. size: the square is resized with bicubic resampling to image_size x image_size (the
       vision encoder expects exactly that grid of patches). Steps 2 and 3 are Pillow's
       ImageOps.pad, which resizes first: the same scale, fewer pixels to resample.
    """
    from PIL import Image, ImageOps, UnidentifiedImageError

    path = Path(path)
    if not path.is_file():
        raise DataError(f"image not found: {path}")
    try:
        with Image.open(path) as img:
            img.load()
            mode = img.mode
            if mode not in RGB_MODES:
                raise DataError(
                    f"{path}: pixel mode {mode!r} cannot be converted to 8-bit RGB "
                    "(save it as 8-bit RGB, RGBA, greyscale or palette)"
                )
            if mode in ("P", "PA", "L", "1") and "transparency" in img.info:
                img = img.convert("RGBA")  # a transparent palette/grey colour becomes alpha
            if img.mode in ("RGBA", "LA", "PA"):
                rgba = img.convert("RGBA")
                black = Image.new("RGBA", rgba.size, (0, 0, 0, 255))
                rgb = Image.alpha_composite(black, rgba).convert("RGB")
            else:
                rgb = img.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        if isinstance(err, DataError):
            raise
        raise DataError(f"{path}: not a readable image ({err})") from err
    square = ImageOps.pad(rgb, (image_size, image_size), Image.Resampling.BICUBIC, (0, 0, 0))
    return np.asarray(square, dtype=np.uint8).copy()


def save_image(path: str | Path, image: np.ndarray) -> None:
    """Write uint8 [H, W, 3] as PNG (or any format Pillow infers from the suffix)."""
    from PIL import Image

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(image).save(path)
