import numpy as np
import pytest
import torch

from lmforge.errors import DataError
from lmforge.vlm.data import (
    COLOURS,
    HELD_OUT_PAIRS,
    SHAPES,
    ShapesDataset,
    latin_square_pairs,
    load_image,
    save_image,
    to_pixels,
)


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


def test_held_out_pairs_never_in_train_or_test_and_always_in_novel():
    data = ShapesDataset()
    held = set(HELD_OUT_PAIRS)
    for i in range(400):
        assert not pairs_of(data.scene("train", i)) & held
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

    for size in (6, 7):
        masks = []
        for shape in SHAPES:
            image = Image.new("L", (8, 8), 0)
            _draw_shape(ImageDraw.Draw(image), shape, 0, 0, size, 255)
            masks.append(np.asarray(image) > 0)
        for i in range(len(masks)):
            for j in range(i):
                assert (masks[i] != masks[j]).sum() >= 4, (SHAPES[i], SHAPES[j], size)


def test_caption_matches_drawing():
    data = ShapesDataset(image_size=32, max_count=3)
    for i in range(50):
        image, caption = data.sample("train", i)
        scene = data.scene("train", i)
        assert caption == scene.caption()
        assert image.shape == (32, 32, 3) and image.dtype == np.uint8
        # The first group's colour dominates its half (left, or top when stacked).
        half = image[:, :16] if scene.layout == "horizontal" else image[:16]
        target = np.array(COLOURS[scene.first.colour])
        close = (np.abs(half.astype(int) - target).max(-1) <= 25).sum()
        assert close >= scene.first.count * 16  # at least a 4x4 blob per shape
    assert data.scene("train", 0).caption().split()[0] in {"a", "two", "three"}
    assert (
        " left of " in ShapesDataset().sample("train", 0)[1]
        or " above " in (ShapesDataset().sample("train", 0)[1])
    )


def test_batch_pixels_range():
    pixels, captions = ShapesDataset().batch("test", range(4))
    assert pixels.shape == (4, 3, 32, 32) and len(captions) == 4
    assert pixels.min() >= -1 and pixels.max() <= 1


def test_bad_dataset_arguments():
    with pytest.raises(DataError, match="multiple of 2 x cell_size"):
        ShapesDataset(image_size=36)
    with pytest.raises(DataError, match="unknown split"):
        ShapesDataset().sample("valid", 0)
    with pytest.raises(DataError, match="not colour x shape pairs"):
        ShapesDataset(held_out=(("mauve", "circle"),))
    with pytest.raises(DataError, match="colours must be in"):
        ShapesDataset(colours=9)


def test_load_png_and_jpeg_resize_and_modes(tmp_path):
    from PIL import Image

    rgb = ShapesDataset().sample("test", 0)[0]
    save_image(tmp_path / "a.png", rgb)
    assert np.array_equal(load_image(tmp_path / "a.png", 32), rgb)
    Image.fromarray(rgb).resize((45, 37)).save(tmp_path / "b.jpg")  # not divisible by 8
    assert load_image(tmp_path / "b.jpg", 32).shape == (32, 32, 3)
    Image.fromarray(rgb).convert("P").save(tmp_path / "p.png")
    Image.fromarray(rgb).convert("RGBA").save(tmp_path / "rgba.png")
    Image.fromarray(rgb).convert("L").save(tmp_path / "l.png")
    for name in ("p.png", "rgba.png", "l.png"):
        assert load_image(tmp_path / name, 32).shape == (32, 32, 3)
    assert to_pixels(load_image(tmp_path / "a.png", 32)).shape == (1, 3, 32, 32)


def test_bad_image_files_name_the_file(tmp_path):
    from PIL import Image

    with pytest.raises(DataError, match="image not found: .*missing.png"):
        load_image(tmp_path / "missing.png", 32)
    (tmp_path / "junk.png").write_bytes(b"not an image at all")
    with pytest.raises(DataError, match="junk.png: not a readable image"):
        load_image(tmp_path / "junk.png", 32)
    Image.fromarray(np.zeros((8, 8), dtype=np.uint16)).save(tmp_path / "deep.png")
    with pytest.raises(DataError, match="deep.png: pixel mode 'I;16'"):
        load_image(tmp_path / "deep.png", 32)
    good = tmp_path / "cut.png"
    save_image(good, ShapesDataset().sample("test", 0)[0])
    (tmp_path / "cut2.png").write_bytes(good.read_bytes()[:60])  # truncated PNG
    with pytest.raises(DataError, match="cut2.png: not a readable image"):
        load_image(tmp_path / "cut2.png", 32)
    assert torch.is_tensor(to_pixels(np.zeros((32, 32, 3), np.uint8)))
