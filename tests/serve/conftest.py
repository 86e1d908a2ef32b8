"""What the API and service tests share: a self-contained tiny checkpoint and a Translator on it."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import make_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def translator(ckpt):
    from attnmt import Translator

    with Translator(str(ckpt), max_len_b=12, threads=1) as t:
        yield t
