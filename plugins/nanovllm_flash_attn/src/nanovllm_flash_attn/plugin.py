"""Entry point of ``nanovllm-flash-attn``: registers the ``flash_attn`` backend lazily, or as unavailable with
the reason (no FA4 wheel, no suitable GPU). Importing this imports no torch, triton or flash_attn."""

from nanovllm.hookspecs import hookimpl

from nanovllm_flash_attn.availability import probe, unavailable_reason

# The triton backend's head sizes: a call FA4 does not take runs its kernels. FA4 takes all of them on
# SM 9.x (8..256, multiples of 8; 16 with pages it loads through cp.async) and SM 10.x (<= 128, and 256).
HEAD_SIZES = (32, 64, 128, 256)
DTYPES = ("float16", "bfloat16")  # FA4's forward on SM 9.x (fp8 needs SM 10.x)


@hookimpl
def register_attention_backends(registry) -> None:
    registry.add_attention_backend(
        "flash_attn",
        "nanovllm_flash_attn.backend:FlashAttnBackend",
        devices=("cuda",),
        dtypes=DTYPES,
        head_sizes=HEAD_SIZES,
        config="nanovllm_flash_attn.config:FlashAttnConfig",
        unavailable=unavailable_reason(probe()),
    )
