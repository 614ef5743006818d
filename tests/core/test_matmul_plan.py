"""nkilib.core.matmul.plan: the core split and MatmulPlan beyond the dense kernel's own use.

The dense kernel's phases are covered bit-exactly by tests/kernels; here a plan computes several products
sharing a stationary operand with a custom epilogue (the shape of phase 1), and plans run per block of
rows of windowed descriptors (the shape of a grouped-experts kernel's loop over token blocks). Expected
values come from the NumPy reference's contract matmul (nkilib.core.numerics.contract_mm), not from the plan.
"""
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
from nkilib.core.matmul import CoreSplit, MatmulPlan, MatmulSetup, StoreEpilogue, TensorDescriptor
from nkilib.core.matmul.constants import PARTITIONS
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import MatmulConfig, get_program_sharding_info
from nkilib.core.numerics import contract_mm, to_bf16
from simkit import BF16, assert_outputs_identical, randn, simulate


@pytest.mark.parametrize("m, n, cores, prefer_m, want", [
    (512, 300, 1, False, [((0, 512), (0, 300))]),
    (512, 300, 2, False, [((0, 256), (0, 300)), ((256, 512), (0, 300))]),  # M larger: 4 blocks of 128, 2 each
    (300, 1000, 2, False, [((0, 300), (0, 512)), ((0, 300), (512, 1000))]),  # N larger: 8 blocks, 4 each
    (300, 1000, 2, True, [((0, 256), (0, 1000)), ((256, 300), (0, 1000))]),  # prefer M: 3 blocks -> 2 + 1
    (200, 100, 2, False, [((0, 128), (0, 100)), ((128, 200), (0, 100))]),  # N < 256: split M anyway
])
def test_core_split_ranges(m, n, cores, prefer_m, want):
    assert [CoreSplit(cores, i).ranges(m, n, prefer_m) for i in range(cores)] == want


@pytest.mark.parametrize("m, n, cores, want", [
    (4096, 1536, 2, True),  # 2048 rows each: four 512-row blocks per core, all columns
    (4096, 1536, 1, True),
    (1536, 1536, 2, False),  # 768 rows per core: not whole 512-row blocks
    (1000, 64, 1, False),  # M not a multiple of the block
    (1024, 4096, 2, True),  # prefer_m splits M (512 rows each) although N is larger
    (512, 4096, 2, False),  # 256 rows per core
])
def test_core_split_whole_row_blocks(m, n, cores, want):
    """Whole 512-row blocks on every core (the condition for quantizing rows along M on chip in K tiles)."""
    assert all(CoreSplit(cores, i).whole_row_blocks(m, n, 512) == want for i in range(cores))


class _TwoOutputs(nl.NKIObject):
    """Epilogue: evicts product 0 to out0 and product 1 to out1 (bf16), one SBUF tile each per output tile."""

    def __init__(self, out0, out1):
        self.outs = (out0, out1)

    def prepare(self, plan):
        pass

    def finish(self):
        pass

    def held_bytes(self, n_tile):
        return 0

    def tile(self, i, m0, msz, n0, nsz, accumulators):
        for out, acc in zip(self.outs, accumulators):
            res = nl.ndarray((PARTITIONS, acc.shape[1]), dtype=nl.bfloat16, buffer=nl.sbuf)
            nisa.tensor_copy(dst=res[:msz, :nsz], src=acc[:msz, :nsz])
            nisa.dma_copy(dst=out[m0:m0 + msz, n0:n0 + nsz], src=res[:msz, :nsz])


def _setup(precision):
    return MatmulSetup(precision, nl.float8_e4m3fn_x4, "1x32", True)


@nki.jit
def _shared_stationary_kernel(a, b, c, precision):
    """out_b = a @ b and out_c = a @ c in one plan: a [M, K] stationary (K contiguous), b, c [K, N] moving."""
    M, N = a.shape[0], b.shape[1]
    out_b = nl.ndarray((M, N), dtype=nl.bfloat16, buffer=nl.shared_hbm)
    out_c = nl.ndarray((M, N), dtype=nl.bfloat16, buffer=nl.shared_hbm)
    split = CoreSplit(*get_program_sharding_info(True))
    plan = MatmulPlan([TensorDescriptor(a, k_axis=1)], [TensorDescriptor(b, k_axis=0), TensorDescriptor(c, k_axis=0)],
                      M, N, _setup(precision), MatmulConfig(m_tile=128, n_tile=256), split, _TwoOutputs(out_b, out_c),
                      products=((0, 0), (0, 1)), groups=False)
    plan.step("all")
    return out_b, out_c


