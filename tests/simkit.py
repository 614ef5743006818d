"""Test helpers shared by all test files (import as `from simkit import ...`)."""
from __future__ import annotations

import ml_dtypes
import numpy as np

import nki

BF16 = ml_dtypes.bfloat16


def simulate(kernel, lnc=1, **inputs):
    """Run a kernel the official way: nki.simulate(kernel)[lnc](**inputs)."""
    return nki.simulate(kernel)[lnc](**inputs)


def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def randn(seed: int, shape, dtype=np.float32, scale=1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32).astype(dtype)


def sbuf_load(src, dtype=None):
    """Inside a kernel: DMA an HBM tensor [P, F...] into a new SBUF tile (dtype converts via the DMA)."""
    import nki.isa as nisa
    import nki.language as nl

    tile = nl.ndarray(src.shape, dtype or src.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=src)
    return tile


def hbm_store(tile, dtype=None):
    """Inside a kernel: DMA an SBUF tile into a new shared_hbm output tensor and return it."""
    import nki.isa as nisa
    import nki.language as nl

    out = nl.ndarray(tile.shape, dtype or tile.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=tile)
    return out


def matmul_panels_to_hbm(stationary, moving, setup, M: int, N: int):
    """Inside a kernel: out [M, N] fp32 = stationaryᵀ @ moving (nkilib.core.matmul.matmul_panels into PSUM),
    evicted to SBUF and stored to a new shared_hbm tensor, which is returned."""
    import nki.isa as nisa
    import nki.language as nl
    from nkilib.core.matmul import matmul_panels
    from nkilib.core.matmul.constants import PARTITIONS

    acc = nl.ndarray((PARTITIONS, N), dtype=nl.float32, buffer=nl.psum)
    matmul_panels(acc[:M, :], stationary, moving, setup)  # K=panels' K, M=M, N=N
    res = nl.ndarray((PARTITIONS, N), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=res[:M, :], src=acc[:M, :])
    out = nl.ndarray((M, N), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=res[:M, :])
    return out


def bits(a: np.ndarray) -> np.ndarray:
    """Raw bit pattern of an array (unsigned int of the same itemsize), for bit-exact comparisons."""
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


# ---- bit equality (the one set of helpers every test uses; torch tensors are compared via to_numpy) ----
def _as_array(a) -> np.ndarray:
    return to_numpy(a) if hasattr(a, "detach") else np.asarray(a)


