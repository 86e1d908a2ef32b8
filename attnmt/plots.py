"""Plots for a trained model: training curves from ``train.jsonl`` and encoder-decoder attention heat maps.

Both are PNG files drawn with matplotlib's Agg renderer (no display needed, no global pyplot state) and written
atomically. matplotlib is an optional dependency (``pip install 'attnmt[plots]'``); it is imported only here, when a
plot is drawn.

Curves. ``attnmt train`` appends one JSON object per line to ``SAVE_DIR/train.jsonl``: ``"type": "train"`` records
(every ``--log-interval`` updates: ``num_updates``, ``loss`` in bits per token, ...) and ``"type": "valid"`` records
(one per validation split: ``subset``, ``num_updates``, ``loss``, and ``bleu`` with ``--eval-bleu``). A resumed run
appends to the same file starting again from the update of its checkpoint, so records a crashed run wrote after its
last checkpoint are superseded: when a series goes back in updates, its later points are dropped.

Attention. For a source sentence and a target sequence (the model's own translation, or a forced reference) the
model's encoder-decoder attention weights are computed explicitly (``cross_attention_weights``); the heat map has
the source pieces on x and the target pieces on y: row ``t`` is the attention with which target piece ``t`` was
predicted.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from attnmt.backends import backend_for
from attnmt.errors import UserError
from attnmt.fileio import atomic_open
from attnmt.generation.generator import Generator, collate
from attnmt.generation.search import SearchConfig
from attnmt.models.attention_maps import attention_maps_of

# ------------------------------------------------------------------------------------------------ matplotlib


def _figure_class():
    """matplotlib's ``Figure`` (drawn with Agg); a clear error when matplotlib is missing."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError("plotting needs matplotlib, which is not installed; run: pip install 'attnmt[plots]' "
                        "(or pip install matplotlib)") from None
    return Figure


