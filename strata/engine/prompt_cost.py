"""What a prompt costs under a plan's chunk, ring and kept cache slots: the cost model `--prefill auto`
chooses its plan with (strata.engine.planner.prompt_plans), and `plan` prints.

A prompt of N tokens runs in chunks of T; a chunk of at least stream_all_tokens streams every expert
of every layer that the cache does not keep during the prompt (experts.ring: layer by layer, issued
as far ahead as the ring's R slots allow), a smaller one the experts its routing names. Per layer
the GPU computes the part before the experts (attention, its projections, the router: `pre`),
then the experts (`moe`), which wait for the layer's batch of copies; a copy waits for the compute
that last read the ring slots it overwrites (R positions back), and copies run one after another on
the copy stream at PROMPT_BUS_EFFICIENCY of the pinned rate. So, batch by batch (a layer's misses
in batches of at most R, the compute of its experts shared out by batch size):

    copy_start = max(last copy's end, done time of the batch holding position (end - R - 1))
    copy_end   = copy_start + misses x blob / bus rate
    done       = max(compute so far + pre, copy_end) + moe

which is where a ring too shallow for two layers' misses stalls the bus (the next layer's copies wait
for this layer's compute), and where a chunk the bus cannot hide behind its compute costs its
bytes. Compute per token is the layer's multiply-accumulates at PromptRates (linear: the weights'
rows x columns a token, its A experts' too; attention: 2 x heads x head_dim a token and earlier
position, on the layers with softmax attention), plus a fixed cost a layer of each chunk
(PromptRates.expert_chunk_s times the layer's routed experts). The defaults are fitted to the H200 (DEFAULT_PROMPT_RATES says how);
with them this model gives the tenth session's prompt-plan A/B at 8 and 12 GiB within 5% at 16,384
and 32,768 tokens and the rules' plans within 6% at 4096, and the third session's ring A/B at 8 GiB
within 3% (byte ring 200 slots, chunk 14848: 9,799 / 13,009 tok/s at 4096 / 16384 against 10,048 /
13,062 measured; 384 slots, chunk 8192: 14,127 / 15,471 against 14,078 / 15,510), a PCIe-bound
4096-token prompt at 17,620 against 17,761, and the rerun with the loan sized by the prompt 22% high
at 4096 (11,602 against 9,529).
Never touches a device: tested on the CPU (tests/engine/test_prompt_cost.py).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..backends.cuda.kernels import TC_ATTENTION_HEAD_DIMS, TMA_DEFAULT_HEAD_DIMS

PROMPT_BUS_EFFICIENCY = 0.92      # a ring's copies against the pinned rate (docs/PERF.md: 92% when PCIe-bound)
AUTO_PROMPTS = (4096, 16384, 32768)   # the prompt lengths --prefill auto weighs (capped at the context)
DEFAULT_NUM_SMS = 132


@dataclass(frozen=True)
class PromptRates:
    """The GPU's prompt compute: FLOP/s on the linear layers (dense and expert GEMMs) and on the
    attention scores and values, at num_sms SMs (scaled by SM count on another GPU: a rough proxy),
    and the fixed seconds each layer of a chunk costs besides them (launches, grouping, syncs: not
    scaled); the attention of head sizes without a tensor-core prompt kernel (CUDA cores) and the
    chunked gated delta rule of linear-attention layers at their own rates."""
    linear_flop_s: float
    attention_flop_s: float
    num_sms: int
    source: str
    expert_chunk_s: float = 0.0       # a layer's fixed cost of a chunk, per routed expert of the layer
    attention_cuda_core_flop_s: float = 0.0
    gdn_flop_s: float = 0.0

    def with_tma_attention(self) -> "PromptRates":
        """These rates with the softmax attention on the TMA build (TMA_ATTENTION_SPEEDUP)."""
        return replace(self, attention_flop_s=self.attention_flop_s * TMA_ATTENTION_SPEEDUP,
                       source=f"{self.source}; attention on the TMA kernel, {TMA_ATTENTION_SPEEDUP}x")

    def with_tma_gemm(self, expert_weights: float) -> "PromptRates":
        """These rates for a chunk that tma-gemm takes (strata.backends.cuda.moe.dq_experts): the linear
        layers TMA_GEMM_SPEEDUP faster, and each routed expert of a layer (expert_weights weights) its
        dequantization to f16 once a chunk (TMA_DQ_WEIGHT_S a weight) on top of expert_chunk_s."""
        return replace(self, linear_flop_s=self.linear_flop_s * TMA_GEMM_SPEEDUP,
                       expert_chunk_s=self.expert_chunk_s + expert_weights * TMA_DQ_WEIGHT_S * DEFAULT_NUM_SMS
                       / self.num_sms,
                       source=f"{self.source}; GEMMs over f16 weights by the TMA, {TMA_GEMM_SPEEDUP}x")

    def at(self, num_sms: int) -> "PromptRates":
        if num_sms == self.num_sms or num_sms <= 0:
            return self
        f = num_sms / self.num_sms
        return PromptRates(self.linear_flop_s * f, self.attention_flop_s * f, num_sms,
                           f"{self.source}, scaled to {num_sms} SMs", self.expert_chunk_s,
                           self.attention_cuda_core_flop_s * f, self.gdn_flop_s * f)


# Fitted to the H200 on the synthetic qwen3-30b-a3b (2.73 GMAC a token on its linear layers, 393 kMAC
# a token and earlier position in attention, 48 layers of 128 experts): 36.6 us a token + 3.04 ns a
# token and position + 25 ms a chunk (0.52 ms a layer, 4.06 us an expert of it). The chunk's cost is
# the tenth session's prompt-plan A/B at 12 GiB (docs/PERF.md: one more chunk of the same prompt,
# compute-bound, cost 27 ms at 16,384 and 23 at 32,768 tokens); the two rates then fit the resident
# prompt (20,422 tok/s at 4096, 15,855 at 16384, one chunk each), and the model puts a resident
# 512-token prompt at 44 ms against 50 measured. The ninth session's fit had no chunk term (44.75 us +
# 2.219 ns), which priced a prompt in more chunks the same as in fewer and so let auto trade 2.6% of
# a prompt for kept cache slots. The chunk's cost is taken per expert from the 80B shape (512 experts
# a layer): its resident prompt fits 115 ms a chunk, 4x the 30B's, as its experts are. The other two
# rates are the 80B's too: its head_dim-256 attention on the CUDA-core kernel fits 10.4 ns a token and
# position for 196,608 flops (18.9 TFLOP/s), and the chunked delta rule ran 12.1 TFLOP/s of its own
# flops at 16,384 tokens (tools/gdn_chunk_bench.py). With them the model puts the 80B's resident
# prompt at 0.132 / 0.430 / 2.47 s for 512 / 4096 / 16384 tokens against 0.158 / 0.536 / 2.85
# measured (the rest: its expert GEMMs at 80-320 rows an expert, the DeltaNet's small kernels).
# Since then cuda/attention_tc.cu has a head_dim-256 kernel, so the 80B's attention is priced at the
# tensor-core rate, the 30B's Dh-128 fit, slowed by TC_ATTENTION_SLOWDOWN: the Dh-256 kernel (one
# block an SM on 32-cell tiles) ran 169 TFLOP/s at the 80B's shape (tools/attention_tc_bench.py
# --shape 80b, eleventh session) where the Dh-128 one ran 285 at the 30B's (its header). The model
# then puts the 80B's resident 16K prompt within 25% of the 9,762 tok/s measured with it (a test);
# the CUDA-core rate is left for head dims without a tensor-core kernel.
DEFAULT_PROMPT_RATES = PromptRates(149.2e12, 258.6e12, DEFAULT_NUM_SMS,
                                   "fitted to the H200's resident prompts and chunk A/B (docs/PERF.md)", 4.06e-6,
                                   18.9e12, 12.1e12)
# attention_ws.cu's TMA build (tma-attention: head dim 128 on an sm_90 GPU) against attention_tc.cu, the
# two kernels timed in one process on an H100 (docs/PERF.md, twenty-fifth session): 2.0x at 4,096 queries
# after no cells, 2.3-2.4x after 12,288 and 28,672, 2.2x after 126,976. With 2.2 the model (the H200's
# fit) puts the resident 4,096, 16,384 and 32,768-token prompts at 21,967, 20,223 and 16,664 tok/s, where
# an H100 measured 21,480, 19,500 and 16,300 (a test holds the model to these).
TMA_ATTENTION_SPEEDUP = 2.2
# tma-gemm (the prompt GEMMs over weights dequantized to f16, both operands by the TMA; chunks with
# strata.backends.cuda.moe.DQ_MIN_ROWS rows an expert) against the decoding mma.sync GEMMs, an H100 in one
# lease (docs/PERF.md, thirty-first session): the TMA GEMM ran 355-390 TFLOP/s on the 30B's expert shapes
# and 445-643 on its dense ones against 141-190, and a layer's 128 Q4_K experts dequantized in 0.64 ms
# (1.06 ps a weight). With the linear layers 2.0x faster (on the H200's fit, with tma-attention) and that
# cost a chunk, the model puts the resident 4,096, 16,384 and 32,768-token prompts at 28,798, 30,282 and
# 23,448 tok/s (a test holds it there) where the H100 read 28,884-29,419, 29,970 and 23,123 tok/s, against
# 21,427-21,567, 19,657 and 16,334 with --kernels-off tma-gemm (the model: 21,967, 20,223, 16,664).
TMA_GEMM_SPEEDUP = 2.0
TMA_DQ_WEIGHT_S = 1.06e-12
GDN_CHUNK_TOKENS = 64             # strata.backends.cuda.linear_attn.GDN_CHUNK
TC_ATTENTION_SLOWDOWN = {256: 285.0 / 169.0}    # a head dim's tensor-core prompt attention against Dh 128's
# Under tma-attention the Dh-256 build (64-cell tiles) ran 508-632 TFLOP/s at the 80B's shape and the Dh-128
# build 484-658 at the 30B's (H100, the twenty-fifth and twenty-seventh sessions' kernel A/Bs, 4,096 queries
# after 0 to 126,976 cells): the same rate, so a TMA plan prices both head dims alike (layer_work).


@dataclass(frozen=True)
class LayerWork:
    """A main layer's compute and bytes: multiply-accumulates a token outside the experts (dense),
    in its A experts, a token and earlier position in attention; its expert blob's bytes; whether its
    attention has a tensor-core prompt kernel, and the chunked delta rule's flops a token of a
    linear-attention layer."""
    dense_macs: float
    expert_macs: float
    attention_macs: float
    blob: int
    tensor_core_attention: bool = True
    gdn_flops: float = 0.0


def layer_work(sizes, tma_attention: bool = False) -> list[LayerWork]:
    """LayerWork of each main layer of a pack's sizes (strata.engine.planner.PackSizes). tma_attention:
    the GPU runs tma-attention's kernels, whose head dims (TMA_DEFAULT_HEAD_DIMS) all run at the Dh-128
    rate, so no TC_ATTENTION_SLOWDOWN applies to them."""
    a = sizes.args
    out = []
    for l in range(a.num_hidden_layers):
        prefix = f"blk.{l}."
        dense = sum(t["shape"][0] * t["shape"][1] for n, t in sizes.dense.items()
                    if n.startswith(prefix) and len(t["shape"]) == 2)
        parts = sizes.layers[l]["parts"]
        expert = a.num_experts_per_tok * sum(p["shape"][0] * p["shape"][1] for p in parts.values())
        full = a.is_full_attention(l) if hasattr(a, "is_full_attention") else True
        attention = 2 * a.num_attention_heads * a.head_dim if full else 0
        if a.head_dim in TC_ATTENTION_HEAD_DIMS and not (tma_attention and a.head_dim in TMA_DEFAULT_HEAD_DIMS):
            attention *= TC_ATTENTION_SLOWDOWN.get(a.head_dim, 1.0)     # priced as Dh-128 work at its measured rate
        gdn = 0.0
        if not full:        # chunks of C: the Gram matrix, its inverse, the state's update and output
            C, Hv = GDN_CHUNK_TOKENS, a.linear_num_value_heads
            Dk, Dv = a.linear_key_head_dim, a.linear_value_head_dim
            gdn = 2.0 * Hv * (2 * C * Dk + C * C / 6 + 3 * Dk * Dv + 2 * C * Dv)
        out.append(LayerWork(float(dense), float(expert), float(attention), sizes.blob(l),
                             not full or a.head_dim in TC_ATTENTION_HEAD_DIMS, gdn))
    return out


def effective_work(work: list[LayerWork], rates: PromptRates) -> list[LayerWork]:
    """work with the CUDA-core attention and the delta rule priced at the linear and tensor-core
    attention rates the recurrence uses (the same seconds); a layer that has neither is kept as it is,
    so work made effective once passes through again at the cost of a look."""
    out = []
    for w in work:
        if w.tensor_core_attention and not w.gdn_flops:
            out.append(w)
            continue
        att = w.attention_macs
        if not w.tensor_core_attention and rates.attention_cuda_core_flop_s > 0:
            att *= rates.attention_flop_s / rates.attention_cuda_core_flop_s
        dense = w.dense_macs
        if w.gdn_flops and rates.gdn_flop_s > 0:
            dense += 0.5 * w.gdn_flops * rates.linear_flop_s / rates.gdn_flop_s
        out.append(replace(w, dense_macs=dense, attention_macs=att, tensor_core_attention=True, gdn_flops=0.0))
    return out


@dataclass(frozen=True)
class PromptCost:
    """A prompt's predicted seconds, the bytes its chunks stream, and the seconds the copy stream
    sat waiting for ring slots (the ring's stalls) and the compute for copies (the bus's)."""
    seconds: float
    bus_bytes: int
    ring_wait_s: float
    bus_wait_s: float


def prompt_cost(work: list[LayerWork], missing: list[int], N: int, T: int, R: int, h2d_gb_s: float,
                rates: PromptRates, num_experts: int, top_k: int, stream_all_tokens: int) -> PromptCost:
    """The recurrence of the module doc for a prompt of N tokens in chunks of T through a ring of R
    slots; missing[l]: layer l's experts the cache does not keep during the prompt."""
    if N <= 0:
        return PromptCost(0.0, 0, 0.0, 0.0)
    work = effective_work(work, rates)
    native = _native()
    if native is not None:
        return PromptCost(*native.prompt_cost([w.dense_macs for w in work], [w.expert_macs for w in work],
                                              [w.attention_macs for w in work], [w.blob for w in work],
                                              list(missing), N, T, R, h2d_gb_s * 1e9 * PROMPT_BUS_EFFICIENCY,
                                              rates.linear_flop_s, rates.attention_flop_s, num_experts, top_k,
                                              stream_all_tokens, rates.expert_chunk_s * num_experts))
    return _prompt_cost_py(work, missing, N, T, R, h2d_gb_s, rates, num_experts, top_k, stream_all_tokens)


