"""``attnmt serve`` of an imported multilingual model: LibreTranslate's source/target (and the native endpoint's
source_lang/target_lang) choose any of its pairs per request, the loaded pair by default; the answers are the
Python API's, in static and continuous batching."""

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
def test_an_imported_multilingual_model_serves_every_pair(m2m100, batching):
    from attnmt import Translator

    lines = sentence_lines(6, 9)
    with Translator(m2m100, tgt_lang="fr") as t:
        want = t.translate(lines)
        want_de = t.translate(lines, tgt_lang="de")
        want_es_from_de = t.translate(lines, src_lang="de", tgt_lang="es")
    assert want != want_de
    svc = Service(m2m100, "--tgt-lang", "fr", "--batching", batching)
    try:
        status, body, _ = svc.request("/translate", {"q": lines, "source": "en", "target": "fr"})
        assert status == 200 and body["translatedText"] == want
        status, body, _ = svc.request("/translate", {"q": lines, "source": "auto", "target": "de"})
        assert status == 200 and body["translatedText"] == want_de and body["detectedLanguage"][0]["language"] == "en"
        status, body, _ = svc.request("/v1/translate", {"text": lines, "source_lang": "de", "target_lang": "es"})
        assert status == 200 and [x["text"] for x in body["translations"]] == want_es_from_de
        assert body["source_lang"] == "de" and body["target_lang"] == "es"
        status, body, _ = svc.request("/translate", {"q": lines[0], "source": "en", "target": "xx"})
        assert status == 400 and "target 'xx' is not one of this model's 100 languages" in body["error"]
        status, body, _ = svc.request("/languages", method="GET")
        assert status == 200 and len(body) == 100 and len(body[0]["targets"]) == 99
    finally:
        assert svc.stop() == 0
