import numpy as np
import pytest
import torch

from lmforge.errors import DataError
from lmforge.vlm.data import (
    COLOURS,
    HELD_OUT_PAIRS,
    IMAGE_RULE,
    SHAPES,
    ShapesDataset,
    latin_square_pairs,
    load_image,
    save_image,
    to_pixels,
)


def patch_mixing(
    data: ShapesDataset, patch_size: int, split: str = "train", n: int = 200
) -> dict[str, float]:
    """How often the first n images of `split` put more than one thing in a patch of a
    patch_size grid (the vision encoder's):
    straddling:  share of shapes whose pixels fall in two or more patches;
    two_shapes:  share of occupied patches (any shape pixel) holding pixels of two or more shapes;
    two_colours: share of occupied patches holding shapes of two different colour names.
    The previous generator (one shape per 8-pixel cell) gave 0% two_colours on its 8-pixel grid."""
    straddling = shapes = two_shapes = two_colours = occupied = 0
    grid = data.image_size // patch_size
    for i in range(n):
        _, labels, scene = data.sample_with_labels(split, i)
        colour = (scene.first.colour, scene.second.colour)
        count = scene.first.count  # labels 1..count are the first group's shapes
        tiles = labels[: grid * patch_size, : grid * patch_size].reshape(
            grid, patch_size, grid, patch_size
        )
        owners = [set(np.unique(tiles[r, :, c, :])) - {0} for r in range(grid) for c in range(grid)]
        for k in range(1, int(labels.max()) + 1):
            shapes += 1
            straddling += sum(k in o for o in owners) > 1
        for o in filter(None, owners):
            occupied += 1
            two_shapes += len(o) > 1
            two_colours += len({colour[int(k > count)] for k in o}) > 1
    return {"straddling": straddling / shapes, "two_shapes": two_shapes / occupied,
            "two_colours": two_colours / occupied}  # fmt: skip


def pairs_of(scene):
    return {(scene.first.colour, scene.first.shape), (scene.second.colour, scene.second.shape)}


def test_deterministic_by_seed_and_index():
    a, b, c = ShapesDataset(seed=3), ShapesDataset(seed=3), ShapesDataset(seed=4)
    img_a, cap_a = a.sample("train", 17)
    img_b, cap_b = b.sample("train", 17)
    assert cap_a == cap_b and np.array_equal(img_a, img_b)
    # Sample i does not depend on which samples were drawn before it.
    b.sample("train", 3)
    assert np.array_equal(b.sample("train", 17)[0], img_a)
    others = [c.sample("train", i)[0] for i in range(5)]
    assert not all(np.array_equal(o, a.sample("train", i)[0]) for i, o in enumerate(others))
    assert not np.array_equal(a.sample("test", 17)[0], img_a)
    # The four splits are different images (validation is its own stream, not test or train).
    firsts = {split: a.sample(split, 0)[0] for split in ("train", "validation", "test", "novel")}
    assert len({f.tobytes() for f in firsts.values()}) == 4


def test_held_out_pairs_never_in_train_validation_or_test_and_always_in_novel():
    data = ShapesDataset()
    held = set(HELD_OUT_PAIRS)
    for i in range(400):
        assert not pairs_of(data.scene("train", i)) & held
        assert not pairs_of(data.scene("validation", i)) & held
        assert not pairs_of(data.scene("test", i)) & held
        assert pairs_of(data.scene("novel", i)) & held
    # Every colour and every shape still occurs in training, each with most partners.
    seen = set().union(*(pairs_of(data.scene("train", i)) for i in range(1000)))
    assert {c for c, _ in seen} == set(COLOURS) and {s for _, s in seen} == set(SHAPES)
    assert seen == {(c, s) for c in COLOURS for s in SHAPES} - held


def test_latin_square_holds_out_one_shape_per_colour():
    pairs = latin_square_pairs(("r", "g", "b", "y"), ("o", "s", "t"))
    assert pairs == (("r", "o"), ("g", "s"), ("b", "t"), ("y", "o"))
    assert HELD_OUT_PAIRS == latin_square_pairs(tuple(COLOURS), SHAPES)
    small = ShapesDataset(colours=4, shapes=3)
    assert small.novel_pairs == list(pairs_of_names(small, pairs))
    assert all(c in small.colours and s in small.shapes for c, s in small.seen_pairs)
    assert "cross" not in small.vocabulary_texts()[0] and "rings" not in small.vocabulary_texts()[0]


