# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The GPU forward's pool in closed form (prompt chunks, decode steps), and the planner's chunk search.

strata.engine.memory_model describes the GPU prompt path (DeviceOps under Qwen3Moe.forward, chunks of
T > GEMV_MAX_T tokens) as numbers: MODEL_FIELDS for the model and LAYER_FIELDS per layer (each
dense projection's rows and what its GEMM borrows, each layer's MoE path). prompt_pool replays that
path's pool blocks, in the order the forward takes and drops them, through the pool's first-fit
(strata.backends.cuda.memory.Pool over one unbounded segment): the same live high-water mark and
address high-water mark as the dry run on a null runtime, in a tenth of a millisecond instead of a
forward of Python ops (a tenth of a second on the 48-layer shapes). Frees between two allocations
commute (the free ranges they leave are the same in any order), so only each block's last use
between allocations matters. tests/engine/test_prompt_plan.py keeps the two equal over a sweep of
shapes, T and KV formats; a change to the forward's allocations must change the replay here.

decode_step does the same for a decode step (or a verify window) of T <= GEMV_MAX_T tokens, whose ids
and positions are already on the device. largest_chunk is the planner's bisection for `--prefill
auto` over the closed form. prompt_cost is strata.engine.prompt_cost's recurrence (a prompt's
seconds under a chunk, ring and kept slots), which --prefill auto runs over its candidate plans.
"""

from libcpp.vector cimport vector

# Column order of the `model` vector and of each `layers` row; memory_model builds both by these names.
MODEL_FIELDS = ("hidden", "heads", "kv_heads", "head_dim", "experts", "top_k", "vocab", "layers",
                "align", "tile_rows", "stream_all_tokens", "group_on_device")
LAYER_FIELDS = ("q_rows", "q_gemm", "q_scratch", "k_rows", "k_gemm", "k_scratch", "v_rows", "v_gemm", "v_scratch",
                "o_rows", "o_gemm", "o_scratch", "r_rows", "r_gemm", "r_scratch",
                "inter", "gate_up_fused", "tensor_core", "gate_gemm", "gate_scratch", "up_gemm", "up_scratch",
                "down_gemm", "down_scratch", "decode_fused")
# A GEMM's borrowing (the *_gemm columns): none (f32 weights), a one-group tile table (tensor cores), or a
# dequantized-rows scratch of *_scratch bytes.
GEMM_NONE, GEMM_TABLE, GEMM_SCRATCH = 0, 1, 2
# Attention paths: fused QK-norm/RoPE/append (f16 cells), unfused (f16, an odd head dim), quantized cells,
# fused over f16 cells on the host (--kv-resident) whose prompt attention reads the layer staged in VRAM.
ATTN_FUSED, ATTN_UNFUSED, ATTN_QUANTIZED, ATTN_STAGED = 0, 1, 2, 3

cdef enum:
    M_D, M_H, M_HK, M_DH, M_E, M_A, M_V, M_L, M_ALIGN, M_BM, M_STREAM_ALL, M_ON_DEVICE, M_COUNT

cdef enum:
    C_Q, C_K = 3, C_V = 6, C_O = 9, C_R = 12
    C_I = 15, C_FUSED, C_TC, C_GATE, C_GATE_SCRATCH, C_UP, C_UP_SCRATCH, C_DOWN, C_DOWN_SCRATCH, C_DECODE_FUSED
    C_COUNT

assert len(MODEL_FIELDS) == M_COUNT and len(LAYER_FIELDS) == C_COUNT


cdef struct Block:
    long long off
    long long size


cdef inline long long _cdiv(long long a, long long b) nogil:
    return (a + b - 1) // b


cdef class _FirstFit:
    """Pool's first-fit over one unbounded segment: sorted free ranges, merged on release."""
    cdef vector[long long] offs
    cdef vector[long long] sizes
    cdef long long align, used, peak, arena, total

    def __cinit__(self, long long align):
        self.align = align
        self.offs.push_back(0)
        self.sizes.push_back(1LL << 60)
        self.used = self.peak = self.arena = self.total = 0

    cdef Block take(self, long long nbytes):
        cdef long long size = _cdiv(nbytes if nbytes > 1 else 1, self.align) * self.align
        cdef size_t i
        cdef Block b
        for i in range(self.offs.size()):
            if self.sizes[i] >= size:
                b.off, b.size = self.offs[i], size
                if self.sizes[i] == size:
                    self.offs.erase(self.offs.begin() + i)
                    self.sizes.erase(self.sizes.begin() + i)
                else:
                    self.offs[i] += size
                    self.sizes[i] -= size
                self.used += size
                self.total += size
                if self.used > self.peak:
                    self.peak = self.used
                if b.off + size > self.arena:
                    self.arena = b.off + size
                return b
        raise AssertionError("unreachable: the segment is unbounded")

    cdef void give(self, Block b):
        cdef size_t i = 0, n = self.offs.size()
        self.used -= b.size
        while i < n and self.offs[i] < b.off:
            i += 1
        self.offs.insert(self.offs.begin() + i, b.off)
        self.sizes.insert(self.sizes.begin() + i, b.size)
        if i + 1 < self.offs.size() and b.off + b.size == self.offs[i + 1]:
            self.sizes[i] += self.sizes[i + 1]
            self.offs.erase(self.offs.begin() + i + 1)
            self.sizes.erase(self.sizes.begin() + i + 1)
        if i > 0 and self.offs[i - 1] + self.sizes[i - 1] == b.off:
            self.sizes[i - 1] += self.sizes[i]
            self.offs.erase(self.offs.begin() + i)
            self.sizes.erase(self.sizes.begin() + i)


cdef long long _table_bytes(long long groups, long long rows, long long bm):
    """GroupTable(ops, groups, rows): addresses (an even count) then [tiles, 4] int32."""
    return 8 * _cdiv(groups, 2) * 2 + 16 * (_cdiv(rows, bm) + groups)


cdef void _borrow(_FirstFit p, long long gemm, long long scratch, long long rows, long long bm):
    """What DeviceOps._gemm_weight takes and gives back for `rows` input rows."""
    if gemm == GEMM_TABLE:
        p.give(p.take(_table_bytes(1, rows, bm)))
    elif gemm == GEMM_SCRATCH:
        p.give(p.take(scratch))


cdef Block _linear(_FirstFit p, const long long[::1] row, int col, long long T, long long bm):
    cdef Block y = p.take(4 * T * row[col])
    _borrow(p, row[col + 1], row[col + 2], T, bm)
    return y


cdef Block _attention(_FirstFit p, const long long[::1] m, long long T, long long cells, int path, bint k_rotated,
                      bint upload_positions, Block *pos, bint *have_pos):
    """qk_norm_rope_attention -> its output block; positions uploaded by the layer's first use."""
    cdef long long q_bytes = 4 * T * m[M_H] * m[M_DH], k_bytes = 4 * T * m[M_HK] * m[M_DH]
    cdef Block q_out, out, qn, qr, kn, kr, qc, kf, vf
    if path == ATTN_FUSED or path == ATTN_STAGED:
        if upload_positions:
            _positions(p, T, pos, have_pos)
        q_out = p.take(q_bytes)
        if path == ATTN_STAGED:        # f16 cells on the host: the layer staged in VRAM (DeviceOps._attend_cells)
            kf = p.take(2 * cells * m[M_HK] * m[M_DH])
            vf = p.take(2 * cells * m[M_HK] * m[M_DH])
            out = p.take(q_bytes)
            p.give(kf)
            p.give(vf)
        else:
            out = p.take(q_bytes)
        p.give(q_out)
        return out
    qn = p.take(q_bytes)
    qr = p.take(q_bytes)
    if upload_positions:
        _positions(p, T, pos, have_pos)
    p.give(qn)
    kn = p.take(k_bytes)
    kr = p.take(k_bytes)
    p.give(kn)
    if path == ATTN_QUANTIZED:
        if k_rotated:
            qc = p.take(q_bytes)
        kf = p.take(2 * cells * m[M_HK] * m[M_DH])
        vf = p.take(2 * cells * m[M_HK] * m[M_DH])
        out = p.take(q_bytes)
        p.give(kf)
        p.give(vf)
        if k_rotated:
            p.give(qc)
    else:
        out = p.take(q_bytes)
    p.give(qr)
    p.give(kr)
    return out


cdef void _positions(_FirstFit p, long long T, Block *pos, bint *have_pos):
    """DeviceOps._positions: the new upload, then the last chunk's goes."""
    cdef Block new = p.take(4 * (T + 1))
    if have_pos[0]:
        p.give(pos[0])
    pos[0] = new
    have_pos[0] = True


cdef Block _moe(_FirstFit p, const long long[::1] m, const long long[::1] row, long long T, bint resident):
    """moe_grouped -> its output block (one expert holds every slot: the dry run's routing is zeros)."""
    cdef long long D = m[M_D], E = m[M_E], bm = m[M_BM], I = row[C_I]
    cdef long long S = T * m[M_A]
    cdef bint fused = row[C_FUSED], tc = row[C_TC]
    cdef bint on_device = m[M_ON_DEVICE] and tc and (resident or T >= m[M_STREAM_ALL])
    cdef Block index, tiles, xs, h, gu, g, u, y, table, out
    index = p.take(4 * (2 * S + E + 1) if on_device else 4 * 2 * S)
    if on_device:
        tiles = p.take(16 * (E + S // bm))
    xs = p.take(4 * S * D)
    h = p.take(4 * S * I)
    if fused:
        gu = p.take(8 * S * I)
    else:
        g = p.take(4 * S * I)
        u = p.take(4 * S * I)
    y = p.take(4 * S * D)
    if on_device:
        table = p.take(8 * E)
    elif tc:
        table = p.take(_table_bytes(E if E < S else S, S, bm))
    else:
        _borrow(p, row[C_GATE], row[C_GATE_SCRATCH], S, bm)
        if not fused:
            _borrow(p, row[C_UP], row[C_UP_SCRATCH], S, bm)
        _borrow(p, row[C_DOWN], row[C_DOWN_SCRATCH], S, bm)
    out = p.take(4 * T * D)
    p.give(index)
    if on_device:
        p.give(tiles)
    p.give(xs)
    p.give(h)
    if fused:
        p.give(gu)
    else:
        p.give(g)
        p.give(u)
    p.give(y)
    if on_device or tc:
        p.give(table)
    return out


cdef _FirstFit _replay(long long T, long long chunks, long long max_cells, int attention_path, bint k_rotated,
                       bint resident, const long long[::1] m, const long long[:, ::1] layers):
    cdef _FirstFit p = _FirstFit(m[M_ALIGN])
    cdef long long D = m[M_D], bm = m[M_BM], L = m[M_L]
    cdef long long cells = max_cells if max_cells > T else T     # the cache's: its quantized scratch
    cdef long long c, l
    cdef Block pos, ids, x, normed, q, k, v, attn, attn_out, x_mid, ffn_norm, router, expert_ids, expert_w
    cdef Block moe_out, x_next, normed_next, head_in, logits
    cdef bint have_pos = False
    cdef const long long[::1] row
    if cells < 1:
        cells = 1
    for c in range(chunks):
        pos = p.take(4 * (T + 1))        # the caller's upload_positions, once per forward
        ids = p.take(4 * T)
        x = p.take(4 * T * D)
        p.give(ids)
        normed = p.take(4 * T * D)
        for l in range(L):
            row = layers[l]
            q = _linear(p, row, C_Q, T, bm)
            k = _linear(p, row, C_K, T, bm)
            v = _linear(p, row, C_V, T, bm)
            attn = _attention(p, m, T, cells, attention_path, k_rotated, False, &pos, &have_pos)
            attn_out = _linear(p, row, C_O, T, bm)
            x_mid = p.take(4 * T * D)
            ffn_norm = p.take(4 * T * D)
            router = _linear(p, row, C_R, T, bm)
            expert_ids = p.take(4 * T * m[M_A])
            expert_w = p.take(4 * T * m[M_A])
            moe_out = _moe(p, m, row, T, resident)
            x_next = p.take(4 * T * D)
            normed_next = p.take(4 * T * D)
            p.give(q)
            p.give(k)
            p.give(v)
            p.give(attn)
            p.give(attn_out)
            p.give(x_mid)
            p.give(ffn_norm)
            p.give(router)
            p.give(expert_ids)
            p.give(expert_w)
            p.give(moe_out)
            p.give(x)
            p.give(normed)
            x, normed = x_next, normed_next
        # the last row's logits: a row slice off the 16-byte alignment is copied first
        if (T - 1) * D * 4 % 16:
            head_in = p.take(4 * D)
            logits = p.take(4 * m[M_V])
            p.give(head_in)
        else:
            logits = p.take(4 * m[M_V])
        p.give(normed)
        p.give(logits)
        p.give(x)
        p.give(pos)                      # the chunk's positions go after its logits and hidden
    return p


def prompt_pool(long long T, long long chunks, long long max_cells, int attention_path, bint k_rotated,
                bint resident, const long long[::1] model, const long long[:, ::1] layers):
    """(live high-water mark, address high-water mark) of `chunks` prompt chunks of T tokens over a
    KV cache of max(max_cells, T) cells (memory_model's dry run of the same arguments)."""
    cdef _FirstFit p = _replay(T, chunks, max_cells, attention_path, k_rotated, resident, model, layers)
    return p.peak, p.arena


cdef long long _need(long long T, long long chunks, long long max_cells, int attention_path, bint k_rotated,
                     const long long[::1] m, const long long[:, ::1] layers, long long zeros_min):
    """planner.bytes_needed: the arena of a streamed prompt, plus the zeros buffer's growth."""
    cdef _FirstFit p = _replay(T, chunks, max_cells, attention_path, k_rotated, False, m, layers)
    cdef long long zeros = 4 * T * m[M_D]
    return p.arena + (zeros if zeros > zeros_min else zeros_min) - zeros_min


def bytes_needed(long long T, long long chunks, long long max_cells, int attention_path, bint k_rotated,
                 const long long[::1] model, const long long[:, ::1] layers, long long zeros_min):
    return _need(T, chunks, max_cells, attention_path, k_rotated, model, layers, zeros_min)


def largest_chunk(const long long[::1] candidates, long long clamp, long long limit_bytes, long long extra_bytes,
                  long long chunks, long long max_cells, int attention_path, bint k_rotated,
                  const long long[::1] model, const long long[:, ::1] layers, long long zeros_min):
    """The largest candidate T (ascending) with bytes_needed(min(T, clamp)) + extra_bytes <= limit_bytes,
    by bisection (bytes_needed is monotone on the grid); None when none fits."""
    cdef Py_ssize_t lo = 0, hi = candidates.shape[0], mid
    cdef long long T
    while lo < hi:
        mid = (lo + hi) // 2
        T = candidates[mid] if candidates[mid] < clamp else clamp
        if _need(T, chunks, max_cells, attention_path, k_rotated, model, layers, zeros_min) + extra_bytes <= limit_bytes:
            lo = mid + 1
        else:
            hi = mid
    return candidates[lo - 1] if lo else None


cdef Block _decode_attention(_FirstFit p, const long long[::1] m, long long T, long long cells, int path,
                             bint k_rotated, long long splits, bint group_fits, bint tiled):
    """qk_norm_rope_attention for T <= GEMV_MAX_T tokens -> its output block. The tokens take the
    split-K decode kernel as rows of one sequence (partials of `splits` splits a head and row) where
    the query group fits the kernel (and, over f16 cells, the head dim is a tiled kernel's); else the
    prompt kernels."""
    cdef bint split_k = group_fits and tiled
    cdef long long q_bytes = 4 * T * m[M_H] * m[M_DH], k_bytes = 4 * T * m[M_HK] * m[M_DH]
    cdef Block q_out, out, qn, qr, kn, kr, qc, kf, vf
    if path == ATTN_FUSED or (path == ATTN_QUANTIZED and split_k):
        # one launch writes the normed, roped (and, over a rotated K, rotated) q and appends the cells
        q_out = p.take(q_bytes)
        out = _decode_attend(p, m, T, q_bytes, splits, split_k)
        p.give(q_out)
        return out
    qn = p.take(q_bytes)
    qr = p.take(q_bytes)
    p.give(qn)
    kn = p.take(k_bytes)
    kr = p.take(k_bytes)
    p.give(kn)
    if path == ATTN_QUANTIZED:        # a group or head dim the split-K kernels do not take: the f16 scratch
        if k_rotated:
            qc = p.take(q_bytes)
        kf = p.take(2 * cells * m[M_HK] * m[M_DH])
        vf = p.take(2 * cells * m[M_HK] * m[M_DH])
        out = _decode_attend(p, m, T, q_bytes, splits, False)
        p.give(kf)
        p.give(vf)
        if k_rotated:
            p.give(qc)
    else:
        out = _decode_attend(p, m, T, q_bytes, splits, split_k)
    p.give(qr)
    p.give(kr)
    return out


cdef Block _decode_attend(_FirstFit p, const long long[::1] m, long long T, long long q_bytes, long long splits,
                          bint split_k):
    cdef Block out = p.take(q_bytes), acc, ml
    if split_k:
        acc = p.take(4 * T * m[M_H] * splits * m[M_DH])
        ml = p.take(8 * T * m[M_H] * splits)
        p.give(acc)
        p.give(ml)
    return out


cdef Block _decode_moe(_FirstFit p, const long long[::1] m, const long long[::1] row, long long T):
    """moe_decode -> its output block: the fused two launches, else the GEMV path."""
    cdef long long S = T * m[M_A], I = row[C_I], D = m[M_D]
    cdef Block h, gu, g, u, y, out
    if row[C_DECODE_FUSED]:
        h = p.take(4 * S * I)
        out = p.take(4 * T * D)
        p.give(h)
        return out
    h = p.take(4 * S * I)
    if row[C_FUSED]:
        gu = p.take(8 * S * I)
    else:
        g = p.take(4 * S * I)
        u = p.take(4 * S * I)
    y = p.take(4 * S * D)
    out = p.take(4 * T * D)
    p.give(h)
    if row[C_FUSED]:
        p.give(gu)
    else:
        p.give(g)
        p.give(u)
    p.give(y)
    return out


def decode_step(long long T, long long max_cells, int attention_path, bint k_rotated, long long splits,
                bint group_fits, bint tiled, const long long[::1] model, const long long[:, ::1] layers):
    """(live high-water mark, sum of every block) of one forward of T <= GEMV_MAX_T tokens over a KV
    cache of max_cells cells (memory_model.decode_step_bytes' dry run); splits, group_fits, tiled:
    the split-K decode attention's (_decode_attention)."""
    cdef _FirstFit p = _FirstFit(model[M_ALIGN])
    cdef long long D = model[M_D], L = model[M_L], l
    cdef long long cells = max_cells if max_cells > 1 else 1
    cdef Block x, normed, q, k, v, attn, attn_out, x_mid, ffn_norm, router, expert_ids, expert_w, moe_out
    cdef Block x_next, normed_next
    cdef const long long[::1] row
    x = p.take(4 * T * D)
    normed = p.take(4 * T * D)
    for l in range(L):
        row = layers[l]
        q = p.take(4 * T * row[C_Q])
        k = p.take(4 * T * row[C_K])
        v = p.take(4 * T * row[C_V])
        attn = _decode_attention(p, model, T, cells, attention_path, k_rotated, splits, group_fits, tiled)
        attn_out = p.take(4 * T * row[C_O])
        x_mid = p.take(4 * T * D)
        ffn_norm = p.take(4 * T * D)
        router = p.take(4 * T * row[C_R])
        expert_ids = p.take(4 * T * model[M_A])
        expert_w = p.take(4 * T * model[M_A])
        moe_out = _decode_moe(p, model, row, T)
        x_next = p.take(4 * T * D)
        normed_next = p.take(4 * T * D)
        p.give(q)
        p.give(k)
        p.give(v)
        p.give(attn)
        p.give(attn_out)
        p.give(x_mid)
        p.give(ffn_norm)
        p.give(router)
        p.give(expert_ids)
        p.give(expert_w)
        p.give(moe_out)
        p.give(x)
        p.give(normed)
        x, normed = x_next, normed_next
    p.take(4 * T * model[M_V])
    return p.peak, p.total


def prompt_cost(dense_macs, expert_macs, attention_macs, blob, missing, long long N, long long T, long long R,
                double bus_bytes_s, double linear_flop_s, double attention_flop_s, long long num_experts,
                long long top_k, long long stream_all_tokens, double layer_chunk_s=0.0):
    """strata.engine.prompt_cost's recurrence (its module doc; _prompt_cost_py there is the same in
    Python) -> (seconds, bus bytes, ring wait s, bus wait s) of a prompt of N tokens in chunks of T
    through a ring of R slots, per main layer: its MACs a token (dense, experts), a token and
    position (attention), blob bytes and experts not kept during the prompt; layer_chunk_s: the fixed
    seconds a layer of a chunk costs besides its multiply-adds."""
    cdef Py_ssize_t L = len(dense_macs), l, head = 0
    cdef vector[double] dm, em, am, bl
    cdef vector[long long] miss
    for l in range(L):
        dm.push_back(dense_macs[l]); em.push_back(expert_macs[l]); am.push_back(attention_macs[l])
        bl.push_back(blob[l]); miss.push_back(missing[l])
    cdef vector[long long] o_start, o_end
    cdef vector[double] o_done
    cdef long long pos = 0, lo = 0, Tc, m, b0, k, end, need, nbytes = 0
    cdef double c_end = 0.0, copy_end = 0.0, ring_wait = 0.0, bus_wait = 0.0
    cdef double touched, pre, moe, c_pre, wait, start
    cdef int i
    if N <= 0 or T <= 0 or R <= 0:
        return 0.0, 0, 0.0, 0.0
    with nogil:
        while lo < N:
            Tc = T if N - lo > T else N - lo
            if Tc >= stream_all_tokens:
                touched = 1.0
            else:
                touched = 1.0
                for i in range(Tc):
                    touched *= 1.0 - <double>top_k / num_experts
                touched = 1.0 - touched
            for l in range(L):
                pre = layer_chunk_s + 2.0 * (dm[l] * Tc / linear_flop_s + am[l] * Tc * (lo + 0.5 * Tc) / attention_flop_s)
                moe = 2.0 * em[l] * Tc / linear_flop_s
                m = <long long>(miss[l] * touched + 0.5)
                c_pre = c_end + pre
                if m == 0:
                    c_end = c_pre + moe
                    continue
                b0 = 0
                while b0 < m:
                    k = R if m - b0 > R else m - b0
                    end = pos + k
                    need = end - R - 1
                    wait = 0.0
                    while head < <Py_ssize_t>o_end.size() and o_end[head] <= need:
                        head += 1
                    if need >= 0 and head < <Py_ssize_t>o_end.size() and o_start[head] <= need:
                        wait = o_done[head]
                    if wait > copy_end:
                        ring_wait += wait - copy_end
                    start = copy_end if copy_end > wait else wait
                    copy_end = start + k * bl[l] / bus_bytes_s
                    nbytes += k * <long long>bl[l]
                    if copy_end > c_pre:
                        bus_wait += copy_end - c_pre
                    c_end = (c_pre if c_pre > copy_end else copy_end) + moe * k / m
                    c_pre = c_end
                    o_start.push_back(pos)
                    o_end.push_back(end)
                    o_done.push_back(c_end)
                    pos = end
                    b0 += k
            lo += Tc
    return c_end, nbytes, ring_wait, bus_wait