def bits_equal(a, b) -> bool:
    """Same dtype, shape and bit pattern (numpy arrays or torch tensors)."""
    a, b = _as_array(a), _as_array(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(bits(a), bits(b))


def count_bits_differ(outs_a, outs_b) -> int:
    """How many elements differ in bit pattern across two tuples of same-shaped outputs."""
    return sum(int(np.count_nonzero(bits(_as_array(x)) != bits(_as_array(y)))) for x, y in zip(outs_a, outs_b))


def assert_bits_equal(got, want, what: str = "", nan_equal: bool = False) -> None:
    """Bit equality of two arrays; nan_equal: compare float32 values, NaNs only at the same positions
    (any payload)."""
    got, want = _as_array(got), _as_array(want)
    if not nan_equal:
        assert got.dtype == want.dtype and got.shape == want.shape, \
            f"{what}: {got.dtype}{got.shape} vs {want.dtype}{want.shape}"
        diff = int(np.count_nonzero(bits(got) != bits(want)))
        assert diff == 0, f"{what}: {diff} of {got.size} elements differ"
        return
    got32, want32 = got.astype(np.float32), want.astype(np.float32)
    nan = np.isnan(want32)
    np.testing.assert_array_equal(np.isnan(got32), nan, err_msg=f"{what}: NaN positions")
    diff = int(np.count_nonzero(bits(got32[~nan]) != bits(want32[~nan])))
    assert diff == 0, f"{what}: {diff} values differ"


def in_kernel(body):
    """Run `body()` inside a simulated LNC1 launch (for view/allocation checks); returns its result as is."""
    result = []

    def kernel():
        result.append(body())

    nki.simulate(kernel)()
    return result[0]


def run_tiles(body, inputs=(), outputs=(), psum_inputs=(), trace=False):
    """Run `body(*in_tiles, *out_tiles)` inside an LNC1 kernel and return the output arrays.

    Each input array is DMA'd into an SBUF tile (then copied into a PSUM tile if its index is in
    `psum_inputs`). `outputs` are (shape, dtype) or (shape, dtype, "psum") specs of fresh tiles that
    `body` writes; they go back to shared_hbm (PSUM via an SBUF tensor_copy) and are returned as a
    tuple of arrays. With trace=True returns (outputs, trace records of `body`'s instructions only).
    """
    import nki.isa as nisa
    import nki.language as nl
    from nkilib.simulator import runtime
    from nkilib.simulator.launcher import run_kernel

    span = {}

    def kernel(ins):
        tiles = []
        for i, t in enumerate(ins):
            tile = sbuf_load(t)
            if i in psum_inputs:
                ps = nl.ndarray(t.shape, t.dtype, buffer=nl.psum)
                nisa.tensor_copy(dst=ps, src=tile)
                tile = ps
            tiles.append(tile)
        outs = [nl.ndarray(s[0], s[1], buffer=nl.psum if len(s) > 2 and s[2] == "psum" else nl.sbuf)
                for s in outputs]
        ctx = runtime.current()
        span["start"] = len(ctx.trace or ())
        body(*tiles, *outs)
        span["end"] = len(ctx.trace or ())
        results = []
        for o in outs:
            if o.buffer == nl.psum:
                sb = nl.ndarray(o.shape, o.dtype, buffer=nl.sbuf)
                nisa.tensor_copy(dst=sb, src=o)
                o = sb
            results.append(hbm_store(o))
        return tuple(results)

    res = run_kernel(kernel, args=(tuple(inputs),), trace=trace)
    if trace:
        return res.outputs, res.trace[span["start"]:span["end"]]
    return res.outputs


def oversized_tile(shape, dtype, buffer="sbuf"):
    """Inside a kernel: an initialised on-chip tile with more partitions than the hardware has, built
    behind nl.ndarray's back (which rejects it) so tests can check that instructions reject it too."""
    from nkilib.simulator import runtime
    from nkilib.simulator.dtypes import as_nki_dtype
    from nkilib.simulator.storage import Storage
    from nkilib.simulator.tensor import NkiTensor

    ctx = runtime.current()
    dt = as_nki_dtype(dtype)
    init = np.zeros(shape, dt.storage_np(ctx.settings.precise_fp))
    st = Storage(shape, dt, buffer, "oversized", ctx.settings.precise_fp, ctx.numerics, ctx.program_id, init=init)
    strides = [int(np.prod(shape[i + 1:])) for i in range(len(shape))]
    return NkiTensor(st, dt, shape, strides, 0)


# ---- MLP backward kernel (tests/kernels): inputs, runs, comparisons against reference.py ----
MLP_OPERANDS = ("output_grad", "hidden_states", "down_proj_weight", "gate_up_weights")
MLP_CHECKPOINTS = ("gate_pre", "gate_act", "up", "intermediate")
# kernel options that have a reference counterpart (the rest only change scheduling / layout)
_MLP_REF_OPTIONS = ("clamp_limits", "quant_scheme", "matmul_precision", "weight_grad_dtype")


def _record_calls(monkeypatch, owner, name, before=None, after=None) -> None:
    """Replace owner.name by a wrapper that calls before(*args, **kwargs), the original with the same arguments, then
    after(result, *args, **kwargs), and returns the result (before: events in the order the calls begin, an outer
    call's before the calls it makes); monkeypatch restores owner.name after the test."""
    original = getattr(owner, name)

    def recorder(*args, **kwargs):
        if before is not None:
            before(*args, **kwargs)
        result = original(*args, **kwargs)
        if after is not None:
            after(result, *args, **kwargs)
        return result

    monkeypatch.setattr(owner, name, recorder)


def spy(monkeypatch, owner, name, key=lambda *args, **kwargs: args, into=None) -> list:
    """Record every call of owner.name (a module's function or a class's method) and call through to it.

    Each call appends key(*args, **kwargs) (its arguments as the caller passed them; a method's first is self) to the
    returned list, `into` when given (several spies filling one list in call order), then returns the original's
    result for the same arguments; a key of None records nothing (a filter). monkeypatch restores owner.name after
    the test.
    """
    calls = [] if into is None else into

    def record(*args, **kwargs):
        event = key(*args, **kwargs)
        if event is not None:
            calls.append(event)

    _record_calls(monkeypatch, owner, name, before=record)
    return calls


def count_calls(monkeypatch, owner, names) -> dict:
    """Count the calls of owner.name for each name in names, calling through (as spy does).

    Returns the dict name -> calls so far, updated as the calls run (compare it whole: `counts == {...}`).
    """
    counts = dict.fromkeys(names, 0)
    for name in names:
        def bump(*args, _name=name, **kwargs):
            counts[_name] += 1

        _record_calls(monkeypatch, owner, name, before=bump)
    return counts


def spy_per_core(monkeypatch, owner, name, core, key=lambda *args, **kwargs: args, into=None) -> dict:
    """spy with one list per LNC core: each call appends key(*args, **kwargs) to events[core(*args, **kwargs)].

    The kernel traces once per core, so each list holds that core's calls in its program order. core names the call's
    core from its arguments (core_of_self, core_of_ctx or a lambda). Returns the dict
    core -> [key], `into` when given (several spies interleaving their events per core); a key of None records
    nothing.
    """
    events = {} if into is None else into

    def record(*args, **kwargs):
        event = key(*args, **kwargs)
        if event is not None:
            events.setdefault(core(*args, **kwargs), []).append(event)

    _record_calls(monkeypatch, owner, name, before=record)
    return events


def spy_results(monkeypatch, owner, name, key) -> dict:
    """Record what each call of owner.name returns: results[key(*args, **kwargs)] = its result (the last call's for a
    key), for a test that checks a later call takes that very object. Calls through like spy."""
    results = {}

    def record(result, *args, **kwargs):
        results[key(*args, **kwargs)] = result

    _record_calls(monkeypatch, owner, name, after=record)
    return results


def spy_returns(monkeypatch, owner, name, key=lambda result, *args, **kwargs: result, into=None) -> list:
    """Record what each call of owner.name returns: after each call, appends key(result, *args, **kwargs) (its result,
    then its arguments as the caller passed them) to the returned list, `into` when given; a key of None records
    nothing (a filter). For a test that checks what a rule decided, or an object's state after a method ran. Calls
    through like spy.
    """
    calls = [] if into is None else into

    def record(result, *args, **kwargs):
        event = key(result, *args, **kwargs)
        if event is not None:
            calls.append(event)

    _record_calls(monkeypatch, owner, name, after=record)
    return calls


def mlp_inputs(S: int, H: int, I: int, seed: int, kind: str = "normal") -> dict:
    """Seeded bf16 inputs of the MLP backward: dY, X [S, H], W_down [H, I], W_gu [2I, H].

    kind="normal": unit-normal activations, weights scaled by 1/sqrt(fan_in) (so the checkpoints are
    O(1) and clamps at +-0.5 are hit). kind="pow2": +-2**e with e uniform in [-12, 12]: a dynamic range
    (2**24) wider than an fp8 group can hold, so which elements share an MX group (the quant scheme) matters.
    """
    r = np.random.default_rng(seed)
    shapes = {"output_grad": (S, H), "hidden_states": (S, H), "down_proj_weight": (H, I),
              "gate_up_weights": (2 * I, H)}
    fan_in = {"output_grad": 1, "hidden_states": 1, "down_proj_weight": I, "gate_up_weights": H}
    out = {}
    for name in MLP_OPERANDS:
        shape = shapes[name]
        if kind == "normal":
            v = r.standard_normal(shape) / np.sqrt(fan_in[name])
        elif kind == "pow2":
            v = r.choice([-1.0, 1.0], shape) * np.exp2(r.integers(-12, 13, shape))
        else:
            raise ValueError(f"kind must be 'normal' or 'pow2', got {kind!r}")
        out[name] = v.astype(np.float32).astype(BF16)
    return out


def run_mlp(inputs: dict, lnc: int = 1, trace: bool = False, **options):
    """mlp_backward_mxfp8_nki on the simulator: (hidden_states_grad, gate_up_weight_grad, down_proj_weight_grad).

    With trace=True returns the launcher's RunResult instead (outputs plus the per-program instruction trace).
    """
    from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import mlp_backward_mxfp8_nki

    if trace:
        from nkilib.simulator.launcher import run_kernel

        return run_kernel(mlp_backward_mxfp8_nki.fn, kwargs={**inputs, **options}, lnc=lnc, grid_ndim=1, trace=True)
    return simulate(mlp_backward_mxfp8_nki, lnc, **inputs, **options)


def mlp_reference(inputs: dict, mode: str = "mx_exact", **options):
    """reference.mlp_backward_reference for the bf16 tensors of `inputs` and the kernel options.

    Translates the kernel's option names (fp8_x4_dtype -> fp8_dtype); options without a numeric meaning
    (matmul_config, use_scale_packing, run_with_lnc2, spill_reload) are ignored. The default
    matmul_precision is the trn3 default "mxfp8".
    """
    from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8.reference import mlp_backward_reference

    kw = {k: inputs[k] for k in MLP_OPERANDS + MLP_CHECKPOINTS if inputs.get(k) is not None}
    kw.update({k: options[k] for k in _MLP_REF_OPTIONS if options.get(k) is not None})
    if "fp8_x4_dtype" in options:
        kw["fp8_dtype"] = str(options["fp8_x4_dtype"])  # the reference accepts the _x4 spellings
    return mlp_backward_reference(**kw, mode=mode)


def mlp_checkpoints(inputs: dict, **options) -> dict:
    """The four checkpoints exactly as phase 0 recomputes them (reference_phase0_recompute, mx_exact)."""
    from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8.reference import reference_phase0_recompute

    kw = {k: options[k] for k in ("clamp_limits", "quant_scheme", "matmul_precision") if options.get(k) is not None}
    if "fp8_x4_dtype" in options:
        kw["fp8_dtype"] = str(options["fp8_x4_dtype"])
    return reference_phase0_recompute(inputs["hidden_states"], inputs["gate_up_weights"], **kw)._asdict()


def mlp_inputs_with_checkpoints(S: int, H: int, I: int, seed: int, kind: str = "normal", **options) -> dict:
    """mlp_inputs(S, H, I, seed, kind) with their four checkpoints added (mlp_checkpoints(inputs, **options): the
    options that change them, e.g. matmul_precision, clamp_limits, quant_scheme), so phase 1 does not recompute them.
    """
    inputs = mlp_inputs(S, H, I, seed=seed, kind=kind)
    return {**inputs, **mlp_checkpoints(inputs, **options)}


def assert_mlp_bit_exact(out, inputs: dict, **options) -> None:
    """The kernel's outputs `out` (run on `inputs` with the kernel options) equal mx_exact bit for bit."""
    measured = assert_matches_mx_exact(out, mlp_reference(inputs, **options))
    assert all(m == (0, 0.0) for m in measured), measured


def assert_mlp_bit_exact_on_lnc1_and_lnc2(inputs: dict, out2, **options) -> None:
    """LNC2's outputs `out2` (run on `inputs` with the kernel options) equal mx_exact bit for bit, and LNC1's run of the
    same inputs and options gives the same bits. LNC1 runs last, so a spy's records made before this call are LNC2's.
    """
    assert_mlp_bit_exact(out2, inputs, **options)
    assert_outputs_identical(run_mlp(inputs, lnc=1, **options), out2, "LNC1 vs LNC2")


def assert_mlp_traced_bit_exact_on_lnc1_and_lnc2(inputs: dict, check_trace=None, phases: bool = False,
                                                 **options) -> list:
    """Run the kernel traced on LNC1, then on LNC2, call check_trace(trace, lnc) on each run's trace (when given), and
    assert both runs' outputs equal mx_exact bit for bit and each other.

    phases: the trace records are labelled by phase (attrs["phase"]: "phase0+1", "phase2", ... as the cost study
    names them, nkilib.examples.mlp_backward_cost.PHASES). Returns [(lnc, RunResult)] of the two runs.
    """
    import contextlib

    from nkilib.examples.mlp_backward_cost import PHASES
    from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import mlp_bwd_mxfp8_kernel as kernel_module
    from nkilib.simulator.trace import label_phases

    runs = []
    for lnc in (1, 2):
        with label_phases(kernel_module, PHASES) if phases else contextlib.nullcontext():
            res = run_mlp(inputs, lnc=lnc, trace=True, **options)
        if check_trace is not None:
            check_trace(res.trace, lnc)
        assert_mlp_bit_exact(res.outputs, inputs, **options)
        runs.append((lnc, res))
    assert_outputs_identical(runs[0][1].outputs, runs[1][1].outputs, "LNC1 vs LNC2")
    return runs


def mlp_torch_oracle(inputs: dict, clamp_limits=None):
    """The exact gradients by torch float64 autograd of the clamped SwiGLU forward, written here from the
    math (Y = (silu(clamp(X W_gate^T)) * clamp(X W_up^T)) W_down^T, or GPT-OSS's gated function for
    clamp_limits.activation "gpt_oss", loss = sum(Y * dY)): an oracle that
    shares no code with reference.py or nkilib.mx. torch is used only in tests.

    Returns (dX [S, H], dW_gu [2I, H], dW_down [H, I]) float64 numpy arrays.
    """
    import torch

    def t64(name, grad):
        return torch.tensor(np.asarray(inputs[name], np.float64), dtype=torch.float64, requires_grad=grad)

    x, w_gu, w_down = t64("hidden_states", True), t64("gate_up_weights", True), t64("down_proj_weight", True)
    dy = t64("output_grad", False)
    n_i = w_down.shape[1]
    lim = clamp_limits
    gate, up = x @ w_gu[:n_i].T, x @ w_gu[n_i:].T
    if lim is not None:
        gate = torch.clamp(gate, lim.non_linear_lower, lim.non_linear_upper) if lim.has_gate_clamp else gate
        up = torch.clamp(up, lim.linear_lower, lim.linear_upper) if lim.has_up_clamp else up
    if getattr(lim, "activation", "silu") == "gpt_oss":  # GPT-OSS: gate * sigmoid(1.702 gate) * (up + 1)
        y = (gate * torch.sigmoid(1.702 * gate) * (up + 1)) @ w_down.T
    else:
        y = (torch.nn.functional.silu(gate) * up) @ w_down.T
    (y * dy).sum().backward()
    return tuple(t.grad.numpy() for t in (x, w_gu, w_down))


def rel_fro(result, ideal) -> float:
    """||result - ideal||_F / ||ideal||_F in float64."""
    r, i = np.asarray(result, np.float64), np.asarray(ideal, np.float64)
    return float(np.linalg.norm((r - i).ravel()) / np.linalg.norm(i.ravel()))


def assert_outputs_identical(a, b, what: str = "") -> None:
    """Bit equality of two output tuples (dtypes too; NaNs compare by bit pattern)."""
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        assert_bits_equal(x, y, f"{what} output {i}")


def unit_stride(op) -> bool:
    """Whether a traced on-chip operand's free dims are one unit-stride run (row-major, no gaps)."""
    expect = op.storage_itemsize
    for n, s in reversed(list(zip(op.shape[1:], op.strides[1:]))):
        if n != 1 and s != expect:
            return False
        expect *= n
    return True


def touches(record, name: str, side: str = "reads") -> bool:
    """Whether a trace record reads (side "reads") or writes ("writes") the tensor named `name`."""
    return any(getattr(t, "name", "") == name for t in getattr(record, side))


def sbuf_tiles_loaded(records, reads) -> set:
    """The storage ids of the SBUF tiles written by the dma_copy records among `records` for which reads(record)
    holds (for instance `lambda r: touches(r, "down_weight")`): which tiles a load's staging ring holds."""
    return {w.storage_id for r in records if r.instr == "dma_copy" and reads(r) for w in r.writes
            if w.buffer == "sbuf"}


def reads_before_writes(trace, read_name: str, write_name: str, program: int = 0) -> list:
    """For each record of `program` that writes `write_name` (in program order), how many of its records read
    `read_name` before it: an ordering fingerprint of two kinds of instruction in one core's program."""
    reads, counts = 0, []
    for r in trace:
        if r.program != program:
            continue
        reads += touches(r, read_name)
        if touches(r, write_name, "writes"):
            counts.append(reads)
    return counts


def assert_matches_mx_exact(out, ref, max_ulp: int = 0, max_fraction: float = 0.0, rel_fp32: float = 0.0) -> list:
    """The kernel against reference mode "mx_exact": bit-exact by default (the documented claim); a test
    that passes a tolerance says why.

    bf16 outputs: at most `max_ulp` bf16 ulp apart, and on at most `max_fraction` of the elements;
    fp32 outputs: max |out - ref| <= rel_fp32 * max |ref|. NaN/Inf positions must coincide.
    Returns the measured [(max ulp, fraction differing)] per output (fp32: (max rel err, fraction)).
    """
    from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8.reference import fraction_over_ulp, ulp_diff_bf16

    measured = []
    for i, (o, r) in enumerate(zip(out, ref)):
        assert o.dtype == r.dtype and o.shape == r.shape, f"output {i}: {o.dtype}{o.shape} vs {r.dtype}{r.shape}"
        o32, r32 = o.astype(np.float32), r.astype(np.float32)
        np.testing.assert_array_equal(np.isnan(o32), np.isnan(r32), err_msg=f"output {i}: NaN positions")
        np.testing.assert_array_equal(o32[np.isinf(r32)], r32[np.isinf(r32)], err_msg=f"output {i}: Inf positions")
        if o.dtype == BF16:
            ulp = ulp_diff_bf16(o, r)
            frac = fraction_over_ulp(o, r, 0)
            assert ulp.max(initial=0) <= max_ulp, f"output {i}: {ulp.max()} bf16 ulp from mx_exact"
            assert frac <= max_fraction, f"output {i}: {frac:.2e} of the elements differ from mx_exact"
            measured.append((int(ulp.max(initial=0)), frac))
        else:
            fin = np.isfinite(r32)
            err = np.abs(o32[fin].astype(np.float64) - r32[fin])
            scale = float(np.max(np.abs(r32[fin]), initial=0.0))
            rel = float(err.max(initial=0.0)) / scale if scale else float(err.max(initial=0.0))
            assert rel <= rel_fp32, f"output {i}: fp32 relative error {rel:.2e} from mx_exact"
            measured.append((rel, float(np.mean(err > 0)) if err.size else 0.0))
    return measured


# ---- torch <-> numpy (tests/torch; torch is imported lazily so this module works without it) ----
def to_torch(a: np.ndarray):
    """numpy (bf16 via ml_dtypes, or any numpy float) -> torch CPU tensor with the same values and bits."""
    import torch

    a = np.ascontiguousarray(a)
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def to_numpy(t) -> np.ndarray:
    """torch tensor -> numpy with the same bits (bf16 -> ml_dtypes.bfloat16)."""
    import torch

    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BF16)
    return t.numpy()


def assert_dense_shape_plans(S: int, H: int, I: int) -> float:
    """The dense MLP backward's shape-only run at (S, H, I) (MXFP8, trn3, LNC2, checkpoints given: as the cost model
    and the README's figures run it) traces without an exception and without plan errors; returns the modeled time
    (s, central)."""
    from nkilib.examples.mlp_backward_cost import model_mlp_backward, summarize

    report = summarize(model_mlp_backward(S, H, I, "trn3", "mxfp8", 2, False, ("central",))["central"])
    assert report["plan_errors"] == [], (S, H, I, report["plan_errors"])
    assert report["modeled_time_s"] is not None and report["modeled_time_s"] > 0, (S, H, I, report["modeled_time_s"])
    return report["modeled_time_s"]


def run_with_timeout(fn, seconds=20):
    """Run fn() in a daemon thread; fail the test (instead of hanging) if it does not finish."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    import threading

    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(seconds)
    assert not th.is_alive(), f"kernel launch did not finish within {seconds} s (deadlock)"
    if "error" in box:
        raise box["error"]
    return box.get("value")
