"""The CUDA backend on a real GPU (skipped without one): precision choice, prepared model, a bf16 training step,
and the same numbers as the CPU."""

import pytest
import torch
from conftest import tiny_transformer

from attnmt.backends import backend_for, resolve_precision
from attnmt.backends.cuda import CudaBackend
from attnmt.models.linear import AttentionKernel, Linear

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


def _model(seed=0):
    return tiny_transformer(seed)


def _inputs(device):
    g = torch.Generator().manual_seed(1)
    src, prev = torch.randint(4, 50, (3, 9), generator=g), torch.randint(4, 50, (3, 7), generator=g)
    return src.to(device), torch.full((3,), 9, device=device), prev.to(device)


def test_precision_on_the_gpu():
    dev = torch.device("cuda")
    bf16 = torch.cuda.is_bf16_supported()
    assert resolve_precision("auto", dev, mode="train") == ("bf16" if bf16 else "fp32")
    assert resolve_precision("auto", dev, mode="generate") == "fp32"
    assert resolve_precision("fp16", dev, mode="train") == "fp16"
    assert type(backend_for(dev, "fp32")) is CudaBackend


def test_prepared_model_computes_what_the_cpu_computes():
    cpu_model = _model().eval()
    gpu_model = _model().eval().cuda()
    CudaBackend(torch.device("cuda"), "fp32").prepare_training(gpu_model)
    assert all(m.plain_attention_max_len == 0 for m in gpu_model.modules() if isinstance(m, AttentionKernel))
    assert sum(type(m) is Linear for m in gpu_model.modules()) > 10
    torch.backends.cuda.matmul.allow_tf32 = False
    with torch.no_grad():
        ref = cpu_model(*_inputs("cpu"))
        out = gpu_model(*_inputs("cuda")).cpu()
    assert torch.allclose(out, ref, atol=1e-4)


def test_bf16_training_step_on_the_gpu():
    from attnmt.criterions import LabelSmoothedCrossEntropy, LabelSmoothedCrossEntropyConfig
    from attnmt.optim import AdamConfig, FixedConfig, FixedSchedule, build_adam
    from attnmt.training.trainer import Trainer

    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    dev = torch.device("cuda")
    model = _model().cuda()
    backend_for(dev, "bf16").prepare_training(model)
    crit = LabelSmoothedCrossEntropy(LabelSmoothedCrossEntropyConfig(0.1), 1)
    backend_for(dev, "bf16").prepare_criterion(crit)
    assert crit.block_elements == 0
    trainer = Trainer(model, crit, build_adam(AdamConfig(), model.parameters(), lr=1e-3),
                      FixedSchedule(FixedConfig(lr=1e-3)), device=dev, precision="bf16")
    src, lengths, prev = _inputs("cuda")
    target = torch.cat([prev[:, 1:], torch.full((3, 1), 2, device=dev)], dim=1)
    sample = {"net_input": {"src_tokens": src, "src_lengths": lengths, "prev_output_tokens": prev},
              "target": target, "ntokens": int(target.numel()), "nsentences": 3}
    log = trainer.train_step([sample])
    assert torch.isfinite(log["loss"]) and all(p.dtype == torch.float32 for p in model.parameters())
