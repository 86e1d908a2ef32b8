"""``attnmt preprocess``: raw parallel text -> subword model, dictionaries and memory-mapped binarized splits.

Stages (each parallel over ``--workers`` processes, on line ranges of the inputs):

1. scan every input once: UTF-8 check, line count, sha256 of the decompressed text (the input's identity);
   source and target of a split must have the same number of lines;
2. (``--bpe sentencepiece``) normalise the training text and learn one joint BPE model on it, once;
3. encode every split to pieces; in TRAIN, drop pairs with an empty side or more than ``--max-len`` tokens
   (counted, never silent); valid/test keep every line, so line *i* of a binarized test set is input line *i*;
4. build the dictionaries from the pieces of the kept training pairs;
5. binarize each line range to a part dataset, then concatenate the parts in order.

Every stage works on line ranges whose results are combined in input order and dictionaries sort by count then
symbol, so the output files are byte-identical for any number of workers.

All output is built in a temp directory beside ``--destdir`` and renamed into place at the end: ``--destdir``
never holds a half-written preprocessing. A destdir whose ``preprocess.json`` records the same inputs (by
checksum) and options is up to date and left alone; one holding anything else is refused.
"""

from attnmt.preprocess.build import preprocess
from attnmt.preprocess.config import PreprocessConfig
from attnmt.preprocess.report import print_summary

__all__ = ["PreprocessConfig", "preprocess", "print_summary"]
