"""The service's options (``attnmt serve``), importable without the service's libraries."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class ServeConfig:
    """How the service listens, batches and limits requests."""

    host: str = field(default="127.0.0.1", metadata={"help": "Address to listen on (0.0.0.0: every interface)."})
    port: int = field(default=5000, metadata={"min": 0, "max": 65535,
                                              "help": "Port to listen on (0: a free one, printed at start)."})
    batching: Literal["static", "continuous"] = field(default="static", metadata={
        "help": "static: the sentences waiting are searched together as one batch, which runs until its longest "
                "sentence ends; continuous: a request's sentences join the running search at its next step and leave "
                "it as soon as they are translated (beam search or greedy with one model, without "
                "--no-repeat-ngram-size or a negative --unkpen; other options are batched statically). On a CPU "
                "whose cores also serve the HTTP side, static is faster (docs/serving.md)."})
    max_batch: int = field(default=256, metadata={
        "min": 1, "help": "Most sentences of concurrent requests translated together (continuous: in flight at "
                          "once); --max-tokens still cuts static batches into search batches."})
    batch_wait_ms: float = field(default=5.0, metadata={
        "min": 0, "help": "How long the first waiting sentence waits for others to join its batch."})
    return_wait_ms: float = field(default=50.0, metadata={
        "min": 0, "help": "After a batch, how long to wait for its clients' next sentences (until as many as it "
                          "answered are back) before starting a smaller batch; 0: never wait."})
    max_queue: int = field(default=2048, metadata={
        "min": 1, "help": "Most sentences waiting; a request beyond it gets 503 (retry later)."})
    max_queue_tokens: int = field(default=1 << 19, metadata={
        "min": 1, "help": "Most work waiting, in the cost of --max-request-tokens; a request beyond it gets 503."})
    max_request_sentences: int = field(default=64, metadata={"min": 1, "help": "Most sentences in one request."})
    max_chars: int = field(default=20_000, metadata={
        "min": 1, "help": "Most characters of text in one request, counted before anything is tokenized."})
    max_request_tokens: int = field(default=1 << 16, metadata={
        "min": 1, "help": "Most work one request may ask for: per sentence, (source tokens + the longest target "
                          "the search may write) x the hypotheses answered, plus source x target tokens with "
                          "alignment; checked before it is searched (413 beyond)."})
    max_sentence_tokens: int = field(default=0, metadata={
        "min": 0, "help": "Longest sentence accepted, in source tokens (0: the model's limit)."})
    max_request_bytes: int = field(default=1 << 20, metadata={"min": 64, "help": "Largest request body."})
    allow_alignment: bool = field(default=False, metadata={
        "help": "Answer 'alignment' (the attention weights, target x source numbers per sentence) in "
                "/v1/translate and the page's attention map; off, such requests get 403."})
    timeout: float = field(default=60.0, metadata={
        "min": 0.1, "help": "Seconds a request may wait for its translation before it gets 503."})
    graceful_timeout: float = field(default=30.0, metadata={
        "min": 0, "help": "On SIGTERM or Ctrl-C, seconds to finish the requests in flight (new ones are refused; "
                          "those unfinished then get 503); 0: stop at once. A second signal stops at once."})
    # connections
    max_connections: int = field(default=256, metadata={
        "min": 1, "help": "Most open connections; requests beyond get 503, connections beyond are closed."})
    header_timeout: float = field(default=10.0, metadata={
        "min": 0.1, "help": "Seconds a connection may take to send a request's headers (also: an idle new "
                            "connection); then it is closed."})
    body_timeout: float = field(default=20.0, metadata={
        "min": 0.1, "help": "Seconds a request may take to send its body; then 408 and the connection closed."})
    keep_alive: float = field(default=5.0, metadata={
        "min": 0.1, "help": "Seconds an idle kept-alive connection stays open between requests."})
    max_header_bytes: int = field(default=32 * 1024, metadata={
        "min": 1024, "help": "Largest request line and headers together; beyond: 431 and the connection closed."})
    # who may use it
    allowed_hosts: str = field(default="", metadata={
        "help": "Host header names accepted, comma-separated ('*': any); default: the names of --host "
                "(127.0.0.1, localhost, ::1 for a loopback address; any for 0.0.0.0 or ::). Others get 400: "
                "pages of other sites cannot reach the service through DNS rebinding."})
    cors_origins: str = field(default="", metadata={
        "help": "Web origins whose pages may call the service, comma-separated (e.g. https://app.example; "
                "'*': any); default: none."})
    api_keys: str = field(default="", metadata={
        "help": "A file of API keys, one per line ('#' starts a comment): the translate routes then need one, "
                "as LibreTranslate's 'api_key' field or an 'Authorization: Bearer KEY' header (401 without, 403 "
                "for an unknown one)."})
    req_limit: int = field(default=0, metadata={
        "min": 0, "help": "Most translate requests a minute per API key (per client address without keys); "
                          "beyond: 429 with Retry-After. 0: no limit."})
    metrics_token: str = field(default="", metadata={
        "help": "A token that /metrics then needs ('Authorization: Bearer TOKEN'); default: /metrics answers "
                "clients on this machine (a loopback address) only."})
