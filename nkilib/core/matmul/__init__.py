"""The matmul layer shared by nkilib kernels (dense MLP backward, grouped MoE experts).

descriptor.py: operand descriptors (TensorDescriptor) and numeric setup (MatmulSetup);
panels.py: HBM operand -> SBUF panel (on-chip MX quantization along K, PE transposes) -> PSUM matmuls;
panel_builder.py: Panel, PanelPlacement (where a panel's K tiles go in SBUF) and the PanelBuilder that places them;
row_panels.py: panels from rows the caller fetches or already holds on chip, and on-chip panels to HBM and back;
sources.py: PanelSource / ResidentPanels (where a plan's panels come from), blocks and tile_order;
plan.py: MatmulPlan (tiling, core split, epilogue decided once; runnable in steps); sizing.py: fit_width, psum_buffers;
tiling.py: the tiling a MatmulPlan decides when it is built (residency, n tile, sources, tile order, K-interleaved spans);
overlap.py: what a MatmulPlan holds and first loads, for overlapping it with its neighbours (PhaseGraph);
core_split.py: CoreSplit (the LNC split, decided once per kernel); epilogue.py: StoreEpilogue (the default epilogue);
k_chunks.py: plan_matmul (a MatmulPlan, or a KChunkedPlan cut along K when neither long-K operand fits SBUF);
constants.py: tile geometry, accepted numeric choices, SBUF/PSUM budgets (usable_sbuf_bytes: the target's SBUF).
"""
from .descriptor import MatmulSetup, TensorDescriptor  # noqa: F401
from .panel_builder import Panel, PanelPlacement  # noqa: F401
from .panels import (PanelLoad, k_tiles, load_panel, matmul_panels,  # noqa: F401
                     panel_bytes_per_partition, panel_columns, panel_layout_hbm, single_k_tile, stage_ahead,
                     stage_row_block, store_k_tile)
from .row_panels import (PanelSlots, RowPanelByColumns, load_panel_tiles, panel_from_row_loader,  # noqa: F401
                         panel_from_rows, panel_tile_widths, panels_from_row_blocks, store_panel_tiles)
from .sources import PanelSource, ResidentPanels, blocks, tile_order  # noqa: F401
from .core_split import CoreSplit  # noqa: F401
from .epilogue import StoreEpilogue  # noqa: F401
from .constants import usable_sbuf_bytes  # noqa: F401
from .plan import MatmulPlan  # noqa: F401
from .sizing import fit_width, psum_buffers  # noqa: F401
from .k_chunks import KChunkedPlan, plan_matmul  # noqa: F401
