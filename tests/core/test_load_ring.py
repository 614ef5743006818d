"""LoadRing: an operand's successive panel loads share their load tiles (nkilib/core/matmul/panels.py).

What is checked is where the loads write: a load into a tile of the ring waits (in the cost model, by the
WAR dependency on that SBUF) for the previous reader, which is the point of the ring. Bit-exactness of
the kernels that use it is covered by tests/kernels.
"""

import nki
import nki.language as nl
from nkilib.core.matmul import MatmulSetup, TensorDescriptor, load_panel, stage_ahead
from nkilib.core.matmul.constants import STAGING_BUFFERS
from nkilib.core.matmul.panels import LoadRing
from nkilib.core.matmul.sources import PanelSource
from nkilib.core.numerics import contract_mm
from nkilib.simulator.launcher import run_kernel
from simkit import BF16, assert_outputs_identical, in_kernel, matmul_panels_to_hbm, randn, simulate

MX = MatmulSetup("mxfp8", nl.float8_e4m3fn_x4, "1x32", True)


def test_ring_takes_the_least_recently_used_tile_and_grows_between_loads():
    def body():
        ring = LoadRing(2)
        taken = []
        for _ in range(3):
            ring.take((128, 64))
            taken.append(ring.tiles[-1])
        ring.size = 3
        ring.take((128, 32))  # narrower: a view of a new tile (the ring is not full)
        taken.append(ring.tiles[-1])
        ring.take((128, 128))  # wider than the ring's tiles: a new ring
        return taken, list(ring.tiles)

    taken, last = in_kernel(body)
    assert taken[2] is taken[0] and taken[1] is not taken[0]  # A, B, A
    assert all(taken[3] is not t for t in taken[:3])  # grown: a new tile first
    assert len(last) == 1 and all(last[0] is not t for t in taken)


def _load_destinations(kernel, operand):
    """Storage ids written by the DMAs that read `operand` (in program order)."""
    res = run_kernel(kernel, args=(operand,), trace=True)
    out = []
    for r in res.trace:
        if r.instr == "dma_copy" and any(o.buffer.endswith("hbm") for o in r.reads):
            out.append(r.writes[0].storage_id)
    return out


def test_panel_source_staging_tiles_are_shared_across_its_loads():
    """[K, F] MXFP8 operand, K = 1024 (two K tiles per panel), two 128-column panels: the second load's
    staging DMAs reuse the first load's tiles (fresh tiles per load before: no storage in common)."""
    def kernel(w):
        src = PanelSource(TensorDescriptor(w, k_axis=0), MX, pad_even=False, keep_all=True)
        src.get(0, 128)
        src.get(128, 128)

    dst = _load_destinations(kernel, randn(0, (1024, 256), BF16))
    assert len(dst) == 4
    assert set(dst[:2]) & set(dst[2:])  # ring of 3: A, B | C, A
    assert len(set(dst)) == 3


def test_panel_source_natural_row_tiles_one_for_the_first_load_then_two():
    """K-contiguous operand [F, K], K = 4096 (two 2048-column natural DMAs per 128-row panel): the first
    load's two DMAs write one tile (the second waits for the first's transposes), the next load alternates."""
    def kernel(w):
        src = PanelSource(TensorDescriptor(w, k_axis=1), MX, pad_even=True, keep_all=True)
        src.get(0, 128)
        src.get(128, 128)

    dst = _load_destinations(kernel, randn(1, (256, 4096), BF16))
    assert len(dst) == 4
    assert dst[0] == dst[1]
    assert dst[2] != dst[3] and dst[0] in dst[2:]



@nki.jit
def _ring_matmul_kernel(a, b, ring_size):
    """out [M, N] = a [K, M]ᵀ @ b [K, N], a's panel loaded through LoadRing(ring_size) (0: load_panel's default)."""
    K, M = a.shape
    N = b.shape[1]
    ring = None if ring_size == 0 else LoadRing(ring_size)
    stationary = load_panel(TensorDescriptor(a, k_axis=0), 0, M, M, MX, ring=ring)
    moving = load_panel(TensorDescriptor(b, k_axis=0), 0, N, N, MX)
    return matmul_panels_to_hbm(stationary, moving, MX, M, N)  # K=K, M=M, N=N


def test_load_panel_through_a_ring_smaller_than_its_look_ahead():
    """load_panel stages at most ring.size K tiles ahead of its quantizes: a [K, F] MXFP8 operand of 4 K tiles loaded
    through a ring of 2 (below STAGING_BUFFERS) multiplies to the contract's bits, as through the default ring (before,
    the third K tile's DMA retook the first tile's stage before that tile was quantized), and its DMAs alternate the
    ring's two tiles."""
    a, b = randn(2, (2048, 64), BF16), randn(3, (2048, 32), BF16)
    want = contract_mm(a.T, b, "mxfp8", "float8_e4m3fn", "1x32")
    for size in (0, 2):
        assert_outputs_identical((simulate(_ring_matmul_kernel, 1, a=a, b=b, ring_size=size),), (want,), f"ring {size}")
    res = run_kernel(_ring_matmul_kernel.fn, kwargs=dict(a=a, b=b, ring_size=2), trace=True)
    dst = [r.writes[0].storage_id for r in res.trace
           if r.instr == "dma_copy" and any(o.name == "a" for o in r.reads)]
    assert len(dst) == 4 and len(set(dst)) == 2 and dst[0] == dst[2] and dst[1] == dst[3], dst


