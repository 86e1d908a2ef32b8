"""The HTTP service: routes, request checks and answers, on Starlette (ASGI), served by uvicorn.

Routes:

* ``POST /translate``: LibreTranslate's request and answer (``q``: a string or a list; ``source``, ``target``,
  ``format``, ``alternatives``; JSON or a form) -> ``{"translatedText": ...}``.
* ``POST /v1/translate``: ``{"text": str | [str], "nbest": n, "scores": bool, "alignment": bool}`` ->
  ``{"translations": [{"text", "score", "tokens", "positional_scores", "hypotheses", "alignment"}]}``; steering
  (per sentence for a list of texts): ``"prefix"`` (the target start), ``"constraints"`` (phrases every
  hypothesis contains; ``"constraint_order": "ordered"``), ``"suppress"`` (texts never written),
  ``"return_alternatives"`` (the ``nbest`` continuations at the end of the prefix).
* ``GET /languages`` (LibreTranslate's), ``GET /health``, ``GET /metrics`` (Prometheus; ``?format=json``),
  ``GET /`` (a page to try sentences, with the attention map).

Every error is JSON ``{"error": "..."}`` with a 4xx status saying what to change, never repeating the input (503
when overloaded or stopping, with ``Retry-After``; 429 beyond ``--req-limit``); an unexpected error is logged with
its traceback and answered with a generic 500; a request never ends the process. Each request is bounded before
any work: its characters (``--max-chars``, before tokenizing), its sentences' tokens, and its cost in tokens
(``--max-request-tokens``: what the search may write, the hypotheses and the alignment answered); tokenizing and
building the answer run off the event loop. A client that disconnects has its sentences dropped (logged as 499).
``access.py`` checks hosts, origins, keys and rates; ``connections.py`` bounds slow and idle connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import json
import logging
import re
import time
from importlib import resources
from typing import Any
from urllib.parse import parse_qs

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from attnmt.api import Translation, Translator
from attnmt.errors import UserError
from attnmt.serve.access import Access, is_loopback
from attnmt.serve.batcher import Batcher, Job, Overloaded, Stopped
from attnmt.serve.config import ServeConfig
from attnmt.serve.metrics import Metrics

log = logging.getLogger("attnmt.serve")

MAX_PHRASES = 16  # constraint phrases per sentence, suppressed texts per request
CLIENT_GONE = 499  # nginx's status for a client that closed its connection before the answer


def shown(value: Any) -> str:
    """A client's value as an error message may name it: short printable strings only, never the input."""
    if isinstance(value, str) and len(value) <= 24 and value.isprintable():
        return repr(value)
    if isinstance(value, str):
        return f"a string of {len(value)} characters"
    return f"a JSON {type(value).__name__}" if value is not None else "null"


