"""fusemla's MLAAttention against an independent model: Hugging Face transformers'
``DeepseekV3Attention`` (fp32), on a tiny random DeepSeek-V3 config (H=4, P=32, R=16, L=64,
V=32, hidden 64, DeepSeek YaRN, interleaved RoPE; fusemla.testing.hf).

The driver runs an engine-like schedule: requests with prompts of different lengths arrive at
different steps and prefill (some in chunks on top of their own cached context) while others
decode one token per step (mixed batches), finish, and free their blocks, which a later request
reuses (stale rows in the cache); two steps carry CUDA-graph padding requests. Every step's batch
comes from :func:`fusemla.testing.scheduler.build_metadata` with a shuffled BlockAllocator; the
cache starts NaN-poisoned. After every step each token's output row is held against HF's output
at that request position, computed over the request's whole sequence with a causal mask (the
output at ``p`` depends only on positions ``<= p``: what incremental decoding gives, see
``test_hf_harness_matches_incremental_decoding``).

Checks per step (rel. L2 = ||out - ref|| / ||ref|| over the step's rows; per row likewise):
1. vs HF: bf16 cache: HF as is. FP8 cache: HF with its cached latents (kv_a_layernorm output and
   rotated k_pe) round-tripped through the same FP8 quantization, saturation included
   (fp8(saturate(x / kv_scale)) * kv_scale; fusemla.testing.hf.LatentRoundTrip).
2. vs HF attending over the layer's own cache rows (dequantized) instead of its own latents:
   separates "the cache holds the right values" from "the layer computes attention right over
   its cache", so the FP8 case is also checked at bf16 tolerance.
3. The step's cache rows vs HF's latents (rotated k_pe re-interleaved: transformers 5 returns
   rope dims de-interleaved, the engines' cache keeps DeepSeek's interleaved pairs); every row no
   request ever owned still holds its poison bytes; padding rows' outputs are zero. RoPE is
   relative, so e.g. all positions shifted by one leave the outputs (1.) unchanged: only 2. and
   3. see it, and any other reader of the cache would.

Error budget and tolerances (TOL, measured maxima over all steps and configs in brackets):
- Weights and hidden states are bf16-representable (fusemla.testing.hf), so the bf16 layer and the
  fp32 reference hold the same numbers; what remains is the layer's bf16 arithmetic, about ten
  roundings to bf16 (2^-9 relative each) through projections, RMSNorms, attention and o_proj:
  bf16 cache vs HF [7.8e-3 per step, 1.24e-2 per row] -> 2e-2 / 4e-2. Over its own cache (2.)
  [6.0e-3 / 1.04e-2] -> 2e-2 / 4e-2, for every cache dtype.
- FP8 cache vs round-tripped HF (1.) [3.45e-2 / 7.7e-2] -> 5e-2 / 1.2e-1. The round trip removes
  the quantization error only where both sides quantize the same value: the layer quantizes its
  bf16-computed latents, which differ from HF's fp32 ones by ~2^-9 relative, so about 2-5 % of
  the cache codes land one FP8 code (2^-3 relative) away from HF's (more than one code only for
  small values after RoPE's cancellation, whose bf16 *absolute* error spans several small codes).
  That residue is ~half the layer's deviation from plain HF (rel vs plain HF [<= 7.9e-2], mean
  over steps ~2x that vs the round trip). Check 2 is the tight one for FP8.
- Cache rows: bf16 [3.0e-3] -> 1e-2; FP8 vs round-tripped HF latents [2.4e-2] -> 5e-2; share of
  FP8 codes off HF's [4.6 %] -> 10 % (a wrong rounding mode, e.g. truncation, moves ~50 %).
- FP8 W_UK_T (weight_format="fp8"): decode tokens are compared with HF whose W_UK rows of
  kv_b_proj are the layer's dequantized FP8 weight (prefill tokens, which use kv_b_proj in bf16,
  with plain HF): bf16 tolerances [7.8e-3 / 1.16e-2]. Against unquantized HF as well
  [3.2e-2 / 6.1e-2] -> 6e-2 / 1.2e-1.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass

import pytest
import torch
from transformers import DynamicCache

from fusemla.config import MLAConfig
from fusemla.layers.mla import MLAAttention
from fusemla.reference.prologue import quantize_fp8
from fusemla.testing import (
    BlockAllocator,
    RequestStep,
    build_metadata,
    fp8_ordinal,
    poisoned_cache,
    rel_err,
    stable_seed,
)
from fusemla.testing.hf import (
    HFAttention,
    LatentRoundTrip,
    causal_mask,
    fp8_round_trip,
    interleave_rope,
    make_hf_attention,
    tiny_deepseek_v3_config,
)

FP8 = torch.float8_e4m3fn
#: kv_scale of the FP8 cache: latents and rotated k_pe are O(1) (RMSNorm output, N(0,1)
#: projections) with |x| up to ~4, so |x| > 3 (about 0.5 % of them) saturates at 448 * scale
KV_SCALE = 3.0 / 448.0

#: (per step, per row) relative L2 bounds; see the module docstring for the measured values
TOL = {
    "bf16": (2e-2, 4e-2),  # bf16 cache vs HF
    "fp8": (5e-2, 1.2e-1),  # FP8 cache vs HF with FP8 round-tripped latents
    "own_cache": (2e-2, 4e-2),  # vs HF attending over the layer's own (dequantized) cache rows
    "fp8_weight_vs_plain": (6e-2, 1.2e-1),  # FP8 W_UK_T vs unquantized HF
    "cache_bf16": 1e-2,  # cache rows vs HF's latents
    "cache_fp8": 5e-2,  # FP8 cache rows vs HF's round-tripped latents
    "fp8_code_share": 0.10,  # share of FP8 cache codes that differ from HF's codes
}


# ------------------------------------------------------------------------------- schedule


@dataclass(frozen=True)
class Request:
    rid: str
    prompt: int  # prompt tokens
    total: int  # prompt + generated tokens
    arrive: int  # first step
    chunk: int  # prefill chunk (tokens per step while prefilling)


#: the mixed schedule, 18 steps: "a" finishes at step 8 and "e" (arriving at step 9) reuses its
#: blocks; "b" and "c" prefill in chunks on top of their own context while others decode; "d"
#: has a one-token prompt (a prefill with no context); steps 6-8, 10-12 and 14-17 are pure
#: decode (test_schedule_is_mixed checks these claims).
MIXED = (
    Request("a", prompt=5, total=13, arrive=0, chunk=5),
    Request("b", prompt=17, total=33, arrive=0, chunk=9),
    Request("c", prompt=33, total=45, arrive=2, chunk=13),
    Request("d", prompt=1, total=13, arrive=5, chunk=1),
    Request("e", prompt=12, total=18, arrive=9, chunk=12),
    Request("f", prompt=20, total=24, arrive=13, chunk=20),
)
NUM_STEPS = 18
#: steps whose decode rows are padded (CUDA-graph style) with two padding requests
PADDED_STEPS = (4, 11)


def schedule(requests, num_steps: int) -> list[list[tuple[str, int, int]]]:
    """Per step, ``(rid, context_len, num_new_tokens)`` of each active request."""
    done = {r.rid: 0 for r in requests}
    steps = []
    for s in range(num_steps):
        work = []
        for r in requests:
            if s < r.arrive or done[r.rid] >= r.total:
                continue
            n = min(r.chunk, r.prompt - done[r.rid]) if done[r.rid] < r.prompt else 1
            work.append((r.rid, done[r.rid], n))
            done[r.rid] += n
        steps.append(work)
    return steps


def is_decode(ctx: int, n: int) -> bool:
    return n == 1 and ctx > 0  # build_metadata's rule


# ------------------------------------------------------------------------------- the driver


@dataclass
class Case:
    q_lora_rank: int | None = 48
    kv_dtype: torch.dtype = torch.bfloat16
    block_size: int = 16
    weight_format: str = "plain"
    config: MLAConfig | None = None  # None: the environment's (default: fused) paths

    @property
    def fp8_cache(self) -> bool:
        return self.kv_dtype == FP8

    @property
    def kv_scale(self) -> float | None:
        return KV_SCALE if self.fp8_cache else None


_HF_MODULES: dict = {}


def hf_module(q_lora_rank: int | None) -> HFAttention:
    """The tiny random HF attention (one per q_lora_rank, shared by the tests; never modified)."""
    if q_lora_rank not in _HF_MODULES:
        config = tiny_deepseek_v3_config(q_lora_rank=q_lora_rank)
        _HF_MODULES[q_lora_rank] = make_hf_attention(
            config, seed=stable_seed("test_mla_vs_hf", "weights", q_lora_rank)
        )
    return _HF_MODULES[q_lora_rank]


def with_layer_w_uk(hf: HFAttention, layer: MLAAttention) -> HFAttention:
    """A copy of ``hf`` whose kv_b_proj W_UK rows are the layer's (dequantized) W_UK_T."""
    cfg = hf.config
    H, P, V, L = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank)
    w_uk = layer.W_UK_T.dequantize(torch.float32).cpu()  # [H, P, L]
    attn = copy.deepcopy(hf.attn)
    with torch.no_grad():
        w = attn.kv_b_proj.weight.view(H, P + V, L)
        # the layout is right (and the quantization an FP8 one) before it replaces anything
        assert rel_err(w_uk, w[:, :P]) < 0.1
        w[:, :P] = w_uk
    return HFAttention(cfg, attn, hf.rotary)


