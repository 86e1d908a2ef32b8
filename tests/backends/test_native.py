"""The CPU's compiled kernels: the same step attention as the masked products over the beam cache, the same
scores and the same training loss as PyTorch's passes, built once, and PyTorch's forms wherever they cannot be."""

import os
import platform
import subprocess
import sys
import time

import pytest
import torch
from conftest import tiny_transformer

import attnmt.criterions as C
from attnmt.backends import capabilities, native
from attnmt.backends.cpu import CpuBackend
from attnmt.criterions import LabelSmoothedCrossEntropy, LabelSmoothedCrossEntropyConfig
from attnmt.generation.search import SearchConfig, Symbols, search
from attnmt.models.kernels import DecodingKernels, StepRows

pytestmark = pytest.mark.precision  # compiled for the vector instructions PyTorch uses here (CI: AVX2 as well)

KERNEL = native.step_attention(native.target(capabilities.cpu()))  # what the CPU backend uses here
# only a machine without a compiler may skip: where one is present, a failed build fails the tests
needs_kernel = pytest.mark.skipif(not native.has_compiler(), reason="no C compiler here: PyTorch's forms run")


@needs_kernel
def test_where_a_compiler_is_present_the_kernels_build_and_load():
    isa = native.target(capabilities.cpu())
    assert KERNEL is not None, f"the compiled kernels are {native.status(isa)}"
    assert native.status(isa).startswith("on (")


def _reference(q, k_buf, v_buf, sentence_of, slots_of):
    """softmax(q k^T / sqrt(dh)) v per row and head over the slots ``slots_of(r)`` of buffered sentence
    ``sentence_of(r)`` (None: padding), written out one row at a time in fp32."""
    R, H, _, Dh = q.shape
    out = torch.zeros(R, 1, H * Dh)
    for r in range(R):
        s, slots = sentence_of(r), slots_of(r)
        for h in range(H):
            keys, values = k_buf[s, h, slots].float(), v_buf[s, h, slots].float()
            p = torch.softmax(keys @ q[r, h, 0].float() / Dh ** 0.5, dim=0)
            out[r, 0, h * Dh:(h + 1) * Dh] = p @ values
    return out


def _queries(R, H, Dh, dtype, g):
    """Queries, keys and values as the model's fused projection gives them: views into one (R, 1, 3 D) tensor."""
    qkv = torch.randn(R, 1, 3 * H * Dh, generator=g).to(dtype)
    return [t.view(R, 1, H, Dh).transpose(1, 2) for t in qkv.chunk(3, dim=-1)]


@needs_kernel
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("first", [False, True])
@pytest.mark.parametrize("head_dim", [64, 24])
def test_self_attention_reads_each_rows_own_history_and_writes_its_new_slot(dtype, atol, first, head_dim):
    g = torch.Generator().manual_seed(0)
    N, H, beam, position = 5, 3, 4, 6
    live = torch.tensor([0, 2, 3])  # sentences 1 and 4 have finished: their buffers are left alone
    per = 1 if first else beam
    rows = StepRows(len(live) * per, per, None if first else live, beam)
    padded = rows.count + 3  # padding rows after the real ones (the backend's row bucket)
    slots = (position + 2) * beam
    k_buf = torch.randn(N, H, slots, head_dim, generator=g).to(dtype)
    v_buf = torch.randn(N, H, slots, head_dim, generator=g).to(dtype)
    ancestors = torch.randint(0, beam, (len(live) * beam, position + 2), generator=g, dtype=torch.int32)
    q, k, v = _queries(padded, H, head_dim, dtype, g)
    before_k, before_v = k_buf.clone(), v_buf.clone()
    ancestor_rows = beam // per
    if first:  # the first call: one row per sentence, every hypothesis's history starts with its keys/values
        ancestors[:, position] = 0
    else:
        ancestors[:, position] = torch.arange(beam, dtype=torch.int32).repeat(len(live))

    out = KERNEL.self_attention(q, k, v, k_buf, v_buf, rows, position, ancestors, ancestor_rows)

    def sentence_of(r):
        return r // per if first else int(live[r // per])

    new_k, new_v = before_k.clone(), before_v.clone()
    for r in range(rows.count):  # the expected writes: slot position * beam + r % per of the row's sentence
        new_k[sentence_of(r), :, position * beam + r % per] = k[r, :, 0]
        new_v[sentence_of(r), :, position * beam + r % per] = v[r, :, 0]
    assert torch.equal(k_buf, new_k) and torch.equal(v_buf, new_v)
    expected = _reference(q[:rows.count], new_k, new_v, sentence_of,
                          lambda r: [s * beam + int(ancestors[r * ancestor_rows, s]) for s in range(position + 1)])
    assert out.shape == (padded, 1, H * head_dim) and out.dtype == dtype
    assert torch.allclose(out[:rows.count].float(), expected, atol=atol)
    assert not out[rows.count:].any()