def _prompt_cost_py(work, missing, N, T, R, h2d_gb_s, rates, num_experts, top_k, stream_all_tokens) -> PromptCost:
    """prompt_cost's recurrence in Python, over work already made effective (effective_work)."""
    from collections import deque
    bus = h2d_gb_s * 1e9 * PROMPT_BUS_EFFICIENCY
    lin, att = rates.linear_flop_s, rates.attention_flop_s
    owners = deque()                 # (ring start, end, done) of batches a later copy may wait for
    pos, c_end, copy_end = 0, 0.0, 0.0
    ring_wait = bus_wait = 0.0
    nbytes = 0
    lo = 0
    while lo < N:
        Tc = min(T, N - lo)
        touched = 1.0 if Tc >= stream_all_tokens else 1.0 - (1.0 - top_k / num_experts) ** Tc
        for w, miss in zip(work, missing):
            pre = rates.expert_chunk_s * num_experts + 2.0 * (w.dense_macs * Tc / lin + w.attention_macs * Tc * (lo + 0.5 * Tc) / att)
            moe = 2.0 * w.expert_macs * Tc / lin
            m = int(miss * touched + 0.5)
            c_pre = c_end + pre
            if m == 0:
                c_end = c_pre + moe
                continue
            for b0 in range(0, m, R):
                k = min(R, m - b0)
                end = pos + k
                need = end - R - 1
                wait = 0.0
                while owners and owners[0][1] <= need:
                    owners.popleft()
                if need >= 0 and owners and owners[0][0] <= need:
                    wait = owners[0][2]
                if wait > copy_end:
                    ring_wait += wait - copy_end
                start = max(copy_end, wait)
                copy_end = start + k * w.blob / bus
                nbytes += k * w.blob
                if copy_end > c_pre:
                    bus_wait += copy_end - c_pre
                c_end = max(c_pre, copy_end) + moe * k / m
                c_pre = c_end
                owners.append((pos, end, c_end))
                pos = end
        lo += Tc
    return PromptCost(c_end, nbytes, ring_wait, bus_wait)


def _native():
    try:
        from .._ext import prompt_plan
    except ImportError:
        return None
    return prompt_plan if hasattr(prompt_plan, "prompt_cost") else None
