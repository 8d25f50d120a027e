"""The one correctness comparison of the prologue, used by the tests, the demo and the benchmark.

:func:`compare` holds a fused result against the unfused reference run on the same inputs (and
both against a float64 model), every byte of the cache included; :data:`TOL` is the one table of
tolerances. Free of Triton: usable on any tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from fusemla.dtypes import FP8_DTYPES
from fusemla.testing.inputs import PrologueInputs, prologue_model_f64

#: every tolerance of the prologue's comparisons, in one place
TOL = {
    # relative L2 error vs the float64 model: one rounding of the output + bf16/fp16 operands
    "rel_l2": {torch.bfloat16: 8e-3, torch.float16: 1e-3},
    # relative L2 error of q[..., :L] vs the float64 model (unquantized weight), per weight format
    "weight_rel_l2": {"fp8": 0.05, "mxfp4": 0.2},
    # an FP8 e4m3 value is within 2^-4 (half an ulp at 3 mantissa bits) of what it rounds
    "fp8_rel": 2.0**-4,
    # FP8 query output: share of codes allowed one step from the reference's
    "fp8_q_off_by_one_share": 0.01,
    # FP8 query output, dequantized, vs the bf16 query (relative L2), per weight format
    "fp8_q_dequant_rel_l2": {"plain": 0.05, "fp8": 0.08, "mxfp4": 0.25},
    # act_quant="fp8" vs bf16 activations, both with the same FP8 weights: q[..., :L] relative
    # L2 (per-(token, head) FP8 rounding of q_nope: about 2-3 % on Gaussian data)
    "act_fp8_rel_l2": 0.05,
}


@dataclass
class Comparison:
    """Result of :func:`compare`: numbers worth printing, and what disagreed (empty = agreed)."""

    metrics: dict = field(default_factory=dict)
    problems: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def assert_ok(self) -> None:
        assert self.ok, "; ".join(self.problems)


def rel_err(x, ref) -> float:
    x, ref = x.double().cpu(), ref.double().cpu()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def scale_value(scale) -> float:
    if isinstance(scale, torch.Tensor):
        return float(scale.float().cpu().reshape(-1)[0])
    return 1.0 if scale is None else float(scale)


def fp8_ordinal(codes: torch.Tensor) -> torch.Tensor:
    """FP8 bytes -> integers in value order (+0 and -0 both 0; adjacent values differ by 1).

    Valid for both e4m3 formats: sign-magnitude with the sign in bit 7.
    """
    c = _bits(codes).int()
    mag = c & 0x7F
    return mag.where(c < 0x80, -mag)


def pow2_ceil64(s: torch.Tensor) -> torch.Tensor:
    """``2**ceil(log2 s)`` for positive ``s`` in float64, from frexp (no log2 rounding, and
    independent of the kernels' bit tricks): the UE8M0 scale rule's model."""
    m, e = torch.frexp(s.double())
    return torch.ldexp(torch.ones_like(m), torch.where(m == 0.5, e - 1, e))


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bits of a tensor, as integers of the same width."""
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


def _rope_magnitude(x, cos, sin, is_neox: bool):
    """Per output element, an upper bound of sum |term| of RoPE's two products (fp32)."""
    x = x.abs().float()
    half = x.shape[-1] // 2
    w = cos.abs().float() + sin.abs().float()
    if is_neox:
        m = (x[..., :half] + x[..., half:]) * w
        return torch.cat([m, m], dim=-1)
    m = (x[..., 0::2] + x[..., 1::2]) * w
    return torch.stack([m, m], dim=-1).flatten(-2)


def _within_ulp(got, want, dtype, slack):
    """Elementwise: |got - want| <= 1 ulp of the larger, plus ``slack`` (False for NaN)."""
    got, want = got.float(), want.float()
    fi = torch.finfo(dtype)
    bound = fi.eps * torch.maximum(got.abs(), want.abs()) + fi.tiny + slack
    return (got - want).abs() <= bound


def weight_kind(w: Any) -> str:
    """ "plain", "fp8" or "mxfp4" (keys of the per-format tolerances in :data:`TOL`): the
    library's one rule (:func:`fusemla.quant.weight_format`); None is the inputs' plain one."""
    from fusemla.quant import weight_format

    return "plain" if w is None else weight_format(w)


def compare(
    inp: PrologueInputs,
    out: Any,
    out_ref: Any,
    cache: torch.Tensor,
    cache_ref: torch.Tensor,
    cache_before: torch.Tensor,
    *,
    is_neox: bool = False,
    rope_applied: bool = False,
    w_uk_t: Any = None,
    fp8_code_slack: int | None = None,
) -> Comparison:
    """Check a fused result against the reference's on the same inputs.

    ``out`` / ``out_ref``: a :class:`~fusemla.contracts.prologue.PrologueOutput` (or just the
    decode query ``q``). ``cache_before``: the cache both started from. ``w_uk_t``: the weight
    both ran with when it differs from ``inp.w_uk_t`` (a QuantizedWeight). ``fp8_code_slack``:
    FP8 codes the rope part of a cache row may differ by (None: 1 on a GPU, 0 on the CPU).
    Agreement means:

    - q (decode tokens): no NaN; within 1 ulp of the reference (plus the fp32 accumulation bound
      ``2 * K * 2^-24 * sum|products|``); an FP8 q within one code (at most 1 % of codes one
      off); relative L2 error vs the float64 model below the tolerance of the dtype or weight
      format.
    - prefill tokens' rotated q_pe and k_pe: within 1 ulp (+ fp32 rounding of RoPE's products).
    - cache rows of the valid slots: the latent part bit-equal to the reference's; the rope part
      within 1 ulp (bf16/fp16) or equal FP8 codes (one code apart on a GPU, where FMAs
      contract); close to the float64 model (FP8: saturated); no NaN.
    - every other cache row byte-identical to ``cache_before``.
    """
    res = Comparison()
    m, problems = res.metrics, res.problems
    q, q_pe_out, k_pe_out = _split(out)
    q_ref, q_pe_ref, k_pe_ref = _split(out_ref)
    gpu = inp.q_nope.device.type != "cpu"
    act = inp.q_nope.dtype
    N, H, P = inp.q_nope.shape
    D, L, R = inp.D, inp.kv_c.shape[1], inp.q_pe.shape[-1]
    kind = weight_kind(w_uk_t)
    w_eff = inp.w_uk_t if w_uk_t is None else w_uk_t
    if kind != "plain":
        w_eff = w_eff.dequantize(torch.float32)
    model = prologue_model_f64(inp, is_neox, rope_applied)
    pos = inp.positions.long().clamp(0, inp.cos_cache.shape[0] - 1)
    cos, sin = inp.cos_cache[pos].float().cpu(), inp.sin_cache[pos].float().cpu()
    acc = 2.0**-24

    # ---- q (decode tokens) -------------------------------------------------------------------
    if tuple(q.shape) != (D, H, L + R):
        problems.append(f"q has shape {tuple(q.shape)}, expected {(D, H, L + R)}")
        return res
    qc, qr = q.detach().cpu(), q_ref.detach().cpu()
    if q.dtype in FP8_DTYPES:
        _compare_fp8_q(res, qc, qr)
    else:
        qcf, qrf = qc.float(), qr.float()
        n_nan = int(torch.isnan(qcf).sum())
        if n_nan:
            problems.append(f"q: {n_nan} of {qcf.numel()} values are NaN (not written?)")
        diff = (qcf - qrf).abs().nan_to_num(nan=float("inf"))
        m["q_max_abs_diff"] = float(diff.max()) if diff.numel() else 0.0
        s_nope = (
            torch.bmm(inp.q_nope[:D].abs().float().transpose(0, 1), w_eff.abs().float())
            .transpose(0, 1)
            .cpu()
        )
        q_in = inp.q_pe[:D].cpu()
        s_rope = (
            torch.zeros(q_in.shape)
            if rope_applied
            else _rope_magnitude(q_in, cos[:D, None], sin[:D, None], is_neox)
        )
        slack = torch.cat([2 * P * acc * s_nope, 4 * acc * s_rope], dim=-1)
        bad = ~_within_ulp(qcf, qrf, act, slack)
        n_bad = int(bad.sum()) - n_nan
        if n_bad > 0:
            problems.append(
                f"q: {n_bad} of {qcf.numel()} values differ from the reference by "
                f"more than 1 ulp (max |fused - ref| = {m['q_max_abs_diff']:.3g})"
            )
        tols = {
            "nope": TOL["weight_rel_l2"].get(kind, TOL["rel_l2"][act]),
            "rope": TOL["rel_l2"][act],
        }
        for part, sl in (("nope", slice(0, L)), ("rope", slice(L, L + R))):
            m[f"q_rel_{part}"] = rel_err(qcf[..., sl], model["q"][..., sl])
            if qcf.numel() and not m[f"q_rel_{part}"] < tols[part]:
                problems.append(
                    f"q[..., {part}]: relative L2 error vs float64 "
                    f"{m[f'q_rel_{part}']:.3g} >= {tols[part]:g}"
                )

    # ---- prefill tokens' rotated q_pe and k_pe -----------------------------------------------
    if q_pe_out is not None and N > D:
        for name, got, want, x, c, s, ref64 in (
            (
                "q_pe_out",
                q_pe_out,
                q_pe_ref,
                inp.q_pe[D:],
                cos[D:, None],
                sin[D:, None],
                model["q_pe"][D:],
            ),
            (
                "k_pe_out",
                k_pe_out,
                k_pe_ref,
                inp.k_pe.reshape(N, R)[D:],
                cos[D:],
                sin[D:],
                model["k_pe"][D:],
            ),
        ):
            got, want = got.detach().float().cpu(), want.detach().float().cpu()
            slack = 0.0 if rope_applied else 4 * acc * _rope_magnitude(x.cpu(), c, s, is_neox)
            n_bad = int((~_within_ulp(got, want, act, slack)).sum())
            if n_bad:
                problems.append(
                    f"{name}: {n_bad} of {got.numel()} values differ from the "
                    "reference by more than 1 ulp (or NaN)"
                )
            m[f"{name}_rel"] = rel_err(got, ref64)
            if not m[f"{name}_rel"] < TOL["rel_l2"][act]:
                problems.append(f"{name}: relative L2 error vs float64 {m[f'{name}_rel']:.3g}")

    # ---- cache -------------------------------------------------------------------------------
    slack = (1 if gpu else 0) if fp8_code_slack is None else fp8_code_slack
    _compare_cache(
        res,
        inp,
        cache,
        cache_ref,
        cache_before,
        model["rows"],
        cos,
        sin,
        is_neox,
        rope_applied,
        slack,
    )
    return res


def _split(out: Any) -> tuple:
    if isinstance(out, torch.Tensor):
        return out, None, None
    return out[0], out[1], out[2]


def _compare_fp8_q(res: Comparison, qc: torch.Tensor, qr: torch.Tensor) -> None:
    if torch.isnan(qc.float()).any():
        res.problems.append("q: NaN codes (not written?)")
    step = (fp8_ordinal(qc) - fp8_ordinal(qr)).abs()
    res.metrics["q_fp8_codes_off"] = int((step > 0).sum())
    if step.numel() and (
        int(step.max()) > 1 or float((step > 0).float().mean()) > TOL["fp8_q_off_by_one_share"]
    ):
        res.problems.append(
            f"q: FP8 codes differ from the reference by up to {int(step.max())} "
            f"steps in {int((step > 0).sum())} of {step.numel()} values"
        )


def _compare_cache(
    res: Comparison,
    inp: PrologueInputs,
    cache,
    cache_ref,
    cache_before,
    rows64,
    cos,
    sin,
    is_neox: bool,
    rope_applied: bool,
    code_slack: int,
) -> None:
    m, problems = res.metrics, res.problems
    L = inp.kv_c.shape[1]
    N = inp.q_nope.shape[0]
    width = cache.shape[-1]
    flat = cache.reshape(-1, width).cpu()
    flat_ref = cache_ref.reshape(-1, width).cpu()
    flat_before = cache_before.reshape(-1, width).cpu()
    n_rows = flat.shape[0]
    slots_all = inp.slot_mapping.long().cpu()
    valid = (slots_all >= 0) & (slots_all < n_rows)
    slots = slots_all[valid]
    written = torch.zeros(n_rows, dtype=torch.bool)
    written[slots] = True
    m["rows_valid"] = int(slots.numel())
    m["rows_padding"] = int((~valid).sum())
    stray = flat[~written].view(torch.uint8) != flat_before[~written].view(torch.uint8)
    n_stray = int(stray.any(dim=-1).sum())
    if n_stray:
        problems.append(f"cache: {n_stray} rows outside the valid slots were modified")
    fp8 = cache.dtype in FP8_DTYPES
    m["cache_kind"] = "fp8" if fp8 else "float"
    if slots.numel() == 0:
        m["rows_agree"] = 0
        return
    got, want = flat[slots], flat_ref[slots]
    ref_rows = rows64[valid]
    if fp8:  # the latent part is a plain scaled copy: equal codes (+0 and -0 are one value)
        latent_ok = (fp8_ordinal(got[:, :L]) == fp8_ordinal(want[:, :L])).all(dim=-1)
    else:  # bit-equal
        latent_ok = (_bits(got[:, :L]) == _bits(want[:, :L])).all(dim=-1)
    if fp8:
        scale = scale_value(inp.kv_scale)
        nan_rows = torch.isnan(got.float()).any(dim=-1)
        if nan_rows.any():
            problems.append("cache: NaN codes in written rows (not written?)")
        step = (fp8_ordinal(got[:, L:]) - fp8_ordinal(want[:, L:])).abs()
        row_ok = latent_ok & (step <= code_slack).all(dim=-1) & ~nan_rows
        m["fp8_codes_off_by_one"] = int((step == 1).sum())
        fmax = torch.finfo(cache.dtype).max * scale
        m["cache_rel"] = rel_err(got.float() * scale, ref_rows.clamp(-fmax, fmax))
        cache_tol = TOL["fp8_rel"]
        if float(got.float().abs().max()) > torch.finfo(cache.dtype).max:
            problems.append("cache: FP8 values beyond the format's max (not saturated)")
    else:
        k_pe = inp.k_pe.reshape(N, inp.q_pe.shape[-1]).cpu()
        s_k = (
            torch.zeros(k_pe.shape) if rope_applied else _rope_magnitude(k_pe, cos, sin, is_neox)
        )[valid]
        ok = _within_ulp(got[:, L:], want[:, L:], cache.dtype, 4 * 2.0**-24 * s_k)
        row_ok = latent_ok & ok.all(dim=-1)
        m["cache_rel"] = rel_err(got, ref_rows)
        cache_tol = TOL["rel_l2"].get(cache.dtype, 8e-3)
    m["rows_agree"] = int(row_ok.sum())
    n_bad_rows = int((~row_ok).sum())
    if n_bad_rows:
        first = int(slots[~row_ok][0])
        problems.append(
            f"cache: {n_bad_rows} of {slots.numel()} written rows differ from the "
            f"reference (first: slot {first})"
        )
    if not m["cache_rel"] < cache_tol:
        problems.append(
            f"cache: relative L2 error of the written rows vs float64 "
            f"{m['cache_rel']:.3g} >= {cache_tol:g}"
        )


def check_against_reference(
    inp: PrologueInputs,
    out: Any,
    cache_before: torch.Tensor,
    *,
    is_neox: bool = False,
    rope_applied: bool = False,
    w_uk_t: Any = None,
    **kw: Any,
) -> Comparison:
    """Run the unfused reference on ``inp`` (from ``cache_before``) and :func:`compare` to
    ``out`` and ``inp.kv_cache`` (the fused op's results on ``inp``). ``kw`` goes to both
    calls' other keywords (``q_out_dtype``, ``q_scale`` ...)."""
    from fusemla.reference.prologue import mla_prologue_ref

    cache_ref = cache_before.clone()
    out_ref = inp.run(
        mla_prologue_ref,
        kv_cache=cache_ref,
        w_uk_t=w_uk_t,
        is_neox=is_neox,
        rope_applied=rope_applied,
        **kw,
    )
    return compare(
        inp,
        out,
        out_ref,
        inp.kv_cache,
        cache_ref,
        cache_before,
        is_neox=is_neox,
        rope_applied=rope_applied,
        w_uk_t=w_uk_t,
    )


_OUTPUT_BUFFERS = ("out", "q_pe_out", "k_pe_out")


def run_and_compare(fn, inp: PrologueInputs, *, w_uk_t: Any = None, **kw: Any) -> Comparison:
    """Run ``fn`` (``mla_prologue``) on ``inp`` and compare with the reference run from the same
    cache. Output buffers in ``kw`` (``out``, ``q_pe_out``, ``k_pe_out``) go to ``fn`` only and
    must come back as its results."""
    before = inp.kv_cache.clone()
    out = inp.run(fn, w_uk_t=w_uk_t, **kw)
    for i, name in enumerate(_OUTPUT_BUFFERS):
        given = kw.pop(name, None)
        if given is not None and out[i].data_ptr() != given.data_ptr():
            return Comparison(problems=[f"{name}: the given buffer was not returned"])
    return check_against_reference(inp, out, before, w_uk_t=w_uk_t, **kw)
