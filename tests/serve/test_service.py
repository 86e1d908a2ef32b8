"""``attnmt serve`` over real HTTP on a free local port: LibreTranslate's shape, the native endpoint, batching of
concurrent clients, every malformed request answered 4xx, graceful shutdown, health and metrics."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from helpers import make_checkpoint, sentence_lines
from service import Service


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def translator(ckpt):
    from attnmt import Translator

    with Translator(str(ckpt), max_len_b=12, threads=1) as t:
        yield t


@pytest.fixture(scope="module", params=["static", "continuous"])
def service(ckpt, request):
    s = Service(ckpt, "--max-len-b", "12", "--max-request-sentences", "8", "--max-request-bytes", "4096",
                "--max-chars", "1200", "--max-request-tokens", "4000", "--allow-alignment", "--batching",
                request.param)
    s.batching = request.param
    yield s
    assert s.stop() == 0, "\n".join(s.lines)


def test_libretranslate_requests_get_libretranslates_answers(service, translator):
    lines = sentence_lines(5, 21)
    expected = translator.translate(lines)
    status, body, _ = service.request("/translate", {"q": lines[0], "source": "en", "target": "de"})
    assert (status, body) == (200, {"translatedText": expected[0]})
    status, body, _ = service.request("/translate", {"q": lines, "source": "en", "target": "de", "format": "text",
                                                     "api_key": ""})
    assert (status, body) == (200, {"translatedText": expected})
    # a blank one of several keeps its place, translated to "" (a blank "q" alone is a 400, as LibreTranslate's)
    status, body, _ = service.request("/translate", {"q": ["", lines[0], " \n "], "source": "en", "target": "de"})
    assert (status, body) == (200, {"translatedText": ["", expected[0], ""]})
    # source "auto": the model's one source language is reported as detected
    status, body, _ = service.request("/translate", {"q": lines[1], "source": "auto", "target": "de"})
    assert body == {"translatedText": expected[1], "detectedLanguage": {"confidence": 100.0, "language": "en"}}
    # alternatives: the next best hypotheses of the beam
    status, body, _ = service.request("/translate", {"q": lines[2], "source": "en", "target": "de", "alternatives": 2})
    assert body == {"translatedText": expected[2], "alternatives": translator.translate(lines[2], nbest=3)[1:]}
    # a form, as LibreTranslate also accepts
    form = f"q={urllib.request.quote(lines[3])}&source=en&target=de".encode()
    status, body, _ = service.request("/translate", raw=form, content_type="application/x-www-form-urlencoded")
    assert (status, body) == (200, {"translatedText": expected[3]})
    status, body, _ = service.request("/languages")
    assert body == [{"code": "en", "name": "English", "targets": ["de"]}]


def test_the_native_endpoint_gives_nbest_scores_and_attention(service, translator):
    lines = sentence_lines(3, 22)
    status, body, _ = service.request("/v1/translate", {"text": lines, "nbest": 2, "scores": True,
                                                        "alignment": True})
    assert status == 200 and (body["source_lang"], body["target_lang"]) == ("en", "de")
    expected = translator.translate(lines, nbest=2, alignment=True)
    for got, want in zip(body["translations"], expected):
        assert got["text"] == want.text
        assert got["tokens"] == want.tokens
        assert got["score"] == pytest.approx(want.score, abs=1e-5)
        assert [h["text"] for h in got["hypotheses"]] == [h.text for h in want.hypotheses]
        flat = [w for row in got["alignment"]["weights"] for w in row]  # written with 3 decimals
        assert flat == pytest.approx([w for row in want.alignment.weights for w in row], abs=5.1e-4)
    status, body, _ = service.request("/v1/translate", {"text": lines[0]})
    assert body["translations"] == [{"text": translator.translate(lines[0])}]


def test_a_steered_request_gets_its_constraints_prefix_and_alternatives(service, translator):
    lines = sentence_lines(3, 23)
    cons = [["dog"], [], ["red", "house"]]
    status, body, _ = service.request("/v1/translate", {"text": lines, "constraints": cons, "scores": True})
    assert status == 200, body
    want = translator.translate(lines, constraints=cons, details=True)
    assert [t["tokens"] for t in body["translations"]] == [w.tokens for w in want]
    status, body, _ = service.request("/v1/translate", {"text": lines[0], "prefix": "the dog",
                                                        "suppress": ["red"]})
    assert body["translations"] == [{"text": translator.translate(lines[0], prefix="the dog", suppress=["red"])}]
    status, body, _ = service.request("/v1/translate", {"text": lines[1], "prefix": "the", "nbest": 2,
                                                        "return_alternatives": True})
    want = translator.translate(lines[1], prefix="the", nbest=2, return_alternatives=True)
    assert [h["text"] for h in body["translations"][0]["hypotheses"]] == want


def test_concurrent_clients_are_batched_together_and_each_gets_its_own_answer(service, translator):
    lines = sentence_lines(96, 23)
    expected = dict(zip(lines, translator.translate(lines)))
    before = service.request("/metrics?format=json")[1]
    answers: dict[str, object] = {}

    def client(k: int):
        for line in lines[k::24]:
            status, body, _ = service.request("/translate", {"q": line, "source": "en", "target": "de"})
            answers[line] = body["translatedText"] if status == 200 else (status, body)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == expected
    after = service.request("/metrics?format=json")[1]
    sentences = after["sentences"] - before["sentences"]
    assert sentences == 96
    if service.batching == "static":
        batches = after["batches"] - before["batches"]
        assert batches < 96 / 2, f"{batches} decoding calls for 96 sentences from 24 clients: no batching"
    else:  # the clients' sentences are decoded in the same steps of the running search
        steps = after["search_steps"] - before["search_steps"]
        together = (after["search_step_sentences"] - before["search_step_sentences"]) / steps
        assert together > 4, f"{together:.1f} sentences per search step from 24 clients: no batching"


BAD = [
    # (what, raw body, content type, path, method, status, words of the error)
    ("not JSON", b"{q: 1", "application/json", "/translate", "POST", 400, "not valid JSON"),
    ("not UTF-8", b'{"q": "\xff\xfe"}', "application/json", "/translate", "POST", 400, "not valid UTF-8"),
    ("empty body", b"", "application/json", "/translate", "POST", 400, "body is empty"),
    ("a JSON list", b'["a"]', "application/json", "/translate", "POST", 400, "a JSON list"),
    ("no q", b'{"source": "en"}', "application/json", "/translate", "POST", 400, "'q' is missing"),
    ("empty q", b'{"q": "  "}', "application/json", "/translate", "POST", 400, "'q' is empty"),
    ("q a number", b'{"q": 5}', "application/json", "/translate", "POST", 400, "'q' is a int"),
    ("q with a number", b'{"q": ["a", 5]}', "application/json", "/translate", "POST", 400, "'q[1]' is a int"),
    ("empty list", b'{"q": []}', "application/json", "/translate", "POST", 400, "empty list"),
    ("too many", json.dumps({"q": ["a"] * 9}).encode(), "application/json", "/translate", "POST", 413, "at most 8"),
    ("too big", json.dumps({"q": "a" * 5000}).encode(), "application/json", "/translate", "POST", 413, "4096"),
    ("too long", json.dumps({"q": "word " * 200}).encode(), "application/json", "/translate", "POST", 400,
     "at most 96"),
    ("other source", b'{"q": "a", "source": "fr"}', "application/json", "/translate", "POST", 400,
     "source 'fr' is not served"),
    ("other target", b'{"q": "a", "target": "fr"}', "application/json", "/translate", "POST", 400,
     "target 'fr' is not served"),
    ("html", b'{"q": "a", "format": "html"}', "application/json", "/translate", "POST", 400, "format 'html'"),
    ("alternatives", b'{"q": "a", "alternatives": 7}', "application/json", "/translate", "POST", 400,
     "'alternatives' is 7"),
    ("alternatives text", b'{"q": "a", "alternatives": "x"}', "application/json", "/translate", "POST", 400,
     "must be an integer"),
    ("nbest", b'{"text": "a", "nbest": 0}', "application/json", "/v1/translate", "POST", 400, "'nbest' is 0"),
    ("flag", b'{"text": "a", "scores": "yes"}', "application/json", "/v1/translate", "POST", 400,
     "true or false"),
    ("unknown constraint", b'{"text": "a", "constraints": ["qqqzzz"]}', "application/json", "/v1/translate",
     "POST", 400, "constraints[0]: 'qqqzzz' has pieces the model's target vocabulary does not hold"),
    ("constraints too long", json.dumps({"text": "a", "constraints": [" ".join(["dog"] * 40)]}).encode(),
     "application/json", "/v1/translate", "POST", 400, "the constraints need"),
    ("constraints per sentence", b'{"text": ["a", "b"], "constraints": [["dog"]]}', "application/json",
     "/v1/translate", "POST", 400, "one item per sentence of 'text' (2)"),
    ("constraint order", b'{"text": "a", "constraints": ["dog"], "constraint_order": "up"}', "application/json",
     "/v1/translate", "POST", 400, "'constraint_order' must be"),
    ("prefix type", b'{"text": "a", "prefix": 3}', "application/json", "/v1/translate", "POST", 400,
     "'prefix' must be a string"),
    ("xml", b"<q>a</q>", "application/xml", "/translate", "POST", 415, "application/xml"),
    ("no content type", b'{"q": "a"}', "", "/translate", "POST", 415, "no content type"),
    ("too many characters", json.dumps({"q": ["a" * 300] * 5}).encode(), "application/json", "/translate", "POST",
     413, "at most 1200 per request"),
    ("too much work", json.dumps({"text": ["word " * 10] * 8, "alignment": True}).encode(), "application/json",
     "/v1/translate", "POST", 413, "tokens of work"),
    ("deep nesting", b"[" * 4000, "application/json", "/translate", "POST", 400, "nests JSON too deeply"),
    ("superscript digit", '{"text": "a", "nbest": "\u00b2"}'.encode(), "application/json", "/v1/translate", "POST",
     400, "must be an integer"),
    ("form --1", b"q=a&alternatives=--1", "application/x-www-form-urlencoded", "/translate", "POST", 400,
     "must be an integer"),
    ("lone surrogate", b'{"q": "a \\ud800 b"}', "application/json", "/translate", "POST", 400, "lone surrogate"),
    ("JSON as a form", b'{"q": "a"}', "application/x-www-form-urlencoded", "/translate", "POST", 415,
     "Content-Type: application/json"),
    ("a long source name", json.dumps({"q": "a", "source": "x" * 900}).encode(), "application/json", "/translate",
     "POST", 400, "source a string of 900 characters is not served"),
    ("GET translate", None, "", "/translate", "GET", 405, "GET is not allowed"),
    ("no such path", b"{}", "application/json", "/nope", "POST", 404, "no such endpoint: /nope"),
]


@pytest.mark.parametrize("what, raw, kind, path, method, status, words", BAD, ids=[b[0] for b in BAD])
def test_a_malformed_request_gets_a_4xx_with_its_reason(service, what, raw, kind, path, method, status, words):
    got, body, _ = service.request(path, raw=raw, content_type=kind, method=method)
    assert got == status, body
    assert words in body["error"], body


def test_the_service_keeps_serving_after_many_malformed_requests(service, translator):
    before = service.request("/metrics?format=json")[1]["requests_by_status"]
    for k in range(200):
        what, raw, kind, path, method, status, _ = BAD[k % len(BAD)]
        assert service.request(path, raw=raw, content_type=kind, method=method)[0] == status, what
    line = sentence_lines(1, 24)[0]
    assert service.request("/translate", {"q": line, "source": "en"})[1] == {"translatedText": translator.translate(line)}
    status, health, _ = service.request("/health")  # what anyone may know: no model file, device or limits
    assert (status, health) == (200, {"status": "ok", "source_lang": "en", "target_lang": "de", "alignment": True})
    assert service.request("/metrics?format=json")[1]["queue_sentences"] == 0
    after = service.request("/metrics?format=json")[1]["requests_by_status"]
    four = sum(after.get(str(c), 0) - before.get(str(c), 0) for c in range(400, 500))
    assert four == 200
    text = service.request("/metrics")[1]
    assert 'attnmt_request_latency_seconds{quantile="0.99"}' in text and "attnmt_queue_sentences 0" in text


def test_sigterm_finishes_the_requests_in_flight_then_refuses_new_ones(ckpt, translator):
    # each batch waits 1.5 s for company, so the request is surely in flight when SIGTERM comes
    s = Service(ckpt, "--max-len-b", "12", "--batch-wait-ms", "1500")
    line = sentence_lines(1, 25)[0]
    got = {}
    t = threading.Thread(target=lambda: got.update(answer=s.request("/translate", {"q": line, "source": "en"})))
    t.start()
    time.sleep(0.5)
    code = s.stop()
    t.join()
    assert got["answer"][:2] == (200, {"translatedText": translator.translate(line)})
    assert code == 0, "\n".join(s.lines)
    assert "stopped by SIGTERM; 1 requests, 1 sentences" in s.lines[-1]
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(s.url + "/health", timeout=5)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="tgkill(2), to aim the signal at one thread, is Linux's")
def test_sigterm_stops_an_idle_service_whichever_thread_the_kernel_gives_it_to(ckpt):
    """The kernel may hand a process's SIGTERM to any of its threads, but Python runs the handler on the main thread,
    which an idle service keeps waiting for work: the service must still stop, promptly, with every thread tried."""
    import ctypes
    import os
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    tgkill = 234  # x86-64's syscall number; aarch64's is 131
    if os.uname().machine == "aarch64":
        tgkill = 131
    s = Service(ckpt, "--max-len-b", "12")
    try:
        assert s.request("/health")[0] == 200
        pid = s.proc.pid
        others = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
        assert others, "the service runs its HTTP server on a thread of its own"
        assert libc.syscall(tgkill, pid, others[-1], int(signal.SIGTERM)) == 0, ctypes.get_errno()
        assert s.proc.wait(20) == 0, "\n".join(s.lines)
    finally:
        s.kill()
    assert "stopped by SIGTERM" in s.lines[-1], "\n".join(s.lines)


def test_a_taken_port_is_a_one_line_error(ckpt, service):
    port = service.url.rsplit(":", 1)[1]
    r = subprocess.run([sys.executable, "-m", "attnmt.cli", "serve", "--path", str(ckpt), "--port", port],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1].startswith(f"attnmt: error: --host 127.0.0.1 --port {port}: cannot "
                                                        f"listen there")
    assert "Traceback" not in r.stderr


def test_the_page_is_served_at_the_root(service):
    status, page, headers = service.request("/")
    assert status == 200 and headers["content-type"].startswith("text/html")
    for element in ('id="source"', 'id="translate"', 'id="translation"', 'id="show-attention"', "/v1/translate"):
        assert element in page


def test_options_continuous_batching_does_not_take_are_batched_statically_and_said_so(ckpt):
    s = Service(ckpt, "--max-len-b", "12", "--batching", "continuous", "--sampling", "--beam", "2")
    try:
        status, body, _ = s.request("/translate", {"q": sentence_lines(1, 40)[0], "source": "en", "target": "de"})
        assert status == 200 and isinstance(body["translatedText"], str)
        assert s.request("/metrics?format=json")[1]["search_steps"] == 0
    finally:
        assert s.stop() == 0
    assert any("continuous batching does not take the sampling search: batching statically" in line
               for line in s.lines), "\n".join(s.lines)