def pairs_of_names(data, pairs):
    names = dict(zip("rgby", data.colours)) | dict(zip("ost", data.shapes))
    return [(names[c], names[s]) for c, s in pairs]


def test_shapes_have_distinct_outlines():
    """Every shape, drawn at both sizes, differs from every other shape in some pixel."""
    from PIL import Image, ImageDraw

    from lmforge.vlm.data import _draw_shape

    for size in range(6, 11):  # the default min_size..max_size
        masks = []
        for shape in SHAPES:
            image = Image.new("L", (12, 12), 0)
            _draw_shape(ImageDraw.Draw(image), shape, 0, 0, size, 255)
            masks.append(np.asarray(image) > 0)
        for i in range(len(masks)):
            for j in range(i):
                assert (masks[i] != masks[j]).sum() >= 4, (SHAPES[i], SHAPES[j], size)


def test_caption_matches_drawing():
    """From the label map: the right number of shapes per group, each fully drawn in its group's
    colour, the first group strictly left of (above) the second, the groups overlapping in the
    other direction, and no two shapes touching."""
    data = ShapesDataset(image_size=32, max_count=3)
    for i in range(60):
        image, labels, scene = data.sample_with_labels("train", i)
        assert data.sample("train", i)[1] == scene.caption() == data.scene("train", i).caption()
        assert image.shape == (32, 32, 3) and image.dtype == np.uint8
        n1, n2 = scene.first.count, scene.second.count
        assert sorted(set(np.unique(labels)) - {0}) == list(range(1, n1 + n2 + 1))
        along, across = (1, 0) if scene.layout == "horizontal" else (0, 1)  # array axes
        extents = []
        for k in range(1, n1 + n2 + 1):
            where = np.nonzero(labels == k)
            group = scene.first if k <= n1 else scene.second
            target = np.array(COLOURS[group.colour])
            assert (np.abs(image[where].astype(int) - target).max(-1) <= 25).all()
            extents.append((where[along].min(), where[along].max(), where[across].min(),
                            where[across].max()))  # fmt: skip
        first, second = extents[:n1], extents[n1:]
        assert max(e[1] for e in first) < min(e[0] for e in second)  # left of / above
        lo1, hi1 = min(e[2] for e in first), max(e[3] for e in first)
        lo2, hi2 = min(e[2] for e in second), max(e[3] for e in second)
        assert lo1 <= hi2 and lo2 <= hi1  # not also "above" / "left of"
        # No two shapes touch (8-neighbourhood): every shape stays countable.
        padded = np.pad(labels, 1)
        for dy in (-1, 0, 1):
            for dx in (-1, 0, 1):
                shifted = padded[1 + dy : 33 + dy, 1 + dx : 33 + dx]
                assert not ((labels > 0) & (shifted > 0) & (shifted != labels)).any()
    assert data.scene("train", 0).caption().split()[0] in {"a", "two", "three"}


def test_shapes_do_not_line_up_with_patches():
    """Random sizes and positions: most shapes straddle an 8-pixel patch border and a real
    share of occupied patches hold two shapes / two colours (the old cell-aligned generator gave
    0% two-colour patches). Positions are not on a grid: the top-left corners take many values
    mod 8."""
    data = ShapesDataset()
    mix = patch_mixing(data, 8, "train", 100)
    assert mix["straddling"] >= 0.75
    assert mix["two_shapes"] >= 0.10
    assert mix["two_colours"] >= 0.03
    corners = set()
    for i in range(40):
        labels = data.sample_with_labels("train", i)[1]
        for k in range(1, labels.max() + 1):
            ys, xs = np.nonzero(labels == k)
            corners.add((xs.min() % 8, ys.min() % 8))
    assert len(corners) >= 30  # of 64 possible offsets


def test_batch_pixels_range():
    pixels, captions = ShapesDataset().batch("test", range(4))
    assert pixels.shape == (4, 3, 32, 32) and len(captions) == 4
    assert pixels.min() >= -1 and pixels.max() <= 1


def test_bad_dataset_arguments():
    with pytest.raises(DataError, match="image_size=16 is too small"):
        ShapesDataset(image_size=16)
    with pytest.raises(DataError, match="max_size=5 is smaller than min_size=6"):
        ShapesDataset(max_size=5)
    with pytest.raises(DataError, match="unknown split 'valid'; choose from .*validation"):
        ShapesDataset().sample("valid", 0)
    with pytest.raises(DataError, match="not colour x shape pairs"):
        ShapesDataset(held_out=(("mauve", "circle"),))
    with pytest.raises(DataError, match="colours must be in"):
        ShapesDataset(colours=9)


