"""Host-side packing of one step's inputs into a few numpy arrays (one host->device copy each).

A decode step takes `ints [B, DI + P]` (the per-row columns below, then the row's page table)
and `floats [B, DF]`; a prefill step takes per-token `tok_ints [T, TI]`, `tok_floats [T, 2]` and
per-sequence `seq_ints [B, SI + P]`, `seq_floats [B, 2]`. Moving ~20 small arrays per step as 2-4
transfers is what keeps the host side of a batch-1 decode step short.

Row inputs: a decode row either gets its input explicitly (kind, token, value) or, with
`src >= 0`, from row `src` of the previous step's packed outputs, still on the device: the
sampled token for text, reasoning and segment rows (or, when that token is the coordinate / size
token of a reasoning or segment row, its decoded value), the decoded coordinate or size for region rows. That
lets the host dispatch step N+1 before it has read step N. Pure numpy (no JAX).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Decode int columns.
D_POS, D_SLOT, D_KV_LEN, D_KIND, D_TOKEN, D_SRC, D_FLAGS, D_TOP_K, D_SEED, D_STEP = range(10)
D_SUP = 10  # 3 suppressed-id slots: 10, 11, 12
D_NUM_VALID = 13
D_NSTEPS = 14  # multi-step decode: iterations this row runs (0 = padding)
D_REGION = 15  # every row: 1 if any row of the step needs the region heads (`mark_region`)
DI = 16
# Decode float columns.
F_VAL0, F_VAL1, F_TEMP, F_TOP_P = range(4)
DF = 4
# Prefill per-token int columns.
T_POS, T_SLOT, T_KIND, T_TOKEN, T_IMG_ROW, T_NUM_VALID, T_REGION = range(7)  # T_REGION as D_REGION
TI = 7
# Prefill per-sequence int columns.
S_CU_END, S_KV_LEN, S_PREFIX, S_LOGITS_ROW, S_FLAGS, S_TOP_K, S_SEED, S_STEP = range(8)
S_SUP = 8  # 8, 9, 10
SI = 11
N_SUP = 3

FLAG_REGION, FLAG_REASONING, FLAG_SEGMENT = 1, 2, 4
# Row / token input kinds (T_KIND, D_KIND): a token id, E_coord(value), E_size(value), an image row.
IN_TOKEN, IN_COORD, IN_SIZE, IN_IMAGE = 0, 1, 2, 3


def needs_region(flags: np.ndarray, kinds: np.ndarray) -> int:
    """1 if any row samples for a region, reasoning or segment job (its outputs carry decoded coordinates
    and sizes) or takes a coordinate or size as input, else 0: the value of D_REGION / T_REGION,
    which lets a step skip the region heads' weight streams on the device (`ops.region_gate_wanted`)."""
    return int(bool(np.any(flags != 0) or np.any((kinds == IN_COORD) | (kinds == IN_SIZE))))


def mark_region(ints: np.ndarray) -> None:
    """Set a decode step's D_REGION column from its rows' flags and input kinds."""
    ints[:, D_REGION] = needs_region(ints[:, D_FLAGS], ints[:, D_KIND])


@dataclass
class RowSpec:
    """Sampling settings and skill flags of one row's output."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    step: int = 0
    suppressed: tuple[int, ...] = ()
    region: bool = False
    reasoning: bool = False
    segment: bool = False  # a sampled coordinate / size token feeds its decoded value

    @property
    def flags(self) -> int:
        return ((FLAG_REGION if self.region else 0) | (FLAG_REASONING if self.reasoning else 0)
                | (FLAG_SEGMENT if self.segment else 0))


def _fill_sampling(ints: np.ndarray, floats: np.ndarray, i: int, spec: RowSpec, top_k_col: int, seed_col: int,
                   step_col: int, sup_col: int, flags_col: int, temp_col: int, top_p_col: int) -> None:
    if len(spec.suppressed) > N_SUP:
        raise ValueError(f"at most {N_SUP} suppressed ids per row, got {spec.suppressed}")
    ints[i, top_k_col] = spec.top_k
    ints[i, seed_col] = np.uint32(spec.seed).view(np.int32)
    ints[i, step_col] = spec.step
    ints[i, sup_col: sup_col + len(spec.suppressed)] = spec.suppressed
    ints[i, flags_col] = spec.flags
    floats[i, temp_col] = spec.temperature
    floats[i, top_p_col] = spec.top_p


def empty_decode(b: int, pages: int) -> tuple[np.ndarray, np.ndarray]:
    """Inert decode inputs: every row padding (slot -1, kv_len 0, greedy)."""
    ints = np.zeros((b, DI + pages), np.int32)
    ints[:, D_SLOT] = -1
    ints[:, D_SRC] = -1
    ints[:, D_SUP: D_SUP + N_SUP] = -1
    floats = np.zeros((b, DF), np.float32)
    floats[:, F_TOP_P] = 1.0
    return ints, floats


def decode_row(ints: np.ndarray, floats: np.ndarray, i: int, *, kind: int, token: int, value: tuple[float, float],
               src: int, spec: RowSpec, steps: int = 1) -> None:
    ints[i, D_KIND], ints[i, D_TOKEN], ints[i, D_SRC], ints[i, D_NSTEPS] = kind, token, src, steps
    floats[i, F_VAL0], floats[i, F_VAL1] = value
    _fill_sampling(ints, floats, i, spec, D_TOP_K, D_SEED, D_STEP, D_SUP, D_FLAGS, F_TEMP, F_TOP_P)


def empty_prefill(t: int, b: int, pages: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Inert prefill inputs: every token padding, every sequence empty."""
    tok_ints = np.zeros((t, TI), np.int32)
    tok_ints[:, T_SLOT] = -1
    tok_ints[:, T_IMG_ROW] = -1
    tok_floats = np.zeros((t, 2), np.float32)
    seq_ints = np.zeros((b, SI + pages), np.int32)
    seq_ints[:, S_LOGITS_ROW] = -1
    seq_ints[:, S_SUP: S_SUP + N_SUP] = -1
    seq_floats = np.zeros((b, 2), np.float32)
    seq_floats[:, 1] = 1.0
    return tok_ints, tok_floats, seq_ints, seq_floats


