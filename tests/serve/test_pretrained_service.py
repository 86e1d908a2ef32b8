"""``attnmt serve`` of an imported multilingual model: the pair it was loaded with, LibreTranslate's source/target
checked against it, answers as the Python API gives them, in static and continuous batching."""

from __future__ import annotations

import pytest
from helpers import sentence_lines

pytest.importorskip("transformers")
pytest.importorskip("starlette")

from hf_models import m2m100_dir  # noqa: E402
from service import Service  # noqa: E402

from attnmt import checkpoint  # noqa: E402
from attnmt.interop.huggingface import import_model  # noqa: E402


@pytest.fixture(scope="module")
def m2m100(tmp_path_factory):
    root = tmp_path_factory.mktemp("m2m100_serve")
    checkpoint.save(import_model(m2m100_dir(root), "en", "de"), root / "model.pt")
    return root / "model.pt"


@pytest.mark.slow
@pytest.mark.parametrize("batching", ["static", "continuous"])
def test_an_imported_multilingual_model_serves_its_pair(m2m100, batching):
    from attnmt import Translator

    lines = sentence_lines(6, 9)
    with Translator(m2m100, tgt_lang="fr") as t:
        want = t.translate(lines)
    svc = Service(m2m100, "--tgt-lang", "fr", "--batching", batching)
    try:
        status, body, _ = svc.request("/translate", {"q": lines, "source": "en", "target": "fr"})
        assert status == 200 and body["translatedText"] == want
        status, body, _ = svc.request("/translate", {"q": lines[0], "source": "en", "target": "de"})
        assert status == 400 and "target 'de' is not served" in body["error"]
        status, body, _ = svc.request("/languages", method="GET")
        assert status == 200 and body[0]["code"] == "en" and body[0]["targets"] == ["fr"]
    finally:
        assert svc.stop() == 0
