"""What the host knows of the kernel libraries in cuda/: limits and the types each entry point reads."""

RMS_NORM_BLOCK = 256  # threads per row; cuda/rms_norm.cu accepts any multiple of 32 up to 1024
# cuda/embed.cu's strata_embed_<type>: every type strata.quant reads, so every pack's embedding is
# read on the device from device-side ids (tests/kernels/test_embed_gpu.py checks the source's list)
EMBED_QTYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                "Q6_K", "IQ4_NL", "IQ4_XS")