@dataclass
class Reference:
    hidden: torch.Tensor  # [total, hidden] fp32, bf16-representable
    out: torch.Tensor  # [total, hidden] HF (latents FP8 round-tripped for an FP8 cache)
    out_dec: torch.Tensor  # the same with the layer's W_UK (== out for plain weights)
    out_plain: torch.Tensor  # [total, hidden] plain HF
    kv_c: torch.Tensor  # [total, L] HF's kv_a_layernorm output
    k_pe: torch.Tensor  # [total, R] HF's rotated k_pe, interleaved (the cache layout)


def reference(hf: HFAttention, hf_dec: HFAttention, rid: str, total: int, case: Case) -> Reference:
    g = torch.Generator().manual_seed(stable_seed("test_mla_vs_hf", "hidden", rid))
    hidden = hf.random_hidden(total, g)
    kv_dtype = case.kv_dtype if case.fp8_cache else None
    rt = LatentRoundTrip(kv_dtype, case.kv_scale)
    out = hf.outputs(hidden, cache=rt)
    out_dec = (
        out
        if hf_dec is hf
        else hf_dec.outputs(hidden, cache=LatentRoundTrip(kv_dtype, case.kv_scale))
    )
    out_plain = hf.outputs(hidden) if case.fp8_cache else out
    return Reference(hidden, out, out_dec, out_plain, rt.kv_c[0, 0], interleave_rope(rt.k_pe[0, 0]))


