"""The measurements behind the CPU backend's kernel choices, on this machine (medians of repeated runs, in ms).

    python benchmarks/kernel_choices.py [--threads 2] [--only linear,steplinear,attention,cache,int8,quantize,blockmax]

* linear:    nn.Linear + ReLU against oneDNN's inner product with bias and ReLU fused, with the weight packed
             once (PackedLinear) and not; fp32, and bf16 where the CPU runs it natively (backends/onednn.py,
             capabilities.onednn_fp32).
* attention: the plain matmul-softmax-matmul against SDPA's fused kernel, causal, forward + backward, 4096
             tokens per batch, by sequence length (backends/cpu.py PLAIN_ATTENTION_MAX_LEN).
* cache:     one decoder step's attention over a beam cache: the plain form against SDPA (models/incremental.py).
* steplinear: a decoding step's fp32 products by row count (sentences x beam): oneDNN with the weight packed
             once (PackedLinear, what fp32 decoding runs where capabilities.onednn_fp32) against nn.Linear (MKL),
             on transformer_small's shapes (backends/onednn.py PackedLinear).
* int8:      a decoding step's products with int8 weights and activations quantized on the fly (oneDNN, bf16
             out; the quantization included) against the bf16 packed product, by shape (backends/onednn.py
             Int8PackedLinear, INT8_MIN_ROWS); where the CPU has native bf16 and int8.
* quantize:  activations to unsigned bytes for the int8 products: the arithmetic as tensor operations (float
             copy, scale, shift, round, two conversions) against ``torch.quantize_per_tensor``'s single pass, by
             shape (backends/onednn.py ``quantize_u8``).
* blockmax:  the maxima of 64-token blocks of bf16 log-probabilities: ``amax`` against the integer scan on the
             bit patterns (backends/cpu.py ``bf16_block_maxima``).

Numbers depend on the CPU (say which: ``lscpu``) and the torch version; docs/experiments.md keeps those measured.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def timed(fn, repeat: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def linear(native_bf16: bool) -> None:
    from attnmt.backends.onednn import PackedLinear

    m, k, n = 4032, 512, 2048
    for dtype in [torch.float32] + ([torch.bfloat16] if native_bf16 else []):
        x = torch.randn(m, k, dtype=dtype)
        lin = torch.nn.Linear(k, n).to(dtype)
        packed = PackedLinear(lin)
        w, b = lin.weight.detach(), lin.bias.detach()
        with torch.no_grad():
            plain = timed(lambda x=x, lin=lin: F.relu(lin(x)))
            fused = timed(lambda x=x, w=w, b=b: torch.ops.mkldnn._linear_pointwise(x, w, b, "relu", [], ""))
            pk = timed(lambda x=x, packed=packed: packed(x, relu=True))
        print(f"linear {str(dtype)[6:]:8s} ({m}x{k})x({k}x{n}) + relu: nn.Linear {plain:.2f} ms, oneDNN fused "
              f"{fused:.2f} ms, packed weight {pk:.2f} ms")


def step_linear() -> None:
    from attnmt.backends.onednn import PackedLinear

    # (in, out) of transformer_small's decoding step: fused query/key/value, the square projections (self-attention
    # output, cross-attention query and output), the feed-forward in and out, the output projection (8k pieces)
    shapes = ((256, 768), (256, 256), (256, 1024), (1024, 256), (256, 7800))
    print("step products, fp32, microseconds packed / nn.Linear, by rows: " +
          ", ".join(f"{k}x{n}" for k, n in shapes))
    for m in (4, 16, 64, 128, 256, 512):
        row = []
        for k, n in shapes:
            x, lin = torch.randn(m, k), torch.nn.Linear(k, n)
            packed = PackedLinear(lin)
            with torch.no_grad():
                t_packed = timed(lambda x=x, packed=packed: packed(x), repeat=50, warmup=10)
                t_mkl = timed(lambda x=x, lin=lin: lin(x), repeat=50, warmup=10)
            row.append(f"{t_packed * 1e3:6.0f} / {t_mkl * 1e3:6.0f}")
        print(f"  {m:4d} rows: " + ", ".join(row))


def int8() -> None:
    from attnmt.backends import configure_process, onednn
    from attnmt.backends.onednn import Int8PackedLinear, PackedLinear

    configure_process("generate", "cpu")  # as attnmt generate runs: the quantization's temporaries reuse memory

    threshold, onednn.INT8_MIN_ROWS = onednn.INT8_MIN_ROWS, 1  # the int8 kernel at every row count, to show
    # where the threshold belongs; restored below

    # (rows, in, out) of transformer_small's decoding steps: output projection, feed-forward in and out, fused
    # query/key/value, a square projection; 1,024 rows = 256 sentences x beam 4, 64 rows = a batch's tail
    for m, k, n in ((256, 256, 9656), (1024, 256, 1024), (1024, 1024, 256), (1024, 256, 768), (1024, 256, 256),
                    (128, 256, 768), (64, 256, 768)):
        x = torch.randn(m, k).bfloat16()
        lin = torch.nn.Linear(k, n).bfloat16()
        q, packed = Int8PackedLinear(lin), PackedLinear(lin)
        with torch.no_grad():
            t_bf16 = timed(lambda x=x, packed=packed: packed(x))
            t_int8 = timed(lambda x=x, q=q: q(x))
        print(f"int8 ({m}x{k})x({k}x{n}): bf16 packed {t_bf16:.3f} ms, int8 with quantization {t_int8:.3f} ms "
              f"({t_bf16 / t_int8:.2f}x)")
    onednn.INT8_MIN_ROWS = threshold


def quantize() -> None:
    from attnmt.backends import configure_process
    from attnmt.backends.onednn import quantize_u8

    configure_process("generate", "cpu")

    def arithmetic(x):  # the same quantization as five tensor operations, rounding halves upwards
        lo, hi = torch.aminmax(x)
        scale = max(float(torch.maximum(-lo, hi)), 1e-30) / 127
        return x.float().mul_(1 / scale).add_(128.5).to(torch.int32).to(torch.uint8), scale

    # (rows, width) of transformer_small's product inputs: a decoding step's (256 sentences x beam 4) model-wide
    # and feed-forward-wide inputs, and an encoder batch's (8,192 tokens)
    for m, k in ((1024, 256), (1024, 1024), (8192, 256), (8192, 1024)):
        x = torch.randn(m, k).bfloat16()
        t_old, t_new = timed(lambda x=x: arithmetic(x)), timed(lambda x=x: quantize_u8(x))
        assert int((arithmetic(x)[0].int() - quantize_u8(x)[0].int()).abs().max()) <= 1  # ties only
        print(f"quantize bf16 ({m}x{k}) to bytes: tensor arithmetic {t_old:.3f} ms, quantize_per_tensor "
              f"{t_new:.3f} ms ({t_old / t_new:.2f}x)")


def attention(dtype: torch.dtype) -> None:
    from attnmt.models.transformer import plain_attention

    for length in (32, 128, 256, 384, 512):
        batch = max(1, 4096 // length)
        q, k, v = (torch.randn(batch, 8, length, 64, dtype=dtype, requires_grad=True) for _ in range(3))

        def run(fn):
            def step():
                out = fn()
                out.sum().backward()
            return timed(step, repeat=5, warmup=2)

        plain = run(lambda q=q, k=k, v=v: plain_attention(q, k, v, None, True, 0.0))
        sdpa = run(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        print(f"attention {str(dtype)[6:]} causal fwd+bwd, {batch} x {length} tokens: plain {plain:.1f} ms, "
              f"SDPA {sdpa:.1f} ms ({sdpa / plain:.2f}x)")


def cache(dtype: torch.dtype) -> None:
    from attnmt.models.incremental import _attend

    n, h, beam, length, dh = 64, 4, 4, 24, 64
    q = torch.randn(n, h, beam, dh, dtype=dtype)
    k, v = (torch.randn(n, h, length * beam, dh, dtype=dtype) for _ in range(2))
    bias = torch.zeros(n, 1, beam, length * beam, dtype=dtype)
    with torch.no_grad():
        plain = timed(lambda: _attend(q, k, v, bias), repeat=50)
        sdpa = timed(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias), repeat=50)
    print(f"cache attention {str(dtype)[6:]} ({n} sentences x beam {beam}, {length * beam} slots): plain "
          f"{plain:.3f} ms, SDPA {sdpa:.3f} ms ({sdpa / plain:.2f}x)")


def blockmax() -> None:
    from attnmt.backends.cpu import bf16_block_maxima

    x = torch.log_softmax(torch.randn(1024, 9664), -1).to(torch.bfloat16)
    n = 9664 // 64
    ref = timed(lambda: x.unflatten(1, (n, -1)).amax(dim=2), repeat=30)
    ours = timed(lambda: bf16_block_maxima(x, n, True), repeat=30)
    assert torch.equal(bf16_block_maxima(x, n, True), x.unflatten(1, (n, -1)).amax(dim=2))
    print(f"block maxima bf16 (1024 x 9664, blocks of 64): amax {ref:.3f} ms, bit-pattern scan {ours:.3f} ms "
          f"({ref / ours:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="linear,steplinear,attention,cache,int8,quantize,blockmax")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from attnmt.backends import cpu

    caps = cpu()
    print(f"CPU: {caps.describe()}; torch {torch.__version__}, {args.threads} threads")
    dtype = torch.bfloat16 if caps.native_bf16 else torch.float32
    only = set(args.only.split(","))
    if "linear" in only:
        linear(caps.native_bf16)
    if "steplinear" in only:
        step_linear()
    if "attention" in only:
        attention(dtype)
    if "cache" in only:
        cache(dtype)
    if "int8" in only and caps.onednn_int8:
        int8()
    if "quantize" in only and caps.onednn_int8:
        quantize()
    if "blockmax" in only:
        blockmax()


if __name__ == "__main__":
    main()
