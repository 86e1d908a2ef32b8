"""The hardware seam: precision from the CPU's capabilities, the fallback paths, and the modules a backend swaps
in computing what the plain model computes."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from conftest import NATIVE_BF16, needs_native_bf16, tiny_transformer

from attnmt.backends import backend_for, capabilities, resolve_precision
from attnmt.backends import onednn as onednn_module
from attnmt.backends.base import Backend
from attnmt.backends.cpu import INT8_ONEDNN_MIN_ROWS, CpuBackend, Int8Linear, padded_rows
from attnmt.backends.onednn import (
    INT8_MIN_ROWS,
    QUANTIZE_BLOCK,
    Int8PackedLinear,
    PackedLinear,
    quantize_u8,
    quantize_u8_affine,
)
from attnmt.errors import UserError
from attnmt.generation.generator import GenerationConfig
from attnmt.models.linear import Linear

CPU = torch.device("cpu")

pytestmark = pytest.mark.precision


def _model(seed=0):
    return tiny_transformer(seed)


def _inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randint(4, 50, (3, 9), generator=g), torch.full((3,), 9), torch.randint(4, 50, (3, 7), generator=g)


def test_precision_auto_follows_the_cpu():
    assert resolve_precision("auto", CPU) == ("bf16" if NATIVE_BF16 else "fp32")
    assert resolve_precision("fp32", CPU) == "fp32"
    with pytest.raises(UserError, match="--fp16 needs a CUDA GPU"):
        resolve_precision("fp16", CPU)


def test_without_native_bf16_auto_is_fp32_and_bf16_is_a_one_line_error(no_native_bf16):
    caps = capabilities.cpu()
    assert not caps.native_bf16 and not caps.fused_linear
    assert "ATTNMT_CPU_BF16=0" in caps.describe()
    assert resolve_precision("auto", CPU) == "fp32"
    with pytest.raises(UserError) as e:
        resolve_precision("bf16", CPU)
    message = str(e.value)
    assert "\n" not in message and "no native bf16" in message and "--precision auto" in message


def test_onednn_isa_cap_turns_native_bf16_off():
    """oneDNN's own switch, as CI uses it to prove the AVX2 paths on a machine with AMX."""
    code = "import json; from attnmt.backends import cpu; c = cpu(); print(json.dumps([c.native_bf16, c.describe()]))"
    env = {**__import__("os").environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    env.pop(capabilities.BF16_SWITCH, None)
    native, text = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                                             check=True).stdout)
    assert native is False and "no native bf16" in text


