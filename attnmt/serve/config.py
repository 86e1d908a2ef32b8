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
    max_request_sentences: int = field(default=64, metadata={"min": 1, "help": "Most sentences in one request."})
    max_sentence_tokens: int = field(default=0, metadata={
        "min": 0, "help": "Longest sentence accepted, in source tokens (0: the model's limit)."})
    max_request_bytes: int = field(default=1 << 20, metadata={"min": 64, "help": "Largest request body."})
    timeout: float = field(default=60.0, metadata={
        "min": 0.1, "help": "Seconds a request may wait for its translation before it gets 503."})
    graceful_timeout: float = field(default=30.0, metadata={
        "min": 0, "help": "On SIGTERM or Ctrl-C, seconds to finish the requests in flight (new ones are refused)."})
