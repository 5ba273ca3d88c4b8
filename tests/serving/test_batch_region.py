"""The "any row needs the region heads" column of a step's inputs (batch.D_REGION / T_REGION),
on which the region heads' decode GEMMs are gated (`ops.region_gate_wanted`): set when any row
samples for a region or reasoning job or takes a coordinate or size as input, clear otherwise."""

from __future__ import annotations

import numpy as np

from kestrel_jax.serving import batch as bt


def test_needs_region_by_flags_and_input_kinds() -> None:
    none = np.zeros(4, np.int32)
    kinds = np.array([bt.IN_TOKEN, bt.IN_IMAGE, bt.IN_TOKEN, bt.IN_TOKEN], np.int32)
    assert bt.needs_region(none, kinds) == 0
    for flag in (bt.FLAG_REGION, bt.FLAG_REASONING):  # a detect / point row, a reasoning row
        assert bt.needs_region(np.where(np.arange(4) == 2, flag, 0), kinds) == 1
    for kind in (bt.IN_COORD, bt.IN_SIZE):  # a coordinate / size input (a prompt's region slot)
        assert bt.needs_region(none, np.where(np.arange(4) == 3, kind, kinds)) == 1


def test_decode_and_prefill_packing_set_the_column_in_every_row() -> None:
    rows = [(0, 5, 7, -1), (2, 9, 8, -1)]
    text, _ = bt.text_decode(rows, bucket=4, pages=2, page_size=16)
    assert not text[:, bt.D_REGION].any()
    point, _ = bt.text_decode(rows, bucket=4, pages=2, page_size=16, specs=(bt.RowSpec(), bt.RowSpec(region=True)))
    assert (point[:, bt.D_REGION] == 1).all()
    reasoning, _ = bt.text_decode(rows[:1], bucket=4, pages=2, page_size=16, specs=(bt.RowSpec(reasoning=True),))
    assert (reasoning[:, bt.D_REGION] == 1).all()
    seqs = [(0, [1, 2, 3]), (4, [5, 6])]
    tok_ints, _, _, _ = bt.text_prefill(seqs, tokens=8, max_seqs=2, pages=2, page_size=16)
    assert tok_ints.shape[1] == bt.TI and not tok_ints[:, bt.T_REGION].any()
    tok_ints, _, _, _ = bt.text_prefill(seqs, tokens=8, max_seqs=2, pages=2, page_size=16,
                                        specs=(bt.RowSpec(), bt.RowSpec(region=True)))
    assert (tok_ints[:, bt.T_REGION] == 1).all()
    ints, _ = bt.empty_decode(2, 3)
    ints[1, bt.D_KIND] = bt.IN_SIZE
    bt.mark_region(ints)
    assert (ints[:, bt.D_REGION] == 1).all()