def test_either_librarys_avx2_cap_takes_the_int8_weights_bit(monkeypatch):
    """8-bit weights need 32-bit accumulation in fbgemm's kernels and in oneDNN's: capping either library below
    VNNI must give ``Int8Linear`` 7-bit weights, or its products would saturate."""
    vnni = capabilities.CpuCapabilities(name="test CPU", vendor="AuthenticAMD", isa="avx512",
                                        flags=frozenset({"avx2", "avx512f", "avx512_vnni"}), onednn=True,
                                        onednn_bf16=True, switched_off=False)
    for name in ("FBGEMM_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    assert vnni.int8_full_range
    assert not replace(vnni, flags=frozenset({"avx2", "avx512f"})).int8_full_range  # no VNNI
    for name, cap, full in (("ONEDNN_MAX_CPU_ISA", "AVX2", False), ("ONEDNN_MAX_CPU_ISA", "avx512_core", False),
                            ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_VNNI", True), ("ONEDNN_MAX_CPU_ISA", "AVX2_VNNI", True),
                            ("FBGEMM_ENABLE_INSTRUCTIONS", "AVX2", False)):
        monkeypatch.setenv(name, cap)
        assert vnni.int8_full_range is full, (name, cap)
        monkeypatch.delenv(name)


@pytest.mark.parametrize("relu", [False, True])
def test_model_linear_contract(relu):
    torch.manual_seed(2)
    layer = Linear(8, 5)
    x = torch.randn(3, 8)
    y = F.linear(x, layer.weight, layer.bias)
    assert torch.equal(layer(x, relu=relu), F.relu(y) if relu else y)


def test_fp32_training_layers_and_attention_kernel(cpu_env):
    from attnmt.backends.onednn import TrainingLinear
    from attnmt.models.tuning import AttentionKernel

    cpu_env(ATTNMT_CPU_ONEDNN_FP32="0")
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    CpuBackend(CPU, "fp32").prepare_training(model, "auto")
    assert sum(type(m) is Linear for m in model.modules()) > 10  # MKL
    cpu_env(ATTNMT_CPU_ONEDNN_FP32="1")
    CpuBackend(CPU, "fp32").prepare_training(model, "auto")
    assert sum(type(m) is TrainingLinear for m in model.modules()) > 10  # oneDNN
    kernels = [m for m in model.modules() if isinstance(m, AttentionKernel)]
    assert kernels and all(m.plain_attention_max_len == 256 for m in kernels)
    CpuBackend(CPU, "fp32").prepare_training(model, "flash")
    assert all(m.plain_attention_max_len == 0 for m in kernels)
    assert model.state_dict().keys() == before.keys()


def test_cpu_training_draws_dropout_masks_from_random_bits_and_cuda_keeps_f_dropout():
    from attnmt.backends.cuda import CudaBackend
    from attnmt.models.dropout import Dropout
    from attnmt.models.transformer import MultiHeadAttention
    from attnmt.models.tuning import DropoutKernel

    model = _model()
    sites = [m for m in model.modules() if isinstance(m, DropoutKernel)]
    # every dropout of the model: embeddings, residuals, feed-forward activations and attention weights
    assert any(isinstance(m, MultiHeadAttention) for m in sites) and any(isinstance(m, Dropout) for m in sites)
    assert not any(m.random_bit_dropout for m in sites)  # the model alone: F.dropout
    CudaBackend(torch.device("cuda"), "fp32").prepare_training(model)
    assert not any(m.random_bit_dropout for m in sites)
    CpuBackend(CPU, "fp32").prepare_training(model)
    assert all(m.random_bit_dropout for m in sites)


def test_cuda_training_pads_decoder_rows_and_keeps_the_stream_in_bf16_with_the_same_parameters():
    """The CUDA backend's training choices, made on modules alone (no GPU needed): no packed rows, LayerNorms
    that keep a bf16 stream bf16 (statistics in fp32), the same state dict; fp32 training keeps nn.LayerNorm."""
    from attnmt.backends.cuda import CudaBackend, StreamLayerNorm

    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    CudaBackend(torch.device("cuda"), "fp32").prepare_training(model)
    assert not model.decoder.pack_rows and not any(isinstance(m, StreamLayerNorm) for m in model.modules())
    CudaBackend(torch.device("cuda"), "bf16").prepare_training(model)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert norms and all(type(m) is StreamLayerNorm for m in norms)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)

    norm = norms[0]
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x = torch.randn(5, 7, norm.normalized_shape[0]) * 3 + 1
    ref = F.layer_norm(x.bfloat16().float(), norm.normalized_shape, norm.weight, norm.bias, norm.eps)
    assert torch.equal(norm(x), F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = norm(x.bfloat16())
    assert low.dtype == torch.bfloat16
    assert (low.float() - ref).abs().max() < 0.05 * ref.abs().max()


def test_compile_is_a_one_line_error_off_cuda():
    with pytest.raises(UserError, match="--compile .* CUDA"):
        CpuBackend(CPU, "fp32").prepare_training(_model(), compile=True)


def test_plain_and_fused_attention_kernels_give_the_same_model_output():
    model = _model().eval()
    src, lengths, prev = _inputs()
    outs = []
    for choice in ("math", "flash"):
        CpuBackend(CPU, "fp32").prepare_training(model, choice)
        with torch.no_grad():
            outs.append(model(src, lengths, prev))
    assert torch.allclose(outs[0], outs[1], atol=1e-5)


def test_bf16_training_without_native_bf16_keeps_plain_layers(no_native_bf16):
    model = _model()
    CpuBackend(CPU, "bf16").prepare_training(model)
    assert sum(type(m) is Linear for m in model.modules()) > 10


@pytest.mark.parametrize("weight_grad", [False, True])
@pytest.mark.parametrize("relu", [False, True])
def test_fp32_onednn_training_linear_equals_the_plain_layer(relu, weight_grad):
    from attnmt.backends.onednn import TrainingLinear

    torch.manual_seed(4)
    layer = Linear(16, 24)
    fused = TrainingLinear(layer, torch.float32, onednn_backward=True, onednn_weight_grad=weight_grad)
    x = torch.randn(3, 5, 16, requires_grad=True)
    g = torch.randn(3, 5, 24)
    outs, grads = [], []
    for module in (fused, layer):
        y = module(x, relu=relu)
        y.backward(g)
        outs.append(y)
        grads.append([t.grad.clone() for t in (x, layer.weight, layer.bias)])
        for t in (x, layer.weight, layer.bias):
            t.grad = None
    assert outs[0].dtype == torch.float32 and torch.allclose(outs[0], outs[1], atol=1e-5)
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-4)


