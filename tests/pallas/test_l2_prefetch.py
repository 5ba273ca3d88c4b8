"""The L2 prefetch plans (`l2_prefetch`): every box of a target is asked for by exactly one CTA.
(The prefetch itself is a no-op in the interpreter; the kernels that issue it are tested for equal
results with and without targets, and cross-lowered for an H100, in their own test files.)"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kestrel_jax.pallas import l2_prefetch as lp


@pytest.mark.parametrize("rows,n_ctas", [(16384, 128), (16384, 132), (8, 128), (2048, 7), (24576, 96), (64, 1)])
def test_whole_array_boxes_cover_each_row_once(rows: int, n_ctas: int) -> None:
    rb, per_cta = lp.plan(rows, n_ctas)
    assert 8 <= rb <= lp.MAX_BOX_ROWS and rows % rb == 0
    boxes = rows // rb
    asked = [c + i * n_ctas for c in range(n_ctas) for i in range(per_cta) if c + i * n_ctas < boxes]
    assert sorted(asked) == list(range(boxes))
    if rows >= 8 * n_ctas and rows // n_ctas <= lp.MAX_BOX_ROWS:
        assert per_cta == 1  # about one box per CTA where the rows allow


@pytest.mark.parametrize("nb", [0, 1, 3, 8])
def test_expert_boxes_cover_each_selected_expert_once_first_rows_first(nb: int) -> None:
    per_expert, n_ctas, max_blocks = 64, 128, 8
    per_cta = lp.expert_units_per_cta(per_expert, n_ctas, max_blocks)
    u = jnp.arange(n_ctas * per_cta, dtype=jnp.int32)
    blk, sl, valid = (np.asarray(a) for a in lp.expert_unit(u, jnp.int32(nb), per_expert))
    pairs = [(int(b), int(s)) for b, s, v in zip(blk, sl, valid, strict=True) if v]
    assert sorted(pairs) == [(b, s) for b in range(nb) for s in range(per_expert)]
    assert pairs[:nb] == [(b, 0) for b in range(nb)]  # each expert's first box is asked for first


def test_views_are_free_reshapes_and_skip_what_cannot_be_viewed() -> None:
    w = jnp.arange(2048 * 64, dtype=jnp.float32).reshape(2048, 64).astype(jnp.bfloat16)
    odd = jnp.zeros((3, 100), jnp.bfloat16)
    (v,) = lp.views((w, odd))
    assert v.shape == (2048 * 64 // 256, 256)
    np.testing.assert_array_equal(np.asarray(v).reshape(-1), np.asarray(w).reshape(-1))
    up = jnp.zeros((4, 512, 128), jnp.float8_e4m3fn)
    ev = lp.expert_view(up)
    assert ev is not None and ev.shape == (4, 256, 256)
    assert lp.expert_view(jnp.zeros((4, 3, 100), jnp.float8_e4m3fn)) is None
    # boxes of at most 256 rows that divide an expert's view rows (MD3: 16,384 up, 8,192 down)
    assert [lp.expert_box_rows(r) for r in (16384, 8192, 128, 24, 8)] == [256, 256, 128, 8, 8]