@needs_kernel
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cross_attention_skips_the_sources_padding(dtype, atol):
    g = torch.Generator().manual_seed(1)
    N, H, S, Dh, beam = 4, 2, 7, 32, 3
    k_buf = torch.randn(N, H, S, Dh, generator=g).to(dtype)
    v_buf = torch.randn(N, H, S, Dh, generator=g).to(dtype)
    lengths = torch.tensor([7, 3, 5, 1])
    keep = torch.arange(S)[None, :] < lengths[:, None]
    k_buf[~keep[:, None, :, None].expand_as(k_buf)] = 1e4  # padding that would dominate if it were read
    live = torch.tensor([1, 3])
    rows = StepRows(len(live) * beam, beam, live, beam)
    q, _, _ = _queries(rows.count, H, Dh, dtype, g)
    out = KERNEL.cross_attention(q, k_buf, v_buf, rows, keep)
    expected = _reference(q, k_buf, v_buf, lambda r: int(live[r // beam]),
                          lambda r: list(range(int(lengths[live[r // beam]]))))
    assert torch.allclose(out.float(), expected, atol=atol)


@needs_kernel
def test_threads_split_the_rows_without_changing_a_bit():
    g = torch.Generator().manual_seed(2)
    N, H, S, Dh = 64, 4, 9, 64
    k_buf, v_buf = torch.randn(N, H, S, Dh, generator=g), torch.randn(N, H, S, Dh, generator=g)
    rows = StepRows(N * 4, 4, None, 4)
    q, _, _ = _queries(rows.count, H, Dh, torch.float32, g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = KERNEL.cross_attention(q, k_buf, v_buf, rows, None)
        torch.set_num_threads(2)
        two = KERNEL.cross_attention(q, k_buf, v_buf, rows, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@needs_kernel
def test_what_the_kernel_takes():
    H, Dh = 2, 16
    q = torch.zeros(3, 1, H * Dh).view(3, 1, H, Dh).transpose(1, 2)
    assert KERNEL.supports(q) and KERNEL.supports(q.bfloat16())
    assert not KERNEL.supports(q.double())  # other dtypes keep the products
    assert not KERNEL.supports(torch.zeros(3, H, 1, 12))  # head sizes that are not a multiple of 8
    assert not KERNEL.supports(torch.zeros(3, 1, H, Dh).transpose(1, 2)[:, :, :, :8])  # not one block per head
    buffers = torch.zeros(2, H, 4, Dh)
    with pytest.raises(ValueError, match="contiguous buffers"):
        KERNEL.cross_attention(q, buffers.transpose(0, 1), buffers, StepRows(2, 1, None, 1), None)


@needs_kernel
@pytest.mark.parametrize("beam", [1, 4])
def test_the_search_finds_the_same_translations_with_the_kernel(beam):
    """The whole search (first step, finished sentences dropped, buffers compacted) with the kernel and with the
    masked products: the same hypotheses and scores."""
    model = tiny_transformer(3).eval()
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([9, 4, 7, 2, 6, 8, 3, 5])
    tokens = torch.full((8, 9), 1)
    for i, n in enumerate(lengths.tolist()):
        tokens[i, :n - 1] = torch.randint(4, 50, (n - 1,), generator=g)
        tokens[i, n - 1] = 2
    cfg = SearchConfig(beam=beam, nbest=beam, lenpen=0.6, max_len_b=12)
    sym = Symbols(pad=1, eos=2, unk=3, bos=2)
    with torch.no_grad():
        plain = search(model, tokens, lengths, cfg, sym, kernels=DecodingKernels())
        calls = []
        counting = _Counting(KERNEL, calls)
        compiled = search(model, tokens, lengths, cfg, sym, kernels=DecodingKernels(step_attention=counting))
    assert calls  # the kernel ran the steps
    assert [[x.tokens for x in h] for h in compiled] == [[x.tokens for x in h] for h in plain]
    for h, p in zip(compiled, plain):
        assert [x.score for x in h] == pytest.approx([x.score for x in p], abs=1e-5)


class _Counting(native.CompiledStepAttention):
    def __init__(self, inner, calls):
        super().__init__(inner.library)
        self.calls = calls

    def self_attention(self, *args):
        self.calls.append("self")
        return super().self_attention(*args)


def test_without_a_compiler_or_when_switched_off_the_search_keeps_its_own_attention(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNMT_CACHE_DIR", str(tmp_path))
    native.clear()
    try:
        monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
        assert native.step_attention("AVX2") is None
        monkeypatch.setenv("CC", "false")  # a compiler that fails
        assert native.step_attention("DEFAULT") is None
        assert not list(tmp_path.glob("*.so")) and not list(tmp_path.glob("tmp*"))  # nothing half-written left
        monkeypatch.delenv("CC")
        monkeypatch.setenv(native.SWITCH, "0")
        assert native.step_attention("AVX512") is None
        assert native.smoothed_loss("AVX512") is None
        crit = LabelSmoothedCrossEntropy(LabelSmoothedCrossEntropyConfig(), pad=1)
        CpuBackend(torch.device("cpu")).prepare_criterion(crit)
        assert crit.loss_kernel is None  # the loss keeps PyTorch's passes
    finally:
        native.clear()


def _fresh(monkeypatch, cache, **env):
    """The kernels forgotten, the cache at ``cache``, ``env`` set (CC, build limit, ...)."""
    monkeypatch.setenv("ATTNMT_CACHE_DIR", str(cache))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    native.clear()


def _load_elsewhere(cache) -> subprocess.CompletedProcess:
    """Load the kernels in a new process (as each command does) with the cache at ``cache``."""
    code = "from attnmt.backends import native; assert native.library('DEFAULT') is not None"
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, "ATTNMT_CACHE_DIR": str(cache)},
                          capture_output=True, text=True)


@needs_kernel
@pytest.mark.parametrize("damage", ["truncated", "foreign", "no checksum"])
def test_a_damaged_cached_library_is_never_loaded_but_built_again(tmp_path, damage):
    """A truncated library would crash the process that maps it (SIGBUS), a foreign one lacks our functions:
    each is found by its checksum before it is loaded, deleted and built again."""
    assert _load_elsewhere(tmp_path).returncode == 0
    (so,) = tmp_path.glob("*.so")
    good = so.read_bytes()
    if damage == "truncated":
        so.write_bytes(good[: len(good) // 3])
    elif damage == "foreign":
        source = tmp_path / "other.c"
        source.write_text("int unrelated(void) { return 1; }\n")
        subprocess.run(["cc", "-shared", "-fPIC", str(source), "-o", str(so)], check=True)
    else:
        so.with_suffix(".sha256").unlink()
    assert not native.verified(so)
    again = _load_elsewhere(tmp_path)
    assert again.returncode == 0, again.stderr[-500:]
    assert "warning" not in again.stderr and native.verified(so) and so.read_bytes() == good


def test_a_cc_that_does_not_parse_is_said_once_and_falls_back(monkeypatch, tmp_path, capfd):
    _fresh(monkeypatch, tmp_path, CC="gcc 'unbalanced")
    try:
        assert native.step_attention("DEFAULT") is None and native.smoothed_loss("DEFAULT") is None
        err = capfd.readouterr().err
        assert err.count("attnmt: warning: the compiled CPU kernels are off") == 1 and "CC=" in err
        assert native.status("DEFAULT").startswith("off (CC=")
    finally:
        native.clear()


def test_a_hanging_compiler_is_stopped_at_the_limit_and_not_waited_on_again(monkeypatch, tmp_path, capfd):
    hang = tmp_path / "hang"
    hang.write_text(f"#!/bin/sh\necho started >> {tmp_path / 'runs'}\nexec sleep 59.25\n")
    hang.chmod(0o755)
    _fresh(monkeypatch, tmp_path / "cache", CC=str(hang), ATTNMT_KERNEL_BUILD_TIMEOUT="1")
    try:
        start = time.monotonic()
        assert native.library("DEFAULT") is None
        assert time.monotonic() - start < 20
        assert "did not answer within 1 s" in capfd.readouterr().err
        native.clear()
        assert native.library("DEFAULT") is None  # remembered: no second wait
        err = capfd.readouterr().err
        assert "an earlier build failed" in err and "delete" in err
        assert (tmp_path / "runs").read_text().split() == ["started"]
        assert "earlier build failed" in native.status("DEFAULT")
        deadline = time.monotonic() + 10  # the compiler and its children were killed: none left
        while subprocess.run(["pgrep", "-f", "sleep 59.25"], capture_output=True).returncode == 0:
            assert time.monotonic() < deadline, "the hanging compiler still runs"
            time.sleep(0.2)
        for remembered in (tmp_path / "cache").glob("failed-*.txt"):
            remembered.unlink()  # as the message says: the next run tries again
        native.clear()
        assert native.library("DEFAULT") is None and (tmp_path / "runs").read_text().split() == ["started"] * 2
    finally:
        native.clear()


def test_the_cache_key_holds_the_compilers_version(monkeypatch, tmp_path):
    """Another compiler version (or C library) builds into another entry instead of loading a foreign build."""
    versions = []
    for version in ("1.0", "2.0"):
        fake = tmp_path / f"cc-{version}"
        fake.write_text(f'#!/bin/sh\n[ "$1" = --version ] && {{ echo "fakecc {version}"; exit 0; }}\nexec cc "$@"\n')
        fake.chmod(0o755)
        monkeypatch.setenv("CC", str(tmp_path / "cc"))
        (tmp_path / "cc").unlink(missing_ok=True)
        (tmp_path / "cc").symlink_to(fake)
        versions.append(native._library_path(tmp_path, native._compiler(), native.compile_flags("DEFAULT"), 10))
    assert versions[0] != versions[1]


@needs_kernel
def test_a_compiler_without_openmp_builds_the_kernels_for_one_thread(monkeypatch, tmp_path):
    compiler = tmp_path / "cc-without-openmp"
    compiler.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && exit 1; done\nexec gcc "$@"\n')
    compiler.chmod(0o755)
    monkeypatch.setenv("ATTNMT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(compiler))
    native.clear()
    try:
        kernel = native.step_attention("AVX2")
        assert kernel is not None and len(list((tmp_path / "cache").glob("*.so"))) == 1
        g = torch.Generator().manual_seed(8)
        k_buf, v_buf = torch.randn(3, 2, 5, 16, generator=g), torch.randn(3, 2, 5, 16, generator=g)
        rows = StepRows(6, 2, None, 2)
        q, _, _ = _queries(rows.count, 2, 16, torch.float32, g)
        expected = _reference(q, k_buf, v_buf, lambda r: r // 2, lambda r: list(range(5)))
        assert torch.allclose(kernel.cross_attention(q, k_buf, v_buf, rows, None), expected, atol=1e-5)
    finally:
        native.clear()


@needs_kernel
def test_a_compiler_of_several_words_is_run_as_a_shell_would(monkeypatch, tmp_path):
    """CC="ccache gcc" (a wrapper, then the compiler) runs the wrapper with the compiler as its first argument."""
    wrapper = tmp_path / "wrap"
    wrapper.write_text(f'#!/bin/sh\necho "$1" >> {tmp_path / "called"}\nexec "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", f"{wrapper} gcc")
    library = native.build("DEFAULT", tmp_path / "cache")
    assert library.exists() and set((tmp_path / "called").read_text().split()) == {"gcc"}


@needs_kernel
@pytest.mark.skipif(platform.machine() != "x86_64", reason="the instruction sets named are x86's")
def test_a_build_is_compiled_once_per_source_and_instruction_set(tmp_path, monkeypatch):
    first = native.build("AVX2", tmp_path)
    stamp = first.stat().st_mtime_ns
    assert native.build("AVX2", tmp_path) == first and first.stat().st_mtime_ns == stamp
    other = native.build("DEFAULT", tmp_path)
    assert other != first and sorted(tmp_path.glob("*.so")) == sorted([first, other])
    assert not list(tmp_path.glob("*.tmp"))  # the libraries and their checksums, nothing half-written
    header = tmp_path / "vec.h"  # the build follows its header as well as its sources
    header.write_bytes(native.HEADERS[0].read_bytes() + b"\n/* changed */\n")
    monkeypatch.setattr(native, "HEADERS", (header,))
    assert native.build("AVX2", tmp_path) not in (first, other)


SCORES = native.scores(native.target(capabilities.cpu()))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [640, 203])  # whole blocks and 8-token groups, and neither
def test_logsumexp_and_block_maxima_equal_pytorchs(dtype, vocab):
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(7, vocab, generator=g) * 6).to(dtype)
    logits[2, 5] = float("-inf")
    bias = torch.zeros(vocab)
    bias[[1, 3]] = float("-inf")
    bias[4] = -1.5
    maxima, lse = SCORES.logsumexp_blocks(logits, bias, 64)
    n = vocab // 64
    x = logits.float() + bias
    assert maxima.shape == (7, n) and torch.equal(maxima, x[:, :n * 64].unflatten(1, (n, 64)).amax(2))
    assert torch.allclose(lse, torch.logsumexp(logits.float(), dim=1), atol=1e-5, rtol=1e-6)
    plain, _ = SCORES.logsumexp_blocks(logits, None, 8)
    assert torch.equal(plain, logits.float()[:, :vocab // 8 * 8].unflatten(1, (-1, 8)).amax(2))
    with pytest.raises(ValueError, match="multiple of 8"):
        SCORES.logsumexp_blocks(logits, bias, 12)


@needs_kernel
@pytest.mark.parametrize("options", [dict(), dict(unkpen=2.0, min_len=3), dict(unkpen=-1.0), dict(max_len_a=0, max_len_b=3)])
def test_the_search_finds_the_same_translations_with_the_score_kernel(options):
    """Beam search over a vocabulary of many blocks, scoring through logsumexp and block maxima (the kernel) and
    through log_softmax: the same hypotheses and scores, with the rules that bias tokens (--unkpen, --min-len) and
    rows that reach their length limit (which keep PyTorch's form)."""
    from attnmt.models.transformer import TransformerConfig, TransformerModel

    cfg = TransformerConfig(encoder_layers=1, decoder_layers=1, encoder_embed_dim=32, decoder_embed_dim=32,
                            encoder_ffn_embed_dim=64, decoder_ffn_embed_dim=64, encoder_attention_heads=4,
                            decoder_attention_heads=4, dropout=0.0)
    torch.manual_seed(6)
    model = TransformerModel.build(cfg, 700, 700, 1, joint_vocab=True).eval()
    with torch.no_grad():
        model.decoder.output_projection.weight.mul_(8)  # peaked distributions: candidates in few blocks
    g = torch.Generator().manual_seed(6)
    tokens = torch.randint(4, 700, (6, 7), generator=g)
    tokens[:, -1] = 2
    lengths = torch.full((6,), 7)
    search_cfg = SearchConfig(beam=4, nbest=2, lenpen=0.6, **({"max_len_b": 10} | options))
    with torch.no_grad():  # the model's favourite tokens play the special ones, so that the rules matter
        enc = model.encode(tokens, lengths)
        first = model.decode(torch.full((6, 1), 2), enc, model.new_cache()).log_softmax(-1).mean((0, 1))
    favourites = first.topk(4).indices.tolist()  # EOS the first only where --min-len holds it back
    eos, unk, pad, bos = favourites if "min_len" in options else favourites[::-1]
    sym = Symbols(pad=pad, eos=eos, unk=unk, bos=bos)
    calls = []
    counting = _CountingScores(SCORES, calls)
    with torch.no_grad():
        plain = search(model, tokens, lengths, search_cfg, sym, kernels=DecodingKernels())
        fused = search(model, tokens, lengths, search_cfg, sym, kernels=DecodingKernels(scores=counting))
    assert calls
    assert [[x.tokens for x in h] for h in fused] == [[x.tokens for x in h] for h in plain]
    for h, p in zip(fused, plain):
        assert [x.score for x in h] == pytest.approx([x.score for x in p], abs=1e-5)


@needs_kernel
@pytest.mark.parametrize("options", [dict(), dict(unkpen=2.0, min_len=3), dict(max_len_a=0, max_len_b=3)])
def test_a_shortlisted_search_scored_over_its_candidates_equals_the_search_over_the_whole_vocabulary(options):
    """With a shortlist the score kernel runs over the candidates alone, in their own ids, and the chosen tokens are
    mapped back: the same hypotheses and scores as scoring the whole vocabulary with every other token at -inf."""
    from attnmt.generation.shortlist import ShortlistedModel, projection_maker
    from attnmt.models.transformer import TransformerConfig, TransformerModel

    cfg = TransformerConfig(encoder_layers=1, decoder_layers=1, encoder_embed_dim=32, decoder_embed_dim=32,
                            encoder_ffn_embed_dim=64, decoder_ffn_embed_dim=64, encoder_attention_heads=4,
                            decoder_attention_heads=4, dropout=0.0)
    torch.manual_seed(8)
    vocab = 1500
    model = TransformerModel.build(cfg, vocab, vocab, 1, joint_vocab=True).eval()
    with torch.no_grad():
        model.decoder.output_projection.weight.mul_(8)
    g = torch.Generator().manual_seed(8)
    ids = torch.cat([torch.arange(4), 4 + torch.randperm(vocab - 4, generator=g)[:800]]).sort().values
    short = ShortlistedModel(model, ids, projection_maker(model.output_projection_weight().detach(), lambda m: m)(ids),
                             vocab)

    class Wide(ShortlistedModel):  # the same logits, scored over the whole vocabulary
        def output_candidates(self):
            return None

    wide = Wide(model, ids, short.projection, vocab)
    tokens = torch.randint(4, vocab, (6, 7), generator=g)
    tokens[:, -1] = 2
    lengths = torch.full((6,), 7)
    sym = Symbols(pad=1, eos=2, unk=3, bos=0)
    search_cfg = SearchConfig(beam=4, nbest=2, lenpen=0.6, **({"max_len_b": 10} | options))
    widths = []

    class Widths(_CountingScores):
        def logsumexp_blocks(self, logits, *args):
            widths.append(logits.size(1))
            return super().logsumexp_blocks(logits, *args)

    kernels = DecodingKernels(scores=Widths(SCORES, []), blockwise_topk=True)
    with torch.no_grad():
        got = search(short, tokens, lengths, search_cfg, sym, kernels=kernels)
        assert widths and set(widths) == {ids.numel()}
        want = search(wide, tokens, lengths, search_cfg, sym, kernels=kernels)
    assert set(widths) == {ids.numel(), vocab}
    assert [[x.tokens for x in h] for h in got] == [[x.tokens for x in h] for h in want]
    for h, w in zip(got, want):
        assert [x.score for x in h] == pytest.approx([x.score for x in w], abs=1e-5)
    assert {int(t) for h in got for x in h for t in x.tokens} <= set(ids.tolist())


class _CountingScores(native.CompiledScores):
    def __init__(self, inner, calls):
        self.functions = inner.functions
        self.calls = calls

    def logsumexp_blocks(self, *args):
        self.calls.append(1)
        return super().logsumexp_blocks(*args)


@needs_kernel
@pytest.mark.parametrize("beam", [1, 4])
@pytest.mark.parametrize("kernel_steps, total", [(6, 9), (8, 10)])  # the buffers grown by the kernel's steps or not
def test_steps_by_the_kernel_then_a_call_of_several_tokens_see_the_same_history(beam, kernel_steps, total):
    """Steps by the kernel, then a call it does not take (several tokens at once: the batched products, which
    read every slot, the unwritten ones under the mask): the same history. Uninitialised memory is NaN here."""
    model = tiny_transformer(7).eval()
    g = torch.Generator().manual_seed(7)
    src = torch.randint(4, 50, (3, 6), generator=g)
    src[:, -1] = 2
    lengths = torch.full((3,), 6)
    prev = torch.randint(4, 50, (3 * beam, total), generator=g)
    prev[:, 0] = 2  # EOS starts every hypothesis
    deterministic = torch.are_deterministic_algorithms_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        with torch.no_grad():
            enc = model.encode(src, lengths)
            full = model(src.repeat_interleave(beam, 0), lengths.repeat_interleave(beam), prev)
            calls = []
            cache = model.new_cache(beam, DecodingKernels(step_attention=_Counting(KERNEL, calls)))
            first = prev[::beam, :1] if beam > 1 else prev[:, :1]
            steps = [model.decode(first, enc, cache).repeat_interleave(beam, 0)]
            steps += [model.decode(prev[:, t:t + 1], enc, cache) for t in range(1, kernel_steps)]
            assert len(calls) == kernel_steps * len(model.decoder.layers)
            steps.append(model.decode(prev[:, kernel_steps:], enc, cache))  # several tokens: the batched products
            assert len(calls) == kernel_steps * len(model.decoder.layers)
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.utils.deterministic.fill_uninitialized_memory = fill
    out = torch.cat(steps, 1)
    assert torch.isfinite(out).all() and (out - full).abs().max().item() < 1e-4


def test_the_target_adds_bf16_dot_products_only_where_bf16_runs_natively_on_avx512():
    import dataclasses

    base = capabilities.CpuCapabilities(name="test CPU", vendor="AuthenticAMD", isa="AVX512",
                                        flags=frozenset({"avx512f", "avx512_bf16"}), onednn=True, onednn_bf16=True,
                                        switched_off=False)
    assert native.target(base) == "AVX512+BF16" and "-mavx512bf16" in native.compile_flags("AVX512+BF16")
    assert native.target(dataclasses.replace(base, switched_off=True)) == "AVX512"  # ATTNMT_CPU_BF16=0
    assert native.target(dataclasses.replace(base, isa="AVX2")) == "AVX2"  # ATEN_CPU_CAPABILITY=avx2
    assert native.target(dataclasses.replace(base, flags=frozenset({"avx512f"}))) == "AVX512"
    if platform.machine() == "x86_64":
        assert "-mavx512bf16" not in native.compile_flags("AVX512") and "-mavx2" in native.compile_flags("AVX2")


LOSS = native.smoothed_loss(native.target(capabilities.cpu()))


def _smoothed_reference(logits, target, eps):
    """lp_y, lp_sum and softmax - q in float64."""
    lp = torch.log_softmax(logits.double(), dim=1)
    q = torch.full_like(lp, eps / logits.size(1))
    q[torch.arange(len(target)), target] += 1 - eps
    return lp.gather(1, target[:, None]).squeeze(1), lp.sum(1), lp.exp() - q


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [640, 203])  # whole 16-token groups, and not even 8
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("grad", ["in place", "apart", "none"])
def test_loss_kernel_gives_the_log_probabilities_sums_and_gradient(dtype, vocab, eps, grad):
    g = torch.Generator().manual_seed(6)
    logits = (torch.randn(9, vocab, generator=g) * 8).to(dtype)
    target = torch.randint(0, vocab, (9,), generator=g)
    target[0], target[1] = 0, vocab - 1  # the first and the last token (the last in the scalar tail at 203)
    ref_y, ref_sum, ref_grad = _smoothed_reference(logits, target, eps)
    lp_y, lp_sum = torch.empty(9), torch.empty(9)
    x = logits.clone()
    out = {"in place": x, "apart": torch.full_like(x, float("nan")), "none": None}[grad]
    LOSS.smoothed_rows(x, target, eps, lp_y, lp_sum, out)
    assert torch.allclose(lp_y.double(), ref_y, atol=1e-4, rtol=1e-5)
    assert torch.allclose(lp_sum.double(), ref_sum, rtol=1e-5)
    if out is None:
        assert torch.equal(x, logits)
        return
    if dtype == torch.float32:
        assert torch.allclose(out.double(), ref_grad, atol=1e-6)
    else:  # rounded to the nearest bf16 (all within one unit in the last place, almost all exactly)
        nearest = ref_grad.to(dtype)
        assert torch.allclose(out.double(), nearest.double(), rtol=2 ** -7, atol=1e-7)
        assert float((out == nearest).double().mean()) > 0.99
    if grad == "apart":
        assert torch.equal(x, logits)


@needs_kernel
def test_loss_kernel_refuses_targets_outside_the_vocabulary():
    logits = torch.randn(3, 40)
    with pytest.raises(ValueError, match="below the vocabulary size 40"):
        LOSS.smoothed_rows(logits, torch.tensor([1, 40, 2]), 0.1, torch.empty(3), torch.empty(3), logits)
    with pytest.raises(ValueError, match="contiguous"):
        LOSS.smoothed_rows(logits, torch.tensor([1, 2, 3]), 0.1, torch.empty(3), torch.empty(3), logits.t())
    with pytest.raises(ValueError, match="contiguous"):
        LOSS.smoothed_rows(logits.t(), torch.arange(40) % 3, 0.1, torch.empty(40), torch.empty(40), None)


@needs_kernel
@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("row_blocks", [False, True])
def test_the_loss_with_its_kernel_equals_the_loss_without(monkeypatch, bf16, row_blocks):
    """The fused projection + loss: the same loss, NLL and gradients with the compiled kernel as with PyTorch's
    passes, over one block of rows or several; in bf16, at least as close to the exact values."""
    if bf16 and not capabilities.cpu().native_bf16:
        pytest.skip("no native bf16 on this CPU")
    if row_blocks:
        monkeypatch.setattr(C, "_PROJECTION_ELEMENTS", 203 * 300)  # blocks of 300 rows
    g = torch.Generator().manual_seed(7)
    h0, w0 = torch.randn(700, 32, generator=g), torch.randn(203, 32, generator=g) * 0.3
    target = torch.randint(0, 203, (700,), generator=g)
    results = []
    for kernel in (None, LOSS):
        h, w = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, nll = C.projected_smoothed_cross_entropy(h, w, target, 0.1, kernel=kernel)
        (loss + 0.5 * nll).backward()
        results.append((loss.detach(), nll.detach(), h.grad, w.grad))
    if not bf16:
        for a, b in zip(*results):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
        return
    # exact values of the products bf16 runs (operands rounded to bf16), in float64
    h, w = h0.bfloat16().double().requires_grad_(True), w0.bfloat16().double().requires_grad_(True)
    ref_loss, ref_nll = C.label_smoothed_nll_loss(torch.log_softmax(h @ w.t(), -1), target, 0.1)
    (ref_loss + 0.5 * ref_nll).backward()
    reference = (ref_loss.detach(), ref_nll.detach(), h.grad, w.grad)
    for plain, compiled, exact in zip(*results, reference):
        plain_error, compiled_error = (float((x.double() - exact).abs().max()) for x in (plain, compiled))
        assert compiled_error <= 1.25 * plain_error + 1e-3 * float(exact.abs().max())


ATTENTION = native.training_attention(native.target(capabilities.cpu()))


def _padded(x, rows, parts, heads):
    """``parts`` zero-padded (B, H, L, Dh) heads of the (R, parts * H * Dh) rows ``x`` laid out as ``rows`` say,
    and the (B, L) bool grid of the real positions."""
    B, L = rows.start.numel(), rows.longest
    t = torch.arange(L)
    real = t[None, :] < rows.length[:, None]
    grid = x.new_zeros(B, L, x.size(1))
    grid[real] = x[(rows.start[:, None] + t[None, :])[real]]
    return [c.reshape(B, L, heads, -1).transpose(1, 2) for c in grid.chunk(parts, dim=-1)], real


def _reference_attention(q, kv, heads, queries, keys, mask, causal):
    """The plain matmul-softmax-matmul over the padded heads the rows give, back as rows like q's."""
    from attnmt.models.transformer import plain_attention

    if kv is None:
        (qh, kh, vh), real = _padded(q, queries, 3, heads)
    else:
        (qh,), real = _padded(q, queries, 1, heads)
        (kh, vh), _ = _padded(kv, keys, 2, heads)
    out = plain_attention(qh, kh, vh, mask, causal, 0.0)  # (B, H, T, Dh)
    return out.transpose(1, 2).flatten(2)[real]  # the real positions in order: the rows


def _sentences(lengths, longest):
    from attnmt.models.packing import SentenceRows

    lengths = torch.tensor(lengths)
    return SentenceRows(lengths.cumsum(0) - lengths, lengths, longest, int(lengths.sum()))


@needs_kernel
@pytest.mark.parametrize("case", ["self", "causal", "cross", "packed", "packed-cross"])
@pytest.mark.parametrize("shape", [(3, 7, 9, 2, 64), (2, 13, 5, 3, 8), (4, 1, 1, 1, 128)])  # B, T, S, H, Dh
def test_training_attention_gives_the_plain_forms_output_and_gradients(case, shape):
    """Against the plain matmul-softmax-matmul in float64: the output and the gradients of the projections'
    outputs it read Q, K and V from, on a padded grid (encoder self-attention with a key padding mask; causal;
    encoder-decoder attention) and on the packed decoder's rows (causal self-attention; encoder-decoder
    attention); key counts that are and are not multiples of 4 (the kernel's dot products in fours)."""
    from attnmt.models.packing import SentenceRows

    B, T, S, H, Dh = shape
    D = H * Dh
    g = torch.Generator().manual_seed(sum(shape))
    if case.startswith("packed"):
        lengths = [T] + [int(n) for n in torch.randint(1, T + 1, (B - 1,), generator=g)]
        queries = _sentences(lengths, T)
    else:
        queries = SentenceRows.grid(B, T, torch.device("cpu"))
    q = torch.randn(queries.rows, D if case.endswith("cross") else 3 * D, generator=g)
    kv = keys = mask = None
    if case.endswith("cross"):
        keys = SentenceRows.grid(B, S, torch.device("cpu"))
        kv = torch.randn(B * S, 2 * D, generator=g)
        keep = torch.ones(B, S, dtype=torch.bool)
        keep[0, S // 2 + 1:] = False  # the first sentence's source is padded
        mask = keep[:, None, None, :]
    elif case == "self":
        keep = torch.ones(B, T, dtype=torch.bool)
        keep[-1, T // 2 + 1:] = False
        mask = keep[:, None, None, :]
    keys = keys or queries
    causal = case in ("causal", "packed")
    leaves = [x.requires_grad_(True) for x in (q, kv) if x is not None]
    assert ATTENTION.supports(q, kv, H, keys, mask)
    out = ATTENTION.attend(q, kv, H, queries, keys, mask, causal)
    dout = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, leaves, dout)

    exact = [x.detach().double().requires_grad_(True) for x in leaves]
    ref = _reference_attention(exact[0], exact[1] if kv is not None else None, H, queries, keys, mask, causal)
    ref_grads = torch.autograd.grad(ref, exact, dout.double())
    assert out.dtype == torch.float32 and out.shape == (queries.rows, D)
    assert torch.allclose(out.double(), ref, atol=2e-6)
    for got, want in zip(grads, ref_grads):
        assert torch.allclose(got.double(), want, atol=2e-5)


@needs_kernel
def test_training_attention_gives_a_query_that_sees_no_key_zeros():
    """The kernel's rule for a query whose keys are all masked (the model's masks never make one): a zero output
    and zero gradients, where the products would give NaN."""
    from attnmt.models.packing import SentenceRows

    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * 3, 3 * 2 * 8, generator=g).requires_grad_(True)
    rows = SentenceRows.grid(2, 3, torch.device("cpu"))
    keep = torch.tensor([[True, True, False], [False, False, False]])
    out = ATTENTION.attend(x, None, 2, rows, rows, keep[:, None, None, :], False)
    assert not out[3:].any() and out[:3].abs().sum() > 0
    (grad,) = torch.autograd.grad(out.sum(), x)
    assert torch.isfinite(grad).all() and not grad[3:].any()


@needs_kernel
def test_what_the_training_attention_takes():
    from attnmt.models.packing import SentenceRows

    rows = SentenceRows.grid(2, 5, torch.device("cpu"))
    x = torch.randn(10, 3 * 2 * 16)
    assert ATTENTION.supports(x, None, 2, rows, None)
    assert not ATTENTION.supports(x.bfloat16(), None, 2, rows, None)  # fp32 only: bf16 keeps PyTorch's products
    assert not ATTENTION.supports(torch.randn(10, 3 * 2 * 12), None, 2, rows, None)  # heads of a multiple of 8
    assert not ATTENTION.supports(x, None, 5, rows, None)  # 96 columns are not 3 x 5 heads
    assert not ATTENTION.supports(x[:, :48], torch.randn(10, 80), 2, rows, None)  # K, V of Q's width
    long = SentenceRows.grid(1, ATTENTION.max_keys + 1, torch.device("cpu"))
    assert not ATTENTION.supports(torch.randn(long.rows, 48), None, 2, long, None)  # longer: PyTorch's products
    assert not ATTENTION.supports(x, None, 2, rows, torch.ones(2, 1, 5, 5, dtype=torch.bool))  # a mask per query
    assert not ATTENTION.supports(x.t().contiguous().t(), None, 2, rows, None)  # rows must be contiguous
    with pytest.raises(ValueError, match="attention kernel takes"):
        ATTENTION.attend(x.bfloat16(), None, 2, rows, rows, None, False)
    with pytest.raises(ValueError, match="rows do not match"):
        ATTENTION.attend(x[:9], None, 2, rows, rows, None, False)


@needs_kernel
@pytest.mark.parametrize("kernels", ["1", "0"])
def test_the_cpu_backend_trains_with_the_compiled_attention_and_dropout(monkeypatch, kernels):
    """``prepare_training`` gives the attention modules the attention kernel and every module with dropout the
    dropout kernel (none when switched off); a training step's loss and gradients are those of PyTorch's plain
    attention."""
    from attnmt.models.tuning import AttentionKernel, DropoutKernel, set_fused_attention

    monkeypatch.setenv(native.SWITCH, kernels)
    native.clear()
    try:
        model = tiny_transformer()
        CpuBackend(torch.device("cpu")).prepare_training(model)
        attention = [m for m in model.modules() if isinstance(m, AttentionKernel)]
        assert len(attention) == 2 + 2 * 2  # encoder self-attention, decoder self- and cross-attention
        dropouts = [m for m in model.modules() if isinstance(m, DropoutKernel)]
        assert len(dropouts) > len(attention)
        if kernels == "0":
            assert all(m.fused_attention is None for m in attention)
            assert all(m.dropout_masks is None for m in dropouts)
            return
        assert all(isinstance(m.fused_attention, native.CompiledTrainingAttention) for m in attention)
        assert all(isinstance(m.dropout_masks, native.CompiledDropout) for m in dropouts)
        g = torch.Generator().manual_seed(3)
        src = torch.randint(4, 30, (4, 6), generator=g)
        src[1, 4:] = 1  # padding
        prev = torch.randint(4, 30, (4, 5), generator=g)
        prev[2, 3:] = 1
        keep = prev.ne(1)
        results = []
        for kernel in (attention[0].fused_attention, None):
            set_fused_attention(model, kernel)
            model.zero_grad()
            h = model(src, src.ne(1).sum(1), prev, output_mask=keep, features_only=True)
            (h * torch.linspace(-1, 1, h.numel()).view_as(h)).sum().backward()
            results.append([h.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None])
        for a, b in zip(*results):
            assert torch.allclose(a, b, atol=1e-5)
    finally:
        native.clear()


DROPOUT = native.dropout_masks(native.target(capabilities.cpu()))
_M32 = 0xFFFFFFFF


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer on int64 tensors holding uint32 values."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def _kept(n: int, threshold: int, seed: int) -> torch.Tensor:
    """The mask the kernel documents: element e kept when 15 bits of hash(seed, e) are >= threshold."""
    e = torch.arange(n, dtype=torch.int64)
    h = _fmix32((e & _M32) ^ (seed & _M32))
    return (_fmix32(h ^ (e >> 32) ^ (seed >> 32)) & 0x7FFF) >= threshold


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [5, 1003, 40_000])  # the scalar tail alone, a tail, several blocks
@pytest.mark.parametrize("add", [False, True])
def test_dropout_kernel_applies_the_documented_mask(dtype, n, add):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g).to(dtype) if add else None
    y = torch.randn(n, generator=g).to(dtype)
    threshold, seed = 9830, 0x9E3779B97F4A7C15  # p = 0.3, a seed with both halves set
    scale = 2**15 / (2**15 - threshold)
    out = DROPOUT.apply(x, y, threshold, scale, seed)
    keep = _kept(n, threshold, seed)
    expected = torch.where(keep, y.float() * scale, torch.zeros(()))
    if add:
        expected = x.float() + expected
    assert out.dtype == dtype and torch.equal(out, expected.to(dtype))  # one rounding, at the end


@needs_kernel
def test_dropout_kernel_masks_drop_at_the_rate_asked_independently_and_per_seed():
    n, threshold = 1 << 20, 6554  # p = 0.2
    y = torch.ones(n)
    out = DROPOUT.apply(None, y, threshold, 1.25, 12345)
    dropped = out == 0
    p = threshold / 2**15
    assert abs(float(dropped.float().mean()) - p) < 5 * (p * (1 - p) / n) ** 0.5
    both = (dropped[:-1] & dropped[1:]).float().mean()  # neighbours, as counters 2k and 2k + 1 could correlate
    assert abs(float(both) - p * p) < 5 * (p * p * (1 - p * p) / n) ** 0.5
    assert torch.equal(out[~dropped], torch.full((int((~dropped).sum()),), 1.25))
    other = DROPOUT.apply(None, y, threshold, 1.25, 12346) == 0
    assert float((dropped == other).float().mean()) < 1 - p  # another seed, another mask (agreement ~ 0.68)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_with_the_kernel_has_the_gradient_of_the_mask_it_applied_and_repeats_under_a_seed(dtype):
    from attnmt.models.dropout import dropout, dropout_add

    g = torch.Generator().manual_seed(8)
    x = torch.randn(37, 64, generator=g).to(dtype).requires_grad_(True)
    y = torch.randn(37, 64, generator=g).to(dtype).requires_grad_(True)
    torch.manual_seed(0)
    out = dropout_add(x, y, 0.3, True, True, DROPOUT)
    torch.manual_seed(0)
    again = dropout_add(x, y, 0.3, True, True, DROPOUT)
    torch.manual_seed(0)
    alone = dropout(y, 0.3, True, True, DROPOUT)  # the same seed, so the same mask, without the residual
    assert torch.equal(out, again)
    kept = alone.detach() != 0  # y has no zeros
    scale = 2**15 / (2**15 - round(0.3 * 2**15))
    assert torch.equal(out, (x.float() + torch.where(kept, y.float() * scale, torch.zeros(()))).to(dtype))
    assert 0.25 < 1 - float(kept.float().mean()) < 0.35
    grad = torch.randn(37, 64, generator=g).to(dtype)
    gx, gy = torch.autograd.grad(out, (x, y), grad)
    assert torch.equal(gx, grad)
    assert torch.equal(gy, torch.where(kept, grad.float() * scale, torch.zeros(())).to(dtype))
    (gy_alone,) = torch.autograd.grad(alone, y, grad)
    assert torch.equal(gy_alone, gy)