def test_fp32_onednn_inference_computes_what_the_plain_model_computes(cpu_env):
    from attnmt.backends.onednn import PackedLinear

    cpu_env(ATTNMT_CPU_ONEDNN_FP32="1")
    model = _model().eval()
    src, lengths, prev = _inputs()
    with torch.inference_mode():
        ref = model(src, lengths, prev)
        prepared = CpuBackend(CPU, "fp32").prepare_inference(model)
        assert sum(type(m) is PackedLinear for m in prepared.modules()) > 10
        assert torch.allclose(prepared(src, lengths, prev), ref, atol=1e-4)


@needs_native_bf16
def test_bf16_training_swaps_fused_layers_with_the_same_parameters_and_outputs(cpu_env):
    from attnmt.backends.onednn import TrainingLinear

    cpu_env(ATTNMT_CPU_ONEDNN_FP32="0")
    model, plain = _model(), _model()
    params = {id(p) for p in model.parameters()}
    keys = model.state_dict().keys()
    backend = CpuBackend(CPU, "bf16")
    backend.prepare_training(model)
    CpuBackend(CPU, "fp32").prepare_training(plain)  # same attention choice, plain layers
    assert sum(type(m) is TrainingLinear for m in model.modules()) > 10
    assert {id(p) for p in model.parameters()} == params and model.state_dict().keys() == keys
    src, lengths, prev = _inputs()
    with torch.no_grad(), backend.autocast():
        assert torch.equal(model(src, lengths, prev), plain(src, lengths, prev))


@needs_native_bf16
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_training_linear_equals_nn_linear_under_bf16_autocast(relu, bias):
    from attnmt.backends.onednn import TrainingLinear

    torch.manual_seed(9)
    layer = Linear(16, 24, bias=bias)
    fused = TrainingLinear(layer, torch.bfloat16)
    x = torch.randn(3, 5, 16, requires_grad=True)
    g = torch.randn(3, 5, 24)
    outs, grads = [], []
    for module in (fused, layer):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = module(x, relu=relu)
        y.float().backward(g)
        outs.append(y)
        grads.append([t.grad.clone() for t in (x, layer.weight, layer.bias) if t is not None])
        for t in (x, layer.weight, layer.bias):
            if t is not None:
                t.grad = None
    assert outs[0].dtype == torch.bfloat16 and torch.equal(outs[0], outs[1])
    for a, b in zip(*grads):  # the weight gradient may be summed in another order (bf16 products)
        assert a.dtype == b.dtype and torch.allclose(a, b, rtol=1e-2, atol=1e-2 * float(b.abs().max()))


