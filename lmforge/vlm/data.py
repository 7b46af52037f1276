"""Images for the vision-language model: a built-in synthetic shapes-and-captions set, and
PNG/JPEG loading with Pillow.

The synthetic set ("shapes") is drawn by code, so it needs no download and is identical for a
given seed. Each image holds two groups of coloured shapes on opposite halves of the canvas, and
its caption names both groups and their relation:

    "two red circles left of a blue square"      (groups side by side: the left group first)
    "a green triangle above three yellow squares" (groups stacked: the top group first)

Naming the left/top group first makes the caption a function of the image, so exact match is a
fair score. Some colour x shape pairs never occur in the "train" and "test" splits; the "novel"
split always contains at least one of them, which measures whether the model composes colour and
shape or memorises pairs. The held-out pairs form a Latin square (colour i loses shape i mod S;
HELD_OUT_PAIRS for the full 8 x 5 palette): with 4 colours x 3 shapes and 3 pairs held out, a
model saw each colour with only two shapes and learnt pairs (about 6% exact match on novel
pairs); with 8 x 5 and 8 held out, every colour is seen with 4 shapes and every shape with 6 or 7
colours, and the model composes (figures in configs/vlm-shapes.yaml). Sample i of a split is
drawn from a generator seeded by (seed, split, i), so every sample is reproducible on its own.

Real images: `load_image` opens a file with Pillow, converts it to RGB and resizes it to the
configured square size (any size, square or not, divisible by the patch size or not: the encoder
sees a fixed grid of patches, so resizing is the one rule). Unreadable files and pixel formats
that do not map to RGB (16-bit or float images) raise DataError naming the file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

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
SPLITS = {"train": 0, "test": 1, "novel": 2}
# Modes Pillow converts to RGB without losing meaning; others (I;16, I, F) are refused.
RGB_MODES = {"1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBX", "CMYK", "YCbCr", "LAB", "HSV"}


@dataclass(frozen=True)
class Group:
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


class ShapesDataset:
    """Deterministic synthetic image-caption pairs: `sample(split, i)` -> (uint8 HxWx3, caption)."""

    def __init__(
        self,
        image_size: int = 32,
        seed: int = 0,
        max_count: int = 3,
        cell_size: int = 8,
        colours: int = len(COLOURS),
        shapes: int = len(SHAPES),
        held_out: Sequence[Sequence[str]] | None = None,
    ):
        if image_size % (2 * cell_size) or image_size < 2 * cell_size or cell_size < 4:
            raise DataError(
                f"shapes: image_size={image_size} must be a multiple of 2 x cell_size={cell_size} "
                "(cell_size >= 4), so each half holds whole cells"
            )
        if max_count > image_size // cell_size * (image_size // cell_size // 2):
            raise DataError(f"shapes: max_count={max_count} shapes do not fit in half the cells")
        if max_count not in COUNT_WORDS:
            raise DataError(f"shapes: max_count must be in {sorted(COUNT_WORDS)}, got {max_count}")
        if not (2 <= colours <= len(COLOURS) and 2 <= shapes <= len(SHAPES)):
            raise DataError(
                f"shapes: colours must be in 2..{len(COLOURS)} and shapes in 2..{len(SHAPES)}, "
                f"got {colours}, {shapes}"
            )
        self.colours, self.shapes = tuple(COLOURS)[:colours], SHAPES[:shapes]
        if held_out is None:
            held_out = latin_square_pairs(self.colours, self.shapes)
        pairs = [(c, s) for c in self.colours for s in self.shapes]
        unknown = [p for p in held_out if tuple(p) not in pairs]
        if unknown:
            raise DataError(f"shapes: held-out pairs {unknown} are not colour x shape pairs")
        self.image_size, self.seed, self.max_count = image_size, seed, max_count
        self.cell_size = cell_size
        self.held_out = {tuple(p) for p in held_out}
        self.seen_pairs = [p for p in pairs if p not in self.held_out]
        self.novel_pairs = [p for p in pairs if p in self.held_out]

    # ---------------------------------------------------------------- scenes and captions

    def scene(self, split: str, index: int) -> Scene:
        return self._draw_scene(self._rng(split, index), split)

    def sample(self, split: str, index: int) -> tuple[np.ndarray, str]:
        """Image (uint8 [H, W, 3]) and caption of sample `index` of `split`."""
        rng = self._rng(split, index)
        scene = self._draw_scene(rng, split)
        return self._render(scene, rng), scene.caption()

    def batch(self, split: str, indices) -> tuple[torch.Tensor, list[str]]:
        """Pixel tensor [B, 3, H, W] (see `to_pixels`) and the captions."""
        images, captions = zip(*(self.sample(split, int(i)) for i in indices))
        return to_pixels(np.stack(images)), list(captions)

    def vocabulary_texts(self) -> list[str]:
        """Every caption word, for building the word tokenizer (held-out words included)."""
        words = [*self.colours, *self.shapes, *map(plural, self.shapes)]
        words += list(COUNT_WORDS.values())
        words += [w for r in RELATIONS.values() for w in r.split()]
        return [" ".join(words)]

    def _rng(self, split: str, index: int) -> np.random.Generator:
        if split not in SPLITS:
            raise DataError(f"shapes: unknown split {split!r}; choose from {list(SPLITS)}")
        return np.random.default_rng([self.seed, SPLITS[split], index])

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

    # ---------------------------------------------------------------- rendering

    def _render(self, scene: Scene, rng: np.random.Generator) -> np.ndarray:
        from PIL import Image, ImageDraw

        n, cell = self.image_size, self.cell_size
        shade = int(rng.integers(0, 40))  # dark background of varying brightness
        image = Image.new("RGB", (n, n), (shade, shade, shade))
        draw = ImageDraw.Draw(image)
        for (col, row), group in self._layout(scene, rng):
            # Size cell-2 or cell-1 and a free last pixel column/row: neighbours never touch.
            size = int(rng.integers(cell - 2, cell))
            x = col * cell + int(rng.integers(0, cell - size))
            y = row * cell + int(rng.integers(0, cell - size))
            jitter = rng.integers(-25, 26, size=3)
            colour = tuple(int(v) for v in np.clip(np.add(COLOURS[group.colour], jitter), 0, 255))
            _draw_shape(draw, group.shape, x, y, size, colour)
        return np.asarray(image, dtype=np.uint8).copy()

    def _layout(
        self, scene: Scene, rng: np.random.Generator
    ) -> list[tuple[tuple[int, int], Group]]:
        """Grid cells (column, row) of every shape. The first group takes cells in the left half
        (or top half when stacked), the second the other half; the groups' row ranges (column
        ranges when stacked) overlap, so "left of" never also reads as "above" (or vice versa)
        and the caption is a function of the image."""
        grid = self.image_size // self.cell_size
        groups = (scene.first, scene.second)
        while True:
            cells = []  # per group: (along, across) = (column, row) side by side
            for g, group in enumerate(groups):
                free = [
                    (a, b) for a in range(g * grid // 2, (g + 1) * grid // 2) for b in range(grid)
                ]
                cells.append([free[k] for k in rng.choice(len(free), group.count, replace=False)])
            across = [[b for _, b in c] for c in cells]
            if min(across[0]) <= max(across[1]) and min(across[1]) <= max(across[0]):
                break
        flip = scene.layout == "vertical"  # stacked: "along" is the row
        return [
            ((b, a) if flip else (a, b), group) for c, group in zip(cells, groups) for a, b in c
        ]


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
    """A PNG/JPEG (any Pillow format) as uint8 [image_size, image_size, 3].

    The image is converted to RGB (alpha dropped, palettes expanded, greyscale repeated) and
    resized with bicubic resampling to image_size x image_size, whatever its size or aspect ratio:
    the vision encoder expects exactly that grid of patches.
    """
    from PIL import Image, UnidentifiedImageError

    path = Path(path)
    if not path.is_file():
        raise DataError(f"image not found: {path}")
    try:
        with Image.open(path) as img:
            img.load()
            mode = img.mode
            if mode not in RGB_MODES:
                raise DataError(
                    f"{path}: pixel mode {mode!r} cannot be converted to RGB "
                    "(save it as 8-bit RGB, RGBA, greyscale or palette)"
                )
            rgb = img.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        if isinstance(err, DataError):
            raise
        raise DataError(f"{path}: not a readable image ({err})") from err
    if rgb.size != (image_size, image_size):
        rgb = rgb.resize((image_size, image_size), Image.Resampling.BICUBIC)
    return np.asarray(rgb, dtype=np.uint8).copy()


def save_image(path: str | Path, image: np.ndarray) -> None:
    """Write uint8 [H, W, 3] as PNG (or any format Pillow infers from the suffix)."""
    from PIL import Image

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(image).save(path)