def _quantize_destinations(kernel, operand):
    """Storage ids that quantize_mx writes its words into (program order)."""
    res = run_kernel(kernel, args=(operand,), trace=True)
    return [r.writes[0].storage_id for r in res.trace if r.instr == "quantize_mx"]


def test_panel_source_large_panel_words_in_pieces():
    """A [K, F] MXFP8 panel whose words exceed MX_PANEL_WHOLE_MAX_BYTES per partition (K = 2560: 5 K tiles of
    2048 words x 4 bytes = 40 KiB) is allocated in MX_PANEL_PIECE_BYTES pieces of whole K tiles (2 + 2 + 1);
    a panel of 16 KiB (1024 columns) stays one allocation."""
    def kernel(w):
        PanelSource(TensorDescriptor(w, k_axis=0), MX, pad_even=False, keep_all=True).get(0, w.shape[1])

    big = _quantize_destinations(kernel, randn(2, (2560, 2048), BF16))
    assert len(big) == 5
    assert big[0] == big[1] and big[2] == big[3] and len(set(big)) == 3
    small = _quantize_destinations(kernel, randn(3, (2560, 1024), BF16))
    assert len(small) == 5 and len(set(small)) == 1


def test_panel_source_narrow_panel_after_a_pieced_one_in_pieces_too():
    """A source's panels: 2048 columns (5 K tiles x 2048 words x 4 bytes = 40 KiB, above MX_PANEL_WHOLE_MAX_BYTES:
    pieces of 2 + 2 + 1 K tiles), then 1024 columns (20 KiB, which alone would be one allocation): the narrower panel
    goes in MX_PANEL_PIECE_BYTES pieces too (4 + 1 K tiles), so it never needs a gap wider than the earlier pieces
    (round 50b, 9216 x 4096 x 1536; main: one 20 KiB allocation). A source whose first panel is narrow keeps it whole."""
    def kernel(w):
        src = PanelSource(TensorDescriptor(w, k_axis=0), MX, pad_even=False, keep_all=True)
        src.get(0, 2048)
        src.get(2048, 1024)

    dest = _quantize_destinations(kernel, randn(4, (2560, 3072), BF16))
    assert len(dest) == 10
    wide, narrow = dest[:5], dest[5:]
    assert len(set(wide)) == 3 and not set(wide) & set(narrow)
    assert narrow[0] == narrow[3] and narrow[4] != narrow[0], narrow  # 4 + 1 K tiles (16 KiB / 4 KiB per K tile)

    def narrow_first(w):
        PanelSource(TensorDescriptor(w, k_axis=0), MX, pad_even=False, keep_all=True).get(2048, 1024)

    assert len(set(_quantize_destinations(narrow_first, randn(4, (2560, 3072), BF16)))) == 1