def new_figure(width: float, height: float):
    """A figure of ``width`` x ``height`` inches with constrained layout, bound to the Agg canvas."""
    figure_class = _figure_class()
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = figure_class(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save_png(fig, path: str | Path, dpi: int = 150) -> tuple[int, int]:
    """Write ``fig`` as a PNG atomically; returns its (width, height) in pixels."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path}: is a directory; --out must be a file name such as {path}/plot.png")
    if path.suffix.lower() != ".png":
        raise UserError(f"{path}: --out must end in .png (the plots are PNG images)")
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=dpi)
    w, h = fig.get_size_inches()
    return int(round(w * dpi)), int(round(h * dpi))


# ----------------------------------------------------------------------------------------- training curves


@dataclass
class Series:
    """Values over updates, in increasing update order."""

    updates: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)

    def add(self, num_updates: int, value: float) -> None:
        """Append a point; a point at or before the last one (a resumed run) supersedes the later points."""
        if self.updates and num_updates <= self.updates[-1]:
            keep = next(i for i, u in enumerate(self.updates) if u >= num_updates)
            del self.updates[keep:], self.values[keep:]
        self.updates.append(num_updates)
        self.values.append(value)

    def __len__(self) -> int:
        return len(self.updates)


@dataclass
class TrainLog:
    """The curves of one ``train.jsonl``: train loss, and per validation split its loss and (if logged) BLEU."""

    path: Path
    train_loss: Series = field(default_factory=Series)
    valid_loss: dict[str, Series] = field(default_factory=dict)
    valid_bleu: dict[str, Series] = field(default_factory=dict)

    def empty(self) -> bool:
        return not len(self.train_loss) and not any(len(s) for s in self.valid_loss.values())


MAX_RECORD_BYTES = 1 << 20  # attnmt's records are a few hundred bytes; a longer line is not one of them


def _short(value) -> str:
    """``repr(value)`` cut to a length an error line can carry."""
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**40 else f"an integer of {len(str(value))} digits"
    return text if len(text) <= 60 else text[:57] + "..."


def _text(value) -> str:
    """A string from the log as printable text (a lone surrogate, which no file can hold, escaped)."""
    return str(value).encode("utf-8", "backslashreplace").decode("utf-8")


def _number(rec: dict, key: str, path: Path, lineno: int) -> float:
    v = rec.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise UserError(f"{path}:{lineno}: a '{_text(rec.get('type'))[:20]}' record without a numeric '{key}' (got "
                        f"{_short(v)}); pass the train.jsonl written by attnmt train")
    v = float(v)
    return v if math.isfinite(v) else math.nan  # a diverged run logs inf/NaN: a gap in the curve


def read_train_log(path: str | Path) -> TrainLog:
    """Parse ``train.jsonl``; a missing, empty or foreign file raises a one-line UserError naming it."""
    path = Path(path)
    fix = "pass --log SAVE_DIR/train.jsonl of a run of attnmt train"
    if path.is_dir():
        raise UserError(f"{path}: is a directory; {fix}")
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{path}: no such file; {fix}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise UserError(f"{path}:{line}: not UTF-8 text; {fix}") from None
    if not text.strip():
        raise UserError(f"{path}: is empty (training logs its first record after --log-interval updates); wait for "
                        f"it or {fix}")
    lines = text.split("\n")
    unterminated = len(lines) - 1 if lines[-1] else None  # a line being written by a running training
    log = TrainLog(path)
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if len(line) > MAX_RECORD_BYTES:
            raise UserError(f"{path}:{lineno}: a line of {len(line):,} characters, not a record of attnmt train; {fix}")
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if lineno - 1 == unterminated:
                continue
            raise UserError(f"{path}:{lineno}: not a JSON record ({e.msg}); {fix}") from None
        except (ValueError, RecursionError) as e:  # too deeply nested, an integer past Python's digit limit
            why = "nested too deeply" if isinstance(e, RecursionError) else str(e).split(":")[0][:80]
            raise UserError(f"{path}:{lineno}: not a record of attnmt train ({why}); {fix}") from None
        if not isinstance(rec, dict):
            raise UserError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}; {fix}")
        kind = rec.get("type")
        if kind not in ("train", "valid"):
            continue  # summaries and records of other kinds carry no curve point
        n = rec.get("num_updates")
        if isinstance(n, bool) or not isinstance(n, int):
            raise UserError(f"{path}:{lineno}: a '{kind}' record without an integer 'num_updates' (got {_short(n)}); "
                            f"{fix}")
        if kind == "train":
            log.train_loss.add(n, _number(rec, "loss", path, lineno))
            continue
        subset = _text(rec.get("subset") or "valid")[:80]
        log.valid_loss.setdefault(subset, Series()).add(n, _number(rec, "loss", path, lineno))
        if rec.get("bleu") is not None:
            log.valid_bleu.setdefault(subset, Series()).add(n, _number(rec, "bleu", path, lineno))
    if log.empty():
        raise UserError(f"{path}: holds no 'train' or 'valid' record with a loss, so there is nothing to plot; {fix}")
    return log


def plot_curves(log: TrainLog, title: str | None = None):
    """Loss (bits per token) over updates: train and every validation split; BLEU in a second panel if logged."""
    has_bleu = any(len(s) for s in log.valid_bleu.values())
    fig = new_figure(8.0, 7.0 if has_bleu else 4.5)
    axes = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2]) if has_bleu else [fig.subplots()]
    ax = axes[0]
    if len(log.train_loss):
        ax.plot(log.train_loss.updates, log.train_loss.values, color="tab:blue", lw=1.2, label="train loss")
    colors = ["tab:orange", "tab:red", "tab:purple", "tab:brown"]
    for i, (subset, s) in enumerate(log.valid_loss.items()):
        c = colors[i % len(colors)]
        ax.plot(s.updates, s.values, color=c, lw=1.2, marker="o", ms=3.5, label=f"{subset} loss")
        best = _best(s, maximize=False)
        if best is not None:
            ax.annotate(f"{s.values[best]:.3f}", (s.updates[best], s.values[best]), textcoords="offset points",
                        xytext=(0, 7), ha="center", fontsize=8, color=c)
    ax.set_ylabel("loss (bits per token)")
    ax.margins(y=0.1)  # room for the annotation of the best point
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right", fontsize=9)
    if has_bleu:
        bx = axes[1]
        for i, (subset, s) in enumerate(log.valid_bleu.items()):
            c = colors[i % len(colors)]
            bx.plot(s.updates, s.values, color=c, lw=1.2, marker="s", ms=3.5, label=f"{subset} BLEU")
            best = _best(s, maximize=True)
            if best is not None:
                bx.annotate(f"{s.values[best]:.2f}", (s.updates[best], s.values[best]), textcoords="offset points",
                            xytext=(0, 7), ha="center", fontsize=8, color=c)
        bx.set_ylabel("BLEU")
        bx.margins(y=0.15)
        bx.grid(True, alpha=0.3)
        bx.legend(loc="lower right", fontsize=9)
    axes[-1].set_xlabel("updates")
    fig.suptitle(title or f"training curves: {log.path}", fontsize=11)
    return fig


def _best(s: Series, maximize: bool) -> int | None:
    finite = [i for i, v in enumerate(s.values) if math.isfinite(v)]
    if not finite:
        return None
    return (max if maximize else min)(finite, key=lambda i: s.values[i])


# ------------------------------------------------------------------------------------------ attention maps


@dataclass
class AttentionDump:
    """Encoder-decoder attention of one sentence pair: ``weights`` (L, H, T, S), float32 on the CPU."""

    weights: torch.Tensor
    source_pieces: list[str]  # S labels, the final </s> included
    target_pieces: list[str]  # T labels: target piece t is predicted with row t
    source_lang: str = "src"
    target_lang: str = "tgt"
    forced: bool = False  # True: the target is a given reference; False: the model's translation
    translation: str = ""  # the target as text
    score: float | None = None  # the hypothesis' search score (not for a forced reference)


def _check_source_length(bundle, ids: list[int]) -> None:
    limit = bundle.max_source_positions()
    if limit is not None and len(ids) > limit:
        raise UserError(f"--input: the source has {len(ids)} tokens but the model accepts at most {limit}; "
                        f"shorten the sentence")


def cross_attention_dump(bundle, source: str, reference: str | None = None, search_cfg: Any = None) -> AttentionDump:
    """Translate ``source`` with ``search_cfg`` (or force ``reference``) and take the model's attention weights.

    ``bundle`` is an ``attnmt.inference.InferenceBundle``.
    """
    model = bundle.model
    if not source.strip():
        raise UserError("--input is empty; give the source sentence to translate, e.g. --input \"A man rides a bike.\"")
    src_ids = bundle.encode_source(source)
    _check_source_length(bundle, src_ids)
    device = next(model.parameters()).device
    score = None
    if reference is not None:
        if not reference.strip():
            raise UserError("--reference is empty; give the target sentence, or leave --reference out to plot the "
                            "model's own translation")
        tgt_ids = bundle.tgt_dict.encode_line(bundle.tgt_pipeline.encode(reference))
    else:
        cfg = search_cfg if search_cfg is not None else SearchConfig()
        generator = Generator(model, bundle.symbols, cfg, backend_for(device),
                              max_source_positions=bundle.max_source_positions())
        hyps = generator.search_batch([src_ids], [0])[0]
        if not hyps:
            raise UserError("the search found no translation of --input within its length limit; raise "
                            "--max-len-b or pass --reference")
        tgt_ids, score = list(hyps[0].tokens), float(hyps[0].score)
    limit = model.max_positions()[1]
    if len(tgt_ids) > limit:
        raise UserError(f"--reference: the target has {len(tgt_ids)} tokens but the model accepts at most {limit}; "
                        f"shorten it")
    eos = bundle.symbols.eos
    src_tokens, src_lengths = collate([src_ids], bundle.symbols.pad, device)
    prev, _ = collate([[eos] + tgt_ids[:-1]], bundle.symbols.pad, device)  # the decoder input: </s> then y_<t
    weights = attention_maps_of(model)(src_tokens, src_lengths, prev)[0].float().cpu()  # (L, H, T, S)
    return AttentionDump(weights=weights, source_pieces=[bundle.src_dict[i] for i in src_ids],
                         target_pieces=[bundle.tgt_dict[i] for i in tgt_ids], source_lang=bundle.source_lang,
                         target_lang=bundle.target_lang, forced=reference is not None,
                         translation=bundle.detokenize(bundle.target_pieces(tgt_ids)), score=score)


def parse_head(head: str | int) -> str | int:
    """``--head``: 'mean' (average over heads), 'all' (one panel per head) or a head number."""
    if isinstance(head, int):
        return head
    h = str(head).strip().lower()
    if h in ("mean", "all"):
        return h
    try:
        return int(h)
    except ValueError:
        raise UserError(f"--head {head!r}: use mean (average over heads), all (one panel per head) or a head "
                        f"number such as 0") from None


def _resolve_layer(layer: int, num_layers: int) -> int:
    if not -num_layers <= layer < num_layers:
        raise UserError(f"--layer {layer}: the decoder has {num_layers} layers; use 0..{num_layers - 1} "
                        f"(or -1 for the last)")
    return layer % num_layers


def _panel(ax, w, dump: AttentionDump, vmax: float, fontsize: float, show_y: bool = True):
    im = ax.imshow(w, aspect="auto", cmap="viridis", vmin=0.0, vmax=vmax, interpolation="nearest")
    ax.set_xticks(range(len(dump.source_pieces)))
    ax.set_xticklabels(dump.source_pieces, rotation=90, fontsize=fontsize)
    ax.set_yticks(range(len(dump.target_pieces)))
    ax.set_yticklabels(dump.target_pieces if show_y else [], fontsize=fontsize)
    ax.tick_params(length=2)
    return im


def plot_attention(dump: AttentionDump, layer: int = -1, head: str | int = "mean", title: str | None = None):
    """Heat map(s) of one decoder layer's encoder-decoder attention: source pieces on x, target pieces on y.

    ``head``: 'mean' averages the heads (one map), 'all' draws one panel per head on a shared colour scale, a number
    draws that head only.
    """
    L, H, T, S = dump.weights.shape
    li = _resolve_layer(layer, L)
    head = parse_head(head)
    if isinstance(head, int) and not -H <= head < H:
        raise UserError(f"--head {head}: the model has {H} attention heads; use 0..{H - 1}, mean or all")
    w = dump.weights[li]  # (H, T, S)
    n = max(S, T)
    cell = 0.3 if n <= 40 else max(0.1, 12.0 / n)  # inches per token: long sentences shrink instead of growing
    fontsize = max(5.0, min(9.0, cell * 28))
    pad_w, pad_h = 1.8, 1.6  # tick labels, colour bar and title
    side = f"{dump.source_lang}->{dump.target_lang}"
    what = "reference (forced)" if dump.forced else (
        "translation" + (f", score {dump.score:.3f}" if dump.score is not None else ""))
    if head == "all":
        cols = min(H, 4)
        rows = math.ceil(H / cols)
        fig = new_figure(max(5.0, cols * S * cell + pad_w + 0.8), max(3.5, rows * T * cell + pad_h * rows))
        axes = fig.subplots(rows, cols, squeeze=False)
        vmax = float(w.max())
        im = None
        for h in range(rows * cols):
            ax = axes[h // cols][h % cols]
            if h >= H:
                ax.axis("off")
                continue
            im = _panel(ax, w[h].numpy(), dump, vmax, fontsize, show_y=h % cols == 0)
            ax.set_title(f"head {h}", fontsize=9)
        fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, aspect=30, label="attention weight")
        fig.supxlabel(f"source ({dump.source_lang})", fontsize=9)
        fig.supylabel(f"target ({dump.target_lang}, {what})", fontsize=9)
        sub = f"decoder layer {li} (0..{L - 1}), every head"
    else:
        m = w.mean(0) if head == "mean" else w[head % H]
        fig = new_figure(max(4.5, S * cell + pad_w + 0.8), max(3.5, T * cell + pad_h))
        ax = fig.subplots()
        im = _panel(ax, m.numpy(), dump, float(m.max()), fontsize)
        ax.set_xlabel(f"source ({dump.source_lang})")
        ax.set_ylabel(f"target ({dump.target_lang}, {what})")
        fig.colorbar(im, ax=ax, shrink=0.9, aspect=30, label="attention weight")
        sub = f"decoder layer {li} (0..{L - 1}), " + (f"mean of {H} heads" if head == "mean" else f"head {head % H} of {H}")
    fig.suptitle(fitted_title(fig, title or f"{side} encoder-decoder attention: {sub}", 10), fontsize=10)
    return fig


def fitted_title(fig, text: str, fontsize: float) -> str:
    """``text`` wrapped to the figure's width (a centred title wider than a narrow figure is cut off both sides)."""
    import textwrap

    per_line = max(20, int(fig.get_size_inches()[0] * 72 / (0.6 * fontsize)))  # about 0.6 em per character
    return "\n".join(textwrap.wrap(text, per_line)) or text