@pytest.mark.parametrize("precision", ["mxfp8", "bf16"])
@pytest.mark.parametrize("lnc", [1, 2])
def test_products_sharing_a_stationary_operand(precision, lnc):
    M, K, N = 300, 640, 520  # partial m tile, two MX K tiles (second partial), partial n tile
    a, b, c = randn(1, (M, K), BF16), randn(2, (K, N), BF16), randn(3, (K, N), BF16)
    got = simulate(_shared_stationary_kernel, lnc, a=a, b=b, c=c, precision=precision)
    want = tuple(to_bf16(contract_mm(a, w, precision, "float8_e4m3fn", "1x32")) for w in (b, c))
    assert_outputs_identical(got, want, f"{precision} lnc{lnc}")


@nki.jit
def _blocked_kernel(x, w, block):
    """out = x @ w computed as one plan per block of `block` rows of x (windowed descriptors, like a run over
    token blocks), each split across the launch's cores."""
    S, N = x.shape[0], w.shape[1]
    out = nl.ndarray((S, N), dtype=nl.float32, buffer=nl.shared_hbm)
    split = CoreSplit(*get_program_sharding_info(True))
    x_td = TensorDescriptor(x, k_axis=1)
    for s0 in range(0, S, block):
        rows = min(block, S - s0)
        plan = MatmulPlan([x_td.window(s0, rows)], [TensorDescriptor(w, k_axis=0)], rows, N, _setup("mxfp8"),
                          MatmulConfig(), split, StoreEpilogue(out[s0:s0 + rows, :], nl.float32))
        plan.step("all")
    return out


@pytest.mark.parametrize("lnc", [1, 2])
def test_plans_over_row_blocks_of_windowed_operands(lnc):
    S, K, N = 384, 256, 384
    x, w = randn(4, (S, K), BF16), randn(5, (K, N), BF16)
    got = simulate(_blocked_kernel, lnc, x=x, w=w, block=256)
    assert_outputs_identical((got,), (contract_mm(x, w, "mxfp8", "float8_e4m3fn", "1x32"),), f"lnc{lnc}")


@nki.jit
def _large_moving_panel_kernel(a, b):
    """out = a @ b with b's whole [K, N] panel resident (40 KiB of MX words per partition: in pieces)."""
    M, N = a.shape[0], b.shape[1]
    out = nl.ndarray((M, N), dtype=nl.float32, buffer=nl.shared_hbm)
    plan = MatmulPlan([TensorDescriptor(a, k_axis=1)], [TensorDescriptor(b, k_axis=0)], M, N, _setup("mxfp8"),
                      MatmulConfig(m_tile=128, n_tile=N), CoreSplit(1, 0), StoreEpilogue(out, nl.float32))
    plan.step("all")
    return out


def test_plan_with_moving_panel_words_in_pieces():
    """Bit-exact with the moving panel's MX words allocated in pieces (tests/core/test_load_ring.py checks the
    pieces): K = 5120 (10 K tiles) x N = 1024, 40 KiB of words per partition, pieces of 4 + 4 + 2 K tiles."""
    M, K, N = 128, 5120, 1024
    a, b = randn(6, (M, K), BF16), randn(7, (K, N), BF16)
    got = simulate(_large_moving_panel_kernel, 1, a=a, b=b)
    assert_outputs_identical((got,), (contract_mm(a, b, "mxfp8", "float8_e4m3fn", "1x32"),), "pieces")


_KEPT = []  # per trace of _kept_stationary_kernel: whether its plan kept the stationary operand whole


@nki.jit
def _kept_stationary_kernel(a, b, lookahead):
    """out [M, N] = a [K, M]ᵀ @ b [K, N] with a kept whole (the resident-operand rule, forced by the caller's budgets)
    and b's panels streamed n-major; lookahead: MatmulPlan's stationary_lookahead."""
    M, N = a.shape[1], b.shape[1]
    out = nl.ndarray((M, N), dtype=nl.float32, buffer=nl.shared_hbm)
    plan = MatmulPlan([TensorDescriptor(a, k_axis=0)], [TensorDescriptor(b, k_axis=0)], M, N, _setup("mxfp8"),
                      MatmulConfig(m_tile=128, n_tile=512), CoreSplit(1, 0), StoreEpilogue(out, nl.float32),
                      stationary_lookahead=lookahead)
    _KEPT.append(plan.stationary[0].keep_all and not plan.keep_moving)
    plan.step("all")
    return out


