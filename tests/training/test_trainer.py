"""The update step: gradient accumulation normalised by the total token count, clipping, precision guards."""

import numpy as np
import pytest
import torch

from attnmt.backends import backend_for
from attnmt.cli import load_components
from attnmt.criterions import LabelSmoothedCrossEntropy, LabelSmoothedCrossEntropyConfig
from attnmt.data.pairs import collate_pairs
from attnmt.errors import UserError
from attnmt.optim import AdamConfig, FixedConfig, FixedSchedule, build_adam
from attnmt.registry import arch_config, get
from attnmt.training.trainer import Trainer

PAD, EOS, V = 1, 2, 24


def _model(seed=0):
    load_components()
    cfg = arch_config("transformer_small", dict(encoder_layers=1, decoder_layers=1, encoder_embed_dim=16,
                                                 decoder_embed_dim=16, encoder_ffn_embed_dim=32,
                                                 decoder_ffn_embed_dim=32, encoder_attention_heads=2,
                                                 decoder_attention_heads=2, dropout=0.0))
    torch.manual_seed(seed)
    return get("model", "transformer").obj.build(cfg, V, V, PAD, joint_vocab=True)


def _trainer(model, clip=0.0, precision="fp32"):
    crit = LabelSmoothedCrossEntropy(LabelSmoothedCrossEntropyConfig(0.1), PAD)
    opt = build_adam(AdamConfig(), model.parameters(), lr=1e-3)
    return Trainer(model, crit, opt, FixedSchedule(FixedConfig(lr=1e-3)), backend=backend_for("cpu", precision),
                   clip_norm=clip)


def _sentences(n, seed):
    rng = np.random.RandomState(seed)
    out = []
    for i in range(n):
        k = 2 + (i * 5) % 11
        out.append(np.append(rng.randint(4, V, size=k), EOS))
    return out


def _batch(srcs, tgts, ids):
    return collate_pairs(srcs, tgts, np.asarray(ids), PAD, EOS)


def _capture_grads(trainer):
    """Record the gradients the optimizer step sees (then step as usual)."""
    seen = []
    step = trainer.optimizer.step

    def spy():
        seen.extend(p.grad.detach().clone() for p in trainer.params if p.grad is not None)
        step()

    trainer.optimizer.step = spy
    return seen


def test_update_freq_equals_one_big_batch():
    srcs, tgts = _sentences(8, 0), _sentences(8, 1)
    big = _batch(srcs, tgts, range(8))
    # two micro-batches with very different token counts: normalising each by its own count would differ
    a = _batch(srcs[:2], tgts[:2], range(2))
    b = _batch(srcs[2:], tgts[2:], range(2, 8))
    assert a["ntokens"] != b["ntokens"]
    t1, t2 = _trainer(_model()), _trainer(_model())
    g1, g2 = _capture_grads(t1), _capture_grads(t2)
    log1 = t1.train_step([big])
    log2 = t2.train_step([a, b])
    assert float(log1["gnorm"]) == pytest.approx(float(log2["gnorm"]), rel=1e-5)
    assert float(log1["loss"]) == pytest.approx(float(log2["loss"]), rel=1e-5)
    assert log1["ntokens"] == log2["ntokens"] == big["ntokens"]
    assert len(g1) == len(g2) > 0
    for x, y in zip(g1, g2):
        assert torch.allclose(x, y, rtol=1e-4, atol=1e-7)
    assert t1.num_updates == t2.num_updates == 1


def test_gradient_is_the_mean_per_token_gradient():
    srcs, tgts = _sentences(4, 2), _sentences(4, 3)
    batch = _batch(srcs, tgts, range(4))
    model = _model()
    ref = _model()
    crit = LabelSmoothedCrossEntropy(LabelSmoothedCrossEntropyConfig(0.1), PAD)
    loss, _ = crit(ref, batch)
    (loss / batch["ntokens"]).backward()
    ref_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters() if p.grad is not None]))
    log = _trainer(model).train_step([batch])
    assert float(log["gnorm"]) == pytest.approx(float(ref_norm), rel=1e-5)


def test_clip_norm_limits_the_update_and_reports_the_unclipped_norm():
    srcs, tgts = _sentences(4, 4), _sentences(4, 5)
    batch = _batch(srcs, tgts, range(4))
    t = _trainer(_model(), clip=1e-3)
    grads = {}
    t.optimizer.step = lambda: grads.update(norm=float(torch.linalg.vector_norm(
        torch.stack([p.grad.norm() for p in t.params if p.grad is not None]))))
    log = t.train_step([batch])
    assert float(log["gnorm"]) > 1e-3
    assert grads["norm"] == pytest.approx(1e-3, rel=1e-3)


def test_padding_batches_are_skipped_in_one_process():
    srcs, tgts = _sentences(3, 6), _sentences(3, 7)
    t = _trainer(_model())
    assert t.train_step([None]) is None and t.num_updates == 0
    log = t.train_step([_batch(srcs, tgts, range(3)), None])
    assert log["nsentences"] == 3 and t.num_updates == 1


@pytest.mark.precision
@pytest.mark.parametrize("prepared", [False, True])
def test_bf16_step_runs_and_fp16_needs_cuda(prepared):
    """bf16 autocast on the plain model, and on the model the backend prepared (oneDNN fused layers where the CPU
    runs bf16 natively, the plain ones otherwise)."""
    from attnmt.backends import backend_for

    srcs, tgts = _sentences(4, 8), _sentences(4, 9)
    model = _model()
    if prepared:
        backend_for("cpu", "bf16").prepare_training(model)
    t = _trainer(model, precision="bf16")
    log = t.train_step([_batch(srcs, tgts, range(4))])
    assert torch.isfinite(log["loss"]) and log["loss"].dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in t.model.parameters())  # fp32 master weights
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="--fp16 needs a CUDA"):
            _trainer(_model(), precision="fp16")