@dataclass
class StepResult:
    step: int
    num_decodes: int
    num_prefill_tokens: int
    rel: float  # vs HF (FP8 cache: round-tripped latents)
    row_max: float
    rel_plain: float  # vs plain HF (no round trip, unquantized weights)
    row_max_plain: float
    rel_own: float  # vs HF attending over the layer's own cache rows
    row_max_own: float
    cache_rel: float  # this step's cache rows vs HF's latents (FP8: round-tripped)
    code_share: float = 0.0  # FP8: share of this step's cache codes that differ from HF's
    code_max: int = 0  # FP8: largest code distance (diagnostic)


def _errors(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    per_row = (got - want).norm(dim=-1) / want.norm(dim=-1)
    return rel_err(got, want), float(per_row.max())


def run_schedule(
    case: Case,
    requests,
    num_steps: int,
    *,
    padded_steps=(),
    seed_tag: str = "mixed",
    prefill_cache_from_hf: bool = False,
    device: str = "cpu",
) -> list[StepResult]:
    """Run the layer over the schedule, compare after every step, return the per-step errors.

    ``prefill_cache_from_hf``: write every request's prompt rows into the cache from HF's
    latents (bf16, or FP8-quantized) instead of running the prompts through the layer, so the
    steps hold decode tokens only (the decode path alone). ``device``: where the layer, its
    cache and the metadata live (the HF reference and the comparisons stay on the CPU).
    """
    hf = hf_module(case.q_lora_rank)
    cfg = hf.config
    L, R = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    attn = hf.attn if device == "cpu" else copy.deepcopy(hf.attn).to(device)
    layer = MLAAttention.from_hf(
        attn, dtype=torch.bfloat16, weight_format=case.weight_format, config=case.config
    )
    hf_dec = hf if case.weight_format == "plain" else with_layer_w_uk(hf, layer)
    refs = {r.rid: reference(hf, hf_dec, r.rid, r.total, case) for r in requests}
    bs = case.block_size
    num_blocks = sum(-(-r.total // bs) for r in requests) + 3  # 3 never-used blocks
    alloc = BlockAllocator(num_blocks, bs, seed=stable_seed("test_mla_vs_hf", seed_tag, bs))
    kv_cache = poisoned_cache(num_blocks, bs, L + R, case.kv_dtype, device)
    flat = kv_cache.view(-1, L + R)
    poison = flat[0].to("cpu", copy=True)
    scale = KV_SCALE if case.fp8_cache else 1.0
    fmax = torch.finfo(FP8).max
    written: set[int] = set()
    order_rng = random.Random(stable_seed("test_mla_vs_hf", seed_tag, "order"))
    by_id = {r.rid: r for r in requests}
    plan = schedule(requests, num_steps)

    if prefill_cache_from_hf:
        for r in requests:
            alloc.ensure(r.rid, r.prompt)
            rows = torch.cat([refs[r.rid].kv_c[: r.prompt], refs[r.rid].k_pe[: r.prompt]], -1)
            if case.fp8_cache:
                rows = (rows / torch.tensor(KV_SCALE)).clamp(-fmax, fmax).to(FP8)
            slots = [alloc.slot(r.rid, p) for p in range(r.prompt)]
            flat[torch.tensor(slots, device=device)] = rows.to(case.kv_dtype).to(device)
            written.update(slots)
        plan = [[w for w in work if w[1] >= by_id[w[0]].prompt] for work in plan]

    results = []
    finished: list[str] = []
    for step, work in enumerate(plan):
        for rid in finished:  # free last step's finished requests (their blocks get reused)
            alloc.free(rid)
        finished = []
        if not work:
            continue
        work = list(work)
        order_rng.shuffle(work)  # the order requests are listed in varies; metadata reorders
        steps = [RequestStep(rid, ctx, n) for rid, ctx, n in work]
        num_dec = sum(1 for _, ctx, n in work if is_decode(ctx, n))
        pad = num_dec + 2 if step in padded_steps else None
        md, order = build_metadata(steps, alloc, pad_decodes_to=pad, device=device)

        hidden_rows, pad_rows, real_rows, live = [], [], [], []
        t = 0
        for i in order:
            if i < 0:  # a padding request: one token, zeros in, zeros expected out
                hidden_rows.append(torch.zeros(1, cfg.hidden_size))
                pad_rows.append(t)
                t += 1
                continue
            rid, ctx, n = work[i]
            hidden_rows.append(refs[rid].hidden[ctx : ctx + n])
            real_rows.extend(range(t, t + n))
            live.append((rid, ctx, n))
            t += n
            if ctx + n >= by_id[rid].total:
                finished.append(rid)
        real = torch.tensor(real_rows)
        slots = [alloc.slot(rid, p) for rid, ctx, n in live for p in range(ctx, ctx + n)]
        assert md.slot_mapping.cpu()[real].tolist() == slots  # the driver agrees with metadata
        hidden = torch.cat(hidden_rows).to(torch.bfloat16).to(device)

        with torch.no_grad():
            out = layer(hidden, md.positions, md, kv_cache, case.kv_scale)
        assert out.shape == (md.num_tokens, cfg.hidden_size) and out.dtype == torch.bfloat16
        out = out.float().cpu()
        flat_now = flat.cpu()
        assert torch.isfinite(out).all(), f"step {step}: non-finite outputs"
        assert (out[pad_rows] == 0).all(), f"step {step}: padding rows are not zero"
        got = out[real]

        want, want_plain, want_own, lat = [], [], [], []
        for rid, ctx, n in live:
            ref = refs[rid]
            dec = is_decode(ctx, n)
            want.append((ref.out_dec if dec else ref.out)[ctx : ctx + n])
            want_plain.append(ref.out_plain[ctx : ctx + n])
            lat.append(torch.cat([ref.kv_c[ctx : ctx + n], ref.k_pe[ctx : ctx + n]], -1))
            # HF over the layer's own cache rows of this request (positions 0 .. ctx+n-1)
            own = flat_now[torch.tensor([alloc.slot(rid, p) for p in range(ctx + n)])].float()
            own = own * scale
            rt = LatentRoundTrip(replace=(own[:, :L], own[:, L:]))
            want_own.append((hf_dec if dec else hf).outputs(ref.hidden[: ctx + n], ctx, cache=rt))

        # the cache: this step's rows hold HF's latents; rows nobody owned keep their poison
        written.update(slots)
        codes = flat_now[torch.tensor(slots)]
        lat = torch.cat(lat)
        code_share, code_max = 0.0, 0
        if case.fp8_cache:
            hf_codes = (lat / torch.tensor(KV_SCALE)).clamp(-fmax, fmax).to(FP8)
            dist = (fp8_ordinal(codes) - fp8_ordinal(hf_codes)).abs()
            code_share, code_max = float((dist > 0).float().mean()), int(dist.max())
            lat = fp8_round_trip(lat, KV_SCALE, FP8)
        untouched = torch.tensor([s for s in range(flat.shape[0]) if s not in written])
        assert (flat_now[untouched].view(torch.uint8) == poison.view(torch.uint8)).all(), (
            f"step {step}: cache rows outside the requests' slots were written"
        )

        rel, row_max = _errors(got, torch.cat(want))
        rel_plain, row_max_plain = _errors(got, torch.cat(want_plain))
        rel_own, row_max_own = _errors(got, torch.cat(want_own))
        results.append(
            StepResult(
                step=step,
                num_decodes=sum(1 for _, ctx, n in live if is_decode(ctx, n)),
                num_prefill_tokens=md.num_prefill_tokens,
                rel=rel,
                row_max=row_max,
                rel_plain=rel_plain,
                row_max_plain=row_max_plain,
                rel_own=rel_own,
                row_max_own=row_max_own,
                cache_rel=rel_err(codes.float() * scale, lat),
                code_share=code_share,
                code_max=code_max,
            )
        )
    return results


def check(case: Case, results: list[StepResult]) -> None:
    """Every step within the case's tolerances; the failure message lists every step."""
    tol = TOL["fp8"] if case.fp8_cache else TOL["bf16"]
    cache_tol = TOL["cache_fp8"] if case.fp8_cache else TOL["cache_bf16"]
    limits = [("rel", "row_max", tol), ("rel_own", "row_max_own", TOL["own_cache"])]
    if case.weight_format != "plain" and not case.fp8_cache:
        limits.append(("rel_plain", "row_max_plain", TOL["fp8_weight_vs_plain"]))
    bad = []
    for r in results:
        for step_key, row_key, (step_tol, row_tol) in limits:
            if not (getattr(r, step_key) < step_tol and getattr(r, row_key) < row_tol):
                bad.append(
                    f"step {r.step}: {step_key} {getattr(r, step_key):.3g} / "
                    f"{row_key} {getattr(r, row_key):.3g} >= {step_tol} / {row_tol}"
                )
        if not r.cache_rel < cache_tol:
            bad.append(f"step {r.step}: cache rows rel {r.cache_rel:.3g} >= {cache_tol}")
        if not r.code_share <= TOL["fp8_code_share"]:
            bad.append(
                f"step {r.step}: {r.code_share:.1%} of the FP8 cache codes differ from "
                f"HF's (> {TOL['fp8_code_share']:.0%})"
            )
    summary = "\n".join(
        f"  step {r.step:2d}: {r.num_decodes} dec + {r.num_prefill_tokens:2d} prefill tok: "
        f"rel {r.rel:.2e} (row {r.row_max:.2e}), plain HF {r.rel_plain:.2e} "
        f"(row {r.row_max_plain:.2e}), own cache {r.rel_own:.2e} (row {r.row_max_own:.2e}), "
        f"cache {r.cache_rel:.2e}, fp8 codes off {r.code_share:.3f} (max {r.code_max})"
        for r in results
    )
    print(f"\n{case}\n{summary}")
    assert not bad, "\n".join(bad) + "\n" + summary


# ------------------------------------------------------------------------------- tests


def test_schedule_is_mixed() -> None:
    """The schedule exercises what it claims: >= 16 steps, mixed decode+prefill steps (chunked
    prefills on top of their own context among them), pure-decode steps, every request run to
    its end, and a finished request's blocks handed to a later one."""
    plan = schedule(MIXED, NUM_STEPS)
    assert len(plan) >= 16
    kinds = []
    for work in plan:
        dec = sum(1 for _, ctx, n in work if is_decode(ctx, n))
        pre = [(ctx, n) for _, ctx, n in work if not is_decode(ctx, n)]
        kinds.append((dec, pre))
    mixed = [k for k in kinds if k[0] and k[1]]
    assert len(mixed) >= 6
    assert any(ctx > 0 for _, pre in mixed for ctx, _ in pre)  # a chunk on top of its context
    assert sum(1 for d, pre in kinds if d and not pre) >= 8  # pure decode steps
    done = {rid: ctx + n for work in plan for rid, ctx, n in work}
    assert done == {r.rid: r.total for r in MIXED}
    last = {rid: s for s, work in enumerate(plan) for rid, _, _ in work}
    first = {
        rid: min(s for s, work in enumerate(plan) if rid in [w[0] for w in work]) for rid in done
    }
    assert last["a"] < first["e"]


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("q_lora_rank", [48, None], ids=["q_lora", "q_proj"])
def test_mixed_steps_match_hf(q_lora_rank, kv_dtype, block_size, device) -> None:
    case = Case(q_lora_rank=q_lora_rank, kv_dtype=kv_dtype, block_size=block_size)
    results = run_schedule(case, MIXED, NUM_STEPS, padded_steps=PADDED_STEPS, device=device)
    assert len(results) == NUM_STEPS
    check(case, results)
    if case.fp8_cache:
        # the round-tripped reference is the right one: it is clearly closer than plain HF
        mean = sum(r.rel for r in results) / len(results)
        mean_plain = sum(r.rel_plain for r in results) / len(results)
        assert mean < 0.75 * mean_plain, (mean, mean_plain)


def test_fp8_weight_matches_hf(device) -> None:
    """W_UK_T stored as FP8 (weight_format="fp8"), bf16 cache."""
    case = Case(q_lora_rank=48, kv_dtype=torch.bfloat16, block_size=16, weight_format="fp8")
    check(case, run_schedule(case, MIXED, NUM_STEPS, device=device))


def test_unfused_paths_match_hf(device) -> None:
    """The layer's reference (unfused) prologue for both halves, FP8 cache, against HF."""
    case = Case(
        q_lora_rank=48,
        kv_dtype=FP8,
        block_size=16,
        config=MLAConfig(fused_decode=False, fused_prefill=False),
    )
    check(case, run_schedule(case, MIXED, NUM_STEPS, padded_steps=PADDED_STEPS, device=device))


PROMPTS = (Request("p5", 5, 5, 0, 5), Request("p17", 17, 17, 0, 17), Request("p33", 33, 33, 0, 33))


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_prefill_only(kv_dtype, device) -> None:
    """One step: three prompts (5, 17, 33 tokens) prefill into an empty (poisoned) cache."""
    case = Case(q_lora_rank=48, kv_dtype=kv_dtype, block_size=16)
    results = run_schedule(case, PROMPTS, 1, seed_tag="prefill-only", device=device)
    assert len(results) == 1 and results[0].num_decodes == 0
    check(case, results)


DECODES = (Request("d5", 5, 8, 0, 5), Request("d17", 17, 20, 0, 17), Request("d33", 33, 36, 0, 33))


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_decode_only(kv_dtype, device) -> None:
    """The prompts' cache rows written from HF's own latents, then three all-decode steps: the
    decode path alone, against HF."""
    case = Case(q_lora_rank=48, kv_dtype=kv_dtype, block_size=16)
    results = run_schedule(
        case, DECODES, 4, seed_tag="decode-only", prefill_cache_from_hf=True, device=device
    )
    assert len(results) == 3 and all(r.num_prefill_tokens == 0 for r in results)
    check(case, results)


# ------------------------------------------------------------------------------- the harness


@pytest.mark.parametrize("q_lora_rank", [48, None], ids=["q_lora", "q_proj"])
def test_hf_harness_matches_incremental_decoding(q_lora_rank) -> None:
    """The reference itself: one causal pass over the whole sequence gives what HF's own
    incremental decoding (DynamicCache: 7 prompt tokens, then one token per call) gives."""
    hf = hf_module(q_lora_rank)
    g = torch.Generator().manual_seed(stable_seed("test_mla_vs_hf", "harness"))
    x = hf.random_hidden(16, g)
    full = hf.outputs(x)
    cache = DynamicCache(config=hf.config)
    outs = []
    with torch.no_grad():
        for lo, hi in [(0, 7)] + [(p, p + 1) for p in range(7, 16)]:
            cos, sin = hf.rotary(x[None, lo:hi], torch.arange(lo, hi)[None])
            mask = causal_mask(hi - lo) if hi - lo > 1 else None
            o, _ = hf.attn(
                x[None, lo:hi],
                position_embeddings=(cos, sin),
                attention_mask=mask,
                past_key_values=cache,
            )
            outs.append(o[0])
    assert rel_err(torch.cat(outs), full) < 1e-5
    assert torch.equal(hf.outputs(x, start=9), full[9:])


def test_hf_harness_round_trip_is_fp8() -> None:
    """LatentRoundTrip hands HF its latents as an FP8 cache returns them (bit-equal to
    fusemla's cache quantization read back as code * kv_scale), some values saturate, and it
    changes HF's output; ``replace`` with HF's own latents changes nothing."""
    hf = hf_module(48)
    g = torch.Generator().manual_seed(stable_seed("test_mla_vs_hf", "harness-fp8"))
    x = hf.random_hidden(40, g)
    rt = LatentRoundTrip(FP8, KV_SCALE)
    out8 = hf.outputs(x, cache=rt)
    assert rt.calls == 1
    for lat in (rt.kv_c, rt.k_pe):
        want = quantize_fp8(lat, KV_SCALE, FP8).float() * torch.tensor(KV_SCALE)
        assert torch.equal(fp8_round_trip(lat, KV_SCALE, FP8), want)
        assert (lat.abs() > torch.finfo(FP8).max * KV_SCALE).any()  # some values saturate
    out = hf.outputs(x)
    assert rel_err(out8, out) > 1e-2
    same = LatentRoundTrip(replace=(rt.kv_c[0, 0], interleave_rope(rt.k_pe[0, 0])))
    assert torch.equal(hf.outputs(x, cache=same), out)
