"""Step shapes: every step pads to a compiled shape, decodes pad little, and warm-up knows every shape."""

import pytest

from jpaged.runner.step_shapes import StepShapes, ladder

DEFAULT = StepShapes(max_num_batched_tokens=512, max_num_seqs=64)


def test_ladder_has_midpoints_from_16_and_ends_at_the_limit():
    assert ladder(16, 64, midpoints=True) == (16, 24, 32, 48, 64)
    assert ladder(4, 64, midpoints=True) == (4, 8, 16, 24, 32, 48, 64)
    assert ladder(8, 64, midpoints=False) == (8, 16, 32, 64)
    assert ladder(16, 100, midpoints=False) == (16, 32, 64, 100)
    assert ladder(16, 8, midpoints=True) == (8,)


def test_default_shapes():
    assert DEFAULT.all_shapes() == [
        (4, 8), (8, 8), (16, 8), (16, 16), (24, 8), (24, 24), (32, 8), (32, 32), (48, 8), (48, 48), (64, 8), (64, 64),
        (128, 8), (128, 16), (128, 32), (128, 64), (256, 8), (256, 16), (256, 32), (256, 64),
        (512, 8), (512, 16), (512, 32), (512, 64),
    ]  # fmt: skip


@pytest.mark.parametrize("num_seqs", range(1, 65))
def test_a_decode_pads_at_most_a_third_beyond_16(num_seqs):
    tokens, seqs = DEFAULT.shape_for(num_seqs, num_seqs)
    assert seqs >= num_seqs and tokens >= num_seqs
    assert tokens <= max(16, num_seqs * 1.5)


def test_a_lone_sequence_gets_the_smallest_shape():
    assert DEFAULT.shape_for(1, 1) == (4, 8)
    assert DEFAULT.shape_for(5, 5) == (8, 8)
    assert DEFAULT.shape_for(40, 1) == (48, 8)  # a short prompt chunk


def test_prefill_chunks_use_powers_of_two():
    assert DEFAULT.shape_for(512, 3) == (512, 8)
    assert DEFAULT.shape_for(300, 40) == (512, 64)
    assert DEFAULT.shape_for(65, 9) == (128, 16)


def test_rows_beyond_tokens_grow_the_shape():
    """A 5-token prompt forking into 20 parallel samples needs 20 sampled rows."""
    tokens, seqs = DEFAULT.shape_for(5, 20)
    assert seqs >= 20 and tokens == seqs
    assert DEFAULT.shape_for(2, 6) == (8, 8)  # never fewer tokens than rows


@pytest.mark.parametrize(
    ("max_tokens", "max_seqs"), [(512, 64), (2048, 256), (64, 4), (8, 8), (100, 48), (16, 16)]
)
def test_every_step_pads_to_a_shape_warm_up_compiles(max_tokens, max_seqs):
    shapes = StepShapes(max_tokens, max_seqs)
    compiled = set(shapes.all_shapes())
    for num_tokens in range(1, max_tokens + 1):
        for num_rows in {1, 2, 7, 8, 9, 16, 17, 33, max_seqs} & set(range(1, max_seqs + 1)):
            if num_rows > num_tokens and num_rows > 8:
                continue  # only forks make more rows than tokens; checked above
            tokens, seqs = shapes.shape_for(num_tokens, num_rows)
            assert (tokens, seqs) in compiled
            assert tokens >= max(num_tokens, num_rows) and seqs >= num_rows
            assert tokens <= max_tokens and seqs <= max_seqs


def test_too_many_rows_is_an_error():
    with pytest.raises(ValueError, match="max_num_seqs"):
        DEFAULT.shape_for(100, 65)