class BadRequest(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


PAGE = resources.files("attnmt.serve").joinpath("page.html").read_text(encoding="utf-8")

LANGUAGE_NAMES = {"en": "English", "de": "German", "fr": "French", "cs": "Czech", "es": "Spanish", "it": "Italian",
                  "nl": "Dutch", "pt": "Portuguese", "ro": "Romanian", "ru": "Russian", "zh": "Chinese",
                  "ja": "Japanese", "ar": "Arabic", "tr": "Turkish", "pl": "Polish", "sv": "Swedish"}


class Service:
    """The translator, the decoding thread and the counters behind the routes."""

    def __init__(self, translator: Translator, cfg: ServeConfig, batcher: Batcher | None = None):
        self.translator = translator
        self.cfg = cfg
        self.metrics = Metrics()
        self.batcher = batcher
        self.stopping = False
        self.stop_at: float | None = None  # set when a signal asked to stop: in-flight requests wait until then
        self.access = Access(cfg.api_keys, cfg.req_limit)
        self._continuous: dict[str, bool] = {}  # search options -> batched continuously
        self._steered = itertools.count()  # numbers the requests with guidance: each is batched alone
        model_limit = translator.max_source_tokens()
        self.max_tokens = min(cfg.max_sentence_tokens or model_limit, model_limit)

    # ------------------------------------------------------------------------------------------ lifetime

    def start(self) -> None:
        if self.batcher is None:
            self.batcher = make_batcher(self.cfg)

    def begin_stop(self, now: bool = False) -> None:
        """A signal asked to stop: new requests get 503; those in flight are answered until ``graceful_timeout``
        has passed (``now``: at once), then 503 (any thread)."""
        deadline = time.monotonic() + (0.0 if now else self.cfg.graceful_timeout)
        self.stop_at = deadline if self.stop_at is None else min(self.stop_at, deadline)
        self.stopping = True

    def stop(self) -> None:
        """Finish the queued work (uvicorn has already waited for the requests in flight), then stop."""
        self.stopping = True
        if self.batcher is not None:
            self.batcher.stop(timeout=self.cfg.graceful_timeout + 5)

    # ------------------------------------------------------------------------------------------ requests

    async def body(self, request: Request) -> dict[str, Any]:
        """The request's fields: a JSON object, or a form (LibreTranslate accepts both)."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.cfg.max_request_bytes:
            raise BadRequest(413, f"the request body has {declared} bytes; at most {self.cfg.max_request_bytes} "
                                  f"are accepted: send fewer or shorter sentences")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > self.cfg.max_request_bytes:
                    raise BadRequest(413, f"the request body is over {self.cfg.max_request_bytes} bytes; send "
                                          f"fewer or shorter sentences")
                chunks.append(chunk)
        except ClientDisconnect:
            raise BadRequest(CLIENT_GONE, "the client disconnected before its request's body ended") from None
        raw = b"".join(chunks)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadRequest(400, f"the request body is not valid UTF-8 (byte {e.start}); send UTF-8 text") from None
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind == "application/x-www-form-urlencoded":
            if text.lstrip().startswith("{"):
                raise BadRequest(415, "the body is JSON but its content type says a form; send it with "
                                      "Content-Type: application/json (curl -H 'Content-Type: application/json')")
            try:
                form = parse_qs(text, keep_blank_values=True, errors="strict", max_num_fields=1000)
            except ValueError:
                raise BadRequest(400, "the form is not valid (over 1000 fields, or bad %-escapes); send a JSON "
                                      "object instead") from None
            return {k: (v if k == "q" and len(v) > 1 else v[-1]) for k, v in form.items()}
        if not kind:  # a browser may send a body without one and without asking first: only declared JSON is read
            raise BadRequest(415, "the request has no content type; send it with Content-Type: application/json")
        if kind != "application/json":
            raise BadRequest(415, f"content type {shown(kind)} is not accepted; send application/json (or a form)")
        if not text.strip():
            raise BadRequest(400, "the request body is empty; send a JSON object such as {\"q\": \"Hello\"}")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise BadRequest(400, f"the request body is not valid JSON ({e.msg} at line {e.lineno} column "
                                  f"{e.colno}); send a JSON object") from None
        except RecursionError:
            raise BadRequest(400, "the request body nests JSON too deeply; send a flat JSON object") from None
        except ValueError:  # e.g. an integer of thousands of digits
            raise BadRequest(400, "the request body holds a number too large to read; send small integers") \
                from None
        if not isinstance(data, dict):
            raise BadRequest(400, f"the request body is a JSON {type(data).__name__}; send a JSON object such as "
                                  f"{{\"q\": \"Hello\"}}")
        return data

    def sentences(self, value: Any, name: str) -> tuple[list[str], bool]:
        """(sentences, whether one string was given) of field ``name``; each checked and stripped."""
        if value is None:
            raise BadRequest(400, f"'{name}' is missing; give the text to translate, a string or a list of strings")
        single = isinstance(value, str)
        items = [value] if single else value
        if not isinstance(items, list):
            raise BadRequest(400, f"'{name}' is a {type(value).__name__}; give a string or a list of strings")
        if not items:
            raise BadRequest(400, f"'{name}' is an empty list; give at least one sentence")
        if len(items) > self.cfg.max_request_sentences:
            raise BadRequest(413, f"'{name}' has {len(items)} sentences; at most {self.cfg.max_request_sentences} per "
                                  f"request: split the request")
        chars = 0
        for i, s in enumerate(items):
            where = name if single else f"{name}[{i}]"
            if not isinstance(s, str):
                raise BadRequest(400, f"'{where}' is a {type(s).__name__}; each sentence must be a string")
            chars += len(s)
        if chars > self.cfg.max_chars:
            raise BadRequest(413, f"'{name}' has {chars} characters; at most {self.cfg.max_chars} per request: "
                                  f"split the request")
        out = []
        for i, s in enumerate(items):
            where = name if single else f"{name}[{i}]"
            try:
                s.encode("utf-8")
            except UnicodeEncodeError as e:
                raise BadRequest(400, f"'{where}' holds a lone surrogate at character {e.start}; send valid "
                                      f"Unicode text") from None
            s = " ".join(s.split())  # one line: newlines and runs of spaces become single spaces
            if not s and single:  # a blank one of several keeps its place and translates to ""
                raise BadRequest(400, f"'{where}' is empty; give text to translate")
            out.append(s)
        return out, single

    @staticmethod
    def integer(data: dict, name: str, default: int, low: int, high: int) -> int:
        value = data.get(name, default)
        if isinstance(value, str) and re.fullmatch(r"\s*[+-]?[0-9]{1,9}\s*", value):
            value = int(value)  # a form's field
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadRequest(400, f"'{name}' must be an integer from {low} to {high}, got {shown(value)}")
        if not low <= value <= high:
            raise BadRequest(400, f"'{name}' is {value}; give {low} to {high}")
        return value

    def steering(self, data: dict, n: int, single: bool) -> dict | None:
        """The prefix, constraints, suppressed texts and ``return_alternatives`` of a request, checked for shape
        and size (their pieces are checked when tokenized); None when it has none."""
        names = ("prefix", "constraints", "constraint_order", "suppress", "return_alternatives")
        if not any(data.get(k) is not None for k in names):
            return None
        steer: dict[str, Any] = {"return_alternatives": self.flag(data, "return_alternatives")}
        chars = 0

        def text(v, where: str) -> str:
            nonlocal chars
            if not isinstance(v, str) or "\n" in v or "\r" in v:
                raise BadRequest(400, f"'{where}' must be a string on one line, got {shown(v)}")
            chars += len(v)
            return v

        def per_sentence(v, name: str) -> list:
            if single and not (isinstance(v, list) and v and isinstance(v[0], list) and name == "constraints"):
                v = [v]
            if not isinstance(v, list) or len(v) != n:
                raise BadRequest(400, f"'{name}' must hold one item per sentence of 'text' ({n}), got {shown(v)}")
            return v

        prefix = data.get("prefix")
        if prefix is not None:
            steer["prefix"] = [None if p is None else text(p, "prefix") for p in per_sentence(prefix, "prefix")]
        constraints = data.get("constraints")
        if constraints is not None:
            items = per_sentence(constraints, "constraints")
            out = []
            for i, c in enumerate(items):
                if c is None:
                    c = []
                if not isinstance(c, list) or len(c) > MAX_PHRASES:
                    raise BadRequest(400, f"'constraints' of sentence {i + 1} must be a list of at most {MAX_PHRASES} "
                                          f"phrases, got {shown(c)}")
                out.append([text(p, "constraints") for p in c])
            steer["constraints"] = out
        order = data.get("constraint_order", "unordered")
        if order not in ("unordered", "ordered"):
            raise BadRequest(400, f"'constraint_order' must be 'unordered' or 'ordered', got {shown(order)}")
        steer["constraint_order"] = order
        suppress = data.get("suppress", [])
        if not isinstance(suppress, list) or len(suppress) > MAX_PHRASES:
            raise BadRequest(400, f"'suppress' must be a list of at most {MAX_PHRASES} texts, got {shown(suppress)}")
        steer["suppress"] = [text(p, "suppress") for p in suppress]
        if chars > self.cfg.max_chars:
            raise BadRequest(413, f"the request's prefixes, constraints and suppressed texts hold {chars} characters; "
                                  f"at most {self.cfg.max_chars}")
        return steer

    @staticmethod
    def flag(data: dict, name: str) -> bool:
        value = data.get(name, False)
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        if not isinstance(value, bool):
            raise BadRequest(400, f"'{name}' must be true or false, got {shown(value)}")
        return value

    def admit(self, request: Request, data: dict) -> None:
        """The API key (``--api-keys``) and the request rate (``--req-limit``) of a translate request."""
        try:
            key = self.access.key(request.headers.get("authorization"), data.get("api_key"))
        except PermissionError as e:
            status, message = e.args
            raise BadRequest(status, message) from None
        client = key if key is not None else (request.client.host if request.client else "?")
        request.state.client = client
        wait = self.access.allow(client)
        if wait:
            raise BadRequest(429, f"over {self.cfg.req_limit} requests a minute; retry in {wait:.0f} s",
                             {"Retry-After": str(max(1, round(wait)))})

    def cost(self, sources: list[list[int]], nbest: int, alignment: bool) -> int:
        """The work a request asks for, in tokens: per sentence (its source tokens + the most the search may write)
        x the hypotheses answered, plus source x target tokens with alignment."""
        total = 0
        for ids in sources:
            target = self.translator.max_target_tokens(len(ids)) + 1
            total += (len(ids) + target) * nbest + (len(ids) * target if alignment else 0)
        return total

    async def translate(self, request: Request, lines: list[str], nbest: int, alignment: bool,
                        source: str | None = None, target: str | None = None,
                        steer: dict | None = None) -> list[Translation]:
        """The translations of ``lines``, through the batching queue (``source``/``target``: a multilingual
        model's language pair for them, checked by ``pair``; ``steer``: ``Translator.guidance``'s arguments and
        ``return_alternatives``: such a request is searched on its own, in a static batch)."""
        if self.stopping or self.batcher is None:
            raise BadRequest(503, "the service is shutting down; retry on another instance",
                             {"Retry-After": "5"})
        if alignment and not self.cfg.allow_alignment:
            raise BadRequest(403, "alignment is off on this service (its operator can turn it on with "
                                  "--allow-alignment); ask without it")
        t = self.translator
        loop = asyncio.get_running_loop()
        sources = await loop.run_in_executor(None, t.encode_batch, lines, source)  # not on the event loop
        guide, alternatives = None, False
        if steer:
            steer = dict(steer)
            alternatives = steer.pop("return_alternatives", False)
            try:
                guide = await loop.run_in_executor(None, lambda: t.guidance(len(lines), **steer))
                if alternatives and guide.constraints is not None and any(guide.constraints):
                    raise UserError("return_alternatives takes a prefix, not constraints; drop one of them")
                if guide or alternatives:
                    t.generator_for({"nbest": nbest} if nbest != t.search_cfg.nbest else {}).check_guide(
                        sources, guide, 0, "text")
            except UserError as e:
                raise BadRequest(400, str(e)) from None
        for i, ids in enumerate(sources):
            if len(ids) > self.max_tokens:
                raise BadRequest(400, f"sentence {i + 1} has {len(ids)} tokens; at most {self.max_tokens} are "
                                      f"accepted: split it into shorter sentences")
        cost = self.cost(sources, nbest, alignment)
        if cost > self.cfg.max_request_tokens:
            raise BadRequest(413, f"the request asks for {cost} tokens of work (source and the longest targets "
                                  f"the search may write{', x hypotheses' if nbest > 1 else ''}"
                                  f"{', with alignment' if alignment else ''}); at most "
                                  f"{self.cfg.max_request_tokens}: send fewer or shorter sentences")
        self.metrics.count_tokens(sum(len(s) for s in sources))
        search = {"nbest": nbest} if nbest != t.search_cfg.nbest else {}
        if target is not None and target != t.target_lang:
            search["tgt_lang"] = target
        try:
            t.generator_for(search)
        except UserError as e:
            raise BadRequest(400, str(e)) from None

        def run(batch: list[list[int]], cancelled=None) -> list[Translation]:
            if alternatives:
                return t.alternatives_encoded(batch, guide, 0.0, details=True, **search)
            return t.translate_encoded(batch, details=True, alignment=alignment, cancelled=cancelled, guide=guide,
                                       **search)

        key: tuple = (nbest, alignment, search.get("tgt_lang"))
        if guide or alternatives:
            key = (*key, "steered", next(self._steered))  # its own batch: the guidance is this job's
        stream = finish = None
        if not (guide or alternatives) and self.continuous(search):
            def stream():
                return t.continuous_search(**search)

            def finish(ids: list[int], hyps) -> Translation:
                return t.finish(ids, hyps, details=True, alignment=alignment, **search)

        job = Job(sources=sources, key=key, run=run,
                  future=loop.create_future(), loop=loop, stream=stream, finish=finish, cost=cost,
                  client=getattr(request.state, "client", ""))
        try:
            self.batcher.submit(job)
        except Overloaded:
            raise BadRequest(503, f"the service is busy: {self.batcher.queued} sentences are waiting; retry "
                                  f"later", {"Retry-After": "1"}) from None
        except Stopped:
            raise BadRequest(503, "the service is shutting down; retry on another instance",
                             {"Retry-After": "5"}) from None
        try:
            return await self.wait(request, job)
        except UserError as e:
            raise BadRequest(400, str(e)) from None

    async def wait(self, request: Request, job: Job) -> list[Translation]:
        """``job``'s answer; the job is cancelled when the client disconnects, the timeout passes or a stop's grace
        runs out (each answered here)."""
        gone = asyncio.ensure_future(_disconnected(request))
        deadline = time.monotonic() + self.cfg.timeout
        try:
            while True:
                now = time.monotonic()
                until = deadline if self.stop_at is None else min(deadline, self.stop_at)
                if now >= until:
                    self.batcher.cancel(job)
                    if self.stop_at is not None and now >= self.stop_at:
                        raise BadRequest(503, "the service stopped before this translation finished; retry on "
                                              "another instance", {"Retry-After": "5"})
                    raise BadRequest(503, f"the translation did not finish within {self.cfg.timeout:g} s; the "
                                          f"service is overloaded, retry later", {"Retry-After": "5"})
                await asyncio.wait({job.future, gone}, timeout=min(until - now, 0.25),
                                   return_when=asyncio.FIRST_COMPLETED)
                if job.future.done():
                    return job.future.result()
                if gone.done():
                    self.batcher.cancel(job)
                    raise BadRequest(CLIENT_GONE, "the client disconnected before its translation was ready")
        finally:
            gone.cancel()

    def continuous(self, search: dict[str, Any]) -> bool:
        """Whether requests of these search options are batched continuously (``--batching``, and options it
        takes)."""
        if self.cfg.batching != "continuous":
            return False
        key = repr(sorted(search.items()))
        if key not in self._continuous:
            self._continuous[key] = self.translator.continuous_unsupported(**search) is None
        return self._continuous[key]

    def languages(self) -> list[dict]:
        t = self.translator
        codes = t.bundle.languages
        if codes:  # a multilingual model: every pair
            return [{"code": c, "name": LANGUAGE_NAMES.get(c, c), "targets": [x for x in codes if x != c]}
                    for c in codes]
        return [{"code": t.source_lang, "name": LANGUAGE_NAMES.get(t.source_lang, t.source_lang),
                 "targets": [t.target_lang]}]

    def pair(self, source: Any, target: Any, auto: bool) -> tuple[str, str]:
        """The (source, target) languages a request asks for, checked against what the model translates (a
        multilingual model: any two of its languages; ``auto``: the source may be 'auto', the loaded one)."""
        t = self.translator
        codes = t.bundle.languages
        if codes:
            if not isinstance(source, str) or source not in codes and not (auto and source == "auto"):
                raise BadRequest(400, f"source {shown(source)} is not one of this model's {len(codes)} languages "
                                      f"({', '.join(codes[:12])}{', ...' if len(codes) > 12 else ''}; GET "
                                      f"/languages lists them)")
            if not isinstance(target, str) or target not in codes:
                raise BadRequest(400, f"target {shown(target)} is not one of this model's {len(codes)} languages "
                                      f"(GET /languages lists them)")
            return (t.source_lang if source == "auto" else source), target
        if not isinstance(source, str) or source not in ((("auto",) if auto else ()) + (t.source_lang,)):
            raise BadRequest(400, f"source {shown(source)} is not served: this service translates {t.source_lang} to "
                                  f"{t.target_lang} (source {t.source_lang!r}{' or ' + repr('auto') if auto else ''})")
        if not isinstance(target, str) or target != t.target_lang:
            raise BadRequest(400, f"target {shown(target)} is not served: this service translates {t.source_lang} to "
                                  f"{t.target_lang}")
        return t.source_lang, t.target_lang


async def _disconnected(request: Request) -> None:
    """Returns when the client of ``request`` (whose body has been read) disconnects."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def make_batcher(cfg: ServeConfig, thread: bool = True) -> Batcher:
    return Batcher(cfg.max_batch, cfg.batch_wait_ms / 1000.0, cfg.max_queue,
                   count_tokens=lambda r: len(r.tokens) if r is not None else 0, thread=thread,
                   return_wait=cfg.return_wait_ms / 1000.0, max_queue_cost=cfg.max_queue_tokens,
                   max_call_cost=cfg.max_request_tokens)


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _compact(o, weights: bool = False):
    """``o`` with the attention weights (``weights`` lists) at 3 decimals: an alignment's answer is mostly them."""
    if isinstance(o, dict):
        return {k: _compact(v, weights or k == "weights") for k, v in o.items()}
    if isinstance(o, list):
        return [_compact(v, weights) for v in o]
    if weights and isinstance(o, float):
        return round(o, 3)
    return o


async def _json_response(body: dict) -> Response:
    """The JSON answer, built off the event loop (an answer with alignment has thousands of numbers)."""
    def render() -> bytes:
        return json.dumps(_compact(body), ensure_ascii=False, separators=(",", ":")).encode("utf-8")

    data = await asyncio.get_running_loop().run_in_executor(None, render)
    return Response(data, media_type="application/json")


def create_app(translator: Translator, cfg: ServeConfig | None = None, batcher: Batcher | None = None) -> Starlette:
    """The ASGI application serving ``translator``; without ``batcher``, its decoding thread starts and stops with
    the app's lifespan (with one, whoever runs the batcher's loop; the lifespan's end stops it)."""
    svc = Service(translator, cfg or ServeConfig(), batcher)

    def answered(handler):
        """Count the request, time it, and turn refusals into JSON errors."""
        async def wrapped(request: Request) -> Response:
            t0 = time.perf_counter()
            sentences = 0
            try:
                response, sentences = await handler(request)
            except BadRequest as e:
                response = _error(e.status, e.message, e.headers)
            except Exception:  # noqa: BLE001 - answer, count, log and keep serving
                log.exception("attnmt serve: %s %s failed", request.method, request.url.path)
                response = _error(500, "internal error; the service's log has the details")
            svc.metrics.request(response.status_code, time.perf_counter() - t0 if response.status_code == 200
                                else None, sentences)
            return response
        return wrapped

    @answered
    async def libretranslate(request: Request):
        data = await svc.body(request)
        t = svc.translator
        svc.admit(request, data)
        lines, single = svc.sentences(data.get("q"), "q")
        source = data.get("source", "auto") or "auto"
        target = data.get("target", t.target_lang) or t.target_lang
        src_lang, tgt_lang = svc.pair(source, target, auto=True)
        fmt = data.get("format", "text") or "text"
        if fmt != "text":
            raise BadRequest(400, f"format {shown(fmt)} is not supported; send plain text with format 'text'")
        beam = t.search_cfg.beam
        alternatives = svc.integer(data, "alternatives", 0, 0, beam - 1)
        results = await svc.translate(request, lines, alternatives + 1, False, src_lang, tgt_lang)
        texts = [r.text for r in results]
        body: dict[str, Any] = {"translatedText": texts[0] if single else texts}
        if alternatives:
            alts = [[h.text for h in r.hypotheses[1:]] for r in results]
            body["alternatives"] = alts[0] if single else alts
        if source == "auto":
            detected = {"confidence": 100.0, "language": src_lang}  # the model's (loaded) source language
            body["detectedLanguage"] = detected if single else [detected] * len(lines)
        return await _json_response(body), len(lines)

    @answered
    async def native(request: Request):
        data = await svc.body(request)
        t = svc.translator
        svc.admit(request, data)
        lines, single = svc.sentences(data.get("text"), "text")
        nbest = svc.integer(data, "nbest", t.search_cfg.nbest, 1, t.search_cfg.beam)
        scores, alignment = svc.flag(data, "scores"), svc.flag(data, "alignment")
        src_lang, tgt_lang = svc.pair(data.get("source_lang", t.source_lang), data.get("target_lang", t.target_lang),
                                      auto=False)
        steer = svc.steering(data, len(lines), single)
        results = await svc.translate(request, lines, nbest, alignment, src_lang, tgt_lang, steer)
        out = []
        for r in results:
            item: dict[str, Any] = {"text": r.text}
            if scores:
                item.update(score=r.score, tokens=r.tokens, positional_scores=r.positional_scores)
            if nbest > 1:
                item["hypotheses"] = [{"text": h.text, **({"score": h.score} if scores else {})}
                                      for h in r.hypotheses]
            if r.alignment is not None:
                a = r.alignment
                item["alignment"] = {"source_tokens": a.source_tokens, "target_tokens": a.target_tokens,
                                     "weights": a.weights}  # written with 3 decimals (_compact)
            out.append(item)
        return await _json_response({"source_lang": src_lang, "target_lang": tgt_lang, "translations": out}), \
            len(lines)

    @answered
    async def languages(request: Request):
        return JSONResponse(svc.languages()), 0

    async def health(request: Request) -> Response:
        t = svc.translator
        ok = not svc.stopping and svc.batcher is not None
        body = {"status": "ok" if ok else "stopping", "source_lang": t.source_lang, "target_lang": t.target_lang,
                "alignment": svc.cfg.allow_alignment}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def metrics(request: Request) -> Response:
        from attnmt.serve.batcher import BatchStats

        token = svc.cfg.metrics_token
        given = request.headers.get("authorization", "")
        if token and not hmac.compare_digest(given.encode("utf-8", "replace"), f"Bearer {token}".encode()):
            svc.metrics.request(401)
            return _error(401, "/metrics needs its token: send 'Authorization: Bearer TOKEN' (--metrics-token)")
        if not token and not is_loopback(request.client.host if request.client else None):
            svc.metrics.request(403)
            return _error(403, "/metrics answers clients on the service's machine only; its operator can open it "
                               "with --metrics-token")
        snap = svc.metrics.snapshot(svc.batcher.queued if svc.batcher else 0,
                                    svc.batcher.stats if svc.batcher else BatchStats())
        if request.query_params.get("format") == "json":
            t = svc.translator
            snap["service"] = {"model": t.bundle.path.name, "device": str(t.device), "precision": t.precision,
                               "search": t.search_cfg.describe(), "beam": t.search_cfg.beam,
                               "max_request_sentences": svc.cfg.max_request_sentences,
                               "max_sentence_tokens": svc.max_tokens, "max_chars": svc.cfg.max_chars,
                               "max_request_tokens": svc.cfg.max_request_tokens}
            return JSONResponse(snap)
        return PlainTextResponse(Metrics.prometheus(snap), media_type="text/plain; version=0.0.4")

    async def page(request: Request) -> Response:
        return HTMLResponse(PAGE)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        reasons = {404: f"no such endpoint: {request.url.path}; see GET / or POST /translate",
                   405: f"{request.method} is not allowed on {request.url.path}"}
        response = _error(exc.status_code, reasons.get(exc.status_code, str(exc.detail)), getattr(exc, "headers", None))
        svc.metrics.request(exc.status_code)
        return response

    @contextlib.asynccontextmanager
    async def lifespan(app):
        svc.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, svc.stop)

    routes = [
        Route("/", page, methods=["GET"]),
        Route("/translate", libretranslate, methods=["POST"]),
        Route("/v1/translate", native, methods=["POST"]),
        Route("/languages", languages, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware

    from attnmt.serve.access import Guard, content_security_policy, parse_hosts, parse_origins

    cfg = svc.cfg
    origins = parse_origins(cfg.cors_origins)
    middleware = [Middleware(Guard, hosts=parse_hosts(cfg.allowed_hosts, cfg.host), origins=origins,
                             csp=content_security_policy(PAGE), count=svc.metrics.request)]
    if origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST"],
                                     allow_headers=["Content-Type", "Authorization"], max_age=600))
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error}, lifespan=lifespan,
                    middleware=middleware)
    app.state.service = svc
    return app