def prefill_seq_sampling(seq_ints: np.ndarray, seq_floats: np.ndarray, b: int, spec: RowSpec) -> None:
    _fill_sampling(seq_ints, seq_floats, b, spec, S_TOP_K, S_SEED, S_STEP, S_SUP, S_FLAGS, 0, 1)


def text_prefill(seqs: list[tuple[int, list[int]]], *, tokens: int, max_seqs: int, pages: int, page_size: int,
                 specs: tuple[RowSpec, ...] = ()) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A prefill step of fresh text prompts, each in contiguous pages (the rest of its page-table
    row 0): `seqs` = (first page, token ids), packed in order into a `tokens`-token bucket of `max_seqs` sequences; each
    sequence samples its next token with `specs[b]` (default greedy). For tests and tools."""
    tok_ints, tok_floats, seq_ints, seq_floats = empty_prefill(tokens, max_seqs, pages)
    off = 0
    for b, (page, toks) in enumerate(seqs):
        n = len(toks)
        if off + n > tokens or b >= max_seqs or -(-n // page_size) > pages:
            raise ValueError(f"sequence {b} ({n} tokens) does not fit the step")
        tok_ints[off: off + n, T_POS] = np.arange(n)
        tok_ints[off: off + n, T_SLOT] = page * page_size + np.arange(n)
        tok_ints[off: off + n, T_TOKEN] = toks
        seq_ints[b:, S_CU_END] = off + n
        seq_ints[b, S_KV_LEN] = n
        seq_ints[b, S_LOGITS_ROW] = off + n - 1
        seq_ints[b, SI: SI + -(-n // page_size)] = page + np.arange(-(-n // page_size))
        prefill_seq_sampling(seq_ints, seq_floats, b, specs[b] if b < len(specs) else RowSpec())
        off += n
    tok_ints[:, T_NUM_VALID] = off
    tok_ints[:, T_REGION] = needs_region(seq_ints[:, S_FLAGS], tok_ints[:, T_KIND])
    return tok_ints, tok_floats, seq_ints, seq_floats


def text_decode(rows: list[tuple[int, int, int, int]], *, bucket: int, pages: int, page_size: int,
                specs: tuple[RowSpec, ...] = ()) -> tuple[np.ndarray, np.ndarray]:
    """One decode iteration of text rows in contiguous pages: `rows` = (first page, position of
    the new token, its id or -1, src row of the previous step's outputs or -1). For tests and
    tools."""
    ints, floats = empty_decode(bucket, pages)
    for i, (page, pos, token, src) in enumerate(rows):
        ints[i, D_POS] = pos
        ints[i, D_SLOT] = (page + pos // page_size) * page_size + pos % page_size
        ints[i, D_KV_LEN] = pos + 1
        used = pos // page_size + 1
        if used > pages:
            raise ValueError(f"row {i} (position {pos}) does not fit {pages} pages")
        ints[i, DI: DI + used] = page + np.arange(used)
        decode_row(ints, floats, i, kind=0, token=max(token, 0), value=(0.0, 0.0), src=src,
                   spec=specs[i] if i < len(specs) else RowSpec())
    ints[:, D_NUM_VALID] = len(rows)
    mark_region(ints)
    return ints, floats
