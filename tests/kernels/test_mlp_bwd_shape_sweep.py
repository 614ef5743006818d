"""The dense MLP backward over sequence lengths (round 41 of docs/dense-performance.md): the shape-only run of the
kernel with the cost model's plan checks (simkit.assert_dense_shape_plans: no exception, no plan error) at S in
multiples of 512 from 512 to 32768 and the README's (H, I) pairs. The whole sweep is `slow` (about 2 h on one core; TP1's
H = 4096, I = 12288 only up to S = 4096, 1-2.5 min a shape there); a few shapes run in the default suite, among them
those round 41's one-block rule for phase 2's kept panels (PHASE2_STATIONARY_SEPARATE_PANELS) made run. Shapes still
refused are listed with their plan error, as strict xfails: one that starts to run fails the sweep until it is taken
off the list."""
import pytest

from simkit import assert_dense_shape_plans

#: (H, I) of the README's dense shapes: Qwen3-8B TP8, Llama3-8B TP8, Qwen3-8B TP1, Qwen3-30B-A3B's dense shape,
#: GPT-OSS's H = I = 2880, and H = 2048, I = 1536
PAIRS = [(4096, 1536), (4096, 1792), (4096, 12288), (2048, 768), (2880, 2880), (2048, 1536)]
#: the largest S swept per pair where the full range costs too much (the shape-only run grows with S * H * I)
MAX_S = {(4096, 12288): 4096}
#: (S, H, I) -> plan error, as the sweep found them after round 41 (next steps in its record); round 43 took
#: 4096 x 2048 x 1536 off (phase 3's spread first load without copies where it begins at phase 2's head), round 44
#: 512 x 4096 x 12288 (phases 3-4 at MX_N_TILE after phase 1's I split with one K tile: fit_weight_grad_n_tile),
#: round 45 3072 x 2880 x 2880 (phase 4, not phase 3, under phase 2's tail with a shallower first staging ring:
#: overlap.prefetch_staging), round 47 4608 x 4096 x 1536 (phase 3's spread copies only with a words piece spare beside
#: phase 2's tail: overlap.spread_copies_fit), round 48b 28672 x 2048 x 768 (a reloading K chunk's fetched fp32 sums
#: counted among the bytes it holds at its tail: PartialSums.held_bytes), round 50b 4608 / 5632 / 6656 x 4096 x 1792 (the
#: cost model's allocator starts a PSUM tile of 2, 4 or 8 banks at a multiple of its size: allocator._psum_alignment)
#: and 9216 x 4096 x 1536 (a source's later panels in words pieces once one was: PanelSource._placement), round 51a
#: 9728 x 4096 x 1536 and 10240 x 4096 x 1792 (a spilling K chunk's tail passes its fp32 sums through one SBUF ring:
#: k_chunks.PartialSums), round 52a 3584 x 2048 x 1536 (a resident stationary operand's kept-whole moving panels in
#: words pieces: tiling.choose_tiling, RESIDENT_KEPT_MOVING_IN_PIECES) and 2048 x 2880 x 2880 (phase 1's words along S
#: in one allocation per chunk beside separate kept panels: SwigluBackwardEpilogue.along_s_words_per_chunk) and
#: 27136 x 2880 x 2880 (a shorter last K chunk's panels in pieces where the full chunks' are: k_chunks.plan_matmul),
#: round 53a 28160 / 31232 / 32256 x 2880 x 2880 (a later K chunk's first moving panel quantizes its last K tiles at
#: its first tile, not under the chunk before's tail: MatmulPlan.prefetch_first_deferring)
STILL_REFUSED = {}  # (S, H, I) -> why the planner refuses it (strict xfail); none since round 53a


def _sweep():
    for H, I in PAIRS:
        for S in range(512, MAX_S.get((H, I), 32768) + 1, 512):
            marks = [pytest.mark.slow]
            if (S, H, I) in STILL_REFUSED:
                marks.append(pytest.mark.xfail(strict=True, reason=STILL_REFUSED[(S, H, I)]))
            yield pytest.param(S, H, I, marks=marks, id=f"{S}x{H}x{I}")


@pytest.mark.parametrize("S,H,I", list(_sweep()))
def test_shape_sweep_plans(S, H, I):
    """Every swept shape traces and plans without an error (those in STILL_REFUSED: strict xfail)."""
    assert_dense_shape_plans(S, H, I)


@pytest.mark.parametrize("S,H,I", [
    (8192, 2048, 768), (5120, 2048, 768), (4608, 2048, 1536),  # refused before round 41 (kept panels in one block)
    (4096, 2048, 1536),  # refused before round 43 (a spread first load's copy into a new words piece)
    (512, 4096, 12288),  # refused before round 44 (PSUM: phases 3-4's wide accumulators after phase 1's I split)
    (3072, 2880, 2880),  # refused before round 45 (phase 3's spread first load's copy under phase 2's tail)
    (4608, 4096, 1536),  # refused before round 47 (that copy with no words piece spare beside phase 2's tail)
    (28672, 2048, 768),  # refused before round 48b (phase 4's first load under phase 3's last chunk: its fetched sums)
    (4608, 4096, 1792),  # refused before round 50b (PSUM: phase 4's second 4-bank accumulator found no 4 banks in a row)
    (9728, 4096, 1536),  # refused before round 51a (a K chunk's tail eviction tile found no gap: a dependency cycle)
    (3584, 2048, 1536),  # refused before round 52a (phase 2's 24 KiB W_gu words found no gap among 14 kept panels)
    (2048, 2880, 2880),  # refused before round 52a (phase 1's 22.5 KiB words along S found no gap among 8 kept panels)
    (1024, 4096, 1536), (1536, 4096, 1792), (1024, 2880, 2880), (2560, 2048, 1536),
])
def test_representative_shapes_plan(S, H, I):
    """The sweep's default-suite subset: the three shapes round 41 fixed and the one round 43 fixed (main before each:
    'SBUF tile ... has no placement'), the one round 44 fixed (main: 'PSUM tile ... has no placement'), the one round
    45 fixed (main: 'SBUF tile ... has no placement'), the one round 47 fixed (the same), the one round 48b fixed
    (main: two 15 KiB SBUF tiles whose waits close a dependency cycle), the first of the three round 50b fixed (main:
    'PSUM tile ... has no placement'), the first of the two round 51a fixed (main: 6 KiB SBUF tiles whose waits close
    a dependency cycle), the two round 52a fixed (main: 'SBUF tile ... has no placement') and one short shape per
    other (H, I) pair."""
    assert_dense_shape_plans(S, H, I)
