// cuda/gated_delta_chunk.cu compiled for the host over tests/kernels/cuda_host_shim.h: its two kernels as
// C entry points with their launch shapes, for tests/kernels/test_gated_delta_chunk_host.py (ctypes).
#include "cuda_host_shim.h"
#include "../../cuda/gated_delta_chunk.cu"

extern "C" void run_gdn_chunk_prep(const float* q, const float* k, const float* g, const float* beta, float* scratch,
                                   int T, int Hv, int Hg, int Dk, float q_scale, int64_t qk_ld) {
    shim::launch({unsigned((T + GDN_CHUNK - 1) / GDN_CHUNK), unsigned(Hv), 1},
                 [&] { strata_gdn_chunk_prep_f32(q, k, g, beta, scratch, T, Hv, Hg, Dk, q_scale, qk_ld); });
}

extern "C" void run_gdn_chunk_scan(const float* q, const float* k, const float* v, const float* scratch, float* state,
                                   float* out, int T, int Hv, int Hg, int Dk, int Dv, int64_t qk_ld, int64_t v_ld) {
    shim::launch({unsigned((Dv + GDN_SCAN_COLS - 1) / GDN_SCAN_COLS), unsigned(Hv), 1},
                 [&] { strata_gdn_chunk_scan_f32(q, k, v, scratch, state, out, T, Hv, Hg, Dk, Dv, qk_ld, v_ld); });
}