@pytest.mark.parametrize("n, k", [(64, 16), (16, 64), (32, 32)])
def test_weight_gradient_layouts_give_the_product(n, k):
    from attnmt.backends.onednn import _weight_grad

    torch.manual_seed(10)
    g, x = torch.randn(50, n, dtype=torch.float64), torch.randn(50, k, dtype=torch.float64)
    out = _weight_grad(g, x)
    assert out.shape == (n, k) and torch.allclose(out, g.t() @ x)


@needs_native_bf16
def test_bf16_inference_packs_every_linear_and_computes_what_the_bf16_model_computes():
    from attnmt.backends.onednn import PackedLinear

    model = _model().eval()
    src, lengths, prev = _inputs()
    with torch.inference_mode():
        ref = model.to(torch.bfloat16)(src, lengths, prev)
        prepared = CpuBackend(CPU, "bf16").prepare_inference(model)
        assert sum(type(m) is PackedLinear for m in prepared.modules()) > 10
        assert not any(type(m) in (Linear, torch.nn.Linear) for m in prepared.modules())
        assert torch.equal(prepared(src, lengths, prev), ref)
        lin = Linear(64, 96).to(torch.bfloat16)
        x = torch.randn(2, 37, 64).to(torch.bfloat16)
        assert torch.equal(PackedLinear(lin)(x, relu=True), torch.relu(lin(x)))


def test_bf16_inference_without_native_bf16_is_a_plain_cast(no_native_bf16):
    model = CpuBackend(CPU, "bf16").prepare_inference(_model().eval())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert sum(type(m) is Linear for m in model.modules()) > 10


def test_int8_inference_quantizes_every_linear_and_stays_close():
    model = _model().eval()
    src, lengths, prev = _inputs()
    with torch.no_grad():
        ref = model(src, lengths, prev)
        q = CpuBackend(CPU, "fp32").prepare_inference(model, "int8")
        assert not any(type(m) in (Linear, torch.nn.Linear) for m in q.modules())
        assert sum(type(m) is Int8Linear for m in q.modules()) > 10
        out = q(src, lengths, prev)
        lin = Linear(64, 48)
        x = torch.randn(5, 64)
        for bits in (7, 8) if capabilities.cpu().int8_full_range else (7,):  # 8 saturates without VNNI (below)
            layer = Int8Linear(lin, bits)
            assert torch.equal(layer(x, relu=True), F.relu(layer(x)))
            assert float((layer(x) - lin(x)).abs().max() / lin(x).abs().max()) < 0.05
    assert float((out - ref).abs().max() / ref.abs().max()) < 0.1


needs_onednn_qlinear = pytest.mark.skipif(not capabilities.cpu().onednn_qlinear,
                                          reason="oneDNN's int8 inner product is not available here")


