"""The CUDA backend on a real GPU (skipped without one): precision choice, prepared model, a bf16 training step,
and the same numbers as the CPU."""

import pytest
import torch
from conftest import tiny_transformer

from attnmt.backends import backend_for, resolve_precision
from attnmt.backends.cuda import CudaBackend
from attnmt.models.linear import Linear
from attnmt.models.tuning import AttentionKernel

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
    backend = backend_for(dev, "bf16")
    backend.prepare_training(model)
    crit = LabelSmoothedCrossEntropy(LabelSmoothedCrossEntropyConfig(0.1), 1)
    backend.prepare_criterion(crit)
    assert crit.block_elements is None
    trainer = Trainer(model, crit, build_adam(AdamConfig(), model.parameters(), lr=1e-3),
                      FixedSchedule(FixedConfig(lr=1e-3)), backend=backend)
    src, lengths, prev = _inputs("cuda")
    target = torch.cat([prev[:, 1:], torch.full((3, 1), 2, device=dev)], dim=1)
    sample = {"net_input": {"src_tokens": src, "src_lengths": lengths, "prev_output_tokens": prev},
              "target": target, "ntokens": int(target.numel()), "nsentences": 3}
    log = trainer.train_step([sample])
    assert torch.isfinite(log["loss"]) and all(p.dtype == torch.float32 for p in model.parameters())


def test_beam_search_on_the_gpu_gives_the_cpus_translations():
    """fp32 on both (TF32 off): the GPU backend's kernels (one topk, fp32 scores) find the CPU's hypotheses."""
    from attnmt.generation.generator import collate
    from attnmt.generation.search import SearchConfig, Symbols, search

    torch.backends.cuda.matmul.allow_tf32 = False
    sym = Symbols(pad=1, eos=2, unk=3, bos=0)
    cfg = SearchConfig(beam=4, nbest=2, max_len_b=10)
    g = torch.Generator().manual_seed(3)
    sources = [torch.randint(4, 50, (n,), generator=g).tolist() + [2] for n in (3, 7, 5, 9, 4)]
    results = {}
    for dev in ("cpu", "cuda"):
        model = _model(1).eval().to(dev)
        tokens, lengths = collate(sources, 1, torch.device(dev))
        kernels = backend_for(torch.device(dev), "fp32").decoding_kernels()
        results[dev] = search(model, tokens, lengths, cfg, sym, kernels=kernels)
    assert [[h.tokens for h in hs] for hs in results["cuda"]] == [[h.tokens for h in hs] for hs in results["cpu"]]


def test_beam_search_steps_replay_as_cuda_graphs_with_the_same_translations():
    """The CUDA backend's beam search runs its steps as replayed CUDA graphs (captured again when the buffers
    grow, each capture succeeding), and finds what the same cache run eagerly and the slot cache find (fp32, TF32
    off); CUDA's random numbers work after it (a failed capture could leave the generator in capture mode)."""
    import dataclasses

    from attnmt.backends.cuda import CudaGraphSteps
    from attnmt.generation.generator import collate
    from attnmt.generation.search import SearchConfig, Symbols, search
    from attnmt.models.static_cache import StaticCache

    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    sym = Symbols(pad=1, eos=2, unk=3, bos=0)
    cfg = SearchConfig(beam=4, nbest=2, max_len_b=40)
    g = torch.Generator().manual_seed(4)
    sources = [torch.randint(4, 50, (n,), generator=g).tolist() + [2] for n in (3, 17, 5, 9, 4, 12, 1)]
    model = _model(1).eval().to(dev)
    tokens, lengths = collate(sources, 1, dev)
    kernels = dataclasses.replace(backend_for(dev, "fp32").decoding_kernels(),
                                  step_graphs=lambda: CudaGraphSteps(dev))
    caches = []
    new_cache = model.new_cache

    def keep(*args, **kw):
        caches.append(new_cache(*args, **kw))
        return caches[-1]

    model.new_cache = keep
    graphed = search(model, tokens, lengths, cfg, sym, kernels=kernels)
    replays, recorder = caches[0].replays, caches[0].recorder
    assert isinstance(caches[0], StaticCache) and caches[0].positions > 16
    assert not recorder.failed and recorder.captures >= 2 and replays > 16  # replayed past the first growth
    assert torch.isfinite(torch.randn(4, device=dev)).all()
    eager_init = StaticCache.__init__
    try:
        StaticCache.__init__ = lambda self, n, beam, positions, recorder=None: eager_init(self, n, beam, positions)
        eager = search(model, tokens, lengths, cfg, sym, kernels=kernels)
    finally:
        StaticCache.__init__ = eager_init
    assert caches[1].replays == 0
    slot = search(model, tokens, lengths, cfg, sym, kernels=dataclasses.replace(kernels, step_graphs=None))
    for other in (eager, slot):
        assert [[h.tokens for h in hs] for hs in graphed] == [[h.tokens for h in hs] for hs in other]
        for hs, gs in zip(graphed, other):
            assert [h.score for h in hs] == pytest.approx([h.score for h in gs], abs=1e-4)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_translation_casts_once_and_stays_close(precision):
    from attnmt.generation.generator import collate
    from attnmt.generation.search import SearchConfig, Symbols, search

    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    dev = torch.device("cuda")
    backend = backend_for(dev, precision)
    model = backend.prepare_inference(_model(1).eval().to(dev))
    assert all(p.dtype == backend.autocast_dtype for p in model.parameters())
    sym = Symbols(pad=1, eos=2, unk=3, bos=0)
    sources = [[5, 6, 7, 2], [9, 10, 11, 12, 13, 2]]
    tokens, lengths = collate(sources, 1, dev)
    hyps = search(model, tokens, lengths, SearchConfig(beam=4, max_len_b=8), sym, kernels=backend.decoding_kernels())
    assert all(h and torch.isfinite(torch.tensor(h[0].score)) for h in hyps)


def test_checkpoint_snapshot_of_gpu_tensors_is_pinned_and_independent(tmp_path):
    from attnmt.checkpoint.saver import CheckpointSaver

    dev = torch.device("cuda")
    w = torch.randn(256, 256, device=dev)
    staging = backend_for(dev, "bf16").host_staging()
    saver = CheckpointSaver(tmp_path, staging, background=True)
    saver.save({"w": w, "tied": w}, ["checkpoint_last.pt"])
    expected = w.cpu()
    w.add_(1.0)
    saver.close()
    assert all(b.is_pinned() for b in staging.buffers.values())
    got = torch.load(tmp_path / "checkpoint_last.pt", weights_only=True)
    assert torch.equal(got["w"], expected) and got["w"].data_ptr() == got["tied"].data_ptr()


def test_training_on_the_gpu_pads_lengths_to_multiples_of_8_and_turns_cudnn_attention_off(tmp_path):
    from helpers import TINY_MODEL, make_data_bin

    from attnmt.cli import main

    data = make_data_bin(tmp_path / "bin")
    main(["train", str(data), *TINY_MODEL, "--save-dir", str(tmp_path / "c"), "--max-tokens", "256",
          "--max-update", "4", "--progress", "none"])  # CUDA when available, as attnmt train does
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert (tmp_path / "c" / "checkpoint_last.pt").exists()