def test_load_png_and_jpeg_resize_and_modes(tmp_path):
    from PIL import Image

    rgb = ShapesDataset().sample("test", 0)[0]
    save_image(tmp_path / "a.png", rgb)
    assert np.array_equal(load_image(tmp_path / "a.png", 32), rgb)  # already right: unchanged
    Image.fromarray(rgb).resize((45, 37)).save(tmp_path / "b.jpg")  # not divisible by 8
    assert load_image(tmp_path / "b.jpg", 32).shape == (32, 32, 3)
    Image.fromarray(rgb).convert("P").save(tmp_path / "p.png")
    Image.fromarray(rgb).convert("L").save(tmp_path / "l.png")
    for name in ("p.png", "l.png"):
        assert load_image(tmp_path / name, 32).shape == (32, 32, 3)
    grey = load_image(tmp_path / "l.png", 32)
    assert (grey[..., 0] == grey[..., 1]).all() and (grey[..., 1] == grey[..., 2]).all()
    assert to_pixels(load_image(tmp_path / "a.png", 32)).shape == (1, 3, 32, 32)


def test_image_rule_alpha_onto_black_and_pad_to_square(tmp_path):
    """IMAGE_RULE: transparent pixels become black whatever RGB they hide; half-transparent
    ones are blended with black; a wide image is padded (black bands top and bottom) rather
    than stretched."""
    from PIL import Image

    rgba = np.zeros((32, 32, 4), np.uint8)
    rgba[..., :3] = (200, 50, 90)  # hidden colour under alpha 0
    rgba[:16, :, 3] = 0
    rgba[16:, :, 3] = 255
    rgba[20, 5] = (200, 100, 0, 128)
    Image.fromarray(rgba, "RGBA").save(tmp_path / "rgba.png")
    out = load_image(tmp_path / "rgba.png", 32)
    assert (out[:16] == 0).all()
    assert (out[16:20] == (200, 50, 90)).all()
    assert np.abs(out[20, 5].astype(int) - (100, 50, 0)).max() <= 1
    la = np.stack([np.full((8, 8), 150, np.uint8), np.zeros((8, 8), np.uint8)], -1)
    Image.fromarray(la, "LA").save(tmp_path / "la.png")
    assert (load_image(tmp_path / "la.png", 8) == 0).all()

    wide = np.full((16, 32, 3), 255, np.uint8)  # white, twice as wide as high
    Image.fromarray(wide).save(tmp_path / "wide.png")
    out = load_image(tmp_path / "wide.png", 32)
    assert out.shape == (32, 32, 3)
    assert (out[:7] == 0).all() and (out[-7:] == 0).all()  # padding bands
    assert (out[9:23] == 255).all()  # the image itself, not stretched over the bands
    assert "transparency composited onto black" in IMAGE_RULE


def test_cli_states_the_same_image_rule():
    from lmforge.cli.vlm import IMAGE_RULE as CLI_RULE

    assert CLI_RULE == IMAGE_RULE


def test_bad_image_files_name_the_file(tmp_path):
    from PIL import Image

    with pytest.raises(DataError, match="image not found: .*missing.png"):
        load_image(tmp_path / "missing.png", 32)
    (tmp_path / "junk.png").write_bytes(b"not an image at all")
    with pytest.raises(DataError, match="junk.png: not a readable image"):
        load_image(tmp_path / "junk.png", 32)
    Image.fromarray(np.zeros((8, 8), dtype=np.uint16)).save(tmp_path / "deep.png")
    with pytest.raises(DataError, match="deep.png: pixel mode 'I;16' cannot be converted to 8-bit"):
        load_image(tmp_path / "deep.png", 32)
    good = tmp_path / "cut.png"
    save_image(good, ShapesDataset().sample("test", 0)[0])
    (tmp_path / "cut2.png").write_bytes(good.read_bytes()[:60])  # truncated PNG
    with pytest.raises(DataError, match="cut2.png: not a readable image"):
        load_image(tmp_path / "cut2.png", 32)
    assert torch.is_tensor(to_pixels(np.zeros((32, 32, 3), np.uint8)))