@pytest.mark.parametrize("kernel", ["fbgemm", pytest.param("onednn", marks=needs_onednn_qlinear)])
def test_int8_weights_leave_avx2_kernels_no_room_to_saturate(kernel):
    """Without 32-bit accumulation fbgemm and oneDNN add pairs of u8 x s8 products in 16 bits: large positive
    activations against large positive 8-bit weights overflow there (CI reruns this file with both capped at
    AVX2). The backend's choice of weight width must give the fp32 product on any CPU, through either kernel."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)
    with torch.no_grad():
        lin.weight.copy_(torch.rand(32, 64) * 0.5 + 0.5)
    x = torch.rand(INT8_ONEDNN_MIN_ROWS, 64) * 0.5 + 0.5
    bits = 8 if capabilities.cpu().int8_full_range else 7
    with torch.no_grad():
        layer = Int8Linear(lin, bits, INT8_ONEDNN_MIN_ROWS if kernel == "onednn" else None)
        w = layer.inner._packed_params._weight_bias()[0].int_repr()
        half = 1 << (bits - 1)
        assert -half <= int(w.min()) and int(w.max()) <= half - 1 <= int(w.abs().max())  # the whole range, no more
        assert float((layer(x) - lin(x)).abs().max() / lin(x).abs().max()) < 0.01
    with pytest.raises(ValueError, match="weight_bits must be 7 or 8"):
        Int8Linear(lin, 4)


@needs_onednn_qlinear
def test_int8_products_of_many_rows_run_onednn_and_few_rows_fbgemm():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48)
    bits = 8 if capabilities.cpu().int8_full_range else 7
    with torch.no_grad():
        both, fbgemm = Int8Linear(lin, bits, INT8_ONEDNN_MIN_ROWS), Int8Linear(lin, bits)
        few = torch.randn(INT8_ONEDNN_MIN_ROWS - 1, 64)
        assert torch.equal(both(few), fbgemm(few)) and torch.equal(both(few, relu=True), fbgemm(few, relu=True))
        many = torch.randn(2, INT8_ONEDNN_MIN_ROWS, 64)  # rows counted over the leading dimensions
        y, expected = both(many), lin(many)
        assert y.shape == (2, INT8_ONEDNN_MIN_ROWS, 48) and not torch.equal(y, fbgemm(many))  # the other kernel
        assert float((y - expected).abs().max() / expected.abs().max()) < 0.03
        # both kernels quantize alike: the same bytes, the same weights; they differ by float rounding only
        assert float((y - fbgemm(many)).abs().max() / expected.abs().max()) < 0.01
        assert torch.equal(both(many, relu=True), F.relu(y))
    model = CpuBackend(CPU, "fp32").prepare_inference(_model().eval(), "int8")
    assert {m.onednn_rows for m in model.modules() if type(m) is Int8Linear} == {INT8_ONEDNN_MIN_ROWS}


def test_affine_activation_bytes_span_the_inputs_range():
    x = torch.tensor([[0.0, 0.5, 1.0, 2.55, 0.004, 0.006]])  # one sign (a ReLU's output): zero point 0
    q, scale, zero = quantize_u8_affine(x)
    assert float(scale) == pytest.approx(0.01) and int(zero) == 0
    assert q.dtype == torch.uint8 and q.tolist() == [[0, 50, 100, 255, 0, 1]]
    q, scale, zero = quantize_u8_affine(torch.tensor([-1.0, 0.0, 1.55]))  # both signs: 0 stays exact
    assert float(scale) == pytest.approx(0.01) and int(zero) == 100 and q.tolist() == [0, 100, 255]
    q, scale, zero = quantize_u8_affine(torch.zeros(3))  # an all-zero input gets a finite scale
    assert q.tolist() == [int(zero)] * 3 and float(scale) > 0


def test_activations_are_quantized_to_bytes_around_128():
    x = torch.tensor([[-1.0, 0.0, 1.0, 0.5, -0.5, 0.25, -0.004, 0.75]]).bfloat16()
    q, scale = quantize_u8(x)
    assert float(scale) == pytest.approx(1 / 127)
    # x / scale rounded to the nearest integer (ties to even: 63.5 -> 64, -63.5 -> -64, 95.25 -> 95), stored as
    # 128 + that
    assert q.tolist() == [[1, 128, 255, 192, 64, 160, 127, 223]]
    assert quantize_u8(torch.zeros(2, 3))[0].eq(128).all()  # an all-zero input gets a finite scale


def test_large_activations_are_quantized_in_blocks_of_rows_with_one_scale(monkeypatch):
    big = torch.randn(3 * QUANTIZE_BLOCK // 256 + 5, 256, generator=torch.Generator().manual_seed(0)).bfloat16()
    blocked, scale = quantize_u8(big)
    monkeypatch.setattr(onednn_module, "QUANTIZE_BLOCK", big.numel())
    whole, whole_scale = quantize_u8(big)
    assert torch.equal(blocked, whole) and float(scale) == float(whole_scale)
    assert float(scale) == pytest.approx(float(big.abs().max()) / 127)
    nearest = (big.float() / float(scale)).round() + 128  # the kernel may round a tie the other way
    assert float((blocked.float() - nearest).abs().max()) <= 1 and float((blocked.float() != nearest).float().mean()) < 1e-4


needs_onednn_int8 = pytest.mark.skipif(not capabilities.cpu().onednn_int8,
                                       reason="no int8 instructions next to native bf16 on this CPU")


@needs_onednn_int8
def test_int8_with_bf16_activations_quantizes_every_product_and_stays_close():
    model = _model().eval()
    src, lengths, prev = _inputs()
    with torch.no_grad():
        ref = model(src, lengths, prev)
        q = CpuBackend(CPU, "bf16").prepare_inference(_model().eval(), "int8")
        kinds = {type(m) for m in q.modules()}
        assert Int8PackedLinear in kinds and PackedLinear in kinds and Linear not in kinds
        inner = {id(m.bf16) for m in q.modules() if type(m) is Int8PackedLinear}  # its small-batch product
        for m in q.modules():
            if isinstance(m, (Int8PackedLinear, PackedLinear)) and id(m) not in inner:
                assert type(m) is Int8PackedLinear
        assert all(p.dtype == torch.bfloat16 for p in q.parameters())
        out = q(src, lengths, prev)
        assert float((out.float() - ref).abs().max() / ref.abs().max()) < 0.1

        lin = Linear(64, 256).bfloat16()  # as in the model, cast before the swap
        layer = Int8PackedLinear(lin)
        x = torch.randn(INT8_MIN_ROWS, 64).bfloat16()
        y, expected = layer(x), F.linear(x.float(), lin.weight.float(), lin.bias.float())
        assert y.dtype == torch.bfloat16 and float((y.float() - expected).abs().max() / expected.abs().max()) < 0.03
        assert torch.equal(layer(x, relu=True), F.relu(layer(x)))
        few = x[: INT8_MIN_ROWS - 1]  # fewer rows: the bf16 product, bitwise
        assert torch.equal(layer(few, relu=True), PackedLinear(lin)(few, relu=True))


def test_int8_activation_precision_follows_the_request(monkeypatch):
    """fp32 asks for fbgemm's layers on any CPU; fp16 is a GPU's and refused with int8."""
    q = CpuBackend(CPU, "fp32").prepare_inference(_model().eval(), "int8")
    assert any(type(m) is Int8Linear for m in q.modules())
    with pytest.raises(ValueError, match="--fp16 and --quantize int8"):
        GenerationConfig(fp16=True, quantize="int8")
    if NATIVE_BF16:  # a CPU with bf16 but without int8 instructions is told what to use instead
        monkeypatch.setattr(type(capabilities.cpu()), "onednn_int8", property(lambda self: False))
        with pytest.raises(UserError, match="--quantize int8 with --precision bf16.*use --precision fp32"):
            CpuBackend(CPU, "bf16").prepare_inference(_model().eval(), "int8")


def test_row_buckets_are_the_cpus_only():
    assert [padded_rows(n) for n in (1, 8, 9, 100, 129)] == [8, 8, 16, 104, 144]
    assert all(padded_rows(n) >= n and padded_rows(n) - n <= max(7, n // 8) for n in range(1, 3000))
    assert CpuBackend(CPU).decoding_kernels().row_bucket(9) == 16
    assert Backend(torch.device("meta")).decoding_kernels().row_bucket is None and type(backend_for("meta")) is Backend


def test_process_settings_apply_once_and_respect_the_user():
    code = ("import os, json; os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'] = '77'\n"
            "from attnmt.backends import configure_process\n"
            "first = configure_process('train', 'cpu'); second = configure_process('train', 'cpu')\n"
            "gen = configure_process('generate', 'cpu')\n"
            "print(json.dumps([first, second, gen, os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY']]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    first, second, gen, capacity = json.loads(out)
    assert first["onednn_primitive_cache_capacity"] == "77" and capacity == "77" and second == {}
    if sys.platform.startswith("linux"):
        assert first["malloc_keep_freed"] is True and gen["malloc_keep_freed"] is True


def test_loss_blocks_are_the_backends_choice_and_change_no_number():
    from attnmt.backends.cpu import LOSS_BLOCK_ELEMENTS
    from attnmt.criterions import LabelSmoothedCrossEntropy, LabelSmoothedCrossEntropyConfig, smoothed_cross_entropy

    crit = LabelSmoothedCrossEntropy(LabelSmoothedCrossEntropyConfig(0.1), 1)
    CpuBackend(CPU).prepare_criterion(crit)
    assert crit.block_elements == LOSS_BLOCK_ELEMENTS * torch.get_num_threads()
    Backend(torch.device("meta")).prepare_criterion(crit)
    assert crit.block_elements is None  # GPUs: the whole batch at once
    torch.manual_seed(5)
    logits, target = torch.randn(37, 50, requires_grad=True), torch.randint(2, 50, (37,))
    results = []
    for block in (None, 0, 60, 1 << 18):  # one block, one block, 1-2 rows per block, the CPU's blocks
        loss, nll = smoothed_cross_entropy(logits, target, 1, 0.1, block)
        (grad,) = torch.autograd.grad(loss + nll, logits)
        results.append((loss.detach(), nll.detach(), grad))
    for other in results[1:]:
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(results[0], other))


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_onednn_vocabulary_projection_gives_the_same_loss_and_gradients(eps):
    from attnmt.criterions import projected_smoothed_cross_entropy

    torch.manual_seed(6)
    h, w = torch.randn(40, 16, requires_grad=True), torch.randn(97, 16, requires_grad=True)
    t = torch.randint(0, 97, (40,))
    results = []
    from attnmt.backends.onednn import product

    for projection in (None, product):
        loss, nll = projected_smoothed_cross_entropy(h, w, t, eps, None, projection)
        grads = torch.autograd.grad(loss + 0.5 * nll, (h, w))
        results.append((loss.detach(), nll.detach(), *grads))
    assert all(torch.allclose(a, b, atol=1e-4, rtol=1e-5) for a, b in zip(*results))
    crit_backend = CpuBackend(CPU, "fp32")
    from attnmt.criterions import LabelSmoothedCrossEntropy, LabelSmoothedCrossEntropyConfig

    crit = LabelSmoothedCrossEntropy(LabelSmoothedCrossEntropyConfig(0.1), 1)
    crit_backend.prepare_criterion(crit)
    assert (crit.projection is not None) == capabilities.cpu().onednn_fp32
    CpuBackend(CPU, "bf16" if NATIVE_BF16 else "fp32").prepare_criterion(crit)
    assert (crit.projection is not None) == (not NATIVE_BF16 and capabilities.cpu().onednn_fp32)


def test_cuda_choices_are_made_by_the_cuda_backend_alone():
    """Decided without a GPU: the CUDA backend turns cuDNN's per-shape attention graphs off for the process,
    pads training lengths to multiples of 8 and stages checkpoints in pinned memory; the CPU does none of it."""
    from attnmt.backends.cuda import CudaBackend

    gpu, cpu = CudaBackend(torch.device("cuda"), "bf16"), CpuBackend(CPU)
    assert gpu.length_multiple() == 8 and cpu.length_multiple() == 1
    assert gpu.host_staging().pinned and not cpu.host_staging().pinned
    code = ("import torch; from attnmt.backends.cuda import CudaBackend\n"
            "before = torch.backends.cuda.cudnn_sdp_enabled()\n"
            "done = CudaBackend(torch.device('cuda')).configure_process('train')\n"
            "print(before, torch.backends.cuda.cudnn_sdp_enabled(), done)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[:2] == ["True", "False"] and "'cudnn_attention':" in out[2]