@nki.jit
def _interleaved_matmul_kernel(a, b, interleave):
    """out [M, N] = a [K, M]ᵀ @ b [K, N] through two PanelSources; interleave: both panels begun by load_ahead and
    quantized one K tile of each in turn (MatmulPlan's interleave_first_loads), else loaded by get one after the
    other."""
    K, M = a.shape
    N = b.shape[1]
    st = PanelSource(TensorDescriptor(a, k_axis=0), MX, pad_even=True, keep_all=True)
    mv = PanelSource(TensorDescriptor(b, k_axis=0), MX, pad_even=False, keep_all=False)
    if interleave:
        for t in range(1, K // 512 + 1):
            st.load_ahead(0, M, t)
            mv.load_ahead(0, N, t)
    return matmul_panels_to_hbm(st.get(0, M), mv.get(0, N), MX, M, N)  # K=K, M=M, N=N


def _quantized_operands(kernel, **kwargs):
    """Names of the HBM operands whose staged K tiles quantize_mx reads, in program order (each staging tile's
    operand is the one its latest DMA read)."""
    res = run_kernel(kernel.fn, kwargs=kwargs, trace=True)
    staged_from, order = {}, []
    for r in res.trace:
        if r.instr == "dma_copy":
            hbm = [o.name for o in r.reads if o.buffer.endswith("hbm")]
            if hbm:
                staged_from[r.writes[0].storage_id] = hbm[0]
        elif r.instr == "quantize_mx":
            order.append(staged_from[r.reads[0].storage_id])
    return order


def test_load_ahead_interleaves_two_panels_with_the_same_bits():
    """PanelSource.load_ahead / PanelLoad: two [K, F] MXFP8 panels (K = 2048: 4 K tiles) begun together and quantized
    one K tile of each in turn give the contract's bits, as get's one-after-the-other loads do; the quantizes
    alternate between the operands (a, b, a, b, ...) instead of all of a's first."""
    a, b = randn(4, (2048, 64), BF16), randn(5, (2048, 96), BF16)
    want = contract_mm(a.T, b, "mxfp8", "float8_e4m3fn", "1x32")
    for interleave in (False, True):
        out = simulate(_interleaved_matmul_kernel, 1, a=a, b=b, interleave=interleave)
        assert_outputs_identical((out,), (want,), f"interleave={interleave}")
    assert _quantized_operands(_interleaved_matmul_kernel, a=a, b=b, interleave=False) == ["a"] * 4 + ["b"] * 4
    assert _quantized_operands(_interleaved_matmul_kernel, a=a, b=b, interleave=True) == ["a", "b"] * 4


def test_load_ahead_refuses_a_k_contiguous_source():
    """load_ahead steps the staged [K, F] path only; a K-contiguous operand (PE transposes) is refused with the
    source's values in the message."""
    import pytest

    def body():
        src = PanelSource(TensorDescriptor(nl.ndarray((128, 512), dtype=nl.bfloat16, buffer=nl.shared_hbm),
                                           k_axis=1), MX, pad_even=True, keep_all=True)
        assert not src.can_load_ahead()
        with pytest.raises(AssertionError, match="k_axis=1"):
            src.load_ahead(0, 128, 1)

    in_kernel(body)


@nki.jit
def _staged_ahead_matmul_kernel(a, b, count):
    """out [M, N] = a [K, M]ᵀ @ b [K, N], a's first `count` K tiles staged by stage_ahead into tiles allocated here,
    b's panel loaded between them and a's load_panel(staged=...) through a ring that holds those tiles (count 0: a
    plain load_panel)."""
    K, M = a.shape
    N = b.shape[1]
    desc = TensorDescriptor(a, k_axis=0)
    stages = [nl.ndarray((128, 4, M), dtype=nl.bfloat16, buffer=nl.sbuf) for _ in range(count)]
    staged = stage_ahead(desc, 0, M, M, MX, stages) if count else None
    moving = load_panel(TensorDescriptor(b, k_axis=0), 0, N, N, MX)
    ring = LoadRing(STAGING_BUFFERS, stages) if count else None
    stationary = load_panel(desc, 0, M, M, MX, ring=ring, staged=staged)
    return matmul_panels_to_hbm(stationary, moving, MX, M, N)  # K=K, M=M, N=N


def test_stage_ahead_then_load_panel_takes_the_staged_k_tiles():
    """stage_ahead (docs/moe.md section 10, round 22a): a [K, F] MXFP8 operand of 4 K tiles with its first 1 or 2 K
    tiles staged before another panel's load multiplies to the contract's bits, as a plain load does; a's DMAs are
    the same four (none repeated), the staged ones first in program order (before b's), into the caller's tiles, and
    the load's later K tiles take a new tile before it retakes the staged ones (oldest first): the ring as if the load
    had staged them itself. Fails if load_panel restages the staged K tiles (six or five DMAs) or drops them (the
    bits)."""
    a, b = randn(6, (2048, 64), BF16), randn(7, (2048, 32), BF16)
    want = contract_mm(a.T, b, "mxfp8", "float8_e4m3fn", "1x32")
    for count in (0, 1, 2):
        out = simulate(_staged_ahead_matmul_kernel, 1, a=a, b=b, count=count)
        assert_outputs_identical((out,), (want,), f"{count} K tiles staged ahead")
        res = run_kernel(_staged_ahead_matmul_kernel.fn, kwargs=dict(a=a, b=b, count=count), trace=True)
        loads = [(o.name, r.writes[0].storage_id) for r in res.trace if r.instr == "dma_copy"
                 for o in r.reads if o.name in ("a", "b")]
        dst = [s for name, s in loads if name == "a"]
        assert len(dst) == 4, loads
        first_b = [name for name, _ in loads].index("b")
        assert [name for name, _ in loads[:count]] == ["a"] * count and first_b == count, loads
        if count == 1:
            assert dst[3] == dst[0] and len(set(dst[:3])) == 3, dst
        if count == 2:
            assert dst[3] == dst[0] and len(set(dst[:3])) == 3, dst


def test_load_panel_refuses_staged_tiles_without_their_ring():
    """load_panel(staged=...) needs the ring that holds the staged tiles (its later K tiles must not retake them before
    their quantizes) and K tiles from 0: refused with the values in the message."""
    import pytest

    def body():
        a = nl.ndarray((1024, 64), dtype=nl.bfloat16, buffer=nl.shared_hbm)
        desc = TensorDescriptor(a, k_axis=0)
        stages = [nl.ndarray((128, 4, 64), dtype=nl.bfloat16, buffer=nl.sbuf)]
        staged = stage_ahead(desc, 0, 64, 64, MX, stages)
        with pytest.raises(AssertionError, match="ring=None"):
            load_panel(desc, 0, 64, 64, MX, staged=staged)
        with pytest.raises(AssertionError, match="t_lo=1"):
            load_panel(desc, 0, 64, 64, MX, t_lo=1, ring=LoadRing(STAGING_BUFFERS, stages), staged=staged)

    in_kernel(body)