def test_stationary_lookahead_loads_the_next_super_panel_early(monkeypatch):
    """stationary_lookahead: a kept-whole stationary operand's panels load STATIONARY_LOOKAHEAD_TILES tiles ahead
    (TP1's phase 4, modeled 4.616 -> 4.603 ms). M = 1024: two 512-column super-panels of four 128-row m tiles; the
    second one's DMAs follow the first tile's matmul instead of the fourth's; the bits are the contract's."""
    from nkilib.core.matmul import tiling as tiling_module
    from nkilib.simulator.launcher import run_kernel

    monkeypatch.setattr(tiling_module, "PANEL_CACHE_BUDGET_BYTES", 1)  # neither fits: keep the smaller (a) whole
    K, M, N = 512, 1024, 2048
    a, b = randn(8, (K, M), BF16), randn(9, (K, N), BF16)
    want = contract_mm(a.T, b, "mxfp8", "float8_e4m3fn", "1x32")
    matmuls_before = []
    for lookahead in (False, True):
        res = run_kernel(_kept_stationary_kernel.fn, kwargs=dict(a=a, b=b, lookahead=lookahead), trace=True)
        assert _KEPT[-1], "the plan must keep a whole"
        assert_outputs_identical((res.outputs,), (want,), f"lookahead={lookahead}")
        matmuls = 0
        for r in res.trace:
            if r.instr == "nc_matmul_mx":
                matmuls += 1
            elif r.instr == "dma_copy" and any(o.name == "a" and o.byte_lo % (M * 2) >= 512 * 2 for o in r.reads):
                break
        matmuls_before.append(matmuls)
    assert matmuls_before == [4, 1], matmuls_before


_STREAMED = []  # per trace of _streamed_kernel: whether its plan was K-streamed


@nki.jit
def _streamed_kernel(a, b, contiguous):
    """out [M, N] = a [M, K] @ b [K, N] (a K-contiguous, the shape of the MLP backward's phase 2) with the budgets
    the caller forces, so that the plan is K-streamed in groups of two stationary panels; contiguous: MatmulPlan's
    contiguous_group."""
    M, N = a.shape[0], b.shape[1]
    out = nl.ndarray((M, N), dtype=nl.float32, buffer=nl.shared_hbm)
    plan = MatmulPlan([TensorDescriptor(a, k_axis=1)], [TensorDescriptor(b, k_axis=0)], M, N, _setup("mxfp8"),
                      MatmulConfig(m_tile=128, n_tile=512), CoreSplit(1, 0), StoreEpilogue(out, nl.float32),
                      contiguous_group=contiguous)
    _STREAMED.append(plan.stream != None)  # noqa: E711
    plan.step("all")
    return out


def test_contiguous_group_places_a_streamed_group_in_one_block(monkeypatch):
    """contiguous_group: a K-streamed group's stationary panels are slots of one PanelGroupBlock (TP1's phase 2,
    modeled 4.603 -> 4.572 ms) instead of one allocation each. M = 300 (m tiles 128, 128, 44: groups of 2 and 1),
    K = 1024 (2 K tiles), N = 600 (two n blocks): the matmuls read the stationary words from 2 allocations instead
    of 3, and the bits are the contract's either way."""
    from nkilib.core.matmul import tiling as tiling_module
    from nkilib.simulator.launcher import run_kernel

    for name in ("PANEL_CACHE_BUDGET_BYTES", "RESIDENT_OPERAND_BUDGET_BYTES", "STATIONARY_GROUP_BUDGET_BYTES"):
        monkeypatch.setattr(tiling_module, name, 1)
    monkeypatch.setattr(tiling_module, "STREAM_STATIONARY_BUDGET_BYTES", 2 * (2 * 128 * 4 + 128))  # two panels
    M, K, N = 300, 1024, 600
    a, b = randn(10, (M, K), BF16), randn(11, (K, N), BF16)
    want = contract_mm(a, b, "mxfp8", "float8_e4m3fn", "1x32")
    allocations = []
    for contiguous in (False, True):
        res = run_kernel(_streamed_kernel.fn, kwargs=dict(a=a, b=b, contiguous=contiguous), trace=True)
        assert _STREAMED[-1], "the plan must be K-streamed"
        assert_outputs_identical((res.outputs,), (want,), f"contiguous_group={contiguous}")
        allocations.append(len({o.storage_id for r in res.trace if r.instr == "nc_matmul_mx"
                                for o in r.reads if o.arg == "stationary"}))
    assert allocations == [3, 2], allocations


