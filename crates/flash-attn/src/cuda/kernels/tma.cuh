// TMA, mbarrier and named-barrier helpers (sm_90a) for the warp-specialised kernels
// (flash_fwd_ws.cuh, and flash_bwd.cuh's run_ws): a tensor-map descriptor as the kernels take it,
// tile loads that complete on an mbarrier, and the waits and arrivals of a producer/consumer
// pipeline.

#if !FA_FWD_ENTRY && FA_WGMMA

// A CUtensorMap (the driver's opaque 128-byte TMA descriptor, built on the host per call).
struct alignas(128) TmaDesc {
    u64 x[16];
};

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n"
        "}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
// A TMA tile load into shared memory, completing `bytes` on `bar`.
__device__ __forceinline__ void tma_load_4d(u32 dst, const TmaDesc* desc, int c0, int c1, int c2, int c3, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
        "%5}], [%6];\n" ::"r"(dst),
        "l"(desc), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
        : "memory");
}
__device__ __forceinline__ void tma_load_3d(u32 dst, const TmaDesc* desc, int c0, int c1, int c2, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
        "[%5];\n" ::"r"(dst),
        "l"(desc), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
        : "memory");
}
// Barrier `id` (1-15) over `threads` threads: wait for all, or arrive without waiting.
__device__ __forceinline__ void named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

#endif  // !FA_FWD_ENTRY && FA_WGMMA
