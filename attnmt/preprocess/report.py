"""The summary table ``attnmt preprocess`` prints."""

from __future__ import annotations

import sys
from typing import Any

# ---------------------------------------------------------------------------------------------------- report


def print_summary(summary: dict[str, Any], file=None) -> None:
    """A readable table of what was done (to stderr)."""
    from rich.console import Console
    from rich.table import Table

    file = file or sys.stderr
    console = Console(file=file, highlight=False, width=None if file.isatty() else 120)
    src, tgt = summary["source_lang"], summary["target_lang"]
    if summary.get("up_to_date"):
        console.print(f"{summary['destdir']} is up to date (same inputs and options); nothing to do")
        return
    max_len = summary["options"]["max_len"]
    table = Table(title=f"attnmt preprocess {src}-{tgt}", title_justify="left")
    for col in ("split", "lines", "pairs", "skipped: empty", f"skipped: >{max_len} tokens", f"tokens {src}",
                f"tokens {tgt}", f"unk {src}", f"unk {tgt}"):
        table.add_column(col, justify="left" if col == "split" else "right")
    for name, s in summary["splits"].items():
        sk = s["skipped"]
        table.add_row(name, f"{s['lines']:,}", f"{s['pairs']:,}", f"{sk['empty']:,}", f"{sk['too_long']:,}",
                      f"{s['sides'][src]['tokens']:,}", f"{s['sides'][tgt]['tokens']:,}",
                      f"{100 * s['sides'][src]['unk_rate']:.2f}%", f"{100 * s['sides'][tgt]['unk_rate']:.2f}%")
    console.print(table)
    kept_empty = {n: s["empty_lines_kept"] for n, s in summary["splits"].items() if s.get("empty_lines_kept")}
    if kept_empty:
        console.print("empty lines kept (as </s> alone, to stay line-aligned): "
                      + ", ".join(f"{n} {k:,}" for n, k in kept_empty.items()))
    d = summary["dictionaries"]
    dicts = (f"joined dictionary: {d[src]['size']:,} symbols" if summary["joined_dictionary"]
             else f"dictionaries: {src} {d[src]['size']:,} symbols, {tgt} {d[tgt]['size']:,} symbols")
    bpe = summary["bpe"]
    if summary.get("bpe_model"):
        bpe += f" ({summary['bpe_settings'].get('pieces', '?')} pieces, {summary['bpe_model']})"
    console.print(f"{dicts}; subwords: {bpe}; tokenizer: {summary['tokenizer']}"
                  f"{'; lowercased' if summary['lowercase'] else ''}")
    bd = summary.get("bpe_dropout")
    if bd:
        train = summary["splits"]["train"]["sides"]
        growth = " and ".join(f"{lang} {bd['sides'][lang]['tokens_per_sample'] / max(train[lang]['tokens'], 1):.2f}x"
                           for lang in (src, tgt))
        console.print(f"BPE-dropout {bd['dropout']}: {bd['samples']} segmentations of train ({bd['splits'][0]}, ...), "
                      f"{growth} its tokens")
    console.print(f"done in {summary['elapsed_s']:.1f} s; output: {summary['destdir']}")