def test_streamed_group_moving_quads_share_a_ring_of_four_staging_tiles(monkeypatch):
    """A K-streamed group's moving K-tile quads stage through one ring of STREAM_STAGING_BUFFERS = 4 tiles (TP1's phase
    2, modeled 4.572 -> 4.567 / 4.762 -> 4.730 ms; 3 before). K = 2048 (4 K tiles: one quad per n block), N = 600 (two n
    blocks), M = 300 in groups of 2 and 1: each group stages 8 K tiles through 4 tiles, 8 in all (6 with a ring of 3);
    the bits are the contract's."""
    from nkilib.core.matmul import tiling as tiling_module
    from nkilib.simulator.launcher import run_kernel

    for name in ("PANEL_CACHE_BUDGET_BYTES", "RESIDENT_OPERAND_BUDGET_BYTES", "STATIONARY_GROUP_BUDGET_BYTES"):
        monkeypatch.setattr(tiling_module, name, 1)
    monkeypatch.setattr(tiling_module, "STREAM_STATIONARY_BUDGET_BYTES", 2 * (4 * 128 * 4 + 128))  # two panels
    M, K, N = 300, 2048, 600
    a, b = randn(12, (M, K), BF16), randn(13, (K, N), BF16)
    res = run_kernel(_streamed_kernel.fn, kwargs=dict(a=a, b=b, contiguous=True), trace=True)
    assert _STREAMED[-1], "the plan must be K-streamed"
    assert_outputs_identical((res.outputs,), (contract_mm(a, b, "mxfp8", "float8_e4m3fn", "1x32"),), "ring of 4")
    staging = {o.storage_id for r in res.trace if r.instr == "dma_copy" and any(i.name == "b" for i in r.reads)
               for o in r.writes if o.buffer == "sbuf"}
    assert len(staging) == 8, len(staging)


def _order(pairs):
    """A plan's tile order from (m0, n0) pairs, 128-row m tiles and 512-column n tiles."""
    return [((m0, 128), (n0, 512)) for m0, n0 in pairs]


def test_fence_after_first_panel_places_the_fence_on_its_last_tile():
    from types import SimpleNamespace
    from nkilib.core.matmul.overlap import place_fence_after_first_panel

    plan = SimpleNamespace(order=_order([(0, 0), (128, 0), (256, 0), (0, 512), (128, 512)]), fence_tile=None,
                           fenced_start=False, moving=[])
    place_fence_after_first_panel(plan)
    assert plan.fence_tile == 2


def test_fence_after_first_panel_refuses_a_plan_that_returns_to_its_first_panel():
    from types import SimpleNamespace
    from nkilib.core.matmul.overlap import place_fence_after_first_panel

    m_major = SimpleNamespace(order=_order([(0, 0), (0, 512), (128, 0), (128, 512)]), fence_tile=None,
                              fenced_start=False, moving=[])
    with pytest.raises(AssertionError, match=r"n-major plan .*tiles \[2\] back on the panel at n0=0 after tile 1"):
        place_fence_after_first_panel(m_major)
    assert m_major.fence_tile is None


def test_first_panel_once_tells_n_major_orders_from_those_that_return():
    """MatmulPlan.first_panel_once, the kernel's condition for fence_after_first_panel (round 40): an n-major order
    and one of a single moving panel take it; an m-major order (tile 2 back on n0 = 0) and a grouped n-major one (the
    second group of m blocks sweeps the panels again) do not."""
    from types import SimpleNamespace

    def once(pairs):
        return MatmulPlan.first_panel_once(SimpleNamespace(order=_order(pairs)))

    assert once([(0, 0), (128, 0), (0, 512), (128, 512)])
    assert once([(0, 0), (128, 0), (256, 0)])
    assert not once([(0, 0), (0, 512), (128, 0), (128, 512)])
    assert not once([(0, 0), (128, 0), (0, 512), (128, 512), (256, 0), (384, 0), (256, 512), (384, 512)])


@pytest.mark.parametrize("pairs, pieces", [([(0, 0), (128, 0), (0, 512)], 2), ([(0, 0), (0, 512), (128, 0)], 1)])
def test_piece_first_span_only_where_run_takes_a_first_span(pairs, pieces):
    """span_columns.piece_span_columns (MatmulPlan.piece_first_span) pieces a fenced start's first span only when
    run() takes one (tile_spans: the plan's first tiles on the first moving panel, here two): with the second tile on
    another panel (an m-major order) the first span is tile 0 alone and neither the plan nor its moving panel's first
    load changes (the old code set both to FENCED_COLUMN_PIECES = 2 columns pieces all the same)."""
    from types import SimpleNamespace
    from nkilib.core.matmul.span_columns import piece_span_columns

    source = SimpleNamespace(first_quantize_columns=1, first_next_words_from=-1)
    plan = SimpleNamespace(order=_order(pairs), fenced_start=True, first_span=5, switch_span=4, done=0,
                           span_columns=1, moving=[source])
    piece_span_columns(plan)
    assert (plan.span_columns, source.first_quantize_columns) == (pieces, pieces)
