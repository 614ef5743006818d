"""The MoE backward kernel's shared context: shapes, HBM tensors, numeric setup and core split, with the row and
block addressing every pass uses (index tiles, run-time row flags, indirect gathers, views of the block-ordered HBM
scratch). Built and validated by the entry point in moe_bwd_mxfp8_kernel.py; the passes only read it.
"""
from __future__ import annotations

import nki.isa as nisa
import nki.language as nl

from ...core.kernel_helpers import kernel_assert, round_up
from ...core.matmul.constants import MX_PACK
from ...core.matmul.sources import blocks as _blocks
from .constants import MX_K_ALIGN, PARTITIONS, SLOT_PIECE_COLUMNS

__all__ = ["MoeContext"]


class MoeContext(nl.NKIObject):
    """Everything the passes share: shapes, HBM tensors (flattened views), numeric setup, core split.

    Dimensions:
        dy, x: [T, H]; weights: [T*k, 1] float32; ids2d, slots2d: [N, B] int32 (block-position order);
        offsets: [E+1] int32; gu_rows: W_gu stacked [E*2I, H]; down_rows: W_down stacked [E*H, I];
        checkpoints: [T*k, I] bf16 by slot, or [N, B, I] by block position (checkpoints_blocked), or None;
        weights_blocks: [N, B, 1] float32 by block position (weights_blocked) or None; d_weights: the d_topk_weights
        output, [T*k, 1] by slot, or [N, B, 1] by block position (weights_blocked);
        scratch d_gu [N, B, 2I], hs [N, B, I] bf16 (shared HBM; slot-interleaved where listed in `interleaved`:
        block_rows);
        d_gu_mx: None or pass B's stationary panels (words [N, B, n*128] x4, scales [N, B, s*128] uint8: n K tiles
        and s scale tiles of K=2I per 128-row chunk, partition p in the chunk's row p; set by the base kernel).
    """

    def __init__(self, T, k, E, H, I, B, N, setup, split, clamp, checkpoints_blocked=False, weights_blocked=False):
        self.T, self.k, self.E, self.H, self.I, self.B, self.N = T, k, E, H, I, B, N
        self.setup, self.split, self.clamp = setup, split, clamp
        self.checkpoints_blocked = checkpoints_blocked  # the entry point's checkpoint_layout == "block"
        self.weights_blocked = weights_blocked  # the entry point's weights_layout == "block"
        self.chunk_panels = None  # pass B's ChunkPanels where the base kernel makes them (moe_bwd_mxfp8_dx.py)
        self.split_panels = None  # pass B's panels made by the I split's pass A (moe_bwd_mxfp8_split_panels.py)
        self.interleaved = []  # block scratches stored slot-interleaved (block_rows; set by the I split: round 30a)
        # pass A's zeroing of a part-filled block's gathered dY / X rows and p: on GpSimd, which generates the gathers'
        # descriptors next, where VectorE bounds pass A (block-ordered checkpoints: round 16a); with checkpoints
        # gathered by slot GpSimd also generates their descriptors and bounds pass A instead, so the compiler's
        # choice stays
        self.padding_zero_engine = nisa.engine.gpsimd if checkpoints_blocked else nisa.engine.unknown
        self.staged_dy = set()  # experts whose pass A reads dY staged in dy_blocks (the kernel's dy_ahead)

    def choose_epilogue_engines(self, on_trn3):
        """Set pass A's SwiGLU epilogue engines and the bf16 narrowing of its clamps (the entry point calls it once).

        Args:
            on_trn3: the target is trn3 (ScalarE's min / max / comparisons and its 2x mode exist there only).
        """
        # Engines of pass A's SwiGLU epilogue (docs/moe.md section 10, round 4). Clamped on trn3: the clamps'
        # tensor_scalar ops on ScalarE (min/max/comparisons there are trn3 only, nki.isa.tensor_scalar page) and the
        # product dh * uc back on VectorE, so that GpSimd, which also generates the gathers' software-DGE
        # descriptors, keeps only dh * a and the masks' products. Otherwise round 2's choice: both dh products on
        # GpSimd. Every op is an exact fp32 compare / clamp or a single fp32 multiply: the bits do not depend on it.
        relieve = on_trn3 and (self.clamp.has_gate_clamp or self.clamp.has_up_clamp)
        self.clamp_engine = nisa.engine.scalar if relieve else nisa.engine.unknown
        self.d_gate_engine = nisa.engine.vector if relieve else nisa.engine.gpsimd
        # the gate's one-limit mask (GPT-OSS: gate_pre <= 7) compared inside d_gate's last product, one VectorE
        # scalar_tensor_tensor, instead of a ScalarE mask pass and a GpSimd product (docs/moe.md section 10, round 19a)
        self.gate_mask_in_product = relieve
        # the clamps and masks of the bf16 gate_pre / up written as bf16 (exact: GPT-OSS's limits are bf16 values,
        # masks 0 / 1), so ScalarE's tensor_scalar passes run in its 2x mode, and up's mask (one tensor_scalar since
        # round 14e: |u| <= 7 on GPT-OSS) with the clamps on ScalarE: VectorE, which paced pass A, loses a pass per I
        # tile (gpt6 3591.0 / 3944.7 -> 3492.2 / 3854.6 us; up's bf16 mask left on VectorE, its 4x mode: 3492.8 /
        # 3923.5 us, that mode shares the SBUF bus with GpSimd; docs/moe.md section 10, rounds 14e and 32a)
        self.narrow_clamps = relieve
        self.up_mask_engine = None

    def allocate_hbm(self, wg_dtype, gate_up_bias_grad):
        """Allocate the passes' shared-HBM scratch and the kernel's outputs on the context.

        Dimensions:
            scratch d_gu [N, B, 2I], hs [N, B, I], dy_blocks / x_blocks [N, B, H] bf16, d_w_partial [N, B, 1] fp32;
            outputs dx [T, H] bf16, d_weights [T, k] (or [N*B] with weights_blocked) fp32, d_gate_up_weight
            [E, 2I, H] and d_down_weight [E, H, I] in wg_dtype, d_gate_up_bias [E, 2I] fp32 or None.

        Returns:
            (dx, d_weights) as the entry point returns them (self.d_weights is the [N, B, 1] or [T*k, 1] view).
        """
        T, k, E, H, I, B, N = self.T, self.k, self.E, self.H, self.I, self.B, self.N
        hbm = nl.shared_hbm
        self.d_gu = nl.ndarray((N, B, 2 * I), dtype=nl.bfloat16, buffer=hbm, name="moe_bwd_d_gate_up")
        self.hs = nl.ndarray((N, B, I), dtype=nl.bfloat16, buffer=hbm, name="moe_bwd_weighted_inter")
        self.dy_blocks = nl.ndarray((N, B, H), dtype=nl.bfloat16, buffer=hbm, name="moe_bwd_dy_blocks")
        self.x_blocks = nl.ndarray((N, B, H), dtype=nl.bfloat16, buffer=hbm, name="moe_bwd_x_blocks")
        self.d_w_partial = nl.ndarray((N, B, 1), dtype=nl.float32, buffer=hbm,
                                      name="moe_bwd_routing_grad_partial")  # pass A's fold across resident I groups
        dx = nl.ndarray((T, H), dtype=nl.bfloat16, buffer=hbm, name="hidden_states_grad")
        d_weights = nl.ndarray((N * B,) if self.weights_blocked else (T, k), dtype=nl.float32, buffer=hbm,
                               name="topk_weights_grad")
        self.dx = dx
        # MoeContext.store_pair_grads writes either: [N, B, 1] by plain DMA, [T*k, 1] by slot
        self.d_weights = d_weights.reshape((N, B, 1) if self.weights_blocked else (T * k, 1))
        self.d_gate_up_weight = nl.ndarray((E, 2 * I, H), dtype=wg_dtype, buffer=hbm, name="gate_up_weight_grad")
        self.d_down_weight = nl.ndarray((E, H, I), dtype=wg_dtype, buffer=hbm, name="down_weight_grad")
        self.d_gate_up_bias = nl.ndarray((E, 2 * I), dtype=nl.float32, buffer=hbm,
                                         name="gate_up_bias_grad") if gate_up_bias_grad else None
        return dx, d_weights

    def f_pad(self, rows):
        """Stationary width of `rows` rows (nc_matmul_mx needs an even M)."""
        return rows + (rows % 2 if self.setup.is_mx else 0)

    def k_width(self, k_size):
        """Columns of a natural [rows, K] tile: K padded to the MX K alignment (zero beyond K)."""
        return round_up(k_size, MX_K_ALIGN) if self.setup.is_mx else k_size

    def positions(self, table, i, first, step, count, dst=None):
        """SBUF [count, 1] int32 index tile: table[i, first + step*r] (token ids or slots of block i; first may
        reach into the blocks after i), written into dst when given."""
        idx = nl.ndarray((count, 1), dtype=nl.int32, buffer=nl.sbuf) if dst == None else dst  # noqa: E711
        nisa.dma_copy(dst=idx, src=table.ap([[step, count], [1, 1]], offset=first, scalar_offset=i, indirect_dim=0))
        return idx

    def row_flags(self, i, step, count):
        """SBUF [count, 1] int32: 1 where position step*r of block i holds a routed pair, else 0 (a block's
        padding is its tail, so a row range starting at a padding position holds only padding). min(T - id, 1):
        ids are at most the sentinel T; integers < 2^24, exact in VectorE's fp32 arithmetic."""
        flags = self.positions(self.ids2d, i, 0, step, count)
        nisa.tensor_scalar(dst=flags, data=flags, op0=nl.multiply, operand0=-1.0, op1=nl.add, operand1=float(self.T))
        nisa.tensor_scalar(dst=flags, data=flags, op0=nl.minimum, operand0=1.0)
        return flags

    def filled_units(self, i, unit, count):
        """SBUF [1, count] int32: column q is 1 when block i's routed pairs fill exactly q + 1 of its leading
        `unit`-row units (its positions unit*q .. hold a pair and unit*(q + 1) .. only padding), else 0 (a block's
        padding is its tail and its first position always holds a pair, so exactly one column is 1). The flags of
        positions unit*q as row_flags', on one partition, then each minus the next. Integers < 2^24, exact in
        VectorE's fp32 arithmetic."""
        flags = nl.ndarray((1, count), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=flags, src=self.ids2d.ap([[count * unit, 1], [unit, count]], offset=0, scalar_offset=i,
                                                    indirect_dim=0))
        nisa.tensor_scalar(dst=flags, data=flags, op0=nl.multiply, operand0=-1.0, op1=nl.add, operand1=float(self.T))
        nisa.tensor_scalar(dst=flags, data=flags, op0=nl.minimum, operand0=1.0)
        exact = nl.ndarray((1, count), dtype=nl.int32, buffer=nl.sbuf)
        if count > 1:
            nisa.tensor_tensor(dst=exact[:, 0:count - 1], data1=flags[:, 0:count - 1], data2=flags[:, 1:count],
                               op=nl.subtract)
        nisa.tensor_copy(dst=exact[:, count - 1:count], src=flags[:, count - 1:count])
        return exact

    @staticmethod
    def if_flag(flags, r, body, complement=False):
        """body() when flags[r] is 1 (complement: when it is 0), a 0/1-trip run-time loop."""
        flag = flags[r:r + 1, 0:1]
        if complement:
            flag = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=flag, data=flags[r:r + 1, 0:1], op0=nl.multiply, operand0=-1.0, op1=nl.add,
                               operand1=1.0)
        reg = nisa.register_alloc()
        nisa.register_load(reg, flag)
        nl.fori_loop(0, reg, lambda _: body())

    def gather(self, dst, src2d, idx, f0, f_size):
        """dst [count, f_size] <- src2d[idx[r], f0:f0+f_size] by indirect DMA (padding sentinels skipped:
        those rows of dst keep their bytes, so callers zero dst first)."""
        row = src2d.shape[1]
        view = src2d.ap([[row, idx.shape[0]], [1, f_size]], offset=f0, vector_offset=idx, indirect_dim=0)
        nisa.dma_copy(dst=dst, src=view, oob_mode=nisa.oob_mode.skip)

    def checkpoint_rows(self, dst, ckpt, i, first, m, slots, f0, width, full):
        """dst [m, width] <- columns [f0, f0 + width) of a checkpoint's rows at positions first..first+m of block i
        (first may reach into the next block). Block layout ([N, B, I], padding rows zero by the entry point's
        contract): one plain DMA, no descriptor per row. Slot layout ([T*k, I]): a gather by slot (software DGE, one
        descriptor per row on GpSimd), dst zeroed first unless the rows are known to hold no padding (a skipped
        sentinel leaves dst's bytes)."""
        if self.checkpoints_blocked:
            nisa.dma_copy(dst=dst, src=self.block_rows(ckpt, i, first, m, 1, f0, width))
            return
        if not full:
            nisa.memset(dst=dst, value=0.0)
        self.gather(dst, ckpt, slots, f0, width)

    def pair_weights(self, dst, i, first, m, slots, full):
        """dst [m, 1] float32 <- the routing weights p of positions first..first+m of block i (first may reach into
        the next block). Block layout ([N, B, 1], padding +0 by the entry point's contract): one plain DMA, no
        descriptor per row. Slot layout ([T*k, 1]): a gather by slot (software DGE, one descriptor per row on
        GpSimd), dst zeroed first unless the rows hold no padding."""
        if self.weights_blocked:
            nisa.dma_copy(dst=dst, src=self.block_rows(self.weights_blocks, i, first, m, 1, 0, 1))
            return
        if not full:  # padding rows' p = 0 (a full block gathers every row)
            nisa.memset(dst=dst, value=0.0, engine=self.padding_zero_engine)
        self.gather(dst, self.weights, slots, 0, 1)

    def store_pair_grads(self, src, i, r0, m, slots):
        """d_topk_weights of positions r0..r0+m of block i <- src [m, 1] float32. Block layout: one plain DMA to the
        [N, B, 1] output (padding rows get what the kernel computed there; the caller reads routed positions only).
        Slot layout: a scatter by slot (software DGE; padding sentinels skipped)."""
        if self.weights_blocked:
            nisa.dma_copy(dst=self.block_rows(self.d_weights, i, r0, m, 1, 0, 1), src=src)
            return
        out = self.d_weights.ap([[1, m], [1, 1]], offset=0, vector_offset=slots, indirect_dim=0)
        nisa.dma_copy(dst=out, src=src, oob_mode=nisa.oob_mode.skip)

    def zero_pair_grads(self, i, r0, m):
        """Block-ordered d_topk_weights of positions r0..r0+m of block i <- +0.0 (rows the kernel computes nothing for:
        a chunk of padding, an unused block), so that every entry of that output is written."""
        zeros = nl.ndarray((m, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=zeros, value=0.0)
        nisa.dma_copy(dst=self.block_rows(self.d_weights, i, r0, m, 1, 0, 1), src=zeros)

    def gather_to_blocks(self, scratch, i, r0, m, src2d, idx):
        """Rows r0..r0+m of block i of a [N, B, F] scratch <- src2d[idx[r], :] by one HBM -> HBM indirect DMA (nothing
        passes through SBUF: the DMA engines move the bytes once instead of in and out). A skipped padding sentinel
        leaves its scratch row unwritten: rows with padding are zeroed first (zero_block_rows)."""
        row = src2d.shape[1]
        view = src2d.ap([[row, m], [1, row]], offset=0, vector_offset=idx, indirect_dim=0)
        nisa.dma_copy(dst=self.block_rows(scratch, i, r0, m, 1, 0, row), src=view, oob_mode=nisa.oob_mode.skip)

    def zero_block_rows(self, scratch, i, r0, m, f_lo, f_hi):
        """Columns [f_lo, f_hi) of rows r0..r0+m of block i of a [N, B, F] scratch <- +0.0, stored from the zeroed
        SBUF tile ctx.zeros (plain DMAs, ZERO_ROWS_WIDTH columns each; a slot-interleaved scratch by its pieces)."""
        for c0, csz in self.row_pieces(scratch, f_lo, f_hi - f_lo):
            for f0, fsz in _blocks(c0, c0 + csz, self.zeros.shape[1]):
                nisa.dma_copy(dst=self.block_rows(scratch, i, r0, m, 1, f0, fsz), src=self.zeros[:m, :fsz])

    def block_tiles(self, scratch, i, r0, tiles, base=0):
        """View [128, tiles, F / tiles] of rows r0..r0+128 of block base + i of a [N', B, F] scratch: one stored panel's
        allocation (store_panel_tiles; pass B's d_gate_up panels, partition p of a chunk's panel in row r0 + p).
        base: a static block offset (a scratch of one [N, B, F] range per core: ChunkPanels)."""
        F = scratch.shape[2]
        return scratch.ap([[F, PARTITIONS], [F // tiles, tiles], [1, F // tiles]],
                          offset=(base * scratch.shape[1] + r0) * F, scalar_offset=i, indirect_dim=0)

    def block_rows(self, scratch, i, r0, count, step, f0, f_size):
        """View of rows r0, r0+step, ... (count) of block i of a [N, B, F] scratch, columns [f0, f0+f_size)."""
        F = scratch.shape[2]
        if self.is_interleaved(scratch):
            return self._interleaved_rows(scratch, i, r0, count, step, f0, f_size)
        return scratch.ap([[step * F, count], [1, f_size]], offset=r0 * F + f0, scalar_offset=i, indirect_dim=0)

    def is_interleaved(self, scratch) -> bool:
        """Whether `scratch` is stored slot-interleaved (self.interleaved)."""
        return any(scratch is s for s in self.interleaved)

    def slot_tile(self, scratch, i, k0, partitions, f0, f_size):
        """View [partitions, 4, f_size] of a slot-interleaved scratch: rows k0 + 4p + j of block i (the 1x32 scheme's
        K tile from row k0, slot j of partition p), columns [f0, f0 + f_size): per partition one contiguous run of
        4 x f_size where the columns are one piece (else runs of SLOT_PIECE_COLUMNS)."""
        kernel_assert(k0 % MX_PACK == 0, f"a slot tile starts at a multiple of {MX_PACK} rows, got k0={k0}")
        F, W = scratch.shape[2], SLOT_PIECE_COLUMNS
        base, cols = self._piece_columns(f0, f_size)
        return scratch.ap([[MX_PACK * F, partitions], [W, MX_PACK]] + cols, offset=k0 * F + base, scalar_offset=i,
                          indirect_dim=0)

    def _piece_columns(self, f0, f_size):
        """(offset, column pattern) of columns [f0, f0 + f_size) of a slot-interleaved scratch's row 4a: inside one
        piece, or whole pieces."""
        W = SLOT_PIECE_COLUMNS
        piece, c = f0 // W, f0 % W
        kernel_assert(c + f_size <= W or (c == 0 and f_size % W == 0),
                      f"slot-interleaved scratch columns [{f0}, {f0 + f_size}) must lie in one {W}-column piece or "
                      "cover whole pieces")
        cols = [[1, f_size]] if c + f_size <= W else [[MX_PACK * W, f_size // W], [1, W]]
        return piece * MX_PACK * W + c, cols

    def _interleaved_rows(self, scratch, i, r0, count, step, f0, f_size):
        """block_rows of a slot-interleaved scratch: [N, B / 4, F / W, 4, W] in the [N, B, F] allocation (W =
        SLOT_PIECE_COLUMNS), row r's columns c at (r // 4, c // W, r % 4, c % W): the 4 rows of a partition of the
        1x32 scheme's K tile are one run per piece. Rows r0, r0 + 4, ... (one slot) or r0.. r0 + count (whole groups
        of 4 rows)."""
        F, W = scratch.shape[2], SLOT_PIECE_COLUMNS
        base, cols = self._piece_columns(f0, f_size)
        offset = (r0 // MX_PACK) * MX_PACK * F + (r0 % MX_PACK) * W + base
        if step == MX_PACK:
            rows = [[MX_PACK * F, count]]
        else:
            kernel_assert(step == 1 and r0 % MX_PACK == 0 and count % MX_PACK == 0,
                          f"slot-interleaved scratch rows are read one slot (step {MX_PACK}) or whole groups of "
                          f"{MX_PACK} (step 1), got r0={r0}, count={count}, step={step}")
            rows = [[MX_PACK * F, count // MX_PACK], [W, MX_PACK]]
        return scratch.ap(rows + cols, offset=offset, scalar_offset=i, indirect_dim=0)

    def row_pieces(self, scratch, f0, f_size):
        """[(c0, width)]: columns [f0, f0 + f_size) cut where block_rows can view them in one (a slot-interleaved
        scratch's pieces; one range otherwise)."""
        if not self.is_interleaved(scratch):
            return [(f0, f_size)]
        W, out, c = SLOT_PIECE_COLUMNS, [], f0
        while c < f0 + f_size:
            end = min(f0 + f_size, (c // W + 1) * W)
            out.append((c, end - c))
            c = end
        return out
